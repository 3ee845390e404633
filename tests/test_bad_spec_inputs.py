"""The spec side of the bad-input corpus (issue #12): specs that a new user or a
fault-injection run produced and that once printed a Python traceback (exit 1). Each
must now exit 2 with an ``error: ...`` message (one line for one error; a headline
first for several), print no traceback, and write nothing in the working folder.
The model and data side is tests/test_bad_inputs.py."""

from __future__ import annotations

import re
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import symspec.binding
import symspec.spec.yamlsrc
from symspec.binding import MAX_HINTS, MAX_UNMATCHED_SHOWN, bind, template_regex
from symspec.errors import BindError, SpecError
from symspec.spec import builtin_path, load_spec, loads_spec
from symspec.spec.exprs import MAX_EXPR_CHARS, MAX_EXPR_DEPTH
from symspec.spec.yamlsrc import MAX_ALIAS_NODES, MAX_DEPTH, load_source
from tests.cli_files import run
from tests.needs import optional

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "nanogpt.py")
GOOD = (ROOT / "specs" / "nanogpt.yaml").read_text()


def edited(*replacements: tuple[str, str], append: str = "") -> str:
    """The nanoGPT spec with each ``(old, new)`` replaced once (``old`` must occur)."""
    text = GOOD
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text + append


def dim(expr: str) -> str:
    """The nanoGPT spec with ``d`` defined as ``expr``."""
    return edited(("  d: config.n_embd", f"  d: {expr}"))


