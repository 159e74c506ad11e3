"""recipes/standalone/causal_lm.py and lora.py, the single-file recipes for transformers models, against the full
recipe (recipes/train.py): run under `accelerate launch` on 1 process and on 2 (DDP over gloo, with gradient
accumulation), each reproduces the full recipe's loss curve for the same settings bit for bit, and exports the
same weights. Bitwise is the right bar, not a tolerance: the same operations run in the same order (the same
blocks of tokens, the same data order and per-process split, the same fp32 weights loaded, the same LoRA
initialisation and dropout draws, fused AdamW with the same parameter groups, the same schedule and clipping),
on one thread per process in both (a matmul split over threads may sum in another order; on these tiny
matrices 2 threads measured the same bits, and so did unfused AdamW, so neither is what the test guards). What
it does guard, measured: causal_lm.py loading the bf16 checkpoint as stored (no fp32 master weights) moves the
first step's gradient norm by 6e-4 and the sixth step's loss by 1.6e-3.

The tiny Llama (2 layers, hidden 64, stored in bf16) is built once for this module with scripts/make_tiny_hf.py
(tests/test_hf_models.py's helper)."""
import ast
import itertools
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import (CONFIGS, CPU_CONFIG, REPO, free_port, main_in_process, run_recipe, teardown_env,
                     teardown_order)
from test_hf_models import make_tiny_hf

STANDALONE = REPO / "recipes" / "standalone"
MINE = ("causal_lm.py", "lora.py")
LIBRARIES = {"torch", "accelerate", "transformers", "datasets", "peft"}
# the same run both ways: 6 optimizer steps of 8 blocks of 32 tokens; 2 processes: 4 blocks each, 2 micro-batches
COMMON = ["--block_size", 32, "--max_steps", 6, "--warmup_steps", 2, "--lr", 3e-3]
LAYOUT = {1: ["--batch_size", 8], 2: ["--batch_size", 4, "--gradient_accumulation_steps", 2]}
# the full recipe's own flags for the same run: its defaults match the standalone ones (weight decay 0.01 on
# matrices, clipping at 1.0, cosine decay to 10%, seed 42); it logs every step, and samples no text at the end
FULL = ["--dataset", "text", "--mixed_precision", "bf16", "--log_every", 1, "--sample_tokens", 0, "--cpu_threads", 1]


def functions(name: str, *wanted: str) -> list:
    """Top-level functions of a standalone recipe, compiled on their own with the modules they use (torch,
    itertools, math): the quick tier does not import transformers, accelerate and peft for them."""
    path = STANDALONE / name
    defs = [node for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "itertools": itertools, "math": math}
    exec(compile(ast.Module(defs, type_ignores=[]), str(path), "exec"), namespace)
    return [namespace[name] for name in wanted]


@pytest.mark.parametrize("name", MINE)
def test_a_standalone_recipe_imports_only_torch_and_the_libraries_it_trains_with(name):
    path = STANDALONE / name
    source = path.read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: a relative import"
            imported.add(node.module.split(".")[0])
    assert imported - sys.stdlib_module_names <= LIBRARIES, imported
    assert "mixprec" not in source.replace("mixprec/", "")  # named as a path to read, never imported
    assert len(source.splitlines()) <= 180  # one sitting


