#!/usr/bin/env python
"""The model call and loss as the recipe writes them against the peers' way, in one process on one model: is a gap
between whole runs in that code, or outside it?

    python benchmarks/step_code.py --config_name runs/hf_llama_small_8k/config --pairs 20 --output_dir DIR

One transformers model (from a config folder, seeded, fp32, sdpa attention, no KV cache), one fused AdamW (decay
on the weights of two or more dimensions, as all three runners), one set of token blocks (random tokens of the
model's vocabulary: the work does not depend on their values), and two ways to write the step, alternating step
by step (the first swapped each pair), each followed by the same clipping (torch's clip_grad_norm_, which
Accelerate calls), fused AdamW step and zero_grad(set_to_none=True):

- recipe: `model(input_ids=inputs.long(), use_cache=False).logits` and mixprec.evaluation.loss_fn on all
  --block_size targets outside the model (recipes/train.py with mixprec.models.hf.CausalLM);
- labels: `model(input_ids=..., labels=..., use_cache=False, num_items_in_batch=N).loss`, the loss inside the model
  on the block's last block_size - 1 targets (HF Trainer's step; the Accelerate loop's without num_items_in_batch).

Both steps train the same weights in turn, so they see the same process, allocator, threads and machine minute by
minute: what is left between them is the computation as each writes it (the model call and the loss), not the
loops around it (Accelerate's backward and clipping, the recipe's bookkeeping, the Trainer's callbacks and
collator), and not a difference in how each process's memory is laid out, which sharing one allocator hides. The
first --warmup pairs are not counted. Prints and writes step_code.json and step_code.md: each way's median and
mean step time and CPU time (user and system seconds of all threads, from getrusage), their ratio (labels over
recipe: above 1, the recipe's step is the cheaper), and pair by pair (the two steps of one turn) the median ratio
and how often the labels step was the slower. `--render DIR` writes DIR's report again from its step times.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the recipe and its peers, before torch loads

import torch  # noqa: E402

from mixprec.errors import UsageError, exit_on_usage_error  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.config_name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(args.seed + 1)
    blocks = [torch.randint(0, config.vocab_size, (args.batch_size, args.block_size + 1), generator=generator)
              for _ in range(8)]
    return model, optimizer, blocks


def steps(model, optimizer, blocks) -> dict:
    from mixprec.evaluation import loss_fn

    def finish(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def recipe(i: int) -> float:
        block = blocks[i % len(blocks)]
        logits = model(input_ids=block[:, :-1].long(), use_cache=False).logits
        return finish(loss_fn(logits, block[:, 1:]))

    def labels(i: int) -> float:
        ids = blocks[i % len(blocks)][:, :-1]
        n = torch.tensor(ids.numel() - ids.shape[0])
        return finish(model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=n).loss)

    return {"recipe": recipe, "labels": labels}


def report(setup: dict, times: dict, cpu: dict) -> dict:
    """The figures of a run from its step times alone (`setup`: what it ran; `--render` computes them again)."""
    ways = {k: {"median_s": statistics.median(v), "mean_s": statistics.mean(v),
                "cpu_median_s": statistics.median(cpu[k]), "steps": len(v)} for k, v in times.items()}
    pair = [b / a for a, b in zip(times["recipe"], times["labels"])]  # pair i: the two steps of one turn
    pair_cpu = [b / a for a, b in zip(cpu["recipe"], cpu["labels"])]
    return {**setup, "ways": ways, "step_times_s": times, "cpu_s": cpu,
            "labels_over_recipe": {"median": ways["labels"]["median_s"] / ways["recipe"]["median_s"],
                                   "mean": ways["labels"]["mean_s"] / ways["recipe"]["mean_s"],
                                   "cpu": ways["labels"]["cpu_median_s"] / ways["recipe"]["cpu_median_s"],
                                   "pair_median": statistics.median(pair),
                                   "pair_cpu_median": statistics.median(pair_cpu),
                                   "labels_slower_pairs": sum(r > 1 for r in pair), "pairs": len(pair)}}


def markdown(r: dict) -> str:
    rows = "\n".join(f"| {k} | {w['median_s'] * 1e3:,.1f} ms | {w['mean_s'] * 1e3:,.1f} ms | {w['cpu_median_s']:.3f} s "
                     f"| {w['steps']} |" for k, w in r["ways"].items())
    ratio = r["labels_over_recipe"]
    return (f"**The recipe's model call and loss and the peers' (loss inside the model), alternating in one process; "
            f"{r['machine']}, {r['threads']} threads**\n\n"
            f"`{r['config_name']}`, batch {r['batch_size']} x {r['block_size']} tokens, fp32, {r['pairs']} pairs "
            f"(the first {r['warmup']} not counted)\n\n"
            "| step | median | mean | CPU time (median) | steps |\n|---|---|---|---|---|\n" + rows + "\n\n"
            f"labels over recipe: **{ratio['median']:.3f}** by the medians, {ratio['mean']:.3f} by the means, "
            f"{ratio['cpu']:.3f} by CPU time (above 1: the recipe's step is the cheaper); pair by pair (the two "
            f"steps of one turn): the median ratio {ratio['pair_median']:.3f}, by CPU time "
            f"{ratio['pair_cpu_median']:.3f}, the labels step the slower in {ratio['labels_slower_pairs']} of "
            f"{ratio['pairs']} pairs\n")


def write(out: Path, r: dict) -> None:
    print(markdown(r))
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_code.json").write_text(json.dumps(r, indent=1))
    (out / "step_code.md").write_text(markdown(r))


def render(out: Path) -> None:
    """step_code.json and .md again from a finished folder's step times."""
    if not (out / "step_code.json").is_file():
        raise UsageError(f"--render {out}: no step_code.json there (a folder this script wrote)")
    old = json.loads((out / "step_code.json").read_text())
    setup = {k: old[k] for k in ("machine", "threads", "config_name", "batch_size", "block_size", "pairs", "warmup")}
    write(out, report(setup, old["step_times_s"], old["cpu_s"]))


