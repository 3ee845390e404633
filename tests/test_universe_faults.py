"""`symspec universe` under faults (issue 28): a full disk, names too long, a read-only
work folder, a killed parent of worker processes, a corrupt work folder. Never a
traceback: one ``error:`` line and exit 2, or a ``note:`` naming what is recomputed; the
rerun after the fault resumes, and its result is the fault-free run's, bit for bit.

A real full or read-only disk is a tiny tmpfs mounted here (as root); where mounting is
not permitted the same faults are injected (``fault_hook``)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from symspec.outputs import work_folder
from tests.cli_files import ROOT, run
from tests.test_outputs import _enospc, _inject, files, one_error_line, tree  # noqa: F401  (files: a fixture)

HOOK = "tests.test_universe_faults:fault_hook"


def fault_hook() -> None:
    """Worker setup (``--setup``, also run in the parent by the inline executor):

    - ``SYMSPEC_TEST_FAULT=CODE:PART``: a write in the work folder to a path containing
      PART fails with errno CODE (``28``: a full disk), as the system would say it;
    - ``SYMSPEC_TEST_SLOW=DIR``: each alignment writes its pid into DIR, then waits (a
      worker busy when its parent is killed).

    Installed once per process (the inline executor runs it in the test's own process),
    the variables are read at each call: without them nothing changes.
    """
    import symspec.universe.tasks as T
    import symspec.universe.workdir as W

    if getattr(W.atomic_write, "fault_hook", False):
        return
    real = W.atomic_write

    def atomic_write(path: Any, write: Any, **kw: Any) -> None:
        code, _, part = os.environ.get("SYMSPEC_TEST_FAULT", "").partition(":")
        if part and part in str(path):
            raise OSError(int(code), os.strerror(int(code)), str(path))
        real(path, write, **kw)

    atomic_write.fault_hook = True  # type: ignore[attr-defined]
    W.atomic_write = atomic_write  # type: ignore[assignment]
    align = T.align

    def slow_align(task: Any, cfg: Any, searched: Any) -> Any:
        slow = os.environ.get("SYMSPEC_TEST_SLOW")
        if slow:
            (Path(slow) / f"{os.getpid()}.pid").write_text(str(os.getpid()))
            time.sleep(5)  # the parent is killed meanwhile; without the fix the result's send fails
        return align(task, cfg, searched)

    T.align = slow_align


# ---------------------------------------------------------------- a real tiny disk


def _mount(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True, capture_output=True, timeout=30)


@pytest.fixture
def tmpfs() -> Iterator[Callable[[Path, str], bool]]:
    """``mount(folder, "size=64k")``: a tmpfs there, True when mounting is permitted
    (root, no sandbox); every mount is undone at the end."""
    mounted: list[Path] = []

    def mount(folder: Path, options: str) -> bool:
        ok = _mount(folder, options)
        if ok:
            mounted.append(folder)
        return ok

    try:
        yield mount
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def universe(f: dict[str, Path], out: Path, *extra: Any) -> tuple[int, str, str]:
    return run("universe", f["a"], f["b"], "--model", f["model"], "--groups", "perm", "--out", out, "--json",
               "--setup", HOOK, *extra)


def merged(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "merged.pt", weights_only=True)


@pytest.fixture(scope="module")
def clean(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # noqa: F811
    """The fault-free run of three rounds every faulty run is compared with."""
    out = tmp_path_factory.mktemp("clean") / "u"
    code, stdout, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    assert code == 0, stderr
    return {"report": json.loads(stdout), "merged": merged(out)}


def same_result(out: Path, stdout: str, clean: dict[str, Any]) -> None:
    report = json.loads(stdout)
    m = merged(out)
    assert m.keys() == clean["merged"].keys() and all(torch.equal(m[k], clean["merged"][k]) for k in m)
    assert report["objective"] == clean["report"]["objective"]


# ---------------------------------------------------------------- 1. a full disk


@pytest.mark.parametrize("how", ["inline", "jobs-2", "learned"])
def test_a_full_disk_is_one_error_line_and_the_rerun_with_space_succeeds(
        files: dict[str, Path], tmp_path: Path, tmpfs: Callable[[Path, str], bool],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    disk = tmp_path / "disk"
    real = tmpfs(disk, "size=64k")  # room for a model file or two: the work folder fills it
    if not real:  # the same fault, injected: the second model's canonical form cannot be written
        monkeypatch.setenv("SYMSPEC_TEST_FAULT", f"{errno.ENOSPC}:canonical/01-b")
    out = disk / "u"
    extra = {"inline": [], "jobs-2": ["-j", 2],
             "learned": ["--method", "learned", "--data", f"text:{files['text']}", "--steps", 2, "--max-samples", 32,
                         "--batch-size", 16]}[how]
    code, _, stderr = universe(files, out, "--rounds", 1, *extra)
    assert code == 2 and one_error_line(stderr), stderr
    assert stderr.startswith(f"error: cannot write {disk}/") and ": No space left on device; " in stderr, stderr
    assert not out.exists() and not list(disk.glob(".symspec-*"))
    # positive control: with room on the disk, the same command succeeds
    if real:
        _remount(disk, "size=64m")
    else:
        monkeypatch.delenv("SYMSPEC_TEST_FAULT")
    code, _, stderr = universe(files, out, "--rounds", 1, *extra)
    assert code == 0, stderr
    assert (out / "merged.pt").exists() and not work_folder(out).exists()


def test_a_full_disk_after_a_finished_round_keeps_the_work_and_the_rerun_resumes(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        clean: dict[str, Any]) -> None:
    """In a worker (-j 2): the disk fills in round 2; round 1 is kept, and said so."""
    out = tmp_path / "u"
    monkeypatch.setenv("SYMSPEC_TEST_FAULT", f"{errno.ENOSPC}:rounds/002/01-b")
    code, _, stderr = universe(files, out, "--rounds", 3, "--tol", 0, "-j", 2)
    work = work_folder(out)
    assert code == 2 and one_error_line(stderr), stderr
    assert f"error: cannot write {work}/rounds/002/01-b." in stderr and ": No space left on device; " in stderr
    assert f"the finished work is kept in {work}: free some space and rerun the same command to resume" in stderr
    assert not out.exists() and (work / "state.json").exists()
    monkeypatch.delenv("SYMSPEC_TEST_FAULT")
    code, stdout, stderr = universe(files, out, "--rounds", 3, "--tol", 0, "-j", 2)
    assert code == 0, stderr
    assert json.loads(stdout)["resumed_tasks"] == 2 + 1  # the canonical forms, and round 2's first model
    assert "note: resuming the unfinished run in" in stderr and "Traceback" not in stderr
    same_result(out, stdout, clean)


def test_a_full_disk_while_writing_out_says_the_rounds_are_kept(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    out = tmp_path / "u"
    with monkeypatch.context() as m:
        _inject(m, "universe", _enospc)  # the merged model cannot be written into --out
        code, _, stderr = universe(files, out, "--rounds", 1)
    assert code == 2 and one_error_line(stderr), stderr
    assert stderr.strip() == (f"error: cannot write {out}: No space left on device; the finished work is kept in "
                              f"{work_folder(out)}: free some space and rerun the same command to resume")
    code, stdout, stderr = universe(files, out, "--rounds", 1)  # positive control
    assert code == 0 and json.loads(stdout)["resumed_tasks"] == 2 and (out / "merged.pt").exists(), stderr


# ---------------------------------------------------------------- 2. names too long


def test_names_too_long_are_refused_before_any_work(files: dict[str, Path], tmp_path: Path,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.universe.api

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run started")

    deep = tmp_path.joinpath(*["d" * 250] * 16)  # --out fits the path limit, the run's files do not
    cases = [tmp_path / ("n" * 300), deep / "u"]
    with monkeypatch.context() as m:
        m.setattr(symspec.universe.api, "load_reference", no_work)
        for out in cases:
            code, _, stderr = universe(files, out, "--rounds", 1)
            assert code == 2 and one_error_line(stderr), stderr
            assert f"error: cannot write {out}: File name too long" in stderr
        assert list(tmp_path.iterdir()) == []
    # positive controls: a name whose work folder's name would pass the limit, a
    # shallower path, and a model whose file name is as long as the system allows
    long_model = tmp_path / "m" / ("k" * 250 + ".pt")
    long_model.parent.mkdir()
    shutil.copy(files["b"], long_model)
    for out, models in ((tmp_path / ("n" * 250), None), (tmp_path.joinpath(*["d" * 250] * 14) / "u", None),
                        (tmp_path / "u", long_model)):
        args = ["universe", files["a"], models or files["b"], "--model", files["model"], "--groups", "perm",
                "--rounds", 1, "--out", out, "--json"]
        code, stdout, stderr = run(*args)
        assert code == 0, stderr
        assert (out / "merged.pt").exists() and not work_folder(out).exists()
        if models:
            assert all(len(Path(p).name) <= 255 for p in json.loads(stdout)["outputs"]["aligned"])


# ---------------------------------------------------------------- 3. a read-only work folder


def test_a_read_only_work_folder_is_one_error_line_and_the_rerun_resumes_once_writable(
        files: dict[str, Path], tmp_path: Path, tmpfs: Callable[[Path, str], bool],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, clean: dict[str, Any]) -> None:
    out = tmp_path / "u"
    work = work_folder(out)
    real = tmpfs(work, "size=16m")  # the work folder is a file system of its own, made read-only below
    with monkeypatch.context() as m:
        m.setenv("SYMSPEC_TEST_FAULT", f"{errno.ENOSPC}:rounds/002/01-b")  # an earlier run failed in round 2
        code, _, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    assert code == 2 and (work / "state.json").exists(), stderr
    before = tree(work)
    if real:
        _remount(work, "ro")
    else:  # as root chmod does not stop writes: refuse them as a read-only file system would
        _read_only(monkeypatch, work)
    for extra in ([], ["--no-resume"]):
        code, _, stderr = universe(files, out, "--rounds", 3, "--tol", 0, *extra)
        assert code == 2 and one_error_line(stderr), (extra, stderr)
        assert stderr.startswith(f"error: cannot write {work}") and "Read-only file system" in stderr, stderr
        assert f"make {work} writable and rerun the same command, or remove it" in stderr
        assert tree(work) == before and not out.exists()
    # positive control: writable again, the same command resumes the run
    if real:
        _remount(work, "rw")
    else:
        monkeypatch.undo()
    code, stdout, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    assert code == 0, stderr
    assert json.loads(stdout)["resumed_tasks"] == 3
    same_result(out, stdout, clean)


def _read_only(monkeypatch: pytest.MonkeyPatch, work: Path) -> None:
    import tempfile

    import symspec.universe.workdir as W

    def refuse(path: Any) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: Any, dir: Any = None, **kw: Any) -> Any:
        if dir is not None and Path(dir).is_relative_to(work):
            raise refuse(dir)
        return real_mkstemp(*args, dir=dir, **kw)

    def clear_folder(path: Any) -> None:
        raise refuse(Path(path) / "run.json")

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(W, "clear_folder", clear_folder)


# ---------------------------------------------------------------- 4. a killed parent


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            return False
        return True
    return "State:\tZ" in status


@pytest.mark.slow
def test_workers_exit_quietly_when_their_parent_is_killed(
        files: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "u"
    pids = tmp_path / "pids"
    pids.mkdir()
    log = tmp_path / "stderr.txt"
    args = [sys.executable, "-c", "from symspec.cli.main import main; main()", "universe", files["a"], files["b"],
            "--model", files["model"], "--groups", "perm", "--rounds", 1, "--out", out, "-j", 2, "--setup", HOOK]
    env = dict(os.environ, SYMSPEC_TEST_SLOW=str(pids), PYTHONPATH=str(ROOT))
    with open(log, "w") as err:
        parent = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while len(list(pids.glob("*.pid"))) < 2 and parent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            workers = [int(p.read_text()) for p in pids.glob("*.pid")]
            assert len(workers) == 2 and parent.poll() is None, log.read_text()
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            deadline = time.monotonic() + 60
            while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(_gone(w) for w in workers), "a worker outlived its parent"
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()
    text = log.read_text()
    assert "Traceback" not in text and "BrokenPipeError" not in text and "Exception ignored" not in text, text
    # positive control: the rerun resumes what the killed run finished (the canonical
    # forms, and an alignment a worker finished before it saw its parent gone)
    code, stdout, stderr = run(*args[3:], "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["resumed_tasks"] >= 2 and (out / "merged.pt").exists()


# ---------------------------------------------------------------- 5. a corrupt work folder


@pytest.fixture(scope="module")
def interrupted(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A work folder left by a run that failed in round 2 of 3: round 1 finished
    (state.json), round 2's first model aligned, the second not."""
    out = tmp_path_factory.mktemp("interrupted") / "u"
    os.environ["SYMSPEC_TEST_FAULT"] = f"{errno.ENOSPC}:rounds/002/01-b"
    try:
        code, _, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    finally:
        del os.environ["SYMSPEC_TEST_FAULT"]
    assert code == 2 and "the finished work is kept" in stderr, stderr
    return work_folder(out)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 2)])