@pytest.mark.parametrize("name", MINE)
def test_the_data_order_and_the_schedule_are_the_full_recipes(name):
    """The few lines of each file against mixprec.data.batches.TrainBatches and mixprec.optim.lr_factor, in
    layouts the runs below do not reach: 3 processes, rows that do not fill the last window, a second epoch."""
    from mixprec.data.arrays import ArrayTable
    from mixprec.data.batches import Layout, TrainBatches
    from mixprec.optim import lr_factor

    micro_batches, factor = functions(name, "micro_batches", "lr_factor")
    blocks = torch.arange(103 * 5).view(103, 5)  # row i holds 5i..5i+4: a batch's tokens name its rows
    table = ArrayTable.from_dict({"inputs": blocks[:, :-1].numpy(), "labels": blocks[:, 1:].numpy()})
    for world, batch, accumulation in ((1, 8, 1), (2, 4, 2), (3, 5, 3), (2, 7, 1)):
        for rank in range(world):
            full = TrainBatches(table, Layout(batch, accumulation, rank, world), 42, torch.device("cpu"))
            expected = [b["inputs"] for epoch in (0, 1) for b in full.epoch(epoch)]
            mine = micro_batches(blocks, batch, accumulation, rank, world, seed=42)
            got = [next(mine)[:, :-1] for _ in expected]
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), (world, batch, accumulation, rank)
    for warmup, total in ((2, 6), (0, 10), (20, 100), (5, 5)):
        assert [factor(s, warmup, total) for s in range(total + 1)] == [
            lr_factor(s, warmup, total, "cosine", 0.1) for s in range(total + 1)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """{'model': a tiny Llama folder stored in bf16 with its tokenizer, 'text': a .txt file of stdlib source}."""
    root = tmp_path_factory.mktemp("standalone_hf")
    out = {"model": make_tiny_hf.make(root / "llama", "llama", "bfloat16")["model"], "text": root / "corpus.txt"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out["text"].write_text("".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")))
    return out


def launch_args(processes: int) -> dict:
    if processes == 1:
        return {"config": CPU_CONFIG}
    return {"config": CONFIGS / "multi_cpu.yaml", "launch_args": ("--num_processes", 2, "--main_process_port",
                                                                  free_port())}


def both(script: str, processes: int, llama, tmp_path: Path, *extra) -> tuple[list[dict], list[dict], str]:
    """(the standalone's metrics.jsonl, the full recipe's training records, the standalone's stdout) of one run
    both ways. The standalone runs under `accelerate launch` on one thread per process (OMP_NUM_THREADS; the
    launcher sets it for 2 processes); the full recipe in this process for 1 (as a fresh process would run it),
    launched for 2."""
    args = ["--model_name_or_path", llama["model"], "--train_file", llama["text"], *COMMON, *LAYOUT[processes]]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if processes > 1:  # no DDP wrapper may outlive its process group (helpers.teardown_order)
        env.update(teardown_env(tmp_path / "alone-teardown"))
    alone = run_recipe(*args, *extra, out=tmp_path / "alone", script=STANDALONE / script, timeout=300, env=env,
                       **launch_args(processes))
    if processes > 1:
        teardown_order(tmp_path / "alone-teardown", freed_first=True)
    full_args = [*args, *FULL, *(["--use_peft"] if script == "lora.py" else []), *extra]
    if processes == 1:
        threads = torch.get_num_threads()
        try:
            main_in_process([*full_args, "--output_dir", tmp_path / "full"])
        finally:
            torch.set_num_threads(threads)  # --cpu_threads 1 set this process's
    else:  # PYTHONPATH: the package from this checkout, installed or not
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**teardown_env(tmp_path / "full-teardown", path), "HF_HUB_OFFLINE": "1"}
        run_recipe(*full_args, out=tmp_path / "full", timeout=300, env=env, **launch_args(processes))
        teardown_order(tmp_path / "full-teardown")  # never freed: the full recipe's processes end with os._exit
    mine = [json.loads(line) for line in (tmp_path / "alone" / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    return mine, [r for r in theirs if "loss" in r], alone.stdout


def assert_same_curve(mine: list[dict], theirs: list[dict]) -> None:
    """Step by step: the same gradient norm and learning rate, bit for bit, and the same loss once rounded to
    fp32 as the full recipe rounds its log (mixprec/health/monitor.py, Monitor.window: the float64 mean over
    processes, cast to float32); the standalone writes the float64 mean itself."""
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == list(range(1, 7))
    for a, b in zip(mine, theirs):
        assert a["grad_norm"] == b["grad_norm"] and a["lr"] == b["lr"], (a, b)
        assert np.float32(a["loss"]) == np.float32(b["loss"]), (a, b)


def same_tensors(a: Path, b: Path) -> dict:
    mine, theirs = load_file(a), load_file(b)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], theirs[k])]
    return mine


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_causal_lm_reproduces_the_full_recipes_curve_and_export_bit_for_bit(processes, llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mine, theirs, _ = both("causal_lm.py", processes, llama, tmp_path)
    assert_same_curve(mine, theirs)
    assert mine[-1]["loss"] < mine[0]["loss"] - 0.2  # it learns (about 6.25 -> 5.8-5.95 nats in 6 steps)
    export = tmp_path / "alone" / "hf_model"
    weights = same_tensors(export / "model.safetensors", tmp_path / "full" / "hf_model" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # the checkpoint's dtype, not fp32
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert AutoTokenizer.from_pretrained(export)("def f(x):")["input_ids"] == \
        AutoTokenizer.from_pretrained(llama["model"])("def f(x):")["input_ids"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers 5
@pytest.mark.parametrize("processes", [1, 2])
def test_lora_reproduces_the_full_recipes_curve_and_adapter_bit_for_bit(processes, llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    mine, theirs, stdout = both("lora.py", processes, llama, tmp_path)
    assert_same_curve(mine, theirs)
    # r 16 on q_proj (64 -> 64) and v_proj (64 -> 32) of 2 layers: 7,168 fp32 adapter weights; the base in bf16
    assert "trainable 7,168 float32; frozen base 139,584 bfloat16" in stdout  # at the start
    assert "the frozen base is still 139,584 bfloat16" in stdout  # at the end
    adapter = tmp_path / "alone" / "adapter"
    weights = same_tensors(adapter / "adapter_model.safetensors",
                           tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
    base = AutoModelForCausalLM.from_pretrained(llama["model"])
    ids = torch.arange(1, 33)[None]
    before = base(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(base, adapter)
    loaded = {n: p for n, p in tuned.named_parameters() if "lora_" in n}
    assert len(loaded) == len(weights) == 8 and {p.dtype for p in loaded.values()} == {torch.float32}
    assert not torch.equal(tuned(input_ids=ids).logits, before)  # the trained adapter changes the model
