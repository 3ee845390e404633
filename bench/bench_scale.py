"""What symspec costs at scale: wall time and peak memory of the CLI on random-initialised
Hugging Face models of real shapes, from a 10M toy to TinyLlama's 1.1B.

    python -m bench.bench_scale [--sizes gpt2-10m gpt2-small qwen2-0.5b tinyllama-1.1b]
                                [--dtypes bfloat16 float32] [--commands check infer match match-data barrier]
                                [--tokens 4096] [--block 128] [--quick] [--merge]
                                [--out bench/results/scale.json] [--plot bench/results/scale.png]
    python -m bench.bench_scale --table [--out bench/results/scale.json]

Each size is a model built from its config with random weights (nothing downloads),
saved with ``save_pretrained(max_shard_size=...)`` as a sharded safetensors folder in
each dtype under ``bench/cache/scale/`` (git-ignored; built once, reused). B is a planted
copy of A: ``symspec.plant`` on the float32 model (seed 3), saved in the same dtype as A.
Planting works in float64 on the whole model (about 28 bytes per parameter at its
peak), so where that does not fit in the memory available B is an independent model
(seed 1) and the row says so (``pair``).

Every measurement is one ``symspec`` command in a fresh child process, waited for with
``os.wait4``, whose resource usage is that child's own: ``wall_s``, ``cpu_s`` (user +
system) and ``peak_rss_gb`` (its peak resident set). ``ratio`` divides the peak by the
size of one checkpoint on disk (in its dtype). The commands:

- ``check``: ``symspec check A --samples 1`` (float64 and float32);
- ``infer``: ``symspec infer A --samples 1 --out ...``;
- ``match``: ``symspec match A B --out ...`` (weight matching), with the planted pair's
  recovery: ||canonical(A) - aligned B|| / ||canonical(A)|| over the spec's parameters,
  in float64 (what ``symspec match`` writes is in canonical form);
- ``match-data``: the same with ``--method weight+activation --data text:...`` on a fixed
  number of training tokens (``--tokens``, windows of ``--block``: the first characters
  of ``../shared/data/tinyshakespeare.txt``, tokenised by a 512-token byte-level BPE
  trained on it and cached beside the models: no download, and its ids fit every size);
- ``barrier``: ``symspec barrier A C --points 3`` on the same text's validation split, C
  an independent model (seed 1; B itself where B is independent): barrier evaluates both
  in A's module, which ties the output head where a planted B's is untied.

Writes ``--out`` (JSON: the command line, the machine, one row per model, dtype and
command) and ``--plot`` (log-log, time and peak memory against parameters, one line per
command and dtype). ``--table`` prints the README's markdown table from ``--out``.
``--merge`` keeps the rows of ``--out`` that this run does not measure again (to run the
sizes one at a time). The machine may be shared: the load average at each start is
recorded with the row. Do not run two of the large sizes at once.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.fixtures import DEFAULT_TEXT, RESULTS, ROOT, command_line, write_results

CACHE = ROOT / "bench" / "cache" / "scale"

#: family (spec and config class) and config of each size
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2-tiny": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 256,
                           "bos_token_id": 0, "eos_token_id": 0}),
    "qwen2-tiny": ("qwen2", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True,
                             "max_position_embeddings": 256}),
    "gpt2-10m": ("gpt2", {"n_embd": 192, "n_layer": 2, "n_head": 6, "vocab_size": 50257, "n_positions": 1024}),
    "gpt2-small": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}),
    "qwen2-0.5b": ("qwen2", {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                             "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                             "max_position_embeddings": 2048}),
    "tinyllama-1.1b": ("llama", {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
                                 "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
                                 "tie_word_embeddings": False, "max_position_embeddings": 2048}),
}
QUICK_SIZES = ["gpt2-tiny", "qwen2-tiny"]
FULL_SIZES = ["gpt2-10m", "gpt2-small", "qwen2-0.5b", "tinyllama-1.1b"]
COMMANDS = ["check", "infer", "match", "match-data", "barrier"]
DTYPES = ["bfloat16", "float32"]
#: planting's peak, bytes per parameter (float32 model, its canonical copy, float64 state and moved state)
PLANT_BYTES_PER_PARAM = 28

# ---------------------------------------------------------------- the models on disk


def build(size: str, seed: int) -> Any:
    """A float32 model of shape ``size`` with random weights (seeded)."""
    import torch
    import transformers

    family, config = SHAPES[size]
    cls = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    torch.manual_seed(seed)
    return cls[1](cls[0](**config)).eval()


def count_params(model: Any) -> int:
    """Parameters, a tied tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def save(model: Any, folder: Path, dtype: str, shards: int = 3) -> None:
    """``model`` in ``dtype`` as a sharded safetensors folder (about ``shards`` shards of at
    most 500 MB), written next to ``folder`` and renamed into place."""
    import torch

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # a copy in the lower precision: casting ``model`` itself there and back would round it
    m = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    shard = max(1, min(500 * 10**6, math.ceil(nbytes / shards)))
    m.save_pretrained(tmp, max_shard_size=shard)
    del m
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes (a large number where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def prepare(size: str, dtypes: list[str], pair: str, cache: Path = CACHE) -> dict[str, Any]:
    """Build (once) and save, in every dtype, A (seed 0), B (planted from A, or seed 1)
    and C (seed 1, which ``barrier`` interpolates A with: a planted B is untied where the
    spec unties, and barrier evaluates B in A's tied module); returns the parameter count
    and which pair B makes with A. The build runs in a process of its own (see
    :func:`recovery_in_child`: built here, the models would set the floor of every later
    row's peak RSS)."""
    root = cache / size
    info_file = root / "info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    needed = "abc" if info.get("pair", pair) != "independent" else "ab"
    missing = [dt for dt in dtypes if not all((root / dt / m).exists() for m in needed)]
    if not missing and info.get("pair") and (pair == "auto" or info["pair"] == pair):
        return info
    print(f"[{size}] building the models ({', '.join(missing or dtypes)})", flush=True)
    code = ("import json, sys; from pathlib import Path; from bench.bench_scale import build_all; "
            "print(json.dumps(build_all(sys.argv[1], sys.argv[2].split(','), sys.argv[3], "
            "Path(sys.argv[4]))))")
    done = subprocess.run([sys.executable, "-c", code, size, ",".join(dtypes), pair, str(cache)],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_all(size: str, dtypes: list[str], pair: str, cache: Path) -> dict[str, Any]:
    """:func:`prepare`'s build, in the child it starts."""
    import symspec

    root = cache / size
    info_file = root / "info.json"
    a = build(size, 0)
    params = count_params(a)
    if pair == "auto":
        pair = "planted" if PLANT_BYTES_PER_PARAM * params < 0.8 * mem_available() else "independent"
    spec = SHAPES[size][0]
    b = symspec.plant(a, spec, seed=3).model if pair == "planted" else build(size, 1)
    untie_config(b)
    for dt in dtypes:
        save(a, root / dt / "a", dt)
        save(b, root / dt / "b", dt)
    del b
    if pair == "planted":  # an independent B is C already
        c = build(size, 1)
        for dt in dtypes:
            save(c, root / dt / "c", dt)
    info = {"size": size, "family": spec, "params": params, "pair": pair, "config": SHAPES[size][1]}
    root.mkdir(parents=True, exist_ok=True)
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    return info


def untie_config(model: Any) -> None:
    """A model whose output head is no longer its embedding (``symspec.plant`` unties
    where the spec does) says so in its config, else loading it ties them again."""
    out = model.get_output_embeddings()
    if out is not None and out.weight is not model.get_input_embeddings().weight:
        model.config.tie_word_embeddings = False


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def tokenizer_file(vocab: int = 512, cache: Path = CACHE, text: Path = DEFAULT_TEXT) -> Path:
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on ``text`` (once, kept in
    ``cache``): its ids fit every size's vocabulary, and it needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = cache / f"tokenizer-{vocab}.json"
    if not out.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train([str(text)], trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
    return out


def text_source(tokens: int, block: int, cache: Path = CACHE) -> str:
    """``text:...`` of the first characters of the default text, tokenised by
    :func:`tokenizer_file`: about ``tokens`` tokens in the train split (0.8 of the text)
    and at least 8 windows in the validation split."""
    from tokenizers import Tokenizer

    tok = tokenizer_file(cache=cache)
    text = DEFAULT_TEXT.read_text()
    sample = text[:100_000]
    per_token = len(sample) / max(1, len(Tokenizer.from_file(str(tok)).encode(sample).ids))
    chars = math.ceil(max(tokens / 0.8, 80 * (block + 1)) * per_token) + 1
    out = cache / f"text-{chars}.txt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text[:chars])
    return f"text:{out},block={block},tokenizer={tok}"

# ---------------------------------------------------------------- measuring one command


def symspec_exe() -> list[str]:
    """The ``symspec`` entry point of this interpreter's environment."""
    exe = Path(sys.executable).parent / "symspec"
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from symspec.cli import main; main()"]


def measure(argv: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """Run ``argv`` in a fresh child (output into ``log``) and return its exit code, wall
    time, CPU time and peak resident set, from the child's own resource usage."""
    log.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc  # reaped here: Popen must not wait for it again
    row = {"rc": rc, "wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
           "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 4), "load_avg": load}
    if wall > timeout:
        row["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        row["error"] = error_line(lines)
    return row


def error_line(lines: list[str]) -> str:
    """What went wrong, from a command's output: its ``error:`` line, else a traceback's
    exception line, else the last line."""
    for test in (lambda ln: ln.startswith("error:"), lambda ln: re.match(r"[\w.]*(Error|Exception|Interrupt)\b", ln)):
        found = next((ln for ln in reversed(lines) if test(ln)), None)
        if found:
            return found
    return lines[-1] if lines else ""


def command_argv(command: str, a: Path, b: Path, work: Path, data: str, rounds: int | None = None) -> list[str]:
    """The symspec command line of one measurement (``rounds``: match's --rounds, where
    given; else its default)."""
    out = work / command
    limit = ["--rounds", str(rounds)] if rounds is not None else []
    return {
        "check": ["check", str(a), "--samples", "1"],
        "infer": ["infer", str(a), "--samples", "1", "--out", str(work / "infer.yaml"), "--force"],
        "match": ["match", str(a), str(b), "--out", str(out), "--force", *limit],
        "match-data": ["match", str(a), str(b), "--out", str(out), "--force", *limit, "--method", "weight+activation",
                       "--data", data],
        "barrier": ["barrier", str(a), str(c if (c := a.with_name("c")).exists() else b), "--data", data, "--points", "3", "--report", str(work / "barrier.json"),
                    "--force"],
    }[command]


def recovery(size: str, a_dir: Path, out_dir: Path) -> float | None:
    """||canonical(A) - aligned B|| / ||canonical(A)|| over the spec's parameters (float64),
    for B planted from A; None when the output holds none of them."""
    import torch
    import transformers
    from safetensors.torch import load_file

    import symspec
    from symspec.transforms import canonicalize_state_dict

    a = transformers.AutoModelForCausalLM.from_pretrained(a_dir, dtype=torch.float32)
    bound = symspec.bind(symspec.load_spec(SHAPES[size][0]), a)
    ca = canonicalize_state_dict(bound, {k: v.detach() for k, v in a.state_dict().items()})
    del a
    num = den = 0.0
    for shard in sorted(out_dir.glob("*.safetensors")):
        if shard.name.startswith("transform"):
            continue
        for k, v in load_file(shard).items():
            if k in bound.problem.params and k in ca:
                ref = ca[k].double()
                num += float((v.double() - ref).square().sum())
                den += float(ref.square().sum())
    return math.sqrt(num / den) if den > 0 else None

def recovery_in_child(size: str, a_dir: Path, out_dir: Path) -> float | None:
    """:func:`recovery` in a process of its own: computed here it grew this process, and a
    child forked later inherits that as the floor of its peak RSS (Linux keeps ru_maxrss
    across fork and exec), so every later row showed this process's size instead."""
    code = ("import json, sys; from pathlib import Path; from bench.bench_scale import recovery; "
            "print(json.dumps(recovery(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, size, str(a_dir), str(out_dir)], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the run


def run_size(size: str, args: argparse.Namespace, data: str,
             on_row: Callable[[dict[str, Any]], None] = lambda row: None) -> list[dict[str, Any]]:
    """Every command on every dtype of ``size``; ``on_row`` is called with each row as it
    is measured (the results are written then: a run stopped later keeps it)."""
    info = prepare(size, args.dtypes, args.pair, args.cache)
    rows = []
    for dt in args.dtypes:
        a, b = args.cache / size / dt / "a", args.cache / size / dt / "b"
        work = args.cache / size / dt / "work"
        for command in args.commands:
            sub = command_argv(command, a, b, work, data, args.rounds)
            shown = shlex.join(["symspec", *sub]).replace(str(ROOT) + "/", "")
            print(f"[{size} {dt}] {shown}", flush=True)
            got = measure([*symspec_exe(), *sub], work / f"{command}.log", args.timeout)
            ckpt = folder_bytes(a)
            row = {"model": size, "family": info["family"], "params": info["params"], "dtype": dt,
                   "shards": len(list(a.glob("*.safetensors"))), "checkpoint_gb": round(ckpt / 1e9, 4), "checkpoint_bytes": ckpt,
                   "command": command, "pair": {"match": info["pair"], "match-data": info["pair"], "barrier": "independent"}.get(command),
                   "argv": shown,
                   **got, "ratio": round(got["peak_rss_gb"] * 1e9 / ckpt, 3)}
            if command.startswith("match") and got["rc"] == 0 and info["pair"] == "planted":
                row["recovery"] = recovery_in_child(size, a, work / command)
            print(f"    {row['wall_s']:.1f} s, peak {row['peak_rss_gb']:.2f} GB ({row['ratio']:.1f}x the checkpoint)"
                  + (f", recovery {row['recovery']:.2e}" if row.get("recovery") is not None else "")
                  + (f"  [{row['error']}]" if "error" in row else ""), flush=True)
            rows.append(row)
            on_row(row)
    return rows


def machine() -> dict[str, Any]:
    import torch

    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 1e9
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "memory_gb": round(mem, 1) if mem else None, "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "commit": commit or None}


def merged(old: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` plus those of ``old`` for a (model, dtype, command) not measured again."""
    seen = {(r["model"], r["dtype"], r["command"]) for r in rows}
    kept = [r for r in (old or {}).get("rows", []) if (r["model"], r["dtype"], r["command"]) not in seen]
    return kept + rows

# ---------------------------------------------------------------- the plot and the table


def plot(doc: dict[str, Any], out: Path) -> None:
    """Log-log: wall time and peak memory against parameters, one line per command and dtype."""
    import matplotlib  # deferred: plotting is heavy and only this step needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred with matplotlib, after choosing the backend

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [r for r in doc["rows"] if r.get("rc") == 0]
    colours = {c: f"C{i}" for i, c in enumerate(COMMANDS)}
    for command in COMMANDS:
        for dt, style in (("bfloat16", "-"), ("float32", "--"), ("float16", ":")):
            pts = sorted((r["params"], r["wall_s"], r["peak_rss_gb"]) for r in rows if r["command"] == command and r["dtype"] == dt)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            for ax, k in zip(axes, (1, 2)):
                ax.plot(xs, [p[k] for p in pts], style, marker="o", color=colours[command], label=f"{command} ({dt})")
    for ax, what in zip(axes, ("wall time (s)", "peak resident set (GB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    m = doc.get("machine", {})
    fig.suptitle(f"symspec on {m.get('cpus')} CPU cores, {m.get('memory_gb')} GB (bench/bench_scale.py)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{int(s // 60)}:{int(s % 60):02d}"


def shown_options(argv: str) -> str:
    """The options of a row's command line that change what it measures (``--samples 1``,
    ``--rounds 2``, ``--method weight+activation``): not its paths, data or --force."""
    parts = shlex.split(argv)[2:]
    keep, i = [], 0
    while i < len(parts):
        p = parts[i]
        takes = i + 1 < len(parts) and not parts[i + 1].startswith("--")
        if p.startswith("--") and p not in ("--out", "--report", "--data", "--force"):
            keep += [p, parts[i + 1]] if takes else [p]
        i += 2 if p.startswith("--") and takes else 1
    return " ".join(keep)


def table(doc: dict[str, Any]) -> str:
    """The README's markdown table: one line per model, dtype and command."""
    lines = ["| model | params | dtype, shards | command | wall | peak RSS | RSS / checkpoint | recovery |",
             "|---|---|---|---|---|---|---|---|"]
    order = {c: i for i, c in enumerate(COMMANDS)}
    for r in sorted(doc["rows"], key=lambda r: (r["params"], r["dtype"], order.get(r["command"], 99))):
        if r.get("rc") == 0:
            wall = fmt_seconds(r["wall_s"])
        elif r.get("rc") == 2 and str(r.get("error", "")).startswith("error: "):  # refused: the input error it gave, and when
            wall = f"refused after {fmt_seconds(r['wall_s'])} ({r['error']})"
        else:
            wall = f"failed ({r.get('error', r.get('rc'))})"
        rec = f"{r['recovery']:.1e}" if r.get("recovery") is not None else ""
        shown = f"`{' '.join(x for x in (r['command'], shown_options(r.get('argv', ''))) if x)}`"
        shown += f" ({r['pair']} pair)" if r.get("pair") and r["command"] != "barrier" else ""
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['dtype']}, {r['shards']} | {shown} | {wall} "
                     f"| {r['peak_rss_gb']:.2f} GB | {r['ratio']:.1f}x | {rec} |")
    return "\n".join(lines)


TABLE_NOTE = "Generated by `python -m bench.bench_scale --table` from bench/results/scale.json."


def write_between_markers(path: Path, text: str) -> None:
    """Replace what lies between ``<!-- scale-table:begin -->`` and ``<!-- scale-table:end -->``."""
    from symspec.outputs import atomic_write_text

    doc = path.read_text()
    begin, end = "<!-- scale-table:begin -->", "<!-- scale-table:end -->"
    if doc.count(begin) != 1 or doc.count(end) != 1:
        raise SystemExit(f"error: {path}: needs one {begin} and one {end}")
    head, rest = doc.split(begin)
    atomic_write_text(path, head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
    print(f"wrote the table into {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=None, help=f"default: {' '.join(FULL_SIZES)}")
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"], default=DTYPES)
    ap.add_argument("--commands", nargs="+", choices=COMMANDS, default=COMMANDS)
    ap.add_argument("--quick", action="store_true", help=f"the tiny sizes only ({' '.join(QUICK_SIZES)})")
    ap.add_argument("--pair", choices=["auto", "planted", "independent"], default="auto",
                    help="B: planted from A, independent, or planted where it fits in memory (auto)")
    ap.add_argument("--tokens", type=int, default=4096, help="training tokens of match-data")
    ap.add_argument("--rounds", type=int, default=None,
                    help="match's --rounds (default: its own; an independent pair runs them all)")
    ap.add_argument("--block", type=int, default=128, help="tokens per window of the text data")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before a command is stopped")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the models are built and kept")
    ap.add_argument("--merge", action="store_true", help="keep the rows of --out not measured again")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--readme", type=Path, default=None,
                    help="with --table: also write it between the scale-table markers of this file (README.md)")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    args = ap.parse_args(argv)
    if args.table:
        text = table(json.loads(args.out.read_text()))
        print(text)
        if args.readme:
            write_between_markers(args.readme, text + f"\n\n{TABLE_NOTE}")
        return
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    data = text_source(args.tokens, args.block, args.cache)
    old = json.loads(args.out.read_text()) if args.merge and args.out.exists() else None
    rows: list[dict[str, Any]] = []

    def write(row: dict[str, Any] | None = None) -> None:
        if row is not None:
            rows.append(row)
        doc = {"benchmark": "wall time and peak memory of the symspec CLI at real sizes",
               "command": command_line(__file__, argv), "machine": machine(),
               "data": {"source": data.replace(str(ROOT) + "/", ""), "train_tokens": args.tokens, "block": args.block},
               "rows": merged(old, rows)}
        write_results(args.out, doc)
        plot(doc, args.plot or args.out.with_suffix(".png"))

    for size in sizes:
        run_size(size, args, data, write)
    write()


if __name__ == "__main__":
    main()