def _garbage(p: Path) -> None:
    p.write_bytes(b"\x00garbage" * 4)


def _empty_object(p: Path) -> None:
    p.write_text("{}")


def _remove(p: Path) -> None:
    p.unlink()


# (entry, how it is damaged, what the note says is recomputed)
CORRUPT = [
    ("state.json", _truncate, "recomputing the rounds from the first"),
    ("canonical/01-b.safetensors", _truncate, "recomputing it"),
    ("canonical/00-a.json", _garbage, "recomputing it"),
    ("canonical/01-b.json", _empty_object, "recomputing it"),
    ("state.json", _remove, "recomputing the rounds from the first"),
    ("rounds/002/00-a.json", _truncate, "recomputing it"),
    ("rounds/002/00-a.aligned.safetensors", _garbage, "recomputing it"),
    ("rounds/002/universe.safetensors", _truncate, "recomputing the rounds from the first"),
    ("rounds/001/01-b.elements.safetensors", _truncate, "recomputing the rounds from the first"),
    ("rounds/001/00-a.aligned.safetensors", _remove, "recomputing the rounds from the first"),
]


@pytest.mark.parametrize(("entry", "damage", "recomputed"), CORRUPT,
                         ids=[f"{c[0]}-{c[1].__name__.strip('_')}" for c in CORRUPT])
