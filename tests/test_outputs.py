"""Outputs never lose data (symspec.outputs, through every command that writes: match,
merge, universe, barrier, schema): no output may be, contain or lie inside an input;
existing outputs need --force; a failed or interrupted write leaves nothing (no output,
no staging folder, no empty folder); stale staging is reported; long names work; the
universe work folder is locked and never followed through a symlink; one file mode
policy."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from symspec.errors import SymspecInputError
from symspec.loading import load_model
from symspec.outputs import (
    MARKER,
    STAGING_PREFIX,
    FolderLock,
    Target,
    atomic_write,
    check_outputs,
    publish,
    stale_staging,
    umask,
    work_folder,
)
from tests.cli_files import ROOT, model_file, run, write_words


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A word text, a one-layer nanoGPT model file, two checkpoints in ``pair/``, a list
    of them, a spec file, two folder inputs and a symlink to one of them."""
    d = tmp_path_factory.mktemp("outputs")
    text = d / "words.txt"
    mf = model_file(d, "gpt.py", write_words(text))
    mod = load_model(mf).model_file.module  # type: ignore[union-attr]
    (d / "pair").mkdir()
    for i, name in enumerate(("a", "b")):
        m = mod.build()
        torch.manual_seed(100 + i)
        for p in m.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.1)
        torch.save(m.state_dict(), d / "pair" / f"{name}.pt")
    (d / "models.txt").write_text("pair/a.pt\npair/b.pt\n")
    (d / "spec.yaml").write_text((ROOT / "specs" / "nanogpt.yaml").read_text())
    for name in ("fa", "fb"):  # folder inputs (Hugging Face style); never loaded here
        (d / name).mkdir()
        (d / name / "config.json").write_text('{"model_type": "gpt2"}\n')
    (d / "link").symlink_to(d / "fa", target_is_directory=True)
    return {"dir": d, "text": text, "model": mf, "a": d / "pair" / "a.pt", "b": d / "pair" / "b.pt",
            "pair": d / "pair", "list": d / "models.txt", "spec": d / "spec.yaml", "fa": d / "fa", "fb": d / "fb",
            "link": d / "link"}


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): a file's sha256, a folder, a link."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def staging_left(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".symspec-*")]


def one_error_line(stderr: str) -> bool:
    """One ``error:`` line (barrier's progress bar, closing, may leave a blank line first)."""
    return stderr.strip().startswith("error: ") and stderr.strip().count("\n") == 0 and "Traceback" not in stderr


DATA = "text:{text}"
BARRIER = ["--max-samples", 16, "--points", 3, "--batch-size", 16]

