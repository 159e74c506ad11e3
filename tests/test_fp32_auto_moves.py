"""--fp32_modules auto under fp16, during training: a forward overflow that the plan measured at start did not see
moves its module to fp32 at the next step (mixprec.precision.auto_moves), with an event, config.yaml's record and
each later checkpoint's plan, instead of the GradScaler skipping steps and halving its scale again and again.

The case: scripts/make_tiny_hf.py's tiny Llama (bf16, 2 layers) with one token, '@', that writes a massive
activation, as real LLMs' delimiter and first tokens do: its embedding points along a direction v that one hidden
unit of layer 0's MLP reads (gate and up rows along v), and that unit's down_proj column writes into one channel;
on '@' the unit's output reaches about 1.3e5, above fp16's 65504, elsewhere at most about 2e4. The training text
(stdlib source without '@') gets '@' at the start of every 20th line, and the seed is the first whose shuffled
order keeps '@' out of the first NUM_BATCHES batches, which `auto` measures, and puts it in one of the next four:
the plan at start is empty, and the overflow comes mid-run (at step 6 here, one step before the first '@': the
first steps at lr 3e-3 have grown the unit's output on other tokens past 65504 too). Nothing downloads."""
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import REPO, Run, free_port, reset_accelerate, run_in_process, run_recipe
from mixprec.devices.hardware import cpu_native

sys.path.insert(0, str(REPO / "scripts"))
import make_tiny_hf  # noqa: E402

MODULE = "hf.model.layers.0.mlp.down_proj"
EMULATED = int(not cpu_native("fp16")[0])  # 1 where this CPU emulates fp16
BATCH, BLOCK = 8, 32


def _hostile_token_model(root: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = make_tiny_hf.make(root / "base", "llama", "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    token = tokenizer.convert_tokens_to_ids("@")
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    v = torch.randn(64, generator=torch.Generator().manual_seed(0))
    v /= v.norm()
    embed, mlp = model.model.embed_tokens.weight, model.model.layers[0].mlp
    with torch.no_grad():
        embed[token] = 20 * embed.norm(dim=1).mean() * v  # after the RMSNorm: about 8 v
        mlp.gate_proj.weight[0], mlp.up_proj.weight[0] = v, 45 * v  # the unit: silu(8) * 360, about 2.9e3
        mlp.down_proj.weight[:, 0] = 0
        mlp.down_proj.weight[5, 0] = 45  # one channel: about 1.3e5
    model = model.to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


def _args(made: dict, *extra) -> list:
    return ["--model_name_or_path", made["model"], "--dataset", "text", "--train_file", made["text"],
            "--block_size", BLOCK, "--batch_size", BATCH, "--lr", "3e-3", "--warmup_steps", 0, "--lr_schedule",
            "constant", "--sample_tokens", 0, "--log_every", 4, "--seed", made["seed"], *extra]


def _seed(made: dict) -> tuple[int, int]:
    """The first seed whose order has no '@' in the first 4 batches and one in the next 4; and that step (1-based)."""
    from mixprec import config, data
    from mixprec.data.batches import Layout, TrainBatches
    from mixprec.precision import auto_fp32

    bundle = data.build(config.parse_config([str(a) for a in _args({**made, "seed": 0})]))
    token = made["token"]
    holds = torch.tensor([token in row for row in bundle.train["inputs"]])
    for seed in range(1000):
        order = TrainBatches(bundle.train, Layout(BATCH, 1, 0, 1), seed, torch.device("cpu")).order(0)
        per_batch = holds[order][:8 * BATCH].view(8, BATCH).any(dim=1)
        if not per_batch[:auto_fp32.NUM_BATCHES].any() and per_batch.any():
            return seed, int(per_batch.nonzero()[0]) + 1
    raise AssertionError("no seed keeps '@' out of the first batches")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("moves")
    model = _hostile_token_model(root)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / n).read_text() for n in ("textwrap.py", "shlex.py", "fnmatch.py")).replace("@", "")
    lines = [("@" + line if i % 20 == 10 else line) for i, line in enumerate(text.splitlines(keepends=True))]
    (root / "corpus.txt").write_text("".join(lines))
    out = {"model": model, "text": root / "corpus.txt", "token": AutoTokenizer.from_pretrained(model)
           .convert_tokens_to_ids("@")}
    out["seed"], out["first"] = _seed(out)
    return out


def train(args, capsys, out: Path) -> Run:
    try:
        run = run_in_process([*map(str, args), "--output_dir", str(out)], capsys)
    finally:
        reset_accelerate()
    return Run(run.returncode, run.stdout, run.stderr, out)


