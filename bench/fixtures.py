"""What the benchmark scripts share: where things are, the model pairs, timing and memory,
and writing a results file.

The scripts form the package ``bench`` and run from the repository's root as modules
(``python -m bench.bench_match --quick``), so they import each other and ``tests.zoo``
without touching ``sys.path``; they import symspec's public names only.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SHARED = ROOT.parent / "shared" / "data"
DEFAULT_TEXT = SHARED / "tinyshakespeare.txt"
DEFAULT_MNIST = SHARED / "mnist"

# ---------------------------------------------------------------- commands and results


def script_name(script: str) -> str:
    """``bench_match``, ``bench_match.py`` or a script's ``__file__`` -> ``bench_match``."""
    return Path(script).stem


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran the script ``script`` with ``argv`` (the process's when None):
    ``python -m bench.SCRIPT ...``."""
    return shlex.join(["python", "-m", f"bench.{script_name(script)}", *(argv if argv is not None else sys.argv[1:])])


def module_command(script: str) -> list[str]:
    """The interpreter running ``script`` as a module (for a fresh subprocess; run it with
    ``cwd=ROOT``)."""
    return [sys.executable, "-m", f"bench.{script_name(script)}"]


def write_results(out: Path, doc: dict[str, Any]) -> None:
    """A benchmark's results file, written atomically (its folder made when missing)."""
    from symspec.outputs import atomic_write_text

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {out}")


# ---------------------------------------------------------------- timing and memory


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (``VmHWM``: the peak resident set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Reset the peak resident set (VmHWM) to the current one."""
    # not Linux, or not permitted: the peak then includes what came before
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def cpu_seconds() -> float:
    """User and system CPU time of this process, all threads."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------- model pairs

#: nanoGPT shapes (examples/nanogpt.py): ``gpt2-small`` is GPT-2 small's
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_ff": 256, "vocab_size": 65, "block_size": 64},
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384, "n_ff": 1536, "vocab_size": 50257, "block_size": 1024},
    "gpt2-small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_ff": 3072, "vocab_size": 50257, "block_size": 1024},
}


def gpt_pair(config: dict[str, int], pair: str) -> tuple[Any, Any]:
    """Two nanoGPTs of shape ``config`` with random weights: ``independent`` (seeds 0 and 1)
    or ``related`` (B = g . canonical(A) + noise of half each tensor's spread, a module of
    A's class)."""
    import torch

    import symspec
    from symspec.loading import import_file
    from symspec.transforms import apply_elements, canonicalize_model, sample_elements

    mod = import_file(ROOT / "examples" / "nanogpt.py")
    torch.manual_seed(0)
    a = mod.build(**config).eval()
    if pair == "independent":
        torch.manual_seed(1)
        return a, mod.build(**config).eval()
    bound = symspec.bind(symspec.load_spec("nanogpt"), a)
    b = canonicalize_model(bound, a)
    sd = {k: v.detach() for k, v in b.state_dict().items()}
    g = sample_elements(bound.problem, seed=7, dtype=torch.float32)
    moved = apply_elements(bound.problem, g, sd)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for k, v in moved.items():
            if v.is_floating_point() and v.numel() > 1:
                moved[k] = v + 0.5 * float(v.std()) * torch.randn(v.shape, generator=gen)
    b.load_state_dict(moved)
    return a, b
