"""The README stays true: its test command is what CI runs, its CLI table lists every command."""

from __future__ import annotations

import re
from pathlib import Path

from symspec.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_test_command_is_what_ci_runs() -> None:
    test_cmd = next(b for b in _blocks() if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text().replace(" --quiet", "")
    for step in (s.strip() for s in test_cmd.split("&&")):
        if step.startswith(". .venv"):
            continue
        assert step in ci, f"README step {step!r} is not in .ci/run"
    ci_pytest = next(line for line in ci.splitlines() if "pytest" in line)
    assert ci_pytest.strip() in test_cmd


def test_quick_start_runs_the_main_job_on_an_example_in_the_repo() -> None:
    quick = _blocks()[0]
    assert "pip install torch==" in quick and "symspec check examples/" in quick
    example = re.search(r"symspec check (\S+)", quick)
    assert example is not None and (ROOT / example.group(1)).exists()


def test_cli_reference_lists_every_command() -> None:
    text = (ROOT / "README.md").read_text()
    for name in COMMANDS:
        assert f"`symspec {name}" in text, f"the README's CLI table misses `symspec {name}`"
