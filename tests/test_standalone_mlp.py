"""recipes/standalone/mlp.py and resume.py, the single-file recipes for the lesson's MLP, against the full recipe
(recipes/train.py --config recipes/configs/mlp_lesson.yaml): run under `accelerate launch` on 1 process and on 2
(DDP over gloo, with gradient accumulation), each writes the full recipe's loss curve for the same settings bit
for bit, in fp32, bf16 and fp16, with clipping that bites and fp16 steps the GradScaler skips.

Bitwise is the right bar, not a tolerance: the same operations run in the same order on both sides (the same
data from the same generator, the same initial weights from set_seed(seed) before the model is built, the same
seeded permutation per epoch cut into the same per-process slices, fused AdamW with the same parameter groups,
Accelerate's clip_grad_norm_, the same GradScaler steps, and the logged loss averaged as the full recipe's log
averages it: summed in float64 over the micro-batches, the mean over processes, rounded to float32). Each side
runs on one thread per process (the full recipe chooses one for a model this small; a matmul's sums split over
threads could add in another order on another CPU). bf16 and fp16 matmuls are native on some CPUs and emulated
on others: the two sides run the same kernels either way, so the numbers agree on any CPU. What the bar catches
(measured by breaking the standalone file): torch's foreach AdamW instead of the fused one fails fp32-1 (bf16-2
happens to keep the same bits); a resume that re-seeds after load_state fails the random draws.

resume.py: a run cut short after a checkpoint and resumed with --resume_from_checkpoint latest ends where the
uninterrupted run ends, bit for bit: the same losses, the same random draws on every process, the same final
checkpoint files."""
import ast
import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import (CONFIGS, CPU_CONFIG, REPO, free_port, main_in_process, run_recipe, teardown_env,
                     teardown_order)

STANDALONE = REPO / "recipes" / "standalone"
LESSON = REPO / "recipes" / "configs" / "mlp_lesson.yaml"
LIBRARIES = {"torch", "accelerate", "transformers", "datasets", "peft"}
STEPS = 16  # a second epoch in every layout: 15 steps of 32 rows in an epoch of 500, 7 of 2 x 2 x 16
LAYOUT = {1: ["--batch_size", 32], 2: ["--batch_size", 16, "--gradient_accumulation_steps", 2]}
FIELDS = ("step", "loss", "lr", "grad_norm", "loss_scale")  # what both write for each step
# The cases each file runs, 1 and 2 processes, each precision. --max_grad_norm 0.3: below the gradient norms
# (about 0.45), so clipping scales them. fp16 on 2 processes starts at a loss scale of 2^20, at which some steps
# overflow (the GradScaler skips them and halves the scale) and, with --growth_interval 2, grows again.
MLP_CASES = {
    "fp32-1": (1, ["--mixed_precision", "no"]),
    "bf16-1": (1, ["--mixed_precision", "bf16", "--max_grad_norm", 0.3]),
    "fp16-1": (1, ["--mixed_precision", "fp16"]),
    "fp32-2": (2, ["--mixed_precision", "no", "--max_grad_norm", 0.3]),
    "bf16-2": (2, ["--mixed_precision", "bf16"]),
    "fp16-2": (2, ["--mixed_precision", "fp16", "--init_scale", 2**20, "--growth_interval", 2]),
}
# resume.py: warmup then cosine decay (the full recipe's --lr_schedule cosine), a checkpoint every 3 steps
RESUME = ["--warmup_steps", 3, "--checkpointing_steps", 3]


