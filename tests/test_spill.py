"""Large activation statistics wait for the descent on disk (:mod:`symspec.solvers.engine.spill`):
at 1.1B they are 7.1 GB, as much as both models' working copies. Spilled, the descent
must give the result it gives from memory, bit for bit; the files must really be what
it reads (a changed file changes or stops it); they must go when the result goes; and a
folder that cannot hold them -- missing, a file, a device, read-only, full, an
overlong name -- is one line naming it, or, where the user named no folder, memory
with a warning."""

from __future__ import annotations

import copy
import errno
import gc
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import symspec
import symspec.alignment.moments as mo
import symspec.solvers.engine.spill as sp
from symspec.alignment import ActivationOptions
from symspec.errors import SymspecInputError
from symspec.solvers.engine.spill import Spilled, SpillStore
from tests.test_activation_streamed import _pair


def _align(method: str, spill: Any, name: str = "llama") -> symspec.AlignResult:
    canon, _, _, sb, data = _pair(name)
    b = copy.deepcopy(canon)
    b.load_state_dict(sb)
    return symspec.align(canon, b, name, method=method, data=data, rounds=3, options=ActivationOptions(spill=spill))


def _folders(parent: Path) -> list[Path]:
    return sorted(parent.glob("symspec-statistics-*"))


@pytest.mark.parametrize(("name", "method"), [("llama", "weight+activation"), ("nanogpt", "activation")])
def test_spilled_statistics_give_the_result_from_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        name: str, method: str) -> None:
    kept = _align(method, False, name)
    assert kept.info["statistics"]["spilled_bytes"] == 0 and kept.info["statistics"]["spill_folder"] is None
    monkeypatch.setattr(mo, "SPILL_MIN_BYTES", 1)  # every square block to disk
    seen: list[int] = []
    load = Spilled.load

    def counted(self: Spilled, device: Any = None) -> torch.Tensor:
        seen.append(self.nbytes)
        return load(self, device)

    monkeypatch.setattr(Spilled, "load", counted)
    spilled = _align(method, str(tmp_path), name)
    stats = spilled.info["statistics"]
    assert stats["spilled_bytes"] > 0 and stats["spill_folder"] == str(tmp_path)
    assert stats["statistics_bytes"] == kept.info["statistics"]["statistics_bytes"]
    assert seen, "the descent never read a spilled block"
    assert spilled.history == kept.history
    for space, e in kept.elements.items():
        for k, v in e.items():
            assert torch.equal(spilled.elements[space][k], v), (space, k)
    del spilled
    gc.collect()
    assert _folders(tmp_path) == []  # the files went with the statistics


