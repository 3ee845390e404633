"""Ctrl-C ends the ``symspec`` command without finalising the interpreter.

Once an interrupted command has rolled its outputs back and printed its line, the
process exits at once (``os._exit(130)``): a thread still running then (a library's
worker, the user's model code) that enters the interpreter while it shuts down aborts
the process (CPython gh-87135: ``Fatal Python error: PyThreadState_Get``, exit -6 instead
of 130, seen in CI). An ``atexit`` hook in the user's model file stands for what runs
during finalisation: it must not run after an interrupt, and must run after a normal end
(the negative case: the hook is real, and the test could see it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

MODEL = '''
import atexit, os, sys, time
import torch
from symspec.loading import import_file

_ng = import_file({nanogpt!r})
SPEC = "nanogpt"
atexit.register(lambda: os.write(2, b"finalised\\n"))


def build(**overrides):
    cfg = dict(vocab_size=15, block_size=16, n_layer=1, n_head=2, n_embd=8, n_ff=32)
    cfg.update(overrides)
    torch.manual_seed(0)
    if os.environ.get("HOLD"):
        os.write(2, b"building\\n")
        time.sleep(60)
    return _ng.build(**cfg)


example_inputs = _ng.example_inputs
'''


def _command() -> list[str]:
    script = Path(sys.executable).parent / "symspec"
    if not script.exists():
        pytest.skip("the installed symspec command is not beside this interpreter (pip install -e .)")
    return [str(script)]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "held.py"
    path.write_text(MODEL.format(nanogpt=str(EXAMPLES / "nanogpt.py")))
    return path


def _run(model: Path, hold: bool) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOLD"}
    if hold:
        env["HOLD"] = "1"
    proc = subprocess.Popen([*_command(), "check", str(model), "--samples", "1", "--dtype", "float32"],
                            cwd=model.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    if hold:  # interrupt once the model's code runs (it sleeps there)
        seen = b""
        deadline = time.monotonic() + 120
        while b"building" not in seen and time.monotonic() < deadline:
            chunk = proc.stderr.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            seen += chunk
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()  # to its end: the process closes it when it exits
        return proc.wait(timeout=120), (seen + rest).decode()
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err.decode()


def test_an_interrupted_command_exits_130_without_finalising(model: Path) -> None:
    code, stderr = _run(model, hold=True)
    assert code == 130, (code, stderr[-2000:])
    assert stderr.strip().splitlines()[-1] == "interrupted", stderr[-2000:]
    assert "finalised" not in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_a_command_that_ends_finalises_as_usual(model: Path) -> None:
    code, stderr = _run(model, hold=False)
    assert code == 0, (code, stderr[-2000:])
    assert "finalised" in stderr, stderr[-2000:]