def test_standalone_recipes_import_no_mixprec():
    """Every file in recipes/standalone/ imports only the standard library, torch, accelerate and the libraries
    it trains with: copied out of the repository, it runs. (The one quick test here: it reads, runs nothing.)"""
    files = sorted(STANDALONE.glob("*.py"))
    assert {"mlp.py", "resume.py"} <= {p.name for p in files}
    for path in files:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import"
                imported.add(node.module.split(".")[0])
        assert "mixprec" not in imported, path.name
        assert imported - sys.stdlib_module_names <= LIBRARIES, (path.name, imported)
    for name in ("mlp.py", "resume.py"):  # one sitting
        assert len((STANDALONE / name).read_text().splitlines()) <= 210, name


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"standalone_{name.removesuffix('.py')}", STANDALONE / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_data_and_its_order_and_the_schedule_are_the_full_recipes():
    """The few lines of the standalone files against the package's own, in layouts the runs do not reach:
    3 processes, rows that do not fill the last window, several epochs."""
    from argparse import Namespace

    from mixprec import config, data
    from mixprec.data.batches import Layout, TrainBatches, columns_of
    from mixprec.optim import lr_factor

    mlp, resume = load("mlp.py"), load("resume.py")
    bundle = data.build(config.parse_config(["--dataset", "lesson", "--seed", "7"]))
    (train_x, train_y), (val_x, val_y) = mlp.lesson_data(7)
    train, val = columns_of(bundle.train), columns_of(bundle.validation)
    assert torch.equal(train_x, train["inputs"]) and torch.equal(train_y, train["labels"])
    assert torch.equal(val_x, val["inputs"]) and torch.equal(val_y, val["labels"])
    assert torch.equal(resume.lesson_data(7)[0], train_x)
    for world, batch, accumulation in ((1, 32, 1), (2, 16, 2), (3, 7, 3), (2, 24, 1)):
        args = Namespace(seed=7, batch_size=batch, gradient_accumulation_steps=accumulation)
        for rank in range(world):
            full = TrainBatches(bundle.train, Layout(batch, accumulation, rank, world), 7, torch.device("cpu"))
            for epoch in (0, 1, 2):
                expected = list(full.indices(epoch))
                for recipe in (mlp, resume):
                    got = list(recipe.batches_of_epoch(len(train_x), args, rank, world, epoch))
                    assert len(got) == len(expected) and all(map(torch.equal, got, expected)), (world, batch, rank)
    for warmup, total in ((3, 16), (0, 10), (20, 100), (5, 5)):
        assert [resume.lr_factor(s, warmup, total, 0.1) for s in range(total + 1)] == [
            lr_factor(s, warmup, total, "cosine", 0.1) for s in range(total + 1)]


def launch_args(processes: int) -> dict:
    """One process: the CPU config; two: multi_cpu.yaml (DDP over gloo). One thread per process either way."""
    threads = ("--num_cpu_threads_per_process", 1)
    if processes == 1:
        return {"config": CPU_CONFIG, "launch_args": threads}
    return {"config": CONFIGS / "multi_cpu.yaml", "launch_args": (*threads, "--main_process_port", free_port())}


def standalone(script: str, processes: int, out: Path, *flags) -> list[dict]:
    """The training records of a standalone recipe's run under `accelerate launch` (metrics.jsonl). On two
    processes, no DDP wrapper outlives its process group (helpers.teardown_order)."""
    teardown = out.with_name(out.name + "-teardown")
    env = teardown_env(teardown) if processes > 1 else None
    run_recipe(*flags, "--log_every", 1, out=out, script=STANDALONE / script, timeout=300, env=env,
               **launch_args(processes))
    if processes > 1:
        teardown_order(teardown, freed_first=True)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def full_recipe(processes: int, out: Path, *flags) -> list[dict]:
    """The training records of recipes/train.py with the lesson's config, logging every step: one process in this
    process (as a fresh process would run it), two launched."""
    args = ["--config", LESSON, *flags, "--log_every", 1, "--cpu_threads", 1]
    if processes == 1:
        threads = torch.get_num_threads()
        try:
            main_in_process([*args, "--output_dir", out])
        finally:
            torch.set_num_threads(threads)  # --cpu_threads 1 set this process's
    else:  # PYTHONPATH: the package from this checkout, installed or not
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        teardown = out.with_name(out.name + "-teardown")
        run_recipe(*args, out=out, timeout=300, env=teardown_env(teardown, path), **launch_args(processes))
        teardown_order(teardown)  # the full recipe's wrapper is never freed: its processes end with os._exit
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def curve(records: list[dict]) -> list[dict]:
    """Each step's fields as exact decimal strings: equal strings are equal float64s (inf and NaN included,
    which the full recipe writes as "inf" and "nan", the standalone files as JSON's Infinity and NaN)."""
    return [{k: repr(float(r[k])) for k in FIELDS if k in r} for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("case", MLP_CASES)
def test_mlp_reproduces_the_full_recipes_curve_bit_for_bit(case, tmp_path):
    processes, flags = MLP_CASES[case]
    flags = [*flags, *LAYOUT[processes], "--max_steps", STEPS]
    mine = standalone("mlp.py", processes, tmp_path / "alone", *flags)
    theirs = full_recipe(processes, tmp_path / "full", *flags)
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1))
    assert curve(mine) == curve(theirs)
    assert ("loss_scale" in mine[0]) == case.startswith("fp16")
    if case == "fp16-2":  # the GradScaler at work: steps skipped (inf/NaN gradients) and applied, the scale moved
        norms = [r["grad_norm"] for r in mine]
        assert any(map(math.isfinite, norms)) and not all(map(math.isfinite, norms)), norms
        assert len({r["loss_scale"] for r in mine}) > 1
    assert mine[-1]["loss"] < mine[0]["loss"]  # it learns at all