def test_the_descent_reads_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative case: a block whose file is changed under it is read changed (the
    objective moves), and one cut short is refused in one line."""
    monkeypatch.setattr(mo, "SPILL_MIN_BYTES", 1)
    canon, bound, sa, sb, data = _pair("llama")
    coll = mo.collect_site_stats(canon, bound.problem, sa, sb, data, spill=str(tmp_path))
    assert coll is not None
    block = next(b for s in coll.stats for b in s.blocks if isinstance(b.cross, Spilled))
    before = block.cross.load()
    path = block.cross.file.path
    with open(path, "r+b") as f:
        f.write((before * 0 + 7).numpy().tobytes())
    assert torch.all(block.cross.load() == 7) and not torch.equal(block.cross.load(), before)
    with open(path, "r+b") as f:
        f.truncate(8)
    with pytest.raises(SymspecInputError, match=r"were changed while in use \(read 8 of"):
        block.cross.load()
    os.unlink(path)
    with pytest.raises(SymspecInputError, match=r"cannot read activation statistics back from"):
        block.cross.load()


def test_a_store_round_trips_and_cleans_up(tmp_path: Path) -> None:
    store = SpillStore(tmp_path)
    x = torch.randn(5, 7, dtype=torch.float64)
    s = store.put(x)
    assert torch.equal(s.load(), x) and torch.equal(s.scaled(3.0).load(), x * 3.0)
    assert s.nbytes == x.numel() * 8 and os.path.exists(s.file.path)
    path = s.file.path
    t = s.scaled(2.0)
    del s
    gc.collect()
    assert os.path.exists(path)  # a scaled handle still names the file
    del t
    gc.collect()
    assert not os.path.exists(path)
    store.close()
    assert _folders(tmp_path) == []


def test_a_named_folder_that_cannot_hold_them_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    long = tmp_path / ("d" * 300)
    for where in (tmp_path / "missing", a_file, "/dev/null", long):
        with pytest.raises(SymspecInputError, match=r"is not a folder") as e:
            mo.open_spill(str(where), 1 << 20)
        assert "\n" not in str(e.value)
    with pytest.raises(SymspecInputError, match=r"need .* GB on disk in .*which has .* free"):
        mo.open_spill(str(tmp_path), 1 << 60)  # more than any disk
    assert _folders(tmp_path) == []  # nothing left behind by the refusal
    assert mo.open_spill(str(tmp_path), 0) is None and mo.open_spill(False, 1 << 20) is None


def test_a_read_only_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes into a read-only folder: the system's refusal, as it comes
        def refused(*args: Any, **kwargs: Any) -> str:
            raise PermissionError(errno.EACCES, "Permission denied", str(ro))

        monkeypatch.setattr(sp.tempfile, "mkdtemp", refused)
    try:
        with pytest.raises(SymspecInputError, match=r"cannot write .*ro: Permission denied"):
            mo.open_spill(str(ro), 1 << 20)
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SpillStore(tmp_path)
    real_open = open

    class Full:
        def __init__(self, path: str, mode: str, buffering: int = -1) -> None:
            self.f = real_open(path, mode, buffering=buffering)

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.close()

        def write(self, b: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sp, "open", Full, raising=False)
    with pytest.raises(SymspecInputError, match=r"cannot write .*: No space left on device \(spilling .* TMPDIR"):
        store.put(torch.zeros(4, 4))
    assert list(Path(store.folder).iterdir()) == []
    store.close()


def test_the_default_folder_falls_back_to_memory_with_a_warning(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the user named no folder, a temporary folder without room (or one that cannot
    be made) keeps the statistics in memory, says so, and aligns all the same."""
    monkeypatch.setattr(mo, "SPILL_MIN_BYTES", 1)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(SpillStore, "free", lambda self: 1000)
    with pytest.warns(UserWarning, match=r"on disk in .* which has .* free: kept in memory \(set TMPDIR"):
        res = _align("weight+activation", True)
    assert res.info["statistics"]["spilled_bytes"] == 0
    assert _folders(tmp_path) == []
    monkeypatch.setattr(SpillStore, "free", lambda self: 1 << 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = _align("weight+activation", True)
    assert res.info["statistics"]["spilled_bytes"] > 0 and res.info["statistics"]["spill_folder"] == str(tmp_path)
    gc.collect()
    assert _folders(tmp_path) == []  # made under TMPDIR, gone with the statistics


def test_a_forked_child_leaves_the_parent_s_files(tmp_path: Path) -> None:
    """A child process forked while a store lives (a data loader's worker) lets go of its
    copies of the handles and the store without removing the parent's files."""
    store = SpillStore(tmp_path)
    s = store.put(torch.ones(3))
    pid = os.fork()
    if pid == 0:  # the child: drop everything, then exit as a normal interpreter would
        try:
            s.file._gone()
            store._gone()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(s.file.path) and torch.equal(s.load(), torch.ones(3))
    store.close()
    assert _folders(tmp_path) == []


def test_blocks_read_back_are_kept_for_the_next_reader_within_a_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A space's terms and its trial's objective read the same blocks: the second read
    comes from the blocks held (:data:`HOT_BYTES`), not the disk, with the same result.
    With no budget every reader goes to the disk (the negative case), and a budget
    smaller than everything still gives the same result."""
    import symspec.solvers.engine.site_statistics as ss

    monkeypatch.setattr(mo, "SPILL_MIN_BYTES", 1)
    load = Spilled.load

    def run(budget: int) -> tuple[int, symspec.AlignResult]:
        seen: list[int] = []

        def counted(self: Spilled, device: Any = None) -> torch.Tensor:
            seen.append(self.nbytes)
            return load(self, device)

        monkeypatch.setattr(Spilled, "load", counted)
        monkeypatch.setattr(ss, "HOT_BYTES", budget)
        res = _align("weight+activation", str(tmp_path))
        return len(seen), res

    held_reads, held = run(1 << 28)
    disk_reads, disk = run(0)
    part_reads, part = run(4096)
    assert held_reads < part_reads < disk_reads, (held_reads, part_reads, disk_reads)
    for other in (disk, part):
        assert other.history == held.history
        for space, e in held.elements.items():
            for k, v in e.items():
                assert torch.equal(other.elements[space][k], v), (space, k)