# (command line, with {a} {b} {model} {spec} {list} {text} {pair} {fa} {fb} {link}; what the refusal says)
OVERLAPS: list[tuple[str, str]] = [
    ("match {a} {b} --model {model} --out {a}", "--out {a} is the input {a}"),
    ("match {a} {b} --model {model} --out {pair}", "--out {pair} contains the input {a}"),
    ("match {fa} {fb} --out {fa}/aligned", "--out {fa}/aligned lies inside the input {fa}"),
    ("match {fa} {fb} --out {link}", "--out {link} is the input {fa}"),
    ("match {fa} {fb} --out {link}/aligned", "lies inside the input {fa}"),
    ("merge {a} {b} --model {model} --out {model}", "--out {model} is the input {model}"),
    ("merge {a} {b} --model {model} --spec {spec} --out {spec}", "--out {spec} is the input {spec}"),
    ("merge {fa} {fb} --no-align --out {fb}", "--out {fb} is the input {fb}"),
    ("universe {a} {b} --model {model} --out {pair}", "--out {pair} contains the input {a}"),
    ("universe @{list} --model {model} --out {list}", "--out {list} is the input {list}"),
    ("universe {a} {b} --model {model} --data " + DATA + " --out {text}", "--out {text} is the input {text}"),
    ("universe {fa} {fb} --out {fa}/universe", "--out {fa}/universe lies inside the input {fa}"),
    ("barrier {a} {b} --model {model} --data " + DATA + " --report {text}", "--report {text} is the input {text}"),
    ("barrier {a} {b} --model {model} --data " + DATA + " --plot {b}", "--plot {b} is the input {b}"),
    ("barrier {a} {b} --model {model} --data " + DATA + " --markdown {model}", "--markdown {model} is the input {model}"),
    ("barrier {fa} {fb} --pair {fb} {fa} --data " + DATA + " --report {pair}/r.json --markdown {link}/r.md",
     "--markdown {link}/r.md lies inside the input {fa}"),
    ("barrier {fa} {fb} --data " + DATA + " --report {fa}/r.json", "--report {fa}/r.json lies inside the input {fa}"),
]


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
@pytest.mark.parametrize(("line", "message"), OVERLAPS, ids=[c[0].split()[0] + f"-{i}" for i, c in enumerate(OVERLAPS)])
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(
        files: dict[str, Path], line: str, message: str, force: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.loading

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded before the outputs were checked")

    monkeypatch.setattr(symspec.loading, "load_model", no_loading)
    names = {k: str(v) for k, v in files.items()}
    before = tree(files["dir"])
    args = line.format(**names).split() + (["--force"] if force else [])
    code, _, stderr = run(*args)
    assert code == 2 and one_error_line(stderr), stderr
    assert message.format(**names) in stderr and "input" in stderr
    assert tree(files["dir"]) == before


def test_outputs_that_do_not_touch_an_input_pass_the_check(files: dict[str, Path], tmp_path: Path) -> None:
    d = files["dir"]
    inputs = [files["a"], files["b"], files["fa"], files["link"], "gpt2"]  # a built-in name is no path
    ok = [Target(d / "pair-out", "--out", folder=True), Target(d / "fab", "--out", folder=True),
          Target(tmp_path / "new" / "deeper" / "r.json", "--report"), Target(d / "gpt2", "--out", folder=True)]
    assert check_outputs(ok, inputs, force=False) == []
    with pytest.raises(SymspecInputError, match="--report and --markdown name the same file"):
        check_outputs([Target(tmp_path / "r", "--report"), Target(tmp_path / "r", "--markdown")], [], force=True)


@pytest.fixture
def words_run(files: dict[str, Path]) -> Callable[..., tuple[int, str, str]]:
    """The commands on the fixture's models, by name, each writing ``out``."""
    f = files

    def go(command: str, out: Path, *extra: Any) -> tuple[int, str, str]:
        if command == "match":
            return run("match", f["a"], f["b"], "--model", f["model"], "--rounds", 1, "--out", out, "--json", *extra)
        if command == "merge":
            return run("merge", f["a"], f["b"], "--model", f["model"], "--rounds", 1, "--out", out, "--json", *extra)
        if command == "universe":
            return run("universe", f["a"], f["b"], "--model", f["model"], "--rounds", 1, "--groups", "perm",
                       "--out", out, "--json", *extra)
        if command == "barrier":  # every file it can write, named after out
            return run("barrier", f["a"], f["b"], "--model", f["model"], "--data", f"text:{f['text']}", *BARRIER,
                       "--report", out, "--plot", out.with_suffix(".png"), "--markdown", out.with_suffix(".md"),
                       "--json", *extra)
        if command == "schema":
            return run("schema", "--out", out, *extra)
        raise ValueError(command)

    return go


def test_barrier_refuses_an_existing_file_without_force(files: dict[str, Path], tmp_path: Path,
                                                         words_run: Callable[..., tuple[int, str, str]]) -> None:
    report = tmp_path / "report.json"
    report.write_text("mine")
    code, _, stderr = words_run("barrier", report)
    assert code == 2 and one_error_line(stderr) and "exists; refusing to overwrite it (use --force)" in stderr
    assert report.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    code, stdout, stderr = words_run("barrier", report, "--force")
    assert code == 0, stderr
    assert json.loads(report.read_text()) == json.loads(stdout)
    assert report.with_suffix(".png").read_bytes()[:4] == b"\x89PNG" and "Loss barrier" in report.with_suffix(".md").read_text()
    assert not staging_left(tmp_path)
    # schema --out follows the same policy
    code, _, stderr = run("schema", "--out", report)
    assert code == 2 and "(use --force)" in stderr and json.loads(report.read_text()) == json.loads(stdout)
    assert run("schema", "--out", report, "--force")[0] == 0 and json.loads(report.read_text())["title"]


# ---------------------------------------------------------------- failures while writing

def _enospc() -> BaseException:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _safetensors_full() -> BaseException:
    from safetensors import SafetensorError

    return SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')


FAULTS: dict[str, Callable[[], BaseException]] = {
    "disk-full": _enospc, "safetensors": _safetensors_full, "interrupt": KeyboardInterrupt,
}


def _inject(monkeypatch: pytest.MonkeyPatch, command: str, fault: Callable[[], BaseException]) -> list[Path]:
    """Make the command's writer fail part-way: it writes half a file, then raises.
    Returns the paths the writer was given (for the test to check they are gone)."""
    touched: list[Path] = []

    def half(path: Path) -> None:
        touched.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path / "half" if path.is_dir() else path, "wb") as f:  # Path.write_bytes may be the patched one
            f.write(b"half")
        raise fault()

    if command in ("match", "merge", "universe"):
        import symspec.loading

        original = symspec.loading.save_model
        calls = [0]

        def save_model(loaded: Any, state_dict: Any, out: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == (2 if command == "universe" else 1):  # universe: the merged model is written
                half(Path(out))
            return original(loaded, state_dict, out, **kw)

        monkeypatch.setattr(symspec.loading, "save_model", save_model)
    elif command == "barrier":
        from symspec.analyzers.report import BarrierReport

        monkeypatch.setattr(BarrierReport, "plot", lambda self, path, title=None: half(Path(path)))
    elif command == "barrier-report":  # barrier writing its JSON report alone
        from symspec.analyzers.report import BarrierReport

        monkeypatch.setattr(BarrierReport, "write_json", lambda self, path: half(Path(path)))
    else:
        monkeypatch.setattr(Path, "write_bytes", lambda self, data: half(self))
    return touched


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("command", ["match", "merge", "universe", "barrier", "schema"])
def test_a_write_that_fails_or_is_interrupted_leaves_nothing(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        words_run: Callable[..., tuple[int, str, str]], command: str, fault: str) -> None:
    out = tmp_path / "new" / "sub" / ("out.json" if command in ("barrier", "schema") else "out")
    before = tree(files["dir"])
    touched = _inject(monkeypatch, command, FAULTS[fault])
    code, _, stderr = words_run(command, out)
    assert touched, "the fault was not injected"
    if fault == "interrupt":
        assert code == 130 and stderr.strip().splitlines()[-1] == "interrupted", (code, stderr)
    else:
        assert code == 2 and one_error_line(stderr), stderr
        failed = out.with_suffix(".png") if command == "barrier" else out  # barrier: the plot fails
        assert f"cannot write {failed}: No space left on device" in stderr
    # no output, no staging, not even the folders made for it; the inputs are untouched.
    # universe keeps its resumable work folder (and so the folders it lies in)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if ".partial" not in str(p))
    assert left == (["new", "new/sub"] if command == "universe" else []), left
    if command == "universe":
        assert (work_folder(out) / "run.json").exists()
    assert tree(files["dir"]) == before


def test_a_staging_folder_whose_marker_cannot_be_written_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk lets ``mkdir`` pass and fails the marker's first byte: the folder
    made for it goes too (it once stayed, with an empty staging.json)."""
    import symspec.outputs.publishing as outputs  # where the staging marker is written

    out = tmp_path / "new" / "s.json"
    real_dump = json.dump

    def full(*args: Any, **kw: Any) -> None:
        raise _enospc()

    monkeypatch.setattr(outputs.json, "dump", full)
    code, _, stderr = run("schema", "--out", out)
    assert code == 2 and one_error_line(stderr) and f"cannot write {out}: No space left on device" in stderr
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(outputs.json, "dump", real_dump)  # the positive control
    assert run("schema", "--out", out)[0] == 0 and out.exists() and not staging_left(tmp_path)


@pytest.mark.parametrize("fault", ["disk-full", "interrupt"])
@pytest.mark.parametrize("writer", ["publish", "atomic_write"])
def test_the_parent_folders_made_before_a_failure_are_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, fault: str) -> None:
    """The third of three missing folders cannot be made: the two made before it go."""
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kw: Any) -> None:
        if Path(path).name == "c" and Path(path).parent.is_dir():  # as a real failure comes: after its parents
            raise FAULTS[fault]()
        real_mkdir(path, *args, **kw)

    out = tmp_path / "a" / "b" / "c" / "out.txt"

    def write() -> None:
        if writer == "publish":
            publish([(Target(out, "--report"), lambda p: p.write_text("x"))], force=False)
        else:
            atomic_write(out, lambda p: p.write_text("x"))

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises((SymspecInputError, OSError, KeyboardInterrupt)):
        write()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    write()
    assert out.read_text() == "x" and not staging_left(tmp_path)


def test_an_interrupt_waits_for_a_step_that_must_not_be_cut_in_two() -> None:
    from symspec.outputs import deferred_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("made")
        done.append("recorded")
    assert done == ["made", "recorded"]
    with pytest.raises(KeyboardInterrupt):  # the negative case: without it, the step is cut
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            done.append("late")
    assert "late" not in done
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_universe_run_that_fails_to_load_leaves_no_folder(files: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "garbage.pt").write_bytes(b"not a checkpoint")
    out = tmp_path / "new" / "sub" / "out"
    code, _, stderr = run("universe", files["a"], tmp_path / "in" / "garbage.pt", "--model", files["model"], "--out", out)
    assert code == 2 and "cannot be read" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_universe_keeps_its_work_folder_after_a_failed_write_and_the_rerun_resumes(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        words_run: Callable[..., tuple[int, str, str]]) -> None:
    out = tmp_path / "u"
    with monkeypatch.context() as m:
        _inject(m, "universe", _enospc)
        code, _, stderr = words_run("universe", out)
    assert code == 2 and one_error_line(stderr) and "No space left on device" in stderr
    assert [p.name for p in tmp_path.iterdir()] == [".u.partial"] and (tmp_path / ".u.partial" / "run.json").exists()
    code, stdout, stderr = words_run("universe", out)
    assert code == 0, stderr
    assert json.loads(stdout)["resumed_tasks"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u"]


def test_a_replaced_output_comes_back_when_a_later_one_fails(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        words_run: Callable[..., tuple[int, str, str]]) -> None:
    """barrier --force with three files: the first is already renamed over the old
    report when the second rename fails; the old report is put back."""
    report = tmp_path / "r.json"
    report.write_text("old report")
    real = os.rename
    renames: list[str] = []

    def rename(src: Any, dst: Any) -> None:
        if Path(dst).suffix == ".png" and Path(src).name.startswith("output"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        renames.append(str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    code, _, stderr = words_run("barrier", report, "--force")
    assert code == 2 and one_error_line(stderr) and "Read-only file system" in stderr
    assert str(report) in renames  # the new report had been published
    assert report.read_text() == "old report" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_sigterm_while_publishing_removes_the_staging(tmp_path: Path) -> None:
    code = ("import os, signal, sys\n"
            "from pathlib import Path\n"
            "from symspec.outputs import Target, publish\n"
            "def fill(p):\n"
            "    (p / 'half').write_text('half')\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "publish([(Target(Path(sys.argv[1]), '--out', folder=True), fill)], force=False)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_stale_staging_folder_is_reported_by_the_next_run(tmp_path: Path) -> None:
    # a run killed (SIGKILL: nothing can clean up) while it wrote its output
    code = ("import os, signal, sys\n"
            "from pathlib import Path\n"
            "from symspec.outputs import Target, publish\n"
            "def fill(p):\n"
            "    p.write_text('half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "publish([(Target(Path(sys.argv[1]), '--out'), fill)], force=False)\n")
    out = tmp_path / "schema.json"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].name.startswith(STAGING_PREFIX) and not out.exists()
    # a staging folder whose process is alive is another run at work: not reported
    busy = tmp_path / f"{STAGING_PREFIX}busy"
    busy.mkdir()
    (busy / MARKER).write_text(json.dumps({"target": "x", "pid": os.getpid(), "host": socket.gethostname()}))
    code_, _, stderr = run("schema", "--out", out)
    assert code_ == 0 and out.exists()
    assert f"note: {left[0]} is left from an interrupted run (writing {out})" in stderr
    assert "busy" not in stderr
    assert stale_staging(tmp_path) == [f"{left[0]} is left from an interrupted run (writing {out}); nothing uses it, remove it"]


# ---------------------------------------------------------------- names and folders

@pytest.mark.parametrize("command", ["match", "universe", "barrier", "schema"])
def test_a_250_character_name_works_and_a_256_character_one_is_refused(
        tmp_path: Path, words_run: Callable[..., tuple[int, str, str]], command: str) -> None:
    name = "n" * 245 + (".json" if command in ("barrier", "schema") else "xxxxx")
    assert len(name) == 250
    out = tmp_path / name
    code, _, stderr = words_run(command, out)
    assert code == 0, stderr
    assert out.exists() and not staging_left(tmp_path)
    if command == "universe":
        assert len(work_folder(out).name) <= 255 and not work_folder(out).exists()
    code, _, stderr = words_run(command, tmp_path / ("m" * 256))
    assert code == 2 and one_error_line(stderr) and "File name too long" in stderr


@pytest.mark.parametrize("command", ["match", "universe", "barrier", "schema"])
def test_an_output_under_a_file_or_a_file_output_that_is_a_folder(
        tmp_path: Path, words_run: Callable[..., tuple[int, str, str]], command: str) -> None:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afolder").mkdir()
    cases = [(tmp_path / "afile" / "deeper" / "out", f"{tmp_path / 'afile'} is not a folder")]
    if command in ("barrier", "schema"):
        cases.append((tmp_path / "afolder", "it is a folder"))
    for out, message in cases:
        for extra in ([], ["--force"]):
            code, _, stderr = words_run(command, out, *extra)
            assert code == 2 and one_error_line(stderr) and f"cannot write {out}: {message}" in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "afolder"] and not list((tmp_path / "afolder").iterdir())


def test_a_read_only_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            words_run: Callable[..., tuple[int, str, str]]) -> None:
    """As root, chmod does not stop writes: simulate a read-only folder, once seen by the
    check (os.access) and once only when writing (mkdtemp raises PermissionError)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
        code, _, stderr = words_run("schema", ro / "s.json")
        assert code == 2 and one_error_line(stderr) and f"{ro} is not writable (Permission denied)" in stderr
    import tempfile

    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args: Any, dir: Any = None, **kw: Any) -> str:
        if dir is not None and Path(dir) == ro:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real_mkdtemp(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    for command, out in (("match", ro / "out"), ("barrier", ro / "r.json"), ("schema", ro / "s.json")):
        code, _, stderr = words_run(command, out)
        assert code == 2 and one_error_line(stderr) and f"cannot write {out}: Permission denied" in stderr, stderr
    assert list(ro.iterdir()) == []


# ---------------------------------------------------------------- the universe work folder

@pytest.fixture
def holder() -> Iterator[Callable[[Path], subprocess.Popen[str]]]:
    """Another process holding the flock on a folder, as a concurrent run does."""
    procs: list[subprocess.Popen[str]] = []

    def hold(folder: Path) -> subprocess.Popen[str]:
        code = ("import fcntl, os, sys, time\n"
                "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('locked', flush=True)\n"
                "time.sleep(120)\n")
        p = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        return p

    yield hold
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_second_universe_run_on_a_locked_work_folder_fails_and_a_killed_ones_lock_does_not_block(
        tmp_path: Path, words_run: Callable[..., tuple[int, str, str]],
        holder: Callable[[Path], subprocess.Popen[str]]) -> None:
    out = tmp_path / "u"
    work = work_folder(out)
    work.mkdir()
    (work / "run.json").write_text('{"fingerprint": "the other run"}\n')
    other = holder(work)
    code, _, stderr = words_run("universe", out)
    assert code == 2 and one_error_line(stderr) and f"another run is using {work}" in stderr
    assert (work / "run.json").read_text() == '{"fingerprint": "the other run"}\n' and not out.exists()
    other.send_signal(signal.SIGKILL)
    other.wait()
    code, _, stderr = words_run("universe", out)
    assert code == 0, stderr
    assert out.exists() and not work.exists()


def test_the_folder_lock_is_reentrant_in_a_process_and_exclusive_across(
        tmp_path: Path, holder: Callable[[Path], subprocess.Popen[str]]) -> None:
    work = tmp_path / "w"
    with FolderLock(work), FolderLock(work):  # the CLI holds it, universe_match takes it again
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys\n"
                                "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                                "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n", str(work)],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "BlockingIOError" in probe.stderr
    assert work.is_dir()  # kept: not asked to remove an empty folder
    other = holder(work)
    with pytest.raises(SymspecInputError, match="another run is using"):
        FolderLock(work).acquire()
    other.kill()
    other.wait()
    with FolderLock(work, remove_if_empty=True):
        pass
    assert not work.exists()


def test_a_work_folder_that_is_a_symlink_is_never_followed(
        tmp_path: Path, files: dict[str, Path], words_run: Callable[..., tuple[int, str, str]]) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "run.json").write_text('{"fingerprint": "planted"}\n')
    (victim / "precious.txt").write_text("mine")
    out = tmp_path / "u"
    work_folder(out).symlink_to(victim, target_is_directory=True)
    before = tree(victim)
    code, _, stderr = words_run("universe", out)
    assert code == 2 and one_error_line(stderr) and "is a symbolic link; refusing to follow it" in stderr
    assert tree(victim) == before and work_folder(out).is_symlink() and not out.exists()
    from symspec.universe import universe_match

    with pytest.raises(SymspecInputError, match="symbolic link"):
        universe_match([str(files["a"]), str(files["b"])], "nanogpt", factory=str(files["model"]), workdir=work_folder(out))
    assert tree(victim) == before
    # a planted "staging" symlink is neither reported nor touched
    (tmp_path / f"{STAGING_PREFIX}planted").symlink_to(victim, target_is_directory=True)
    assert stale_staging(tmp_path) == [] and tree(victim) == before


