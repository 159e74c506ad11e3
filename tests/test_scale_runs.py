"""End-to-end, offline, through `accelerate launch`: the GPT recipe on the standard-library corpus and the CNN
recipe on digits, in fp32 and bf16, with their throughput, memory and MFU; compile and resume; errors."""
import math

import pytest
from safetensors.torch import load_file

from helpers import assert_one_line_error, REPO, run_recipe
from mixprec.devices.hardware import cpu_native

pytestmark = pytest.mark.slow
CONFIGS = REPO / "recipes" / "configs"
# the configs' full runs in fp32, and in bf16 where the CPU has it natively (elsewhere bf16 is emulated, ~100x
# slower: tests/test_matrix.py trains every model briefly in bf16 on any CPU)
PRECISIONS = ["no", "bf16"] if cpu_native("bf16")[0] else ["no"]


def check_speed_fields(run, text: bool):
    """Throughput, memory and MFU: in every logged step, in the summary, and in the banner."""
    records, summary = run.train_records(), run.summary()
    assert records
    for r in [*records, summary]:
        assert r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] > 0 and r["peak_memory_bytes"] > 0
        assert 0 <= r["data_wait_frac"] < 1
        if text:
            assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)
        else:
            assert "tokens_per_s" not in r
    assert "peak FLOP/s" in run.stdout and "measured at start-up (cpu: no table)" in run.stdout
    assert "speed: " in run.stdout and "MFU" in run.stdout
    derived = run.config()["derived"]
    assert derived["peak_flops"] > 0 and derived["flops_per_sample"] > 0


def each_precision(tmp_path_factory, config: str) -> dict:
    root = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
    return {mp: run_recipe("--config", CONFIGS / config, "--mixed_precision", mp, out=root / mp) for mp in PRECISIONS}


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    return each_precision(tmp_path_factory, "gpt_tiny.yaml")


@pytest.mark.parametrize("mp", PRECISIONS)
def test_gpt_tiny_learns_the_standard_library(gpt_runs, mp):
    run = gpt_runs[mp]
    summary, evals = run.summary(), run.eval_records()
    assert summary["effective_precision"] == mp and summary["steps"] == 300
    # uniform over 256 bytes: ln 256 = 5.55 nats; byte frequencies alone (a unigram model): 3.24
    assert summary["val_loss"] < 2.6 < 0.5 * math.log(256)
    assert [e["step"] for e in evals] == [100, 200, 300] and evals[0]["val_loss"] > evals[-1]["val_loss"]
    check_speed_fields(run, text=True)
    assert run.config()["derived"]["flops_method"].startswith("6N + 12*L*H*Q*T")
    assert run.events() == []  # a healthy run: no diagnosis


@pytest.mark.parametrize("mp", PRECISIONS)
def test_gpt_run_ends_with_a_sample(gpt_runs, mp):
    run = gpt_runs[mp]
    text = (run.out / "sample.txt").read_text()
    prompt, generated = text.split("--- prompt ---\n", 1)[1].split("\n--- generated ---\n")
    assert len(generated.encode()) >= 190  # 200 byte tokens (a stray invalid byte prints as one character)
    assert prompt.strip() and generated in run.stdout


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory):
    return each_precision(tmp_path_factory, "cnn_digits.yaml")


@pytest.mark.parametrize("mp", PRECISIONS)
def test_cnn_reaches_95_percent_on_digits(cnn_runs, mp):
    run = cnn_runs[mp]
    summary = run.summary()
    assert summary["effective_precision"] == mp and summary["val_accuracy"] >= 0.95
    check_speed_fields(run, text=False)
    assert run.config()["derived"]["flops_method"].startswith("counted")
    assert not (run.out / "sample.txt").exists() and run.events() == []


def test_compiled_run_resumes_a_plain_checkpoint(tmp_path):
    """torch.compile in place keeps parameter names: a compiled run continues an uncompiled checkpoint (here
    one trained with activation checkpointing, which changes memory, not results) to the same losses."""
    args = ["--config", CONFIGS / "gpt_tiny.yaml", "--max_steps", "40", "--eval_steps", "20", "--log_every", "10",
            "--checkpointing_steps", "20", "--mixed_precision", "no", "--sample_tokens", "0",
            "--dataset_args", "max_val_samples=32"]
    plain = run_recipe(*args, "--activation_checkpointing", out=tmp_path / "plain")
    compiled = run_recipe(*args, "--compile", "--resume_from_checkpoint",
                          tmp_path / "plain" / "checkpoints" / "step_0000020", out=tmp_path / "compiled")
    assert "speed          fused_adamw, activation_checkpointing" in plain.stdout
    assert "speed          compile, fused_adamw" in compiled.stdout
    assert compiled.config()["speed"]["compile"] is True and "at step 20" in compiled.stdout
    a, b = plain.train_records()[-2:], compiled.train_records()
    assert [r["step"] for r in b] == [30, 40]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3)
    assert compiled.summary()["val_loss"] == pytest.approx(plain.summary()["val_loss"], rel=1e-3)
    assert load_file(tmp_path / "compiled" / "model.safetensors").keys() == load_file(
        tmp_path / "plain" / "model.safetensors").keys()


@pytest.mark.parametrize("args, words", [
    (["--dataset", "hub", "--dataset_name", "wikitext", "--dataset_config", "wikitext-2-raw-v1", "--model",
      "gpt_tiny"], ["could not load 'wikitext' (wikitext-2-raw-v1) from the Hugging Face Hub", "stdlib"]),
    (["--config", CONFIGS / "gpt_tiny.yaml", "--dataset_args", "tokenizer=gpt2"], ["tokenizer 'gpt2'", "bytes"]),
    (["--config", CONFIGS / "gpt_tiny.yaml", "--tf32"], ["--tf32", "cpu"]),
    (["--config", CONFIGS / "cnn_digits.yaml", "--activation_checkpointing"], ["--activation_checkpointing", "cnn"]),
], ids=["hub offline", "tokenizer offline", "tf32 on cpu", "checkpointing a cnn"])
def test_errors_are_one_line(args, words, tmp_path):
    run = run_recipe(*args, out=tmp_path / "r", launcher="python", check=False)
    assert_one_line_error(run, *words)
    assert not (tmp_path / "r" / "config.yaml").exists()