@pytest.mark.slow
def test_resume_reproduces_the_full_recipes_curve_on_one_process(tmp_path):
    flags = ["--mixed_precision", "bf16", *LAYOUT[1], "--max_steps", STEPS, *RESUME]
    mine = standalone("resume.py", 1, tmp_path / "alone", *flags)
    theirs = full_recipe(1, tmp_path / "full", *flags, "--lr_schedule", "cosine")
    assert curve(mine) == curve(theirs)
    assert len({r["lr"] for r in mine}) > 3  # warmup and decay


@pytest.mark.slow
def test_resume_on_two_processes_continues_bit_for_bit(tmp_path):
    """A 2-process run, uninterrupted, is the full recipe's; the same run killed after its step-3 checkpoint
    (what a kill leaves: the checkpoint, records written after it, a half-written next checkpoint) and resumed
    with --resume_from_checkpoint latest in its folder ends where the uninterrupted run ends."""
    flags = ["--mixed_precision", "bf16", *LAYOUT[2], "--max_steps", 8, *RESUME]
    whole = standalone("resume.py", 2, tmp_path / "whole", *flags)
    theirs = full_recipe(2, tmp_path / "full", *flags, "--lr_schedule", "cosine")
    assert curve(whole) == curve(theirs)

    cut = tmp_path / "cut"  # the folder of the run killed after step 5, its step_6 checkpoint half written
    shutil.copytree(tmp_path / "whole", cut)
    shutil.rmtree(cut / "checkpoints" / "step_8")
    (cut / "checkpoints" / "step_6").rename(cut / "checkpoints" / ".tmp-step_6")
    (cut / "checkpoints" / ".tmp-step_6" / "model.safetensors").unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cut / "metrics.jsonl").write_text("".join(lines[:5]))
    resumed = standalone("resume.py", 2, cut, *flags, "--resume_from_checkpoint", "latest")
    assert resumed == whole  # losses, learning rates, gradient norms, and each process's random draws
    assert len({tuple(r["random"]) for r in whole}) == len(whole) and all(len(r["random"]) == 2 for r in whole)
    ends = [folder / "checkpoints" / "step_8" for folder in (tmp_path / "whole", cut)]
    names = [sorted(p.name for p in end.iterdir()) for end in ends]
    assert names[0] == names[1] and "random_states_1.pkl" in names[0] and "optimizer.bin" in names[0]
    for name in names[0]:  # weights, Adam's moments, the schedule, each process's random states
        assert (ends[0] / name).read_bytes() == (ends[1] / name).read_bytes(), name


@pytest.mark.slow
def test_resume_refuses_fp16_on_a_cpu_with_one_line(capsys):
    """fp16 on a CPU: Accelerate would train in fp32 without a word; resume.py says so and points to mlp.py."""
    if torch.cuda.is_available():
        pytest.skip("a GPU: Accelerate makes fp16 real there")
    with pytest.raises(SystemExit) as exited:
        load("resume.py").parse_args(["--mixed_precision", "fp16"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "error: fp16 on a CPU" in err and "fp32" in err and "mlp.py" in err, err
