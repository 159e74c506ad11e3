"""Details of the training run that are easy to get wrong: the partial accumulation window, a NaN in any
micro-batch of a window, per-process random states, start-up measurements that leave the training random state
alone, peak memory per logging window, and sums that avoid float64 where a device lacks it."""
import pytest
import torch

from helpers import CONFIGS, REPO, assert_one_line_error, free_port, run_recipe
from mixprec import metrics
from mixprec.evaluation import accumulation_dtype

HANDWRITTEN = REPO / "benchmarks" / "baselines" / "handwritten_loop.py"


@pytest.mark.slow
def test_the_last_partial_window_is_left_out_by_the_recipe_and_the_handwritten_loop_alike(tmp_path):
    """200 batches per epoch, accumulation 3: both leave out the 2 batches that do not fill a window, and log
    the same losses."""
    args = ["--gradient_accumulation_steps", "3", "--num_epochs", "2", "--log_every", "11", "--mixed_precision",
            "no"]
    recipe = run_recipe(*args, out=tmp_path / "recipe", launcher="python")
    plain = run_recipe(*args, out=tmp_path / "plain", launcher="python", script=HANDWRITTEN)
    assert recipe.summary()["steps"] == plain.summary()["steps"] == 2 * 66
    a = {r["step"]: r["loss"] for r in recipe.train_records()}
    b = {r["step"]: r["loss"] for r in plain.train_records()}
    assert a.keys() == b.keys() and all(a[s] == pytest.approx(b[s], rel=1e-5) for s in a)


@pytest.mark.slow
def test_a_nan_in_the_first_micro_batch_of_a_window_halts(tmp_path):
    run = run_recipe("--mixed_precision", "fp16", "--gradient_accumulation_steps", "2", "--max_steps", "8",
                     "--on_nan", "halt", out=tmp_path / "r", launcher="python", faults="nan_loss_at_batch=9",
                     check=False)
    line = assert_one_line_error(run, "halted at step 5 (nan_loss)", code=3)
    assert "lower the learning rate" in line


@pytest.mark.slow
def test_each_process_has_its_own_random_state_and_the_same_weights(tmp_path):
    run = run_recipe("--max_steps", "4", "--mixed_precision", "no", out=tmp_path / "r",
                     config=CONFIGS / "multi_cpu.yaml", launch_args=("--main_process_port", free_port()))
    ckpt = run.out / "checkpoints" / "step_0000004"
    states = [torch.load(ckpt / f"random_states_{r}.pkl", weights_only=False) for r in (0, 1)]
    assert not torch.equal(states[0]["torch_manual_seed"], states[1]["torch_manual_seed"])  # dropout masks differ
    assert run.summary()["world_size"] == 2


@pytest.mark.slow
def test_start_up_measurements_leave_the_training_random_state_alone(tmp_path):
    """With dropout on, giving --peak_flops (nothing measured) or not (a matmul benchmark at start-up) trains the
    same model."""
    args = ["--config", REPO / "recipes" / "configs" / "gpt_tiny.yaml", "--max_steps", "6", "--log_every", "2",
            "--model_args", "dropout=0.2,n_embd=64,n_head=2,block_size=32", "--batch_size", "8",
            "--dataset_args", "max_val_samples=16", "--sample_tokens", "0", "--mixed_precision", "no"]
    measured = run_recipe(*args, out=tmp_path / "a", launcher="python")
    given = run_recipe(*args, "--peak_flops", "1e12", out=tmp_path / "b", launcher="python")
    assert "measured at start-up" in measured.stdout and "(--peak_flops)" in given.stdout
    assert [r["loss"] for r in measured.train_records()] == [r["loss"] for r in given.train_records()]


def test_peak_memory_is_per_logging_window():
    throughput = metrics.Throughput(device=torch.device("cpu"))
    throughput.report()
    big = torch.ones(64 * 2**20 // 4)  # 64 MB, in the second window only
    del big
    first = throughput.report()["peak_memory_bytes"]
    second = throughput.report()["peak_memory_bytes"]
    assert first - second > 32 * 2**20  # the peak was reset after the first window
    assert throughput.summary()["peak_memory_bytes"] >= first  # the run's peak is the largest window's


def test_sums_of_losses_avoid_float64_where_the_device_has_none():
    assert accumulation_dtype(torch.device("mps")) == torch.float32
    assert accumulation_dtype(torch.device("cpu")) == torch.float64