def bomb(levels: int = 10, width: int = 10) -> str:
    """A "billion laughs" document: ``width ** levels`` values from a few hundred bytes."""
    lines = ["symspec: 1", "name: bomb", f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def unmatched(n: int) -> str:
    """The nanoGPT spec with ``n`` extra templates that name no parameter of the model."""
    return GOOD + "".join(f"  nowhere.{k}.weight: invariant\n" for k in range(n))


@attrs.frozen
class Case:
    id: str
    content: str | bytes
    #: a part of the message (the error line, or the headline of several)
    expect: str
    #: one error: one line; else the first line is a headline and details follow
    one_line: bool = True


CASES = [
    # dims that are not integers: a tag PyYAML cannot read raised ValueError from int()
    Case("dims-int-tag", dim("!!int sixteen"), "dims.d: 'sixteen' is not a valid !!int"),
    Case("dims-bool-tag", dim("!!bool maybe"), "dims.d: 'maybe' is not a valid !!bool"),
    Case("dims-unknown-tag", dim("!width 16"), "dims.d: unknown tag '!width'"),
    Case("dims-float", dim("3.5"), "dims.d: expected an integer expression, got 3.5"),
    Case("dims-string", dim("\"'16'\""), "dims.d: '16' is a string, not a number"),
    Case("merge-key", edited(append="\nbase: &base {a: 1}\nmore:\n  <<: *base\n"), "YAML merge keys ('<<') are not supported"),
    # files that are not UTF-8
    Case("latin-1", ("# café\n" + GOOD).encode("latin-1"), ":1:6: the file is not UTF-8 text (byte 0xe9 is not valid UTF-8)"),
    Case("utf-16", GOOD.encode("utf-16"), "the file is UTF-16 text"),
    Case("control-char", GOOD + "extra: \x07\n", "character 0x0007 is not allowed"),
    # documents built to exhaust memory or the stack
    Case("alias-bomb", bomb(), f"at most {MAX_ALIAS_NODES:,} may come from aliases"),
    Case("recursive-alias", edited(append="\nloop: &loop [1, *loop]\n"), "the alias *loop is inside its own anchor &loop"),
    Case("deep-nesting", "symspec: 1\nname: deep\nspaces: " + "[" * 100_000 + "]" * 100_000 + "\n",
         f"the document nests deeper than {MAX_DEPTH} levels"),
    Case("long-dims-expr", dim("+".join(["1"] * 100_000)), f"at most {MAX_EXPR_CHARS:,} are accepted"),
    Case("deep-dims-expr", dim("-" * 500 + "16"), f"nests deeper than {MAX_EXPR_DEPTH} levels"),
    Case("long-group-expr", edited(("group: OC(d)", "group: OC(" + "+".join(["d"] * 10_000) + ")")),
         f"at most {MAX_EXPR_CHARS:,} are accepted"),
    # what validate passed although binding would fail
    Case("dims-cycle", edited(("  d: config.n_embd", "  d: dh * H")), "dims.d: circular dimensions: d -> dh -> d"),
    Case("dims-self", dim("d + 1"), "dims.d: circular dimensions: d -> d"),
    Case("floor-div-zero", dim("config.n_embd // 0"), "dims.d: 'config.n_embd // 0': division by zero"),
    Case("mod-zero", dim("config.n_embd % (2 - 2)"), "dims.d: 'config.n_embd % (2 - 2)': division by zero"),
    Case("literal-div", dim("7 / 2"), "dims.d: '7 / 2': 7 is not divisible by 2"),
    # sizes that are no sizes: validate passed them, binding failed far from the cause
    Case("dims-zero", dim("0"), "dims.d: dimension d is 0; a dimension is a positive integer (a size)"),
    Case("dims-negative", dim("-4"), "dims.d: dimension d is -4; a dimension is a positive integer (a size)"),
    Case("dims-literal-zero", dim("2 * 8 - 16"), "dims.d: dimension d is 0; a dimension is a positive integer"),
]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_in(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: Any) -> tuple[int, str, str]:
    """``symspec ARGS...`` with ``folder`` as the working folder, which must stay as it was."""
    monkeypatch.chdir(folder)
    before = files_under(folder)
    code, out, err = run(*args)
    assert files_under(folder) == before, "the command wrote into the working folder"
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def error_lines(err: str) -> list[str]:
    """stderr from the ``error:`` line on (a model loader's progress bars may precede it)."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert starts, err
    return lines[starts[0]:]


def write_case(folder: Path, case: Case) -> Path:
    path = folder / f"{case.id}.yaml"
    if isinstance(case.content, bytes):
        path.write_bytes(case.content)
    else:
        path.write_text(case.content, encoding="utf-8")
    return path


@pytest.mark.parametrize("command", ["validate", "check"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_spec_is_one_located_error(case: Case, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_case(tmp_path, case)
    args = ("validate", path) if command == "validate" else ("check", GPT, "--spec", path, "--samples", "1")
    code, _, err = run_in(tmp_path, monkeypatch, *args)
    assert code == 2, err
    lines = error_lines(err)
    assert lines[0].startswith(f"error: {path}"), lines[0]  # located in the file
    assert case.expect in lines[0]
    if case.one_line:
        assert len(lines) == 1, lines


def test_a_spec_with_many_unmatched_templates_lists_a_few_and_counts_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a million of them took minutes: a fuzzy "did you mean" for each
    searches = []
    real = symspec.binding.suggest
    monkeypatch.setattr(symspec.binding, "suggest", lambda *a, **k: searches.append(a[0]) or real(*a, **k))
    n = 2_000
    path = tmp_path / "many.yaml"
    path.write_text(unmatched(n))
    code, _, err = run_in(tmp_path, monkeypatch, "check", GPT, "--spec", path, "--samples", "1")
    assert code == 2
    lines = error_lines(err)
    templates = len(load_spec(path).params)
    assert lines[0].startswith(f"error: {path}: the spec 'nanogpt' does not fit GPT: {templates - n} of its {templates} parameter template(s)")
    listed = [line for line in lines if "' matches no parameter of GPT; did you mean" in line]
    assert len(listed) == MAX_UNMATCHED_SHOWN
    assert lines[-1].endswith(f"{n - MAX_UNMATCHED_SHOWN} more parameter template(s) match no parameter of GPT: "
                              f"'nowhere.{MAX_UNMATCHED_SHOWN}.weight', 'nowhere.{MAX_UNMATCHED_SHOWN + 1}.weight', "
                              f"'nowhere.{MAX_UNMATCHED_SHOWN + 2}.weight', ...")
    assert len(lines) == 1 + MAX_UNMATCHED_SHOWN + 1
    assert 0 < len(searches) <= MAX_HINTS


def test_a_few_unmatched_templates_are_all_listed_with_a_suggestion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "few.yaml"
    path.write_text(unmatched(3))
    code, _, err = run_in(tmp_path, monkeypatch, "check", GPT, "--spec", path, "--samples", "1")
    assert code == 2
    lines = error_lines(err)
    assert [line.split(": ")[1] for line in lines[1:]] == [f"params[nowhere.{k}.weight]" for k in range(3)]
    assert all("; did you mean" in line for line in lines[1:])
    assert "more parameter template(s)" not in err
    assert "--spec" not in lines[0]  # an edited copy of the built-in spec: the fix is in the file, not another spec


def test_validate_caps_the_suggestions_of_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    searches = []
    real = symspec.spec.yamlsrc.suggest
    monkeypatch.setattr(symspec.spec.yamlsrc, "suggest", lambda *a, **k: searches.append(a[0]) or real(*a, **k))
    path = tmp_path / "spaces.yaml"
    n = 500
    path.write_text(GOOD + "".join(f"  nowhere.{k}.weight: [residd]\n" for k in range(n)))
    code, _, err = run_in(tmp_path, monkeypatch, "validate", path)
    assert code == 2
    lines = error_lines(err)
    assert lines[0] == f"error: {path}: {n} error(s) in spec"
    assert len(lines) == 1 + n  # every error is still reported ...
    assert sum("did you mean 'resid'" in line for line in lines) == len(searches) == symspec.spec.yamlsrc.MAX_HINTS  # ... a few with a hint


def test_the_alias_bomb_is_refused_before_expansion() -> None:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(SpecError) as info:
            loads_spec(bomb(levels=10, width=10), "bomb.yaml")
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    counted = re.search(r"aliases expand to ([\d,]+) values", str(info.value))
    assert counted and int(counted.group(1).replace(",", "")) > 10**10  # counted, not built
    assert elapsed < 0.5
    assert peak < 5_000_000  # bytes: the document's few hundred nodes, never its expansion


def test_aliases_and_dims_within_the_limits_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the limits refuse abuse, not YAML's features: an anchor reused, dims in any order
    text = edited(("  d: config.n_embd", "  d: dh * H\n  _width: config.n_embd // 1 % (H * dh + 1)"),
                  ("  dh: d / H", "  dh: config.n_embd / H"),
                  ("  transformer.wte.weight: [_, resid]", "  transformer.wte.weight: &embedding [_, resid]"),
                  ("  transformer.wpe.weight: [_, resid]", "  transformer.wpe.weight: *embedding"))
    path = tmp_path / "fine.yaml"
    path.write_text(text)
    code, out, err = run_in(tmp_path, monkeypatch, "validate", path)
    assert code == 0, err
    assert f"{path}: ok" in out
    code, out, err = run_in(tmp_path, monkeypatch, "check", GPT, "--spec", path, "--samples", "1", "--dtype", "float64")
    assert code == 0, err
    src = load_source(bomb(levels=3, width=10), "small.yaml")  # 1,100 values from aliases: expanded
    assert src.data["l2"] == [[["x"] * 10] * 10] * 10


def test_a_valid_spec_validates_and_its_check_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nanogpt.yaml"
    path.write_text(GOOD)
    code, out, err = run_in(tmp_path, monkeypatch, "validate", path, "nanogpt")
    assert code == 0, err
    assert f"{path}: ok (spec 'nanogpt')" in out and "nanogpt: ok (spec 'nanogpt')" in out
    code, out, err = run_in(tmp_path, monkeypatch, "check", GPT, "--spec", path, "--samples", "1", "--dtype", "float64")
    assert code == 0, err
    assert "all symmetries preserve the function" in out


def test_validate_reports_each_bad_file_and_passes_the_good_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    cyc, zero = write_case(tmp_path, CASES[[c.id for c in CASES].index("dims-cycle")]), tmp_path / "zero.yaml"
    zero.write_text(dim("config.n_embd // 0"))
    code, out, err = run_in(tmp_path, monkeypatch, "validate", good, cyc, zero)
    assert code == 2
    assert f"{good}: ok" in out
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {cyc}:") and lines[1].startswith(f"error: {zero}:")


@pytest.mark.parametrize(("expr", "value"), [("config.n_embd - 100", -36), ("config.n_embd - 64", 0), ("config.n_embd + 0", None)])
def test_a_dimension_that_evaluates_to_no_size_is_refused_where_it_is_declared(
        expr: str, value: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # validate cannot know config.n_embd (64 in the example); binding must say which dimension, and where
    path = tmp_path / "dims.yaml"
    path.write_text(dim(expr))
    assert run_in(tmp_path, monkeypatch, "validate", path)[0] == 0
    code, out, err = run_in(tmp_path, monkeypatch, "check", GPT, "--spec", path, "--samples", "1", "--dtype", "float64")
    if value is None:  # the control: a positive value checks
        assert code == 0 and "all symmetries preserve the function" in out, err
        return
    assert code == 2, err
    line = (GOOD.splitlines().index("  d: config.n_embd") + 1)
    assert (f"{path}:{line}:6: dims.d: dimension d = {expr}: evaluates to {value}; a dimension is a positive integer (a size)"
            in error_lines(err))


#: paths that are not a spec file to read: devices and pipes never end (``/dev/zero`` was
#: read until memory ran out; opening a FIFO waited for a writer), and a file far larger
#: than any spec is not one either
NOT_A_FILE = [
    ("dev-zero", "is a character device, not a spec file (a regular file)"),
    ("fifo", "is a pipe (FIFO), not a spec file (a regular file)"),
    ("too-large", "larger than 4,096 bytes, more than a spec file holds; is it the right file?"),
    ("folder", "is a folder, not a spec file"),
]


def _unblock(fifo: Path, after: float = 10.0) -> None:
    """Open ``fifo`` for writing after ``after`` seconds and close it, so that a reader
    blocked on it gets end-of-file; with no reader waiting, do nothing."""
    import contextlib
    import os

    time.sleep(after)
    with contextlib.suppress(OSError):  # no reader: the FIFO was refused without opening it for reading
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("command", ["validate", "check"])
@pytest.mark.parametrize(("kind", "expect"), NOT_A_FILE, ids=[k for k, _ in NOT_A_FILE])
def test_a_spec_path_that_is_not_a_small_regular_file_is_one_line(kind: str, expect: str, command: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import symspec.io_util

    monkeypatch.setattr(symspec.io_util, "MAX_TEXT_BYTES", 4096)
    work = tmp_path / "work"
    work.mkdir()
    if kind == "dev-zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        path = tmp_path / "spec.yaml"
        os.mkfifo(path)  # no writer: reading it once waited forever
        threading.Thread(target=_unblock, args=(path,), daemon=True).start()  # a regression fails, never hangs
    elif kind == "too-large":
        path = tmp_path / "big.yaml"
        path.write_text(GOOD + "#" * 4096 + "\n")  # a valid spec, padded past the limit
    else:
        path = tmp_path / "specs.yaml"
        path.mkdir()
    args = ("validate", path) if command == "validate" else ("check", GPT, "--spec", path, "--samples", "1")
    code, _, err = run_in(work, monkeypatch, *args)
    assert code == 2, err
    assert error_lines(err) == [f"error: {path}: {expect}"]
    if kind == "too-large":  # the control: the same spec under the limit is read
        monkeypatch.setattr(symspec.io_util, "MAX_TEXT_BYTES", 2 * 4096 + len(GOOD))
        code, _, err = run_in(work, monkeypatch, *args)
        assert code == 0, err


# -- a spec that does not fit the model -----------------------------------------------------

def _tiny_llama(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    optional("transformers")
    from tests.zoo import ZOO

    model, _ = ZOO["llama"](n_layer=1)
    model.save_pretrained(folder)
    return folder, dict(model.state_dict())


def test_a_spec_for_another_family_leads_with_how_little_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, state = _tiny_llama(tmp_path / "llama")
    spec = load_spec("gpt2")
    matched = sum(any(template_regex(p.pattern).fullmatch(n) for n in state) for p in spec.params)
    assert matched < len(spec.params) / 2
    code, _, err = run_in(tmp_path, monkeypatch, "check", folder, "--spec", "gpt2", "--samples", "1")
    assert code == 2
    lines = error_lines(err)
    assert lines[0].startswith(f"error: builtin:gpt2: the spec 'gpt2' does not fit LlamaForCausalLM: "
                               f"{matched} of its {len(spec.params)} parameter template(s) match a parameter")
    assert lines[0].endswith("the built-in spec 'llama' fits LlamaForCausalLM: --spec llama")
    assert len(lines) > 2  # the details follow the headline


def test_errors_in_a_builtin_spec_cite_it_by_name_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = _tiny_llama(tmp_path / "llama")
    code, _, err = run_in(tmp_path, monkeypatch, "check", folder, "--spec", "gpt2", "--samples", "1")
    assert code == 2
    details = error_lines(err)[1:]
    assert "specs/gpt2.yaml" not in err  # a path an installed user does not have
    assert all(line.startswith("builtin:gpt2") for line in details)
    file_lines = builtin_path("gpt2").read_text().splitlines()  # type: ignore[union-attr]
    located = [line for line in details if line.startswith("builtin:gpt2:") and ": dims." in line]
    assert located
    for line in located:  # the cited line is the dimension's line of the installed file
        cited = re.match(r"builtin:gpt2:(\d+):\d+: dims\.(\w+):", line)
        assert cited, line
        assert file_lines[int(cited.group(1)) - 1].strip().startswith(f"{cited.group(2)}:"), line


def test_a_fitting_builtin_spec_checks_where_the_wrong_one_did_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the model folder is named 'llama' in the working folder: --spec llama is still the built-in spec
    folder, _ = _tiny_llama(tmp_path / "llama")
    code, out, err = run_in(tmp_path, monkeypatch, "check", folder, "--spec", "llama", "--samples", "1", "--dtype", "float64")
    assert code == 0, err
    assert "all symmetries preserve the function" in out


def test_a_state_dict_is_pointed_to_the_builtin_spec_that_names_its_parameters() -> None:
    optional("transformers")
    from tests.zoo import ZOO

    state = dict(ZOO["llama"](n_layer=1)[0].state_dict())
    with pytest.raises(BindError) as info:
        bind(load_spec("gpt2"), state)
    named = info.value.headline.split("; the built-in specs ")[1]
    assert "'llama'" in named and "'gpt2'" not in named and named.endswith(" name these parameters: --spec NAME")
    with pytest.raises(BindError) as info:  # nothing names these: no suggestion
        bind(load_spec("gpt2"), {"foo.weight": torch.zeros(2, 2)})
    assert "--spec" not in info.value.headline

