#!/usr/bin/env python
"""An fp16-hostile checkpoint fine-tuned in fp32, in fp16, and in fp16 with `--fp32_modules auto`.

    python benchmarks/fp16_hostile.py [--max_steps 150] [--output_dir benchmarks/results/cpu-fp16-hostile-<cpu>]

The checkpoint (`make_hostile`): a tiny transformers Llama built from a config (scripts/make_tiny_hf.py: hidden
64, BPE vocabulary 512; --num_layers 4 here), stored in bf16, in which --hostile_layers (1 and 2) have large-
activation MLPs, as the layers that write "massive activations" into the residual stream of real LLMs do: their
up_proj and down_proj weights are multiplied by powers of two chosen so that down_proj's output reaches about
1.2e5 (within a factor 1.4) on the training text, above fp16's 65504 and far inside bf16's range. Powers of two are exact in bf16 and
fp32, and the RMSNorms that read the residual stream take its scale out, so the model trains in fp32 and bf16.

Three runs of recipes/train.py from it on --dataset stdlib (block 64, batch 16, lr 3e-3, the same seed):
fp32; fp16 (autocast and the GradScaler); fp16 with --fp32_modules auto. For each: the steps the GradScaler
skipped and its last scale, NaN losses, the validation losses, wall time; for auto the plan (its config.yaml)
and the share of the matmul FLOPs of one training step (forward and backward, one batch, the plan applied)
that run in fp16, counted by dtype with torch's FLOP formulas. Writes DIR/fp16_hostile.json and .md, with the
CPU named. Runs in the processes it starts; the tests use `make_hostile` (tests/test_fp32_auto.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.2e5  # down_proj's largest output on the training text, fp16's max being 65504


def _make_tiny_hf():
    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_tokens(tokenizer, rows: int = 8, block: int = 64) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py"))
    ids = tokenizer(text)["input_ids"][:rows * block]
    return torch.tensor(ids).view(rows, block)


def _largest_output(model, module, tokens) -> float:
    seen = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o.detach().abs().max().item()))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        handle.remove()
    return max(seen)


def make_hostile(out: Path, hostile_layers=(1, 2), num_layers: int = 4, seed: int = 0) -> dict:
    """OUT/model: the hostile checkpoint (bf16) with its tokenizer. Returns the folder, the hostile modules'
    names (the transformers model's own) and, per module, the power of two applied and its largest output."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = _make_tiny_hf().make(out / "base", "llama", "bfloat16", seed)
    config = AutoConfig.from_pretrained(base["config"])
    config.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).float()  # bf16 values, fp32 arithmetic
    tokenizer = AutoTokenizer.from_pretrained(base["tokenizer"])
    tokens = probe_tokens(tokenizer)
    scaled = {}
    for i in hostile_layers:
        mlp = model.model.layers[i].mlp
        k = max(2, round(math.log2(TARGET / _largest_output(model, mlp.down_proj, tokens))))
        with torch.no_grad():
            mlp.up_proj.weight.mul_(2.0 ** (k // 2))
            mlp.down_proj.weight.mul_(2.0 ** (k - k // 2))
        scaled[f"model.layers.{i}.mlp.down_proj"] = {"power_of_two": k,
                                                     "largest_output": _largest_output(model, mlp.down_proj, tokens)}
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    return {"model": out / "model", "hostile": scaled}


def train(model: Path, out: Path, precision: str, steps: int, auto: bool) -> dict:
    cmd = [sys.executable, str(REPO / "recipes" / "train.py"), "--model_name_or_path", str(model),
           "--dataset", "stdlib", "--dataset_args", "max_val_samples=64", "--block_size", "64", "--batch_size", "16",
           "--lr", "3e-3", "--warmup_steps", "10", "--max_steps", str(steps), "--eval_steps", str(steps // 3),
           "--log_every", "10", "--mixed_precision", precision, "--output_dir", str(out), "--overwrite_output_dir",
           "--sample_tokens", "0", *(["--fp32_modules", "auto"] if auto else [])]
    started = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line] \
        if (out / "metrics.jsonl").exists() else []
    losses = [float(r["loss"]) for r in records if "loss" in r]  # "nan" is written as a string
    import yaml

    config = yaml.safe_load((out / "config.yaml").read_text()) if (out / "config.yaml").exists() else {}
    scales = [r["loss_scale"] for r in records if "loss_scale" in r]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"precision": precision, "auto": auto, "returncode": run.returncode, "wall_s": round(wall, 1),
            "val_loss": [(r["step"], float(r["val_loss"])) for r in records if "val_loss" in r],
            "nan_losses": sum(1 for x in losses if not math.isfinite(x)), "logged_losses": len(losses),
            "train_wall_s": summary.get("wall_time_s"), "final_val_loss": summary.get("val_loss"),
            "skipped_steps": max([r.get("skipped_steps", 0) for r in records] or [0]),
            "last_loss_scale": scales[-1] if scales else None,
            "events": [r["event"] for r in records if "event" in r],
            "plan": (config.get("effective") or {}).get("fp32_plan"),
            "banner_fp32_line": next((line for line in run.stdout.splitlines() if line.startswith("fp32 modules")), None),
            "last_lines": run.stdout.strip().splitlines()[-3:] + run.stderr.strip().splitlines()[-2:]}


def step_flops_share(model_dir: Path, names: list[str]) -> dict:
    """Matmul FLOPs of one training step (forward and backward of one batch of 16 x 64 tokens) under fp16
    autocast with `names` kept in fp32, by the dtype they run in (torch's FLOP formulas)."""
    from mixprec.evaluation import loss_fn
    from mixprec.precision import policy
    from mixprec.precision.auto_fp32 import _MatmulFlops
    from transformers import AutoTokenizer

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.keep_fp32(model, names)
    tokens = probe_tokens(AutoTokenizer.from_pretrained(model_dir), rows=16)
    flops = _MatmulFlops()
    with flops:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens).logits
            loss = loss_fn(logits[:, :-1], tokens[:, 1:])
        loss.backward()
    total = sum(flops.by_dtype.values())
    return {"by_dtype": flops.by_dtype, "fp16_share": flops.by_dtype.get("float16", 0) / total}


def cpu_slug() -> str:
    from mixprec.devices.hardware import cpu_flags, cpu_name

    name, flags = cpu_name().lower(), cpu_flags()
    vendor = "intel" if "intel" in name else "amd" if "amd" in name else "cpu"
    has = [f for f in ("avx512_fp16", "amx_fp16") if f in flags]
    return f"{vendor}-{'-'.join(f.replace('_', '') for f in has) or 'no-native-fp16'}"


def markdown(report: dict) -> str:
    rows = ["| run | exit | skipped steps | last loss scale | NaN losses / logged | val loss (step: value) | train wall s |",
            "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        name = {"no": "fp32"}.get(r["precision"], r["precision"]) + (" + --fp32_modules auto" if r["auto"] else "")
        vals = ", ".join(f"{s}: {v:.4f}" for s, v in r["val_loss"]) or "-"
        rows.append(f"| {name} | {r['returncode']} | {r['skipped_steps']} | {r['last_loss_scale']} | "
                    f"{r['nan_losses']} / {r['logged_losses']} | {vals} | {r['train_wall_s'] or 0:.1f} |")
    plan, share = report["plan"] or {}, report["step_flops"]
    return "\n".join([
        "# fp16-hostile checkpoint: fp32, fp16, fp16 with --fp32_modules auto", "",
        f"Command: `{report['command']}`", "", f"Machine: {report['machine']}; load average before "
        f"{report['loadavg_before']}, after {report['loadavg_after']}", "",
        "Hostile modules (down_proj weights and up_proj scaled by powers of two; the largest fp32 output on the "
        "probe text): " + ", ".join(f"{n} x2^{v['power_of_two']} -> {v['largest_output']:.3g}"
                                   for n, v in report["hostile"].items()), "", *rows, "",
        "The plan `auto` chose (config.yaml `effective.fp32_plan`): " + "; ".join(
            f"{m['name']} ({m['reason']})" for m in plan.get("modules", [])) +
        f"; measured on {plan.get('batches')} batches of {plan.get('batch_size')} in {plan.get('seconds')} s "
        f"(the run's {report['max_steps']} steps of training: {report['auto_train_wall_s'] or 0:.1f} s); the "
        f"forward's matmul FLOPs in fp16: {plan.get('matmul_flops_share') or 0:.1%}.", "",
        f"One training step (forward and backward, 16 x 64 tokens) with the plan: {share['fp16_share']:.1%} of the "
        f"matmul FLOPs in fp16 ({share['by_dtype']}).", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--output_dir", type=Path, default=None)
    parser.add_argument("--work_dir", type=Path, default=Path("runs/fp16_hostile"))
    args = parser.parse_args()
    from mixprec import benchmarking

    out = args.output_dir or REPO / "benchmarks" / "results" / f"cpu-fp16-hostile-{cpu_slug()}"
    machine = benchmarking.machine()
    made = make_hostile(args.work_dir)
    runs = [train(made["model"], args.work_dir / name, precision, args.max_steps, auto)
            for name, precision, auto in (("fp32", "no", False), ("fp16", "fp16", False), ("fp16_auto", "fp16", True))]
    plan = runs[2]["plan"]
    names = [m["name"].removeprefix("hf.") for m in (plan or {}).get("modules", [])]
    report = {"command": " ".join(["python", "benchmarks/fp16_hostile.py", *sys.argv[1:]]),
              "machine": machine["machine"], "cpu_flags": machine.get("cpu_flags"),
              "loadavg_before": machine["loadavg_before"], "loadavg_after": benchmarking.loadavg(),
              "hostile": made["hostile"], "runs": runs, "plan": plan, "auto_train_wall_s": runs[2]["train_wall_s"],
              "step_flops": step_flops_share(made["model"], names), "max_steps": args.max_steps}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp16_hostile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "fp16_hostile.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
