"""Ctrl-C while a library's module body runs (an import) is delivered once the import is
done: raised inside it, the KeyboardInterrupt could cross C++ that cannot take it (torch
imports parts of itself from C++ on first use; pybind11 and torch abort the process with
'terminate called after throwing ...', exit -6, seen in CI at a Ctrl-C 4 s into infer).
The user's own modules stay interruptible where they are (the negative case)."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

import symspec.cli._common as common

BODY = """
import time
started = time.monotonic()
while time.monotonic() - started < 0.6:  # the interrupt lands in here
    time.sleep(0.01)
done = True
"""


def _import_interrupted(folder: Path, name: str) -> tuple[bool, bool]:
    """Import ``name`` from ``folder`` under the CLI's interrupt handling, with SIGINT
    sent 0.2 s in: (the KeyboardInterrupt came, the module finished its body)."""
    (folder / f"{name}.py").write_text(BODY)
    sys.path.insert(0, str(folder))
    timer = threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT))
    came = False
    try:
        with common._watching_interrupts():
            timer.start()
            try:
                importlib.import_module(name)
                import time

                time.sleep(1.0)  # a re-delivered interrupt lands here, after the import
            except KeyboardInterrupt:
                came = True
    finally:
        timer.cancel()
        sys.path.remove(str(folder))
    module = sys.modules.pop(name, None)
    return came, bool(getattr(module, "done", False))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_an_interrupt_in_a_library_import_comes_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    monkeypatch.setattr(common, "LIBRARY_PATHS", (os.path.join(str(tmp_path / "lib"), ""),))
    (tmp_path / "lib").mkdir()
    came, done = _import_interrupted(tmp_path / "lib", "slow_library_module")
    assert came and done  # delivered, and only once the module was whole
    (tmp_path / "mine").mkdir()
    came, done = _import_interrupted(tmp_path / "mine", "slow_user_module")
    assert came and not done  # the control: the user's module body is interrupted where it is
