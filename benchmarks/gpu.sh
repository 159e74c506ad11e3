#!/usr/bin/env bash
# The GPU benchmark of README's "Benchmarks": GPT-2 124M (context 1024, compiled) on one GPU, fp32 with TF32,
# fp16 with a GradScaler and bf16, each through the recipe, the hand-written loop and the floor (a plain loop
# over tensors already on the GPU: benchmarks/baselines/floor_loop.py), 3 interleaved runs of each, checked
# against the H200 targets (bf16 MFU >= 45% of 989 TFLOP/s, bf16 >= 1.8x fp32+TF32, bf16 memory <= 0.65x
# fp32, fp16 within 5% of bf16, recipe >= 98% of the hand-written loop).
#
#   benchmarks/gpu.sh [RESULTS_DIR]     (default: benchmarks/results/<gpu>-<date>)
#
# Needs a CUDA GPU and nothing from the network (random tokens: recipes/configs/gpt2_bench.yaml).
# 27 compiled runs (3 precisions x 3 runners x 3 repeats) of 20 warm-up + 40 measured steps, estimated at
# about 27 minutes on one H200 from the earlier estimate of 1 minute a run (not yet run on one: no GPU was
# available); stopped after 40 whatever happens. benchmark.json and .md are written after every run, so a
# stopped benchmark keeps the runs it finished (marked INCOMPLETE).
# Writes RESULTS_DIR/benchmark.{json,md,png}, environment.txt and each run's folder under runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "benchmarks/gpu.sh: no CUDA GPU visible to torch here; run it on a machine with one" >&2
  exit 3
fi
gpu=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
results=${1:-benchmarks/results/${gpu}-$(date +%Y%m%d)}
mkdir -p "$results"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  python -c "import torch, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'accelerate', accelerate.__version__)"
} > "$results/environment.txt" 2>&1
cat "$results/environment.txt"
export PYTHONUNBUFFERED=1
timeout 2400 python recipes/benchmark.py --config recipes/configs/gpt2_bench.yaml \
  --precisions no,fp16,bf16 --runners recipe,handwritten,floor --repeats 3 \
  --steps 40 --warmup 20 --log_every 10 --targets h200 --tf32 --output_dir "$results"
