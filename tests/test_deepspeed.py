"""DeepSpeed for real, on 2 CPU processes (DeepSpeed's CPU accelerator, gloo): ZeRO-2 and ZeRO-3 in bf16
through accelerate launch with the repository's configs; the DeepSpeed config derived from the recipe's
settings; ZeRO-3's final weights gathered into one full-size file; conflicts refused before training."""
import json
import math
import struct

import pytest
from safetensors.torch import load_file

from helpers import REPO, free_port, run_recipe

pytestmark = pytest.mark.slow
CONFIGS = REPO / "accelerate_configs"


def deepspeed(config, *args, out, processes=2, check=True, env=None, faults=None):
    return run_recipe(*args, out=out, config=config, check=check, env=env, faults=faults,
                      launch_args=("--num_processes", processes, "--main_process_port", free_port()))


ZERO2_ARGS = ["--mixed_precision", "bf16", "--batch_size", "16", "--gradient_accumulation_steps", "2",
              "--max_steps", "25", "--log_every", "5", "--checkpointing_steps", "10"]


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2") / "run"
    return deepspeed(CONFIGS / "deepspeed_zero2.yaml", *ZERO2_ARGS, out=out)


def test_zero2_bf16_trains_on_two_cpu_processes(zero2):
    assert "processes      2 (DEEPSPEED, backend gloo), DeepSpeed ZeRO-2" in zero2.stdout
    losses = [r["loss"] for r in zero2.train_records()]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.1
    assert all(r["grad_norm"] > 0 for r in zero2.train_records())
    summary = zero2.summary()
    assert (summary["world_size"], summary["effective_precision"], summary["steps"]) == (2, "bf16", 25)


def test_deepspeed_batch_comes_from_the_recipe(zero2):
    effective = zero2.config()["effective"]
    assert effective["deepspeed"] == {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2,
                                      "train_batch_size": 64, "gradient_clipping": 1.0}
    assert "train_batch_size 64 = micro 16 x accumulation 2 x 2 processes" in zero2.stdout
    assert zero2.config()["derived"]["samples_per_step"] == 64


def test_the_banner_tells_the_truth_about_deepspeed_bf16(zero2):
    effective = zero2.config()["effective"]
    assert effective["model_weight_dtype"] == "bfloat16"  # DeepSpeed casts the model itself
    assert effective["master_weight_dtype"] == "float32"  # read from ZeRO's optimizer partitions
    assert effective["eval_precision"].startswith("bf16") and "no fp32 evaluation" in effective["eval_precision"]
    assert effective["autocast_dtype"].startswith("none")
    assert all(t.dtype.is_floating_point for t in load_file(zero2.out / "model.safetensors").values())
    latest = zero2.out / "checkpoints" / (zero2.out / "checkpoints" / "latest").read_text()
    shards = sorted(p.name for p in (latest / "pytorch_model").iterdir())
    assert shards == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                      "mp_rank_00_model_states.pt"]  # one optimizer shard per process (resumes: tests/test_matrix.py)


def test_a_nan_step_under_deepspeed_is_skipped_and_reported_as_skipped(tmp_path):
    """DeepSpeed steps inside backward; its ZeRO optimizers skip a step whose gradients hold NaN/Inf (fp32 and
    bf16 alike, deepspeed 0.19.8), and the health event says what happened."""
    run = deepspeed(CONFIGS / "deepspeed_zero2.yaml", *ZERO2_ARGS, out=tmp_path / "run", faults="nan_loss_at_step=7")
    (event,) = run.events()
    assert (event["event"], event["step"]) == ("nan_loss", 7) and "The step was skipped" in event["diagnosis"]
    assert run.summary()["skipped_steps"] == 1 and math.isfinite(run.summary()["val_loss"])
    assert all(math.isfinite(r["loss"]) for r in run.train_records() if r["step"] != 10)  # the window holding 7


def test_zero3_saves_full_size_final_weights(tmp_path):
    run = deepspeed(CONFIGS / "deepspeed_zero3.yaml", "--mixed_precision", "bf16", "--max_steps", "10",
                    "--log_every", "5", out=tmp_path / "run",
                    env={"ACCELERATE_USE_CPU": "true"})  # as CPU-only SLURM jobs export it: DeepSpeed still runs
    assert "DeepSpeed ZeRO-3" in run.stdout
    path = run.out / "model.safetensors"
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    num_parameters = run.config()["derived"]["num_parameters"]
    assert num_parameters == 100 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    assert path.stat().st_size == 8 + header_len + num_parameters * 2  # every parameter, 2 bytes each (bf16)
    weights = load_file(path)
    assert weights["net.0.weight"].shape == (256, 100) and weights["net.4.weight"].shape == (10, 128)
    assert sum(t.numel() for t in weights.values()) == num_parameters
    assert json.loads((run.out / "summary.json").read_text())["world_size"] == 2


def test_a_deepspeed_config_that_disagrees_stops_before_training(tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    accel = tmp_path / "deepspeed_file.yaml"
    accel.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                     f"  deepspeed_config_file: {ds_json}\nnum_machines: 1\nnum_processes: 1\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("mixed_precision: fp16\n")  # the recipe config says fp16, the DeepSpeed file bf16
    run = deepspeed(accel, "--config", recipe, "--max_steps", "2", out=tmp_path / "run", processes=1, check=False)
    assert run.returncode != 0
    assert f"error: --mixed_precision fp16 disagrees with the DeepSpeed config {ds_json}, which enables bf16" in run.stderr
    assert not (tmp_path / "run").exists()
