"""transformers models with what the built-in models have: --gradient_checkpointing (the same training, less
activation memory), --fp32_modules with the model's own module names, FLOPs and MFU from the model's config.
The tiny models and the `offline` guard are tests/test_hf_models.py's (scripts/make_tiny_hf.py)."""
import json

import pytest
import torch
import yaml

from mixprec.devices.hardware import cpu_native
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
    assert summary["tokens_per_s"] > 0
    if torch.cuda.is_available() or cpu_native("bf16")[0]:
        assert summary["mfu"] > 0
    else:  # bf16 emulated (AMD EPYC, AVX2 only): no peak to divide by, so no MFU rather than a made-up one
        derived = yaml.safe_load((tmp_path / "plain" / "config.yaml").read_text())["derived"]
        assert "mfu" not in summary and derived["peak_flops"] is None
        assert derived["peak_flops_source"].startswith("none: bf16 is emulated on this CPU")


def test_gradient_checkpointing_is_refused_for_a_model_without_it(tmp_path, capsys):
    before = snapshot(tmp_path)
    run = run_in_process(["--gradient_checkpointing", "--max_steps", 2, "--output_dir", tmp_path / "run"], capsys)
    assert_one_line_error(run, "--gradient_checkpointing", "--model mlp", "drop it")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_the_gradient_checkpointing_benchmark_measures_less_kept_for_backward(tmp_path):
    """benchmarks/gradient_checkpointing.py on a small shape: checkpointing keeps less for the backward pass
    (each layer only its input); the first step's loss equal, the last one's within 1e-4 relative (equal on the
    Intel Xeon here; 1.7e-6 apart on one CI machine, where recomputed bf16 activations rounded differently)."""
    import subprocess
    import sys

    from helpers import REPO, base_env

    subprocess.run([sys.executable, "benchmarks/gradient_checkpointing.py", "--hidden", "64", "--layers", "2",
                    "--tokens", "64", "--rows", "2", "--steps", "1", "--out", str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True, env=base_env(), timeout=600)
    result = json.loads((tmp_path / "gradient_checkpointing.json").read_text())
    with_, without = result["with"], result["without"]
    assert with_["saved_for_backward_mb"] < 0.5 * without["saved_for_backward_mb"]
    assert with_["first_loss"] == without["first_loss"] and "cores" in result["machine"]
    assert with_["loss"] == pytest.approx(without["loss"], rel=1e-4)
    assert "| with |" in (tmp_path / "gradient_checkpointing.md").read_text()


def test_gradient_checkpointing_is_the_gpts_activation_checkpointing():
    import torch

    from mixprec import config, models
    from mixprec.training import speed

    model = models.build("gpt_tiny", {"task": "language_modeling", "vocab_size": 64, "block_size": 32}, {})
    cfg = config.parse_config(["--model", "gpt_tiny", "--gradient_checkpointing"])
    applied = speed.apply(cfg.speed, cfg, model, torch.device("cpu"))
    assert model.activation_checkpointing and applied["gradient_checkpointing"]


@pytest.mark.slow
def test_a_transformers_run_stops_on_a_signal_resumes_logs_to_both_trackers_and_the_numerics_tools_read_it(
        tiny, tmp_path):  # noqa: F811
    """What holds for the built-in models, on the tiny Llama: SIGTERM at a step is one checkpoint, preempted.json
    and exit 75; the same command resumes it to the end; W&B (offline) and TensorBoard get every logged step; the
    precision report and the precision diff run on the model with the user's flags, and the report's fp8 command
    gives those flags back."""
    import os
    import signal
    import subprocess
    import sys

    from helpers import REPO
    from test_preemption import PAUSE, Launched, pids
    from test_tracking import tensorboard_scalars, wandb_history

    from mixprec.run_folder.preemption import EXIT_CODE, MARKER

    model = ["--model_name_or_path", tiny["llama_bf16"]["model"], "--dataset", "text", "--train_file", tiny["text"],
             "--block_size", 32, "--batch_size", 8]
    args = [*model, "--max_steps", 30, "--log_every", 10, "--mixed_precision", "bf16", "--report_to", "all",
            "--sample_tokens", 0, "--warmup_steps", 2]
    env = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    run = Launched(tmp_path, 1, launcher="python", args=args, env=env)
    try:
        run.wait_paused()
        (pid,) = pids(str(run.out))
        os.kill(pid, signal.SIGTERM)
        run.release_when_signalled([0])
        code = run.wait_all_gone()
    finally:
        run.kill_leftovers()
    assert code == EXIT_CODE, run.text()[-3000:]
    assert json.loads((run.out / MARKER).read_text())["signal"] == "SIGTERM"
    assert (run.out / "checkpoints" / f"step_{PAUSE:07d}").is_dir()
    resumed = subprocess.run([sys.executable, "recipes/train.py", *map(str, args), "--output_dir", str(run.out),
                              "--resume_from_checkpoint", "latest"], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, **env}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run.out / "summary.json").read_text())["steps"] == 30
    pieces = sorted((run.out / "wandb").glob("offline-run-*"))
    assert pieces and {10, 20, 30} <= {step for piece in pieces for step in wandb_history(piece)}
    _, scalars = tensorboard_scalars(run.out / "tensorboard")
    assert scalars["train/loss"] == [10, 20, 30], scalars
    tools = {"precision_report": ["--output_dir", tmp_path / "report"],
             "precision_diff": ["--compare", "no,bf16", "--output_dir", tmp_path / "diff"]}
    for tool, extra in tools.items():
        done = subprocess.run([sys.executable, f"recipes/{tool}.py", *map(str, [*model, *extra])], capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, **env}, timeout=600)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (tool, done.stderr[-3000:])
    gpt2 = ["--model_name_or_path", tiny["gpt2"]["model"], *model[2:], "--compare", "no,bf16", "--output_dir",
            tmp_path / "diff_gpt2"]  # GPT-2 ties lm_head to the input embeddings: one weight, counted once
    done = subprocess.run([sys.executable, "recipes/precision_diff.py", *map(str, gpt2)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **env}, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    report = (tmp_path / "report" / "fp8_accelerate_config.yaml").read_text()
    assert f"--model_name_or_path {tiny['llama_bf16']['model']}" in report and "--model_args" not in report
    diff = json.loads((tmp_path / "diff" / "diff.json").read_text())
    assert diff["weights"]["total"]["rel_divergence"] > 0
    label = f"{tiny['llama_bf16']['model']} (the transformers checkpoint's)"  # not "fresh": the weights measured
    assert diff["meta"]["weights"] == label, diff["meta"]
    assert json.loads((tmp_path / "report" / "precision_report.json").read_text())["meta"]["weights"] == label


@pytest.mark.slow
def test_a_zero3_export_is_refused_without_a_hang_then_loads_with_from_pretrained(tiny, tmp_path):  # noqa: F811
    """ZeRO-3 on 2 processes gathers the weights to the main process only: an fp16 export that would overflow is
    refused there and the other process follows (no hang, exit 0, no hf_model); the fp32 export the refusal
    advises loads with AutoModelForCausalLM.from_pretrained, keeps the checkpoint's own generation_config and
    reproduces the run's validation loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from helpers import CONFIGS, free_port, run_recipe
    from test_hf_models import export_val_loss, make_tiny_hf

    base = make_tiny_hf.make(tmp_path / "llama", "llama", "float32", seed=1)["model"]
    model = AutoModelForCausalLM.from_pretrained(base)
    used = set(AutoTokenizer.from_pretrained(base)(tiny["text"].read_text())["input_ids"])
    unused = next(i for i in range(model.config.vocab_size - 1, 0, -1) if i not in used)
    with torch.no_grad():
        model.model.embed_tokens.weight[unused, 0] = 1e5  # beyond fp16's 65504, in a row the text never reads
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, max_new_tokens=7, do_sample=True,
                                               top_k=5)
    model.save_pretrained(base)
    args = ["--model_name_or_path", base, *common(tiny, tmp_path / "run"), "--mixed_precision", "bf16"]
    launch = {"env": {"HF_HUB_OFFLINE": "1"}, "timeout": 600, "config": CONFIGS / "deepspeed_zero3.yaml", "out": tmp_path / "run",
              "launch_args": ("--num_processes", 2, "--main_process_port", free_port())}
    refused = run_recipe(*args, "--save_dtype", "fp16", **launch)
    export = refused.summary()["hf_export"]
    assert export["status"] == "refused" and "model.embed_tokens.weight" in export["reason"]
    assert refused.stdout.count("export refused:") == 1 and not (tmp_path / "run" / "hf_model").exists()

    saved = run_recipe(*args, "--save_dtype", "fp32", "--resume_from_checkpoint", "latest", **launch)
    summary = saved.summary()
    assert summary["hf_export"]["status"] == "saved" and summary["hf_export"]["dtype"] == "float32"
    assert "its export was refused: writing its end now (--save_dtype fp32), no step trained" in saved.stdout
    assert "(fp32: all " in saved.stdout and "tensors finite)" in saved.stdout
    assert "stored float32, trained bfloat16 (the model holds bfloat16 weights" in saved.stdout  # DeepSpeed's copy
    folder = tmp_path / "run" / "hf_model"
    generation = GenerationConfig.from_pretrained(folder)
    assert (generation.max_new_tokens, generation.do_sample, generation.top_k) == (7, True, 5)
    loss = export_val_loss(args, folder, torch.float32)
    # the run evaluates under bf16 autocast with DeepSpeed's bf16 weights, this in fp32: measured 0 nats apart
    assert abs(loss - summary["val_loss"]) < 5e-2, (loss, summary["val_loss"])
