#!/usr/bin/env python
"""Where the master weights live, measured: fp32 master weights against bf16 weights updated by round-to-nearest,
Kahan summation and stochastic rounding (--master_weights, --bf16_update), under bf16 autocast.

    python benchmarks/master_weights.py                        # MLP, gpt_tiny 300 steps, tiny Llama 60; lr 1e-4
    python benchmarks/master_weights.py --models mlp --steps 100 --lr 1e-3 --out /tmp/mw
    python benchmarks/master_weights.py --steps mlp=300,gpt_tiny=300,hf_llama=300   # steps per model

--steps N gives every model N steps; MODEL=N pairs give the named models theirs and the others their default
(300; hf_llama 60: its 5 runs of 300 steps take too long on a 2-core CPU). The table's header says which.

hf_llama is a transformers LlamaForCausalLM (2 layers, hidden 64) built from a config with fresh weights by
scripts/make_tiny_hf.py, offline, with recipes/configs/hf_llama_tiny.yaml; it also gets a LoRA row (--use_peft:
the base frozen in bf16, fp32 adapters, whose gradients and Adam states are the only ones).
Each run is `python recipes/train.py` with the model's config, `--mixed_precision bf16 --max_steps N --lr LR`,
in its own folder. For each: the final validation loss, the mean lost-update share over the logged steps
(metrics.jsonl), the training state in bytes per parameter measured from the tensors of the final checkpoint
(the weights in model.safetensors, Adam's states and the compensation buffers in optimizer.bin) plus the
gradients, which have the weights' dtype and size, and the median step time of the logged windows after the
first. Small learning rates are where updates are small against the weights, as in fine-tuning and at the
tail of a schedule. Writes master_weights.md and master_weights.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from mixprec.devices.hardware import cpu_native, machine_line

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"mlp": "recipes/configs/mlp.yaml", "gpt_tiny": "recipes/configs/gpt_tiny.yaml",
           "hf_llama": "recipes/configs/hf_llama_tiny.yaml"}
STEPS = {"mlp": 300, "gpt_tiny": 300, "hf_llama": 60}  # the default steps per model
LORA = {"lora (bf16 base)": ["--use_peft"]}  # transformers models only
MODES = {"fp32": [], "bf16 round": ["--master_weights", "bf16", "--bf16_update", "round"],
         "bf16 kahan": ["--master_weights", "bf16", "--bf16_update", "kahan"],
         "bf16 stochastic": ["--master_weights", "bf16", "--bf16_update", "stochastic"]}


def tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_bytes(out: Path) -> dict:
    """Bytes of the training state, from the final checkpoint's tensors: weights, gradients (the weights' dtype
    and size), optimizer states (Adam's two, the compensation; not the generator's 5 kB state)."""
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    tensors = load_file(latest / "model.safetensors")
    weights = tensor_bytes(tensors)
    adapters = {k: v for k, v in tensors.items() if ".lora_" in k}  # LoRA: only the adapters have gradients
    optimizer = torch.load(latest / "optimizer.bin", weights_only=True)
    return {"weights": weights, "gradients": tensor_bytes(adapters) if adapters else weights,
            "optimizer": tensor_bytes(optimizer["state"])}


def tiny_llama(root: Path) -> Path:
    """A tiny Llama with fresh fp32 weights and its tokenizer (scripts/make_tiny_hf.py), made once per root."""
    folder = root / "tiny_llama"
    if not (folder / "model" / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_hf.py"), str(folder), "--arch", "llama"],
                       check=True, capture_output=True, cwd=REPO, timeout=600)
    return folder / "model"


def parse_steps(text: str) -> dict:
    """`--steps`: N (every model) or MODEL=N pairs, comma-separated, over the defaults (STEPS)."""
    if "=" not in text:
        return dict.fromkeys(STEPS, int(text))
    steps = dict(STEPS)
    for pair in text.split(","):
        model, _, n = pair.partition("=")
        if model.strip() not in STEPS:
            raise argparse.ArgumentTypeError(f"{model!r}: no such model; name some of {', '.join(STEPS)}")
        steps[model.strip()] = int(n)
    return steps


def steps_text(steps: dict, models: list[str]) -> str:
    """'300 steps' or '300 steps (hf_llama 60)': the most common count, then the models that differ."""
    counts = [steps[m] for m in models]
    common = max(counts, key=counts.count)
    other = ", ".join(f"{m} {steps[m]}" for m in models if steps[m] != common)
    return f"{common} steps" + (f" ({other})" if other else "")


def run(model: str, mode: str, args, root: Path) -> dict:
    out = root / f"{model}-{mode.replace(' ', '-')}"
    n = args.steps[model]
    extra = ["--model_name_or_path", str(tiny_llama(root))] if model == "hf_llama" else []
    cmd = [sys.executable, str(REPO / "recipes" / "train.py"), "--config", CONFIGS[model], *extra,
           "--mixed_precision", "bf16",
           "--max_steps", str(n), "--lr", str(args.lr), "--log_every", "25", "--eval_steps", str(n),
           "--sample_tokens", "0", "--report_to", "none", "--output_dir", str(out), *{**MODES, **LORA}[mode]]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=1800,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in records if "loss" in r and "event" not in r]
    summary = json.loads((out / "summary.json").read_text())
    import yaml

    params = yaml.safe_load((out / "config.yaml").read_text())["derived"]["num_parameters"]
    sizes = state_bytes(out)
    return {"model": model, "mode": mode, "steps": n, "parameters": params, "val_loss": summary["val_loss"],
            "lost_update_share": statistics.fmean(r["lost_update_share"] for r in train),
            "bytes_per_parameter": {k: v / params for k, v in sizes.items()},
            "state_bytes_per_parameter": sum(sizes.values()) / params,
            "step_time_s": statistics.median(r["step_time_s"] for r in train[1:]),
            "events": sorted({r["event"] for r in records if "event" in r})}


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | master weights | val loss | vs fp32 | lost-update share | training state, bytes/param "
             "(weights + grads + optimizer) | vs fp32 | step time |", "|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r for r in rows if r["mode"] == "fp32"}
    for r in rows:
        b, f = r["bytes_per_parameter"], base[r["model"]]
        lines.append(f"| {r['model']} | {r['mode']} | {r['val_loss']:.4f} | {r['val_loss'] / f['val_loss'] - 1:+.2%} | "
                     f"{r['lost_update_share']:.1%} | {r['state_bytes_per_parameter']:.1f} ({b['weights']:.0f} + "
                     f"{b['gradients']:.0f} + {b['optimizer']:.1f}) | "
                     f"{r['state_bytes_per_parameter'] / f['state_bytes_per_parameter']:.0%} | "
                     f"{r['step_time_s'] * 1e3:.1f} ms |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt_tiny,hf_llama")
    parser.add_argument("--steps", type=parse_steps, default=dict(STEPS),
                        help="N for every model, or MODEL=N pairs (default: " +
                             ",".join(f"{k}={v}" for k, v in STEPS.items()) + ")")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu-master-weights")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in CONFIGS]
    if unknown:
        parser.error(f"--models {','.join(unknown)}: no such model; name some of {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for model in models:
            for mode in [*MODES, *(LORA if model == "hf_llama" else ())]:
                rows.append(run(model, mode, args, Path(root)))
                print(table(rows)[-1], flush=True)
    bf16 = cpu_native("bf16")[1] if not torch.cuda.is_available() else "GPU"
    flag = f" --models {args.models}" if args.models != "mlp,gpt_tiny,hf_llama" else ""
    if any(args.steps[m] != STEPS[m] for m in models):  # the default needs no flag
        steps = {args.steps[m] for m in models}
        flag += f" --steps {steps.pop()}" if len(steps) == 1 else " --steps " + ",".join(
            f"{m}={args.steps[m]}" for m in models)
    head = (f"{machine_line()} ({bf16}); `python benchmarks/master_weights.py{flag} --lr {args.lr:g}`: "
            f"bf16 autocast, {steps_text(args.steps, models)} at peak lr {args.lr:g} (warmup, cosine decay), "
            f"torch {torch.__version__}")
    text = "\n".join([head, "", *table(rows)]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "master_weights.md").write_text(text)
    (args.out / "master_weights.json").write_text(json.dumps({"machine": machine_line(), "bf16": bf16,
                                                               "steps": {m: args.steps[m] for m in models},
                                                               "lr": args.lr, "runs": rows}, indent=1) + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
