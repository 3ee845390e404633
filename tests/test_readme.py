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


def test_python_api_snippet_runs_and_plants_b_with_a_s_function() -> None:
    import torch

    from tests.zoo import ZOO

    snippet = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    model, inputs = ZOO["nanogpt"]()
    scope: dict[str, object] = {"model": model, "inputs": inputs}
    exec(snippet, scope)
    b = scope["b"]
    assert isinstance(b, torch.nn.Module) and type(b) is type(model)
    with torch.no_grad():
        ya, yb = model(*inputs), b(*inputs)
    assert float((ya - yb).abs().max()) < 1e-4 * float(ya.abs().max())
    assert not torch.allclose(model.lm_head.weight, b.lm_head.weight)


def test_the_two_commands_pin_one_torch_so_either_order_works() -> None:
    # the quick start once pinned another torch than the tests: run second, it swapped
    # the tests' torch under their torchvision (and the tests swapped its CPU build)
    quick, tests = _blocks()[0], next(b for b in _blocks() if "pytest" in b)
    pins = [set(re.findall(r"torch==[\d.]+", block)) for block in (quick, tests)]
    assert len(pins[0]) == 1 and pins[0] == pins[1], pins
    assert "python3 -m venv .venv" in quick and "python3 -m venv .venv" in tests  # one folder, one venv
