"""transformers models with what the built-in models have: --gradient_checkpointing (the same training, less
activation memory), --fp32_modules with the model's own module names, FLOPs and MFU from the model's config.
The tiny models and the `offline` guard are tests/test_hf_models.py's (scripts/make_tiny_hf.py)."""
import json

import pytest
import yaml

from helpers import Run, assert_one_line_error, run_in_process, snapshot
from test_hf_models import common, offline, tiny  # noqa: F401 (fixtures)


def llama_run(tiny, out, capsys, *extra) -> Run:  # noqa: F811
    run = run_in_process(["--model_name_or_path", tiny["llama_bf16"]["model"], *common(tiny, out),
                          "--mixed_precision", "bf16", "--fp32_modules", "model.norm,lm_head", *extra], capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    return Run(run.returncode, run.stdout, run.stderr, out)


@pytest.mark.slow
def test_gradient_checkpointing_trains_bitwise_the_same_and_the_models_own_names_and_flops(tiny, offline,  # noqa: F811
                                                                                          tmp_path, capsys):
    """The same run with and without --gradient_checkpointing (bf16 autocast, fp32 master weights): every logged
    loss and the validation loss bitwise equal (measured: equal; recomputation repeats the same CPU kernels)."""
    plain = llama_run(tiny, tmp_path / "plain", capsys)
    checkpointed = llama_run(tiny, tmp_path / "gc", capsys, "--gradient_checkpointing")
    speed = [next(ln for ln in run.stdout.splitlines() if ln.startswith("speed ")) for run in (plain, checkpointed)]
    assert "gradient_checkpointing" in speed[1] and "gradient_checkpointing" not in speed[0]  # the banner
    losses = [[r["loss"] for r in run.train_records()] for run in (plain, checkpointed)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert plain.summary()["val_loss"] == checkpointed.summary()["val_loss"]
    config = yaml.safe_load((tmp_path / "gc" / "config.yaml").read_text())
    assert config["config"]["gradient_checkpointing"] and config["speed"]["gradient_checkpointing"]

    # --fp32_modules with the Llama's own module names (no adapter prefix), matched and said in the banner
    assert "'lm_head' -> hf.lm_head" in plain.stdout and "'model.norm' -> hf.model.norm" in plain.stdout
    assert config["effective"]["fp32_modules"] == {"model.norm": ["hf.model.norm"], "lm_head": ["hf.lm_head"]}

    # FLOPs per token from the model's config: 6N + 12*L*H*T, N the parameters without the input embeddings
    c = json.loads((tiny["llama_bf16"]["model"] / "config.json").read_text())
    n = config["derived"]["num_parameters"] - c["vocab_size"] * c["hidden_size"]
    T = 32  # --block_size
    assert config["derived"]["flops_per_sample"] == (6 * n + 12 * c["num_hidden_layers"] * c["hidden_size"] * T) * T
    assert config["derived"]["flops_method"].startswith("6N + 12*L*H*Q*T")
    summary = plain.summary()
    assert summary["mfu"] > 0 and summary["tokens_per_s"] > 0


def test_gradient_checkpointing_is_refused_for_a_model_without_it(tmp_path, capsys):
    before = snapshot(tmp_path)
    run = run_in_process(["--gradient_checkpointing", "--max_steps", 2, "--output_dir", tmp_path / "run"], capsys)
    assert_one_line_error(run, "--gradient_checkpointing", "--model mlp", "drop it")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_the_gradient_checkpointing_benchmark_measures_less_kept_for_backward(tmp_path):
    """benchmarks/gradient_checkpointing.py on a small shape: checkpointing keeps less for the backward pass
    (each layer only its input) and ends at the same loss."""
    import subprocess
    import sys

    from helpers import REPO, base_env

    subprocess.run([sys.executable, "benchmarks/gradient_checkpointing.py", "--hidden", "64", "--layers", "2",
                    "--tokens", "64", "--rows", "2", "--steps", "1", "--out", str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True, env=base_env(), timeout=600)
    result = json.loads((tmp_path / "gradient_checkpointing.json").read_text())
    with_, without = result["with"], result["without"]
    assert with_["saved_for_backward_mb"] < 0.5 * without["saved_for_backward_mb"]
    assert with_["loss"] == without["loss"] and "cores" in result["machine"]
    assert "| with |" in (tmp_path / "gradient_checkpointing.md").read_text()


def test_gradient_checkpointing_is_the_gpts_activation_checkpointing():
    import torch

    from mixprec import config, models, speed

    model = models.build("gpt_tiny", {"task": "language_modeling", "vocab_size": 64, "block_size": 32}, {})
    applied = speed.apply(config.parse_config(["--model", "gpt_tiny", "--gradient_checkpointing"]), model,
                          torch.device("cpu"))
    assert model.activation_checkpointing and applied["gradient_checkpointing"]
