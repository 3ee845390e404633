"""The command line: exit codes (0 pass, 1 a failed check, 2 bad input), JSON, laziness."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_files import run

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "nanogpt.py")
VIT = str(ROOT / "examples" / "vit.py")


def test_check_passes_on_the_examples_with_json() -> None:
    code, out, _ = run("check", GPT, "--samples", "1", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["passed"] and data["spec"] == "nanogpt"
    code, out, _ = run("check", VIT, "--samples", "1", "--dtype", "float64")
    assert code == 0 and "all symmetries preserve the function" in out and "float32" not in out


def test_check_fails_with_exit_1_on_a_wrong_spec(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text((ROOT / "specs" / "nanogpt.yaml").read_text().replace("group: S(f)", "group: O(f)"))
    code, out, _ = run("check", GPT, "--spec", str(wrong), "--samples", "1")
    assert code == 1
    assert "FAIL at ff[0], ff[1]" in out and "failed: ff[*], all" in out


@pytest.mark.parametrize(("setup", "message"), [
    ("bad_yaml", "invalid YAML"),
    ("no_model", "defines neither build() nor a module-level 'model'"),
    ("mismatch", "does not fit ViT"),
    ("missing", "no such file"),
    ("no_builtin", "no built-in spec fits Tiny"),
])
def test_check_bad_input_exits_2(tmp_path: Path, setup: str, message: str) -> None:
    args = ["check"]
    if setup == "bad_yaml":
        bad = tmp_path / "bad.yaml"
        bad.write_text("symspec: 1\nspaces: [\n")
        args += [GPT, "--spec", str(bad)]
    elif setup == "no_model":
        f = tmp_path / "empty.py"
        f.write_text("x = 1\n")
        args += [str(f), "--spec", "nanogpt"]
    elif setup == "mismatch":
        args += [VIT, "--spec", "nanogpt"]
    elif setup == "missing":
        args += [str(tmp_path / "nope.py")]
    else:
        f = tmp_path / "tiny.py"
        f.write_text("import torch\nclass Tiny(torch.nn.Linear):\n    pass\ndef build():\n    return Tiny(2, 2)\n"
                     "def example_inputs(model, batch=2, seed=0):\n    return (torch.randn(batch, 2),)\n")
        args += [str(f)]
    code, _, err = run(*args)
    assert code == 2, err
    assert message in err


def test_check_usage_errors_exit_2() -> None:
    assert run("check", GPT, "--dtype", "float16")[0] == 2
    assert run("check", GPT, "--rtol", "bogus")[0] == 2
    code, _, err = run("check", GPT, "--space", "fff")
    assert code == 2 and "did you mean 'ff'" in err


def test_validate_reports_every_error_with_locations(tmp_path: Path) -> None:
    good = ROOT / "specs" / "vit.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("symspec: 1\nname: x\nspaces:\n  resid: Orth(4)\nparams:\n  w: [residd]\n")
    code, out, err = run("validate", str(good), str(bad))
    assert code == 2
    assert "vit.yaml: ok (spec 'vit')" in out
    assert f"{bad}:4:10: spaces.resid: unknown group 'Orth'; did you mean 'O'?" in err
    assert f"{bad}:6:7: params.w[0]: unknown space 'residd'; did you mean 'resid'?" in err
    code, out, _ = run("validate", "nanogpt", "--json")
    assert code == 0 and json.loads(out)[0]["valid"] is True


def test_specs_and_schema(tmp_path: Path) -> None:
    code, out, _ = run("specs", "--json")
    assert code == 0 and json.loads(out)["nanogpt"]["models"] == ["GPT"]
    code, out, _ = run("schema")
    assert code == 0 and json.loads(out)["title"] == "symspec symmetry spec"
    target = tmp_path / "schema.json"
    assert run("schema", "--out", str(target))[0] == 0
    assert json.loads(target.read_text())["required"] == ["symspec", "name", "spaces", "params"]


def test_help_is_lazy() -> None:
    code = (
        "import sys; from symspec.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'cvxpy', 'matplotlib', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "check" in out


def test_console_script_exit_code() -> None:
    exe = Path(sys.executable).parent / "symspec"
    if not exe.exists():
        pytest.skip("the symspec console script is not installed in this environment: pip install -e .")
    proc = subprocess.run([str(exe), "check", VIT, "--samples", "1", "--dtype", "float64", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["passed"]


def test_progress_bar_shows_the_task_on_a_terminal() -> None:
    # the bar barrier and universe share; the CLI tests run without a terminal (quiet)
    import io

    from rich.console import Console

    from symspec.cli._common import progress_bar

    buf = io.StringIO()
    bar = progress_bar(Console(file=buf, force_terminal=True, width=80))
    with bar:
        task = bar.add_task("aligning", total=3)
        bar.update(task, advance=2)
        bar.refresh()
    assert "aligning" in buf.getvalue() and "2/3" in buf.getvalue()


#: a character model whose config names no context length (no block_size, n_positions, ...)
NO_CONTEXT = '''
import torch


class Char(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding({vocab}, 8)
        self.out = torch.nn.Linear(8, {vocab})

    def forward(self, x):
        return self.out(torch.relu(self.emb(x)))


def build():
    torch.manual_seed(0)
    return Char()


def example_inputs(model, batch=2, seed=0):
    return (torch.randint(0, {vocab}, (batch, 4)),)
'''


def test_text_without_a_known_context_spells_out_the_data_option(tmp_path: Path) -> None:
    # the message once ended "give block=N", leaving the user to guess where it goes
    from tests.cli_files import write_words

    text = tmp_path / "small.txt"
    vocab = write_words(text)
    model = tmp_path / "char.py"
    model.write_text(NO_CONTEXT.format(vocab=vocab))
    code, _, err = run("barrier", model, model, "--data", text, "--points", "2", "--max-samples", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    suggested = f"text:{text},block=32"
    assert err.strip().endswith(f"--data {suggested}"), err
    code, _, err = run("barrier", model, model, "--data", suggested, "--points", "2", "--max-samples", "4")
    assert code == 0, err  # the spelled-out form works as given


#: a model no built-in spec fits
MLP = '''
import torch


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build():
    torch.manual_seed(0)
    return TwoLayer()


def example_inputs(model, batch=2, seed=0):
    return (torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed)),)
'''


def test_a_model_without_a_built_in_spec_is_told_to_infer_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two layer.py").write_text(MLP)
    code, _, err = run("check", "two layer.py")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip().endswith("; pass --spec PATH, or draft one with: symspec infer 'two layer.py' --out spec.yaml")
    # the advice, followed word for word (its quoting included)
    import shlex

    code, _, err = run(*shlex.split(err.split("draft one with: symspec ", 1)[1]))
    assert code == 0, err
    code, out, err = run("check", "two layer.py", "--spec", "spec.yaml")
    assert code == 0 and "all symmetries preserve the function" in out, err


# -- progress where stderr is not a terminal (a log file): a plain line every few seconds ------

#: check: sample 2/3: attn (5/12), 41 s, about 95 s left
PROGRESS_LINE = r"^{what}: (round \d+: )?sample \d+/\d+: .+ \((\d+)/(\d+)\), \d+ s(, about \d+ s left)?$"


@pytest.mark.parametrize("command", ["check", "infer"])
def test_a_log_gets_plain_progress_lines(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # check (3 min 20 s) and infer (1 min 47 s) on SmolLM2-135M once logged nothing until they ended
    monkeypatch.setenv("SYMSPEC_PROGRESS_SECONDS", "0")  # a line for every step
    code, _, err = run(command, GPT, "--samples", "2")
    assert code == 0, err
    counted = [m for line in err.splitlines() if (m := re.match(PROGRESS_LINE.format(what=command), line))]
    assert len(counted) >= 4, err
    assert all(int(m.group(2)) < int(m.group(3)) for m in counted)
    assert any(m.group(4) for m in counted), err  # how long is left, once there is a rate
    assert "\x1b" not in err  # plain text: no colours, no cursor movement
    if command == "infer":
        assert "infer: tracing with torch.export" in err and "the spec passes its check" in err
    # the control: throttled to one line an hour, a quick run logs none
    monkeypatch.setenv("SYMSPEC_PROGRESS_SECONDS", "3600")
    code, _, err = run(command, GPT, "--samples", "2")
    assert code == 0 and not re.search(rf"^{command}: ", err, re.M), err


def test_a_terminal_still_gets_the_rich_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    import symspec.cli._common

    buf = io.StringIO()
    monkeypatch.setattr(symspec.cli._common, "stderr_console", lambda: Console(file=buf, force_terminal=True, width=100))
    monkeypatch.setenv("SYMSPEC_PROGRESS_SECONDS", "0")
    code, _, err = run("check", GPT, "--samples", "1")
    assert code == 0, err
    drawn = buf.getvalue()
    assert "━" in drawn and "sample 1/1" in drawn and "\x1b[2K" in drawn  # a bar, redrawn in place
    assert "check: " not in drawn and "check: " not in err  # no log lines on a terminal


def test_a_long_step_without_updates_still_logs_a_line() -> None:
    # one step (tracing, a float64 forward pass of a large model) can take minutes by itself
    import io
    import time

    from rich.console import Console

    from symspec.cli._common import progress_bar

    buf = io.StringIO()
    bar = progress_bar(Console(file=buf, width=80), "infer")
    bar.interval = 0.05
    with bar:
        bar.add_task("tracing with torch.export", total=None)
        for _ in range(200):  # no update: the bar's timer must print (waits at most 10 s)
            if "infer: tracing with torch.export" in buf.getvalue():
                break
            time.sleep(0.05)
    assert re.match(r"^infer: tracing with torch\.export, \d+ s$", buf.getvalue().splitlines()[0])
