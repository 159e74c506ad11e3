#!/usr/bin/env python
"""Where transformers' GPT-2 (as the Trainer runs it) and mixprec's GPT differ in speed, part by part.

    python benchmarks/peers/components.py                       # all parts, fp32 and bf16
    python benchmarks/peers/components.py --parts optimizer,gelu --precisions no --repeats 20

Same size on both sides (the gpt_small preset: 6 layers, d=384, 6 heads, context 256, 256 byte tokens).
Each part is timed forward + backward (the optimizer: one step) on random data, best and median of
--repeats calls after one warm-up call, the sides interleaved (A B A B ...); bf16 means autocast bf16 as in
training (weights stay fp32):
- optimizer: AdamW over the model's parameters (fp32 in both precisions): the recipe on a CPU (torch's default
  there: the for-loop implementation), foreach, and fused (the Trainer's default, adamw_torch_fused);
- gelu: mixprec's F.gelu(approximate="tanh") (one kernel) against transformers' gelu_new
  (NewGELUActivation, eight elementwise ops in Python) on the MLP's activations (B, T, 4d);
- linear: nn.Linear (mixprec) against transformers' Conv1D (addmm with the weight stored [in, out]), c_fc's size;
- loss: mixprec.evaluation.loss_fn against the Trainer's ForCausalLMLoss (both upcast the logits to fp32);
- attention: the kwargs each model passes to scaled_dot_product_attention (is_causal, mask), one forward;
- block: one transformer block (mixprec Block against GPT2Block);
- model: the whole model with its loss (dropout 0, as the benchmark's peer; and GPT-2's default 0.1);
- step: a whole training step (forward, loss, backward, clip, AdamW, zero_grad): mixprec's GPT with the
  recipe's AdamW (for-loop on a CPU) and with fused AdamW, against GPT2LMHeadModel with fused AdamW;
- data: one batch by index into tensors (the recipe) against the Trainer's DataLoader with its collator.
bf16 on a CPU without AVX512-BF16/AMX is emulated (about 1 GFLOP/s for matmuls here): the matmul-heavy parts
(linear, block, model, step) use --small_batch rows in bf16, and their bf16 times say nothing about a native CPU.

Prints one line per measurement and writes --output (JSON) with the hardware line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from mixprec.errors import UsageError, exit_on_usage_error
from mixprec.devices.hardware import machine_line, set_cpu_threads

PARTS = ("optimizer", "gelu", "linear", "loss", "attention", "block", "model", "step", "data")
DTYPES = {"no": None, "bf16": torch.bfloat16}
LAYERS, D, HEADS, T, VOCAB = 6, 384, 6, 256, 256


def timed(fn):
    """Mark a callable for `measure` (every part returns {name: timed(callable) or facts})."""
    fn.timed = True
    return fn


def measure(found: dict, repeats: int) -> dict:
    """Each timed callable once to warm up, then all of them in turn, --repeats times (interleaved, so that a
    slow spell of a shared machine hits all of them): best and median per callable."""
    calls = {k: f for k, f in found.items() if getattr(f, "timed", False)}
    for fn in calls.values():
        fn()
    times = {k: [] for k in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    stats = {k: {"best_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3, "repeats": repeats}
             for k, t in times.items()}
    return {k: stats.get(k, v) for k, v in found.items()}


def fwd_bwd(module, make_input, dtype):
    def step():
        x = make_input()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            y = module(x)
        y.float().sum().backward()
    return step


def gpt2(dropout: float = 0.0):
    from transformers import AutoModelForCausalLM, GPT2Config
    config = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=D, n_layer=LAYERS, n_head=HEADS, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None, eos_token_id=None)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def ours():
    from mixprec.models.gpt import GPT
    return GPT(VOCAB, T, LAYERS, HEADS, D)


def part_optimizer(batch, dtype):
    model = ours()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, kw in (("for-loop (recipe on CPU)", {"foreach": False}), ("foreach", {"foreach": True}),
                     ("fused (Trainer default)", {"fused": True})):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **kw)
        out[name] = timed(lambda o=opt: o.step())
    return out


def part_gelu(batch, dtype):
    from transformers.activations import NewGELUActivation
    x = torch.randn(batch, T, 4 * D, dtype=dtype or torch.float32, requires_grad=True)
    mix = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    return {"F.gelu tanh (mixprec)": timed(lambda: mix(x).sum().backward()),
            "gelu_new (transformers)": timed(lambda: NewGELUActivation()(x).sum().backward())}


def part_linear(batch, dtype):
    from transformers.pytorch_utils import Conv1D
    rows = batch * T
    linear, conv = torch.nn.Linear(D, 4 * D), Conv1D(4 * D, D)
    make = lambda: torch.randn(rows, D, requires_grad=True)  # noqa: E731
    return {"nn.Linear (mixprec)": timed(fwd_bwd(linear, make, dtype)),
            "Conv1D addmm (transformers)": timed(fwd_bwd(conv, make, dtype))}


def part_loss(batch, dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from mixprec.evaluation import loss_fn
    logits = torch.randn(batch, T, VOCAB, dtype=dtype or torch.float32, requires_grad=True)
    ids = torch.randint(VOCAB, (batch, T))
    return {"loss_fn (mixprec)": timed(lambda: loss_fn(logits, ids).backward()),
            "ForCausalLMLoss (Trainer)": timed(lambda: ForCausalLMLoss(logits, ids, VOCAB).backward())}


def part_attention(batch, dtype):
    """Not a timing: what each model asks of scaled_dot_product_attention."""
    seen, original = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append({"is_causal": bool(is_causal), "mask": None if attn_mask is None else list(attn_mask.shape),
                     "q_dtype": str(q.dtype), **{k: str(v) for k, v in kw.items()}})
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    ids = torch.randint(VOCAB, (1, T))
    out = {}
    for name, model in (("mixprec GPT", ours()), ("transformers GPT2", gpt2())):
        seen.clear()
        F.scaled_dot_product_attention = spy
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                model(ids)
        finally:
            F.scaled_dot_product_attention = original
        out[name] = {"calls": len(seen), "first": seen[0] if seen else None}
    return out


def part_block(batch, dtype):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from mixprec.models.gpt import Block
    hf = gpt2().transformer.h[0]
    assert isinstance(hf, GPT2Block)

    def hf_block(x):
        y = hf(x)
        return y[0] if isinstance(y, tuple) else y
    make = lambda: torch.randn(batch, T, D, requires_grad=True)  # noqa: E731
    return {"Block (mixprec)": timed(fwd_bwd(Block(D, HEADS, 0.0, True), make, dtype)),
            "GPT2Block (transformers)": timed(fwd_bwd(hf_block, make, dtype))}


def part_model(batch, dtype):
    from mixprec.evaluation import loss_fn
    ids = torch.randint(VOCAB, (batch, T + 1))
    mix, hf, hf_drop = ours(), gpt2(0.0), gpt2(0.1)

    def step(model, hf_style):
        def run():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = (model(ids[:, :-1], labels=ids[:, :-1]).loss if hf_style
                        else loss_fn(model(ids[:, :-1]), ids[:, 1:]))
            loss.backward()
        return run
    return {"GPT + loss_fn (mixprec)": timed(step(mix, False)),
            "GPT2LMHeadModel, dropout 0": timed(step(hf, True)),
            "GPT2LMHeadModel, dropout 0.1 (GPT-2's default)": timed(step(hf_drop, True))}


def part_step(batch, dtype):
    from mixprec import optim
    from mixprec.evaluation import loss_fn
    ids = torch.randint(VOCAB, (batch, T + 1))

    def step(model, fused, hf_style):
        opt = optim.adamw(model, 1e-4, 0.1, fused=fused)

        def run():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = (model(ids[:, :-1], labels=ids[:, :-1]).loss if hf_style
                        else loss_fn(model(ids[:, :-1]), ids[:, 1:]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run
    return {"GPT, AdamW for-loop (recipe on CPU)": timed(step(ours(), None, False)),
            "GPT, AdamW fused": timed(step(ours(), True, False)),
            "GPT2LMHeadModel, AdamW fused (Trainer)": timed(step(gpt2(), True, True))}


def part_data(batch, dtype):
    from transformers.data.data_collator import default_data_collator
    rows = torch.randint(VOCAB, (20000, T), dtype=torch.int64)
    dataset = [{"input_ids": rows[i], "labels": rows[i]} for i in range(len(rows))]
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=default_data_collator)
    it = iter(loader)
    return {"index into tensors (recipe, floor)": timed(lambda: rows[torch.randint(len(rows), (batch,))]),
            "DataLoader + default_data_collator (Trainer)": timed(lambda: next(it))}


@exit_on_usage_error
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no (fp32), bf16")
    parser.add_argument("--batch_size", type=int, default=16, help="rows of 256 tokens (default: 16, gpt_small's)")
    parser.add_argument("--small_batch", type=int, default=1,
                        help="rows for linear/block/model/step in bf16 (default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up (default: 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--output", default=None, help="write the measurements here as JSON")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message} (see --help)"))
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            raise UsageError(f"--parts: {p!r} is not one of {', '.join(PARTS)}")
    for p in precisions:
        if p not in DTYPES:
            raise UsageError(f"--precisions: {p!r} is not one of no, bf16")
    if min(args.batch_size, args.small_batch, args.repeats) < 1:
        raise UsageError("--batch_size, --small_batch and --repeats must be positive")
    threads, _ = set_cpu_threads(args.threads)
    torch.manual_seed(0)
    report = {"hardware": machine_line(), "threads": threads, "batch_size": args.batch_size,
              "small_batch": args.small_batch, "results": []}
    print(f"# {report['hardware']}, {threads} threads", flush=True)
    for precision in precisions:
        for part in parts:
            heavy = part in ("linear", "block", "model", "step") and precision == "bf16"
            batch = args.small_batch if heavy else args.batch_size
            found = measure(globals()[f"part_{part}"](batch, DTYPES[precision]), args.repeats)
            for name, value in found.items():
                report["results"].append({"part": part, "precision": precision, "batch": batch, "what": name, **value})
                shown = (f"best {value['best_ms']:.2f} ms, median {value['median_ms']:.2f} ms" if "best_ms" in value
                         else json.dumps(value))
                label = {"no": "fp32"}.get(precision, precision)
                print(f"{part:9s} {label:4s} batch {batch:2d}  {name:45s} {shown}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