# ---------------------------------------------------------------- file modes

@pytest.fixture
def umask_027() -> Iterator[int]:
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


@pytest.mark.parametrize("command", ["match", "merge", "universe", "barrier", "schema"])
def test_published_files_get_the_usual_modes(tmp_path: Path, words_run: Callable[..., tuple[int, str, str]],
                                             umask_027: int, command: str) -> None:
    out = tmp_path / ("out.json" if command in ("barrier", "schema") else "out")
    code, _, stderr = words_run(command, out)
    assert code == 0, stderr
    entries = [p for p in tmp_path.rglob("*")]
    assert len(entries) >= (3 if command == "barrier" else 1)
    for p in entries:
        want = (0o777 if p.is_dir() else 0o666) & ~umask_027
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


def test_publish_is_all_or_nothing_from_the_api(tmp_path: Path) -> None:
    first, second = Target(tmp_path / "one.txt", "--report"), Target(tmp_path / "two", "--out", folder=True)

    def broken(p: Path) -> None:
        (p / "x").write_text("x")
        raise RuntimeError("a bug, not a write failure")

    with pytest.raises(RuntimeError, match="a bug"):  # not turned into an input error
        publish([(first, lambda p: p.write_text("1")), (second, broken)], force=False)
    assert list(tmp_path.iterdir()) == []
    publish([(first, lambda p: p.write_text("1")), (second, lambda p: (p / "x").write_text("2"))], force=False)
    assert first.path.read_text() == "1" and (second.path / "x").read_text() == "2"
    with pytest.raises(SymspecInputError, match="exists; refusing to overwrite it"):
        publish([(first, lambda p: p.write_text("new"))], force=False)
    assert first.path.read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["one.txt", "two"]


@pytest.mark.parametrize("folder", [False, True])
def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path, folder: bool) -> None:
    target = tmp_path / "deep" / "out"

    def good(text: str) -> Callable[[Path], None]:
        return (lambda p: (p / "f").write_text(text)) if folder else (lambda p: p.write_text(text))

    def read() -> str:
        return (target / "f").read_text() if folder else target.read_text()

    atomic_write(target, good("one"), folder=folder)
    atomic_write(target, good("two"), folder=folder)  # replaces what is there
    assert read() == "two" and [p.name for p in target.parent.iterdir()] == ["out"]

    def broken(p: Path) -> None:
        good("half")(p)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):  # the negative case: nothing half-written
        atomic_write(target, broken, folder=folder)
    assert read() == "two" and [p.name for p in target.parent.iterdir()] == ["out"]
    if not folder:
        assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask()