def test_a_corrupt_entry_is_named_and_recomputed(
        files: dict[str, Path], tmp_path: Path, interrupted: Path, clean: dict[str, Any],  # noqa: F811
        entry: str, damage: Callable[[Path], None], recomputed: str) -> None:
    out = tmp_path / "u"
    work = work_folder(out)
    shutil.copytree(interrupted, work)
    damage(work / entry)
    code, stdout, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    assert code == 0, stderr
    assert "Traceback" not in stderr
    notes = [line for line in stderr.splitlines() if line.startswith("note: ")]
    assert any(line.startswith(f"note: {work / entry} is ") and line.endswith(recomputed) for line in notes), stderr
    same_result(out, stdout, clean)


def test_an_intact_work_folder_is_resumed_without_notes_of_damage(
        files: dict[str, Path], tmp_path: Path, interrupted: Path, clean: dict[str, Any]) -> None:  # noqa: F811
    """Positive control for the above: nothing damaged, nothing recomputed."""
    out = tmp_path / "u"
    shutil.copytree(interrupted, work_folder(out))
    code, stdout, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    assert code == 0, stderr
    assert [line for line in stderr.splitlines() if line.startswith("note: ")] == [
        f"note: resuming the unfinished run in {work_folder(out)}"]
    assert json.loads(stdout)["resumed_tasks"] == 3
    same_result(out, stdout, clean)


def test_a_corrupt_entry_that_cannot_be_removed_is_one_error_line(
        files: dict[str, Path], tmp_path: Path, interrupted: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    out = tmp_path / "u"
    work = work_folder(out)
    shutil.copytree(interrupted, work)
    bad = work / "rounds" / "002" / "00-a.json"
    _garbage(bad)
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == bad:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    code, _, stderr = universe(files, out, "--rounds", 3, "--tol", 0)
    lines = stderr.strip().splitlines()
    assert code == 2 and one_error_line(lines[-1]) and all(line.startswith("note: ") for line in lines[:-1]), stderr
    assert f"error: cannot write {bad}: Permission denied" in stderr and f"note: {bad} is corrupt" in stderr
