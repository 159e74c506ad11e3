#!/usr/bin/env bash
# The GPU-only checks, on one machine with CUDA GPUs (one is enough): DDP through multi_gpu.yaml,
# multi_cpu.yaml staying on CPUs on a GPU machine, FSDP2 bf16 (fsdp.yaml), DeepSpeed ZeRO-2 and ZeRO-3
# bf16 on CUDA (full-size ZeRO-3 weights), and fp8 (fp8.yaml: trains where it can, else must be refused
# with a clear error). These are the tests in tests/test_gpu.py (marked gpu, skipped without CUDA).
#
#   scripts/gpu_checks.sh [RESULTS_DIR]        (default: runs/gpu_checks-<date>-<time>)
#
# Writes RESULTS_DIR/environment.txt (GPU, driver, package versions), pytest.txt, junit.xml, and one
# folder per run with its banner (stdout.txt), config.yaml, summary.json and metrics.jsonl.
# Takes a few minutes on one GPU; stopped after 9 minutes. Exit code: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_checks: no CUDA GPU visible to torch here; run this on a machine with one" >&2
  exit 3
fi
results=${1:-runs/gpu_checks-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results" && results=$(cd "$results" && pwd)
{
  date -u
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || echo "nvidia-smi not found"
  python - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for name in ("accelerate", "deepspeed", "transformers", "datasets", "torchao", "transformer-engine"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
PY
} > "$results/environment.txt" 2>&1
cat "$results/environment.txt"
export MIXPREC_GPU_RESULTS="$results" PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 540 python -m pytest tests/test_gpu.py -m gpu -v -rA -p no:cacheprovider \
  --junitxml "$results/junit.xml" 2>&1 | tee "$results/pytest.txt"
status=${PIPESTATUS[0]}
echo "gpu checks: exit $status after $(( $(date +%s) - start ))s; results in $results" | tee -a "$results/pytest.txt"
exit "$status"
