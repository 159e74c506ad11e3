"""End-to-end: the recipe through `accelerate launch`, in fp32, bf16 and fp16."""
import json

import pytest
from safetensors.torch import load_file

from mixprec.devices.hardware import cpu_native
from helpers import REPO, run_recipe

pytestmark = pytest.mark.slow
SHORT = ["--num_epochs", "3", "--log_every", "20"]


def test_default_run_without_arguments(tmp_path):
    """`accelerate launch recipes/train.py` with no arguments: the lesson's MLP learns the synthetic data."""
    run = run_recipe(cwd=tmp_path)
    (out,) = (tmp_path / "runs").iterdir()
    run.out = out
    summary, cfg = run.summary(), run.config()
    assert cfg["effective"]["effective_precision"] == ("bf16" if cpu_native("bf16")[0] else "no")
    assert cfg["config"]["mixed_precision"] == "auto" and cfg["config"]["model"] == "mlp"
    assert summary["val_accuracy"] > 0.8  # chance is 0.1
    losses = [r["loss"] for r in run.train_records()]
    assert losses[-1] < 0.5 * losses[0]
    accs = [r["val_accuracy"] for r in run.eval_records()]
    assert len(accs) == 10 and accs[-1] > accs[0]
    assert summary["wall_time_s"] > 0  # recorded (tests never assert on timings: the machine may be busy)
    weights = load_file(out / "model.safetensors")
    assert weights["net.0.weight"].shape == (256, 100) and weights["net.4.weight"].shape == (10, 128)
    assert "precision      requested auto" in run.stdout and "Epoch 10, Batch" in run.stdout
    # a healthy run gets no diagnosis (recipes/configs/mlp.yaml is these defaults)
    assert run.events() == [] and "[health]" not in run.stdout


@pytest.fixture(scope="module")
def three_precisions(tmp_path_factory):
    root = tmp_path_factory.mktemp("precisions")
    return {mp: run_recipe("--mixed_precision", mp, *SHORT, out=root / mp) for mp in ("no", "bf16", "fp16")}


@pytest.mark.parametrize("mp", ["no", "bf16", "fp16"])
def test_each_precision_learns_and_records_itself(three_precisions, mp):
    run = three_precisions[mp]
    records, evals, summary = run.train_records(), run.eval_records(), run.summary()
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert evals[-1]["val_accuracy"] > evals[0]["val_accuracy"] and summary["val_accuracy"] > 0.7
    for r in records:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "skipped_steps", "samples_per_s"} <= set(r)
        assert r["samples_per_s"] > 0 and r["grad_norm"] > 0
    assert [r["step"] for r in records] == list(range(20, 601, 20))
    effective = run.config()["effective"]
    assert effective["effective_precision"] == mp and summary["effective_precision"] == mp
    assert effective["master_weight_dtype"] == "float32"
    assert summary["world_size"] == 1 and summary["peak_memory_bytes"] > 0
    assert json.loads((run.out / "checkpoints" / "step_0000600" / "trainer_state.json").read_text())["step"] == 600


def test_fp16_is_really_in_effect(three_precisions):
    fp16, fp32 = three_precisions["fp16"], three_precisions["no"]
    assert all(r["loss_scale"] == 65536.0 for r in fp16.train_records())
    assert all("loss_scale" not in r for r in fp32.train_records())
    assert fp16.summary()["grad_scaler"] is True and fp32.summary()["grad_scaler"] is False
    half = fp16.config()["effective"]["cpu_half"]  # fp16 native on this CPU, or emulated and how much slower
    if half["native"]:
        assert "autocast       float16  [fp16 on a CPU: the CPU has" in fp16.stdout
    else:
        assert half["matmul_slowdown"] > 1
        assert f"autocast       float16  [fp16 is emulated on this CPU ({half['why']}): a matmul runs " \
               f"{half['matmul_slowdown']:g}x slower than fp32" in fp16.stdout
    assert "GradScaler     on (init_scale=65536" in fp16.stdout
    # the same seed and data: fp16 rounding makes the numbers differ, a little
    a, b = fp16.train_records()[-1]["loss"], fp32.train_records()[-1]["loss"]
    assert a != b and abs(a - b) < 0.05


def test_bf16_differs_from_fp32(three_precisions):
    a, b = three_precisions["bf16"].summary()["val_loss"], three_precisions["no"].summary()["val_loss"]
    assert a != b and abs(a - b) < 0.1


def test_loss_scale_grows_and_backs_off(tmp_path):
    """A tiny growth_interval: the scale doubles every few clean steps and overflows bring it back down,
    each overflow a skipped step."""
    run = run_recipe("--mixed_precision", "fp16", "--init_scale", "1024", "--growth_interval", "5",
                     "--num_epochs", "1", "--log_every", "5", out=tmp_path / "r")
    scales = [r["loss_scale"] for r in run.train_records()]
    assert scales[:3] == [2048.0, 4096.0, 8192.0]  # doubled after every 5 clean steps
    assert any(b < a for a, b in zip(scales, scales[1:]))  # overflow: halved
    assert run.summary()["skipped_steps"] > 0  # and that step was skipped
    assert run.train_records()[-1]["skipped_steps"] == run.summary()["skipped_steps"]


def test_python_launch_and_accumulation(tmp_path):
    """`python recipes/train.py` works too; accumulation steps once per window (never at step 0)."""
    run = run_recipe("--gradient_accumulation_steps", "4", "--num_epochs", "2", "--log_every", "10",
                     "--mixed_precision", "no", "--scale_lr", out=tmp_path / "r", launcher="python")
    cfg = run.config()
    assert cfg["derived"]["samples_per_step"] == 128 and cfg["derived"]["lr"] == pytest.approx(4e-3)
    assert cfg["derived"]["total_steps"] == 100 and run.summary()["steps"] == 100
    assert run.train_records()[0]["step"] == 10


def test_lesson_dataset(tmp_path):
    """The lesson's exact data: random labels, so training loss falls (memorising) and validation stays
    near chance."""
    run = run_recipe("--config", REPO / "recipes/configs/mlp_lesson.yaml", "--num_epochs", "20", "--log_every", "16",
                     out=tmp_path / "r", launcher="python")
    cfg = run.config()["derived"]
    assert cfg["train_samples"] == 500 and cfg["val_samples"] == 100
    records = run.train_records()
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert run.summary()["val_accuracy"] < 0.3
    assert run.events() == []  # memorising random labels is healthy too
