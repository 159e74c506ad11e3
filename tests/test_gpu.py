"""GPU-only paths, on whatever CUDA GPUs the machine has (one is enough): DDP through multi_gpu.yaml, FSDP2,
DeepSpeed ZeRO-2/3 on CUDA, fp8. Skipped without CUDA (see conftest); scripts/gpu_checks.sh runs them and
keeps each run's banner, config.yaml and summary.json under $MIXPREC_GPU_RESULTS."""
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from helpers import REPO, free_port, run_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
CONFIGS = REPO / "accelerate_configs"
SHORT = ["--max_steps", "60", "--log_every", "10", "--checkpointing_steps", "30"]


def launch(name, *args, out, processes=None, extra=(), check=True):
    procs = processes or min(torch.cuda.device_count(), 2)
    run = run_recipe(*args, out=out, config=CONFIGS / name, check=check,
                     launch_args=("--num_processes", procs, "--main_process_port", free_port(), *extra))
    keep = os.environ.get("MIXPREC_GPU_RESULTS")
    if keep:  # the evidence, for the README's table
        dest = Path(keep) / f"{Path(name).stem}-{out.name}"
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "stdout.txt").write_text(run.stdout)
        (dest / "stderr_tail.txt").write_text(run.stderr[-20000:])
        for f in ("config.yaml", "summary.json", "metrics.jsonl"):
            if (out / f).exists():
                shutil.copy(out / f, dest / f)
    return run


def learned(run):
    losses = [r["loss"] for r in run.train_records()]
    return losses[-1] < losses[0] - 0.1


def test_ddp_on_cuda(tmp_path):
    run = launch("multi_gpu.yaml", *SHORT, out=tmp_path / "ddp")
    effective = run.config()["effective"]
    assert effective["distributed_type"] == "MULTI_GPU" and effective["device"].startswith("cuda")
    assert run.summary()["world_size"] == min(torch.cuda.device_count(), 2) and learned(run)
    assert run.summary()["effective_precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


def test_multi_cpu_config_stays_on_cpus_on_a_gpu_machine(tmp_path):
    run = launch("multi_cpu.yaml", *SHORT, "--mixed_precision", "no", out=tmp_path / "cpu", processes=2)
    assert "processes      2 (MULTI_CPU, backend gloo)" in run.stdout
    assert run.config()["effective"]["device"].startswith("cpu")


def test_fsdp2_bf16(tmp_path):
    run = launch("fsdp.yaml", *SHORT, out=tmp_path / "fsdp", extra=("--fsdp_transformer_layer_cls_to_wrap", "Linear"))
    effective = run.config()["effective"]
    assert effective["distributed_type"] == "FSDP" and effective["engine"].startswith("FSDP2")
    assert effective["effective_precision"] == "bf16" and effective["master_weight_dtype"] == "float32"
    assert effective["eval_precision"].startswith("bf16") and learned(run)
    assert (run.out / "model.safetensors").stat().st_size > 60042 * 4  # gathered, fp32


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cuda(tmp_path, stage):
    run = launch(f"deepspeed_zero{stage}.yaml", *SHORT, "--mixed_precision", "bf16", out=tmp_path / f"zero{stage}")
    effective = run.config()["effective"]
    assert effective["engine"] == f"DeepSpeed ZeRO-{stage}" and effective["model_weight_dtype"] == "bfloat16"
    assert effective["deepspeed"]["train_batch_size"] == 32 * run.summary()["world_size"] and learned(run)
    data = (run.out / "model.safetensors").read_bytes()
    assert len(data) == 8 + struct.unpack("<Q", data[:8])[0] + run.config()["derived"]["num_parameters"] * 2


def test_fp8(tmp_path):
    from accelerate.utils import is_torchao_available

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9) or not is_torchao_available():
        run = launch("fp8.yaml", *SHORT, out=tmp_path / "fp8_refused", check=False)
        assert run.returncode != 0 and "error: " in run.stderr and "fp8" in run.stderr  # refused, clearly
        pytest.skip(f"fp8 cannot run here (compute capability {major}.{minor}, torchao installed: "
                    f"{is_torchao_available()}); the recipe refused it with a clear error")
    run = launch("fp8.yaml", *SHORT, out=tmp_path / "fp8")
    summary = run.summary()
    assert summary["effective_precision"] == "fp8" and learned(run)
    assert "fp8 matmuls" in json.dumps(run.config()["effective"])
