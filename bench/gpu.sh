#!/usr/bin/env bash
# What a lent GPU runs, in one call: weight and learned matching on the GPU against the CPU
# (bench/bench_gpu.py) on a planted Mixtral (experts 256x8x256: the case whose GPU recovery
# once stopped at 4.9e-5 against the CPU's 3e-6, with a TF32 row beside it), GPT-2 small and
# Qwen2-0.5B. About 8-9 minutes on an H100 with 16 cores; every row is written as soon as
# it is measured, so a run stopped by its limit keeps the rows it finished.
#
# Before the call (a GPU machine gets the repository but not ../shared beside it):
#   mkdir -p bench/cache/gpu && cp ../shared/data/tinyshakespeare.txt bench/cache/gpu/
# The call (the device tool): run(command="bash bench/gpu.sh", carry=["bench/cache/gpu"], timeout_s=600)
# Here, without a GPU, it prints "no CUDA" and exits 0; `bash bench/gpu.sh --cpu-only`
# runs the CPU half on the tiny cases instead (a minute or two).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
text=bench/cache/gpu/tinyshakespeare.txt
[ -f "$text" ] || text=../shared/data/tinyshakespeare.txt
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONUNBUFFERED=1

if [ "${1:-}" = "--cpu-only" ]; then
    [ -n "${OUT:-}" ] || out="$(mktemp -d)"
    exec $py -m bench.bench_gpu --cpu-only --quick --steps 2 --text "$text" --out "$out/gpu_cpu_only.json"
fi
if ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "no CUDA: nothing to measure here (bash bench/gpu.sh --cpu-only runs the CPU half)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$py -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"
# symspec's extensions (learned matching) register through entry points: an editable install
# without dependencies or network gives them; bench_gpu registers learned matching itself if not
$py -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/pip.log" 2>&1 \
    || echo "pip install -e . failed (pip.log); bench_gpu registers learned matching itself"

# 1. experts (recovery CPU against GPU, and with TF32 allowed) and GPT-2 small
timeout 240 $py -m bench.bench_gpu --cases experts-256 gpt2-small --tf32 --text "$text" \
    --out "$out/gpu_small.json" 2>&1 | tee "$out/gpu_small.log"
# 2. Qwen2-0.5B: the GPU in full, the CPU's first 2 rounds and 4 learned steps (per-round and per-step times)
timeout 330 $py -m bench.bench_gpu --cases qwen2-0.5b --text "$text" \
    --out "$out/gpu_qwen.json" 2>&1 | tee "$out/gpu_qwen.log"