def parse():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config_name", help="a transformers config folder (scripts/make_tiny_hf.py)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="pairs not counted (default: 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--render", metavar="DIR", help="write DIR's report again from its step times, run nothing")
    args = parser.parse_args()
    if args.render:
        return args
    for name in ("batch_size", "block_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)} must be at least 1")
    if args.warmup < 0 or args.pairs <= args.warmup:
        raise UsageError(f"--pairs {args.pairs} --warmup {args.warmup}: give a warm-up of 0 or more and more pairs "
                         "than it")
    if not args.config_name or not (Path(args.config_name) / "config.json").is_file():
        raise UsageError(f"--config_name {args.config_name}: give a folder with a transformers config.json "
                         f"(python scripts/make_tiny_hf.py DIR makes DIR/config)")
    if args.output_dir and (Path(args.output_dir) / "step_code.json").exists():
        raise UsageError(f"--output_dir {args.output_dir} already holds step_code.json: name a new folder")
    return args


@exit_on_usage_error
def main() -> None:
    args = parse()
    if args.render:
        return render(Path(args.render))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, optimizer, blocks = build(args)
    ways = steps(model, optimizer, blocks)
    times, cpu = {k: [] for k in ways}, {k: [] for k in ways}
    for i in range(args.pairs):
        for k in (("recipe", "labels") if i % 2 == 0 else ("labels", "recipe")):
            c0, t0 = cpu_seconds(), time.perf_counter()
            ways[k](i)
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(cpu_seconds() - c0)
    from mixprec.devices.hardware import machine_line

    setup = {"machine": machine_line(), "threads": torch.get_num_threads(), "config_name": args.config_name,
             "batch_size": args.batch_size, "block_size": args.block_size, "pairs": args.pairs, "warmup": args.warmup}
    r = report(setup, times, cpu)
    if args.output_dir:
        write(Path(args.output_dir), r)
    else:
        print(markdown(r))


if __name__ == "__main__":
    main()
