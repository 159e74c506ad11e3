"""The loss of an optimizer step is token-weighted (recipes/train.py's docstring; mixprec.data.batches): on rows
whose targets vary (a masked prompt, padding), the step's gradient is the same whatever the split into
micro-batches and processes, and the per-micro-batch mean (the gradient-accumulation bug transformers fixed in
2024) is not. tests/weighting_probe.py runs one step through the recipe's pieces and loop lines."""
import subprocess
import sys

import pytest
import torch

from helpers import ACCELERATE_LAUNCH, CONFIGS, REPO, base_env, free_port

PROBE = REPO / "tests" / "weighting_probe.py"


def step_gradient(tmp_path, batch: int, accumulation: int, processes: int = 1, mean: bool = False) -> torch.Tensor:
    out = tmp_path / f"g-{batch}-{accumulation}-{processes}-{mean}.pt"
    flags = ["--batch_size", str(batch), "--accumulation", str(accumulation), "--out", str(out)]
    flags += ["--per_micro_batch_mean"] if mean else []
    if processes == 1:
        cmd = [sys.executable, str(PROBE), *flags]
    else:
        cmd = [*ACCELERATE_LAUNCH, "--config_file", str(CONFIGS / "multi_cpu.yaml"), "--num_processes",
               str(processes), "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
               str(PROBE), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=base_env({"OMP_NUM_THREADS": "1"}), cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_the_step_gradient_is_the_same_whatever_the_accumulation_and_the_processes(tmp_path):
    """fp32, 32 rows of 4 to 32 targets each: batch 32 x accumulation 1, batch 8 x accumulation 4 and 2 processes x
    batch 8 x accumulation 2 give the same gradient to 1e-6 of its largest element (measured: about 1e-7, float
    rounding; the micro-batches are also cut after their last target, so their shapes differ); each
    micro-batch's own mean, averaged (batch 8 x accumulation 4), is 10% or more away (measured: 16%)."""
    whole = step_gradient(tmp_path, 32, 1)
    scale = whole.abs().max()
    for batch, accumulation, processes in ((8, 4, 1), (8, 2, 2)):
        split = step_gradient(tmp_path, batch, accumulation, processes)
        assert (split - whole).abs().max() / scale < 1e-6, (batch, accumulation, processes)
    unweighted = step_gradient(tmp_path, 8, 4, mean=True)
    assert (unweighted - whole).abs().max() / scale > 0.1


def test_the_window_carries_its_target_count_and_each_micro_batch_is_cut_after_its_last_target():
    """mixprec.data.batches.weighted: `targets` = the window's target tokens / (micro-batches x processes), the
    same on every micro-batch of the window; a micro-batch ends at its last target (its loss is unchanged: right
    padding under causal attention), and loss_fn(sum) / targets summed over the window is the token mean."""
    from mixprec.data.batches import Layout, weighted
    from mixprec.evaluation import loss_fn

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (2, 4, 6), generator=g)
    labels[0, :, 3:] = -100  # the first micro-batch's targets end at position 2
    labels[1, 0, :2] = -100
    window = [{"inputs": torch.zeros(4, 6, dtype=torch.long), "labels": labels[i].clone()} for i in range(2)]
    logits = torch.randn(2, 4, 6, 10, generator=g)
    count = int((labels != -100).sum())
    out = weighted(window, Layout(4, 2))
    assert [b["labels"].shape[1] for b in out] == [3, 6]
    assert all(float(b["targets"]) == count / 2 for b in out)
    summed = sum(loss_fn(logits[i, :, :b["labels"].shape[1]], b["labels"], b["targets"]) for i, b in enumerate(out))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten())  # the mean over targets
    assert torch.allclose(summed / 2, expected, rtol=1e-6)  # / 2: Accelerate's division by the accumulation


@pytest.mark.slow
def test_the_recipe_logs_the_same_token_weighted_loss_whatever_the_split_on_chat_data(tmp_path):
    """recipes/configs/chat_tiny.yaml (conversations of varying length, the assistant's tokens only), fp32, 3
    optimizer steps of 32 conversations: batch 32, batch 8 x accumulation 4, and 2 processes x batch 8 x
    accumulation 2, with DDP and with DeepSpeed ZeRO-2, log the same loss and gradient norm at every step to 1e-5 (measured: 8.7e-8 apart; with each micro-batch's own mean the logged losses are 1.3% apart)."""
    from helpers import run_recipe
    from test_standalone_mlp import launch_args

    common = ["--config", "recipes/configs/chat_tiny.yaml", "--mixed_precision", "no", "--max_steps", "3",
              "--log_every", "1", "--eval_steps", "3", "--sample_tokens", "0", "--warmup_steps", "0",
              "--cpu_threads", "1"]
    zero2 = {"config": CONFIGS / "deepspeed_zero2.yaml",
             "launch_args": ("--num_processes", 2, "--num_cpu_threads_per_process", 1, "--main_process_port",
                             free_port())}
    runs = {}
    for batch, accumulation, processes in ((32, 1, 1), (8, 4, 1), (8, 2, 2), (8, 2, "zero2")):
        runs[batch, accumulation, processes] = run_recipe(
            *common, "--batch_size", batch, "--gradient_accumulation_steps", accumulation,
            out=tmp_path / f"{batch}x{accumulation}x{processes}",
            **(zero2 if processes == "zero2" else launch_args(processes))).train_records()
    whole = runs[32, 1, 1]
    assert [r["step"] for r in whole] == [1, 2, 3]
    for split, records in runs.items():
        for a, b in zip(whole, records):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (split, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (split, a["step"])