@pytest.mark.slow
def test_an_overflow_in_later_batches_moves_its_module_to_fp32_once_instead_of_collapsing_the_scale(made, tmp_path,
                                                                                                   capsys):
    steps = 16
    plain = train(_args(made, "--mixed_precision", "fp16", "--max_steps", steps), capsys, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    auto = train(_args(made, "--mixed_precision", "fp16", "--fp32_modules", "auto", "--max_steps", steps), capsys,
                 tmp_path / "auto")
    assert auto.returncode == 0, auto.stderr
    # the plan at start did not see it: the banner says none needed
    assert "fp32 modules   auto: none needed under fp16" in auto.stdout
    skipped = [run.summary()["skipped_steps"] for run in (plain, auto)]
    scales = [run.train_records()[-1]["loss_scale"] for run in (plain, auto)]
    overflow = next(e["step"] for e in plain.events() if e["event"] == "nan_loss")  # plain fp16's first NaN loss
    print(f"first '@' at step {made['first']} (seed {made['seed']}); first overflow at step {overflow}; skipped "
          f"plain {skipped[0]}, auto {skipped[1]}; last scale plain {scales[0]:g}, auto {scales[1]:g}")
    assert overflow > 4 and "hf.model.layers.0.mlp.down_proj exceed 65504" in plain.events()[0]["diagnosis"]
    assert skipped[0] >= steps - overflow and scales[0] <= 65536 / 2 ** 8  # the scale halved at each skip
    # both runs skip step 1 (--init_scale 65536 is too high: ordinary back-off); auto then skips the one step
    # that found the overflow, and no other where fp16 is native
    assert [r["skipped_steps"] for r in (plain.train_records()[0], auto.train_records()[0])] == [1, 1]
    # where fp16 is emulated (no AVX512-FP16 or AMX-FP16: the AMD EPYC with AVX2 only) it rounds otherwise, and one
    # more skipped step, with no event (an ordinary back-off), followed the move there (steps 9-12: 3 skips, scale 8192)
    assert skipped[1] in range(2, 3 + EMULATED) and scales[1] >= 16384 / 2 ** EMULATED
    moved = [e for e in auto.events() if e["event"] == "fp32_module_moved"]
    assert len(moved) == 1 and moved[0]["step"] == overflow and moved[0]["modules"] == MODULE
    assert f"its output reached " in moved[0]["diagnosis"] and f"> 65504 (fp16's largest) at step {overflow}" in \
        moved[0]["diagnosis"] and moved[0]["value"] > 65504
    assert moved[0]["fp32_plan"] == [MODULE] and moved[0]["cause"] == "fp16_forward_overflow"
    assert not [e for e in auto.events() if e["event"] == "nan_loss"]  # the move says it, not NaN advice
    assert sum(f"[health] step {overflow}: fp32_module_moved: fp16 forward overflow in {MODULE}" in line
               for line in auto.stdout.splitlines()) == 1
    plan = auto.config()["effective"]["fp32_plan"]
    assert [m["name"] for m in plan["modules"]] == [MODULE] and plan["moved"][0]["step"] == overflow
    assert plan["modules"][0]["reason"].startswith(f"moved at step {overflow}: overflow: its output reached")
    assert auto.config()["history"][-1]["event"] == "fp32_module_moved"
    assert auto.summary()["fp32_modules_moved"] == plan["moved"] and "fp32_modules_moved" not in plain.summary()
    assert math.isfinite(auto.summary()["train_loss"]) and auto.summary()["val_loss"] < plain.summary()["val_loss"]


@pytest.mark.slow
def test_a_resume_after_the_move_keeps_the_module_in_fp32_and_ends_bitwise_where_the_whole_run_ends(made, tmp_path):
    """Killed after the checkpoint that follows the move: the resume's plan comes from that checkpoint (the
    module in fp32 from the first step), and its metrics equal the uninterrupted run's."""
    steps, every = 12, 8  # the move comes at step 6 (the test above)
    args = _args(made, "--mixed_precision", "fp16", "--fp32_modules", "auto", "--max_steps", steps,
                 "--checkpointing_steps", every, "--eval_steps", 6)
    whole = run_recipe(*args, out=tmp_path / "whole", launcher="python")
    killed = run_recipe(*args, out=tmp_path / "killed", launcher="python", faults=f"kill_at_step={every + 1}",
                        check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "summary.json").exists()
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest", out=tmp_path / "killed", launcher="python")
    assert f"recorded by the checkpoint of step {every}, not measured again" in resumed.stdout
    assert f"{MODULE} (moved at step " in resumed.stdout
    assert whole.config()["effective"]["fp32_plan"]["moved"][0]["step"] < every
    assert resumed.comparable() == whole.comparable()
    assert resumed.summary()["skipped_steps"] == whole.summary()["skipped_steps"]  # step 1, the move (and above)
    assert whole.summary()["skipped_steps"] in range(2, 3 + EMULATED)
    assert resumed.config()["effective"]["fp32_plan"]["moved"] == whole.config()["effective"]["fp32_plan"]["moved"]


@pytest.mark.slow
def test_two_ddp_processes_move_the_same_module(made, tmp_path):
    """Each process finds what its own micro-batches show; all keep the union (a process without the module in
    fp32 would feed NaN into the all-reduced gradients and every '@' step would be skipped)."""
    run = run_recipe(*_args(made, "--mixed_precision", "fp16", "--fp32_modules", "auto", "--max_steps", 8),
                     "--batch_size", BATCH // 2, out=tmp_path / "ddp", config=REPO / "accelerate_configs" /
                     "multi_cpu.yaml", launch_args=("--num_processes", 2, "--main_process_port", free_port()))
    moved = [e for e in run.events() if e["event"] == "fp32_module_moved"]
    assert len(moved) == 1 and moved[0]["modules"] == MODULE and moved[0]["step"] > 4
    back_off = run.train_records()[0]["skipped_steps"]  # the first steps' ordinary back-off from --init_scale
    assert run.summary()["skipped_steps"] == back_off + 1 and run.summary()["world_size"] == 2


def test_ordinary_loss_scale_back_off_moves_nothing(tmp_path, capsys):
    """A healthy fp16 run whose first steps overflow only because the loss scale is too high for the gradients
    (--init_scale 2^30): the GradScaler skips them, the moves look, find no forward overflow, and stay silent."""
    run = train(["--mixed_precision", "fp16", "--fp32_modules", "auto", "--init_scale", 2.0 ** 30, "--max_steps", 8,
                 "--log_every", 4], capsys, tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert run.summary()["skipped_steps"] >= 2  # back-off happened
    assert not [e for e in run.events() if e["event"] == "fp32_module_moved"]
    assert "fp32_module_moved" not in run.stdout and "moved" not in run.config()["effective"]["fp32_plan"]
