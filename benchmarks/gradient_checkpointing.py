#!/usr/bin/env python
"""--gradient_checkpointing measured: the same transformers Llama (from a config, fresh weights) trained with
and without `activation_checkpointing_enable` (use_reentrant=False), as the recipe switches it on, under bf16
autocast with fp32 weights and AdamW, each in its own process.

    python benchmarks/gradient_checkpointing.py                     # hidden 256, 8 layers, 512 tokens x 8 rows
    python benchmarks/gradient_checkpointing.py --layers 4 --steps 3 --out /tmp/gc

For each: the bytes the autograd graph keeps for the backward pass (every tensor saved for backward, counted by
a saved-tensors hook at the outermost level: with checkpointing, each layer keeps only its input), the
process's peak resident memory (ru_maxrss: weights, AdamW state, activations and the libraries), and the median
step time (forward, backward, AdamW) after one warm-up step; the first step's loss (the same forward, equal
with and without) and the last step's, after updates from recomputed gradients: equal on the Intel Xeon (AMX)
here, 1.7e-6 apart (relative) on one CI machine, whose bf16 kernels rounded the recomputed activations apart.
Writes gradient_checkpointing.md and .json into --out.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         max_position_embeddings=args.tokens)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    if args.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 512, (args.rows, args.tokens), generator=torch.Generator().manual_seed(1))
    saved, times, losses = [0], [], []

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    for step in range(args.steps + 1):
        start, saved[0] = time.perf_counter(), 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    return {"saved_for_backward_mb": saved[0] / 2**20, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_s": statistics.median(times), "first_loss": losses[0], "loss": losses[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-gradient-checkpointing-amd-avx512bf16")
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    from mixprec.devices.hardware import machine_line

    shape = ["--hidden", args.hidden, "--layers", args.layers, "--tokens", args.tokens, "--rows", args.rows,
             "--steps", args.steps]
    results = {}
    for name, flag in (("without", []), ("with", ["--checkpointing"])):
        out = subprocess.run([sys.executable, __file__, "--child", *map(str, shape), *flag], capture_output=True,
                             text=True, check=True, timeout=1800).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    w, c = results["without"], results["with"]
    lines = [f"{machine_line()}; `python benchmarks/gradient_checkpointing.py {' '.join(map(str, shape))}`: a Llama "
             f"(hidden {args.hidden}, {args.layers} layers) from a config, {args.rows} rows x {args.tokens} tokens, "
             f"bf16 autocast, fp32 weights, fused AdamW", "",
             "| gradient checkpointing | saved for backward (MB) | peak RSS (MB) | step (s) | first loss | last loss |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['saved_for_backward_mb']:.1f} | {r['peak_rss_mb']:.0f} | {r['step_s']:.3f} | "
                     f"{r['first_loss']:.6f} | {r['loss']:.6f} |")
    lines += ["", f"with / without: saved for backward {c['saved_for_backward_mb'] / w['saved_for_backward_mb']:.2f}x, "
              f"peak RSS {c['peak_rss_mb'] / w['peak_rss_mb']:.2f}x, step time {c['step_s'] / w['step_s']:.2f}x"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gradient_checkpointing.md").write_text("\n".join(lines) + "\n")
    (args.out / "gradient_checkpointing.json").write_text(json.dumps({"machine": machine_line(), "shape": shape,
                                                                      **results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
