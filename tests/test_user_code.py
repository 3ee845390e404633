"""A model file's own code (its import, build(), example_inputs(), data hooks) runs under
:func:`symspec.loading.user_code`: it can neither move the command to another working
directory (relative output paths mean the user's folder) nor end it with ``os._exit``.
The rows of tests/test_bad_inputs.py run every command on files that call ``os._exit``;
here, the working directory and the guard itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from symspec.errors import SymspecInputError
from symspec.loading import ExitCalled, describe_failure, load_model, user_code
from tests.cli_files import model_file, run, write_words

#: a model file that moves to ``{away}`` when imported and again in build()
MOVES = """
import os
os.chdir({away!r})
_b = build


def build(**kw):
    os.chdir({away!r})
    return _b(**kw)
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    vocab = write_words(tmp_path / "words.txt")
    away = tmp_path / "elsewhere"
    away.mkdir()
    good = model_file(tmp_path, "good.py", vocab)
    torch.save(load_model(good).model.state_dict(), tmp_path / "good.pt")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return {"dir": tmp_path, "away": away, "cwd": cwd, "good": good, "ckpt": tmp_path / "good.pt",
            "text": tmp_path / "words.txt",
            "moves": model_file(tmp_path, "moves.py", vocab, extra=MOVES.format(away=str(away)))}


@pytest.mark.parametrize("command", ["infer", "match", "barrier"])
@pytest.mark.parametrize("model", ["moves", "good"])  # good: the control, written where it is asked too
def test_relative_outputs_land_in_the_users_folder_when_the_model_file_changes_it(
        files: dict[str, Path], command: str, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    f, g, ck = str(files[model]), str(files["good"]), str(files["ckpt"])
    args, written = {
        "infer": (["infer", f, "--out", "rel_spec.yaml"], "rel_spec.yaml"),
        "match": (["match", f, ck, "--model", g, "--out", "out", "--rounds", "1"], "out"),
        "barrier": (["barrier", f, ck, "--model", g, "--data", f"text:{files['text']}", "--points", "2",
                     "--max-samples", "4", "--report", "rep.json"], "rep.json"),
    }[command]
    monkeypatch.chdir(files["cwd"])
    code, out, err = run(*args)
    assert code == 0, (out, err)
    assert f"wrote {written}" in out + err
    assert (files["cwd"] / written).exists() and os.listdir(files["away"]) == []
    assert Path.cwd() == files["cwd"]
    notes = [line for line in err.splitlines() if "changed the working directory" in line]
    if model == "moves":
        assert len(notes) == 2 and "(at import);" in notes[0] and "(in build());" in notes[1], err
        assert all(n.startswith(f"note: {f} changed the working directory to {files['away']}") for n in notes)
    else:
        assert notes == []


def test_the_guard_turns_os_exit_into_an_error_and_restores_everything(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    real = os._exit
    with pytest.raises(ExitCalled) as e, user_code("m.py", "in build()"):
        os._exit(4)
    assert describe_failure(e.value) == "it called os._exit(4)"
    assert isinstance(e.value, SystemExit) and not isinstance(e.value, Exception)  # `except Exception` does not swallow it
    assert os._exit is real
    with user_code("m.py", "at import"):  # nested: the outer block is still guarded after the inner one
        with user_code("n.py", "at import"):
            pass
        with pytest.raises(ExitCalled):
            os._exit(0)
    assert os._exit is real
    sub = tmp_path / "sub"
    sub.mkdir()
    with user_code("m.py", "at import"):
        os.chdir(sub)
    assert Path.cwd() == tmp_path


def test_a_forked_child_of_user_code_still_exits() -> None:
    """The guard is the parent's: a child forked meanwhile (a data loader's worker) that
    calls os._exit ends, and does not go on running the parent's code."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    with user_code("m.py", "in data('train')"):
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def _unguarded_exit(code: int = 0) -> None:
    raise AssertionError(f"os._exit({code}) reached outside the guard")


def test_a_forward_that_moves_or_exits_on_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first forward (the probe on the example inputs) runs guarded too."""
    vocab = write_words(tmp_path / "words.txt")
    away = tmp_path / "elsewhere"
    away.mkdir()
    body = "\n_b = build\ndef build(**kw):\n    m = _b(**kw)\n    f = m.forward\n    def forward(*a, **k):\n{}\n" \
           "        return f(*a, **k)\n    m.forward = forward\n    return m\n"
    moves = model_file(tmp_path, "moves.py", vocab, extra=body.format(f"        import os\n        os.chdir({str(away)!r})"))
    quits = model_file(tmp_path, "quits.py", vocab, extra=body.format("        import os\n        os._exit(0)"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "_exit", _unguarded_exit)  # were the guard missing, pytest itself would end
    load_model(moves).example_inputs()
    assert Path.cwd() == tmp_path
    with pytest.raises(SymspecInputError, match=r"quits\.py: the model's forward failed on its example inputs "
                                                r"\(at .*quits\.py:\d+\): it called os\._exit\(0\)"):
        load_model(quits).example_inputs()


def _not_a_file(kind: str, where: Path) -> Path:
    """A path that opens as something other than a small regular file."""
    if kind == "fifo":
        os.mkfifo(where)
    else:  # a link to /dev/zero: endless, and the name looks right
        where.symlink_to("/dev/zero")
    return where


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_model_file_a_config_or_a_model_list_that_is_not_a_file_is_one_line(tmp_path: Path, kind: str) -> None:
    """A FIFO once waited forever for a writer and /dev/zero was read until memory ran out,
    for every input the commands read whole; each is now refused before a byte is read.
    The control: the same paths as regular files load."""
    good = model_file(tmp_path, "good.py", write_words(tmp_path / "words.txt"))
    folder = tmp_path / "hf"
    folder.mkdir()
    cases = [
        (["check", _not_a_file(kind, tmp_path / "m.py"), "--samples", "1"], "m.py: is "),
        (["check", folder, "--samples", "1"], "config.json: is "),
        (["universe", f"@{_not_a_file(kind, tmp_path / 'list.txt')}", "--model", good, "--out", tmp_path / "u"],
         "list.txt: is "),
        (["match", good, _not_a_file(kind, tmp_path / "b.pt"), "--model", good, "--out", tmp_path / "o"], "b.pt: is "),
        (["check", _not_a_file(kind, tmp_path / "m.gguf")], "m.gguf: is "),
    ]
    _not_a_file(kind, folder / "config.json")
    for args, says in cases:
        code, out, err = run(*args)
        assert code == 2 and len(err.splitlines()) == 1 and says in err and "regular file" in err, err
        assert "Traceback" not in err + out
    assert not (tmp_path / "u").exists() and not (tmp_path / "o").exists()
    # the control: regular files in the same places are read
    (tmp_path / "m.py").unlink()
    (tmp_path / "m.py").write_text(good.read_text())
    assert run("check", tmp_path / "m.py", "--samples", "1", "--dtype", "float64")[0] == 0
