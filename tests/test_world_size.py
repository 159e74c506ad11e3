"""Resume across world sizes: a checkpoint of 2 processes of batch 16 resumes on 1 process of batch 32 (and the
reverse) at the same sample with the same data order, schedule and GradScaler, and the per-step losses match the
uninterrupted run's. A different global batch is refused, or, when allowed, recorded. With dropout, the processes
of such a resume draw from fresh random states seeded from (seed, process index, step)."""
import pytest
import torch
import yaml

from helpers import CONFIGS, CPU_CONFIG, REPO, assert_one_line_error, free_port, run_recipe

pytestmark = pytest.mark.slow
ARGS = ["--max_steps", "20", "--log_every", "1", "--checkpointing_steps", "10", "--eval_steps", "10",
        "--mixed_precision", "no", "--warmup_steps", "5"]


def launch(processes: int, *args, out, **kwargs):
    if processes == 1:
        return run_recipe(*ARGS, "--batch_size", "32", *args, out=out, config=CPU_CONFIG, **kwargs)
    return run_recipe(*ARGS, "--batch_size", "16", *args, out=out, config=CONFIGS / "multi_cpu.yaml",
                      launch_args=("--main_process_port", free_port()), **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return launch(1, out=tmp_path_factory.mktemp("whole") / "run")


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["2 processes then 1", "1 process then 2"])
def test_a_checkpoint_resumes_on_another_number_of_processes(uninterrupted, tmp_path, first, then):
    out = tmp_path / "run"
    killed = launch(first, out=out, faults="kill_at_step=11", check=False)
    assert killed.returncode != 0 and (out / "checkpoints" / "latest").read_text() == "step_0000010"
    resumed = launch(then, "--resume_from_checkpoint", "latest", out=out)
    assert "at step 10 (epoch 0, batch 10)" in resumed.stdout
    a, b = uninterrupted.train_records(), resumed.train_records()
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 21))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12)  # the schedule carried over
    assert resumed.summary()["val_loss"] == pytest.approx(uninterrupted.summary()["val_loss"], rel=1e-5)
    assert resumed.summary()["world_size"] == then


def test_a_different_global_batch_is_refused_unless_allowed(uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted.out, out)
    shutil.rmtree(out / "checkpoints" / "step_0000020")
    refused = run_recipe(*ARGS, "--batch_size", "8", "--resume_from_checkpoint", "latest", out=out,
                         launcher="python", check=False)
    assert_one_line_error(refused, "global_batch: 32 -> 8", "--allow_config_change global_batch")
    allowed = run_recipe(*ARGS, "--batch_size", "8", "--resume_from_checkpoint", "latest", "--allow_config_change",
                         "global_batch", out=out, launcher="python")
    assert "resume: global_batch 32 -> 8, from step 11 on" in allowed.stdout
    history = yaml.safe_load((out / "config.yaml").read_text())["history"]
    assert history[-1]["changed"] == {"global_batch": "32 -> 8"} and allowed.summary()["steps"] == 20
    assert "at step 10 (epoch 0, batch 40)" in allowed.stdout  # sample 320 of the epoch, in batches of 8


def test_a_resume_with_another_accumulation_split_trains_the_same_steps(uninterrupted, tmp_path):
    """The same global batch of 32 as 4 micro-batches of 8: Accelerate's micro-batch counter (10 in the
    checkpoint, one per step of batch 32) starts again at a window's start (compat.restart_accumulation), so
    every step from the resume on sums the same 32 samples and the losses match the uninterrupted run's."""
    resumed = run_recipe(*ARGS, "--batch_size", "8", "--gradient_accumulation_steps", "4", "--resume_from_checkpoint",
                         uninterrupted.out / "checkpoints" / "step_0000010", out=tmp_path / "run", launcher="python")
    assert "at step 10 (epoch 0, batch 40)" in resumed.stdout
    whole = {r["step"]: r for r in uninterrupted.train_records()}
    steps = resumed.train_records()
    assert [r["step"] for r in steps] == list(range(11, 21))
    for r in steps:
        assert r["loss"] == pytest.approx(whole[r["step"]]["loss"], rel=1e-5), r["step"]
        assert r["lr"] == pytest.approx(whole[r["step"]]["lr"], rel=1e-12)
    assert resumed.summary()["val_loss"] == pytest.approx(uninterrupted.summary()["val_loss"], rel=1e-5)


DROPOUT = ["--config", REPO / "recipes" / "configs" / "gpt_tiny.yaml", "--model_args",
           "dropout=0.2,n_layer=1,n_embd=32,n_head=2,block_size=16", "--dataset_args", "max_val_samples=16",
           "--sample_tokens", "0", "--mixed_precision", "no", "--log_every", "1", "--checkpointing_steps", "2",
           "--eval_steps", "100", "--warmup_steps", "1"]
SEED, STEP = 7, 2  # the checkpoint resumed: step 2


def launch_dropout(processes: int, *args, out, **kwargs):
    """gpt_tiny, cut to one layer of width 32, with dropout 0.2, at a global batch of 16."""
    per_process = ["--batch_size", str(16 // processes)]
    if processes == 1:
        return run_recipe(*DROPOUT, *per_process, *args, out=out, config=CPU_CONFIG, **kwargs)
    return run_recipe(*DROPOUT, *per_process, *args, out=out, config=CONFIGS / "multi_cpu.yaml",
                      launch_args=("--main_process_port", free_port()), **kwargs)


def random_states(checkpoint, processes: int) -> list[dict]:
    return [torch.load(checkpoint / f"random_states_{p}.pkl", weights_only=False) for p in range(processes)]


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["2 processes then 1", "1 process then 2"])
def test_a_resume_on_another_number_of_processes_draws_fresh_dropout_masks(tmp_path, first, then):
    """The random states a checkpoint holds are per process, so a resume on another number of processes seeds
    each process from (seed, process index, step): process p resumed at step s draws its dropout masks from
    set_seed(seed + p + 1_000_003 * s), as a fresh run of seed `seed + 1_000_003 * s` on as many processes
    draws them from its step 1 on. The masks' draws depend only on the tensors' shapes, so after 2 steps each
    resumed process holds exactly the random state (torch, numpy, Python) of that fresh run's process after
    its 2 steps. Without the reseeding, a resumed process keeps the random state another process saved, or
    (no file of its index) the start-up state left by seeding the initial weights: the same on every such
    process and at every resume, so their masks repeat."""
    out = tmp_path / "run"
    killed = launch_dropout(first, "--seed", SEED, "--max_steps", "4", out=out, faults="kill_at_step=3",
                            check=False)
    assert killed.returncode != 0 and (out / "checkpoints" / "latest").read_text() == "step_0000002"
    resumed = launch_dropout(then, "--seed", SEED, "--max_steps", "4", "--resume_from_checkpoint", "latest", out=out)
    assert "at step 2 " in resumed.stdout and resumed.summary()["world_size"] == then
    fresh = launch_dropout(then, "--seed", SEED + 1_000_003 * STEP, "--max_steps", "2", out=tmp_path / "fresh")
    after_resume = random_states(out / "checkpoints" / "step_0000004", then)
    recomputed = random_states(fresh.out / "checkpoints" / "step_0000002", then)
    for p in range(then):
        assert torch.equal(after_resume[p]["torch_manual_seed"], recomputed[p]["torch_manual_seed"]), p
        kind, keys, *rest = after_resume[p]["numpy_random_seed"]
        assert (kind, keys.tolist(), *rest) == (recomputed[p]["numpy_random_seed"][0],
                                                recomputed[p]["numpy_random_seed"][1].tolist(),
                                                *recomputed[p]["numpy_random_seed"][2:]), p
        assert after_resume[p]["random_state"] == recomputed[p]["random_state"], p
        seeded = torch.Generator().manual_seed(SEED + p + 1_000_003 * STEP).get_state()
        assert not torch.equal(after_resume[p]["torch_manual_seed"], seeded), p  # the dropout masks drew from it
    if then == 2:  # and the processes drew different masks
        assert not torch.equal(after_resume[0]["torch_manual_seed"], after_resume[1]["torch_manual_seed"])
