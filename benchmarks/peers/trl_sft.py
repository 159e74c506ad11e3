#!/usr/bin/env python
"""TRL's SFTTrainer as a peer of the recipe on chat data: run by benchmarks/trl_peer.py in TRL's own Python
environment (this file imports neither mixprec nor anything of this repository: TRL is not a dependency).

    /tmp/trl-venv/bin/python benchmarks/peers/trl_sft.py --model M --train_file ORDERED.jsonl --out DIR \\
        --precision fp32 --steps 40 --batch_size 8

The model folder is loaded in fp32 (bf16: autocast on fp32 weights, `bf16=True`, as the recipe's
--mixed_precision bf16). The conversations ('messages') are read in the file's order: trl_peer.py writes them in
the recipe's batch order, and the Trainer's own `train_sampling_strategy="sequential"` keeps it (no shuffle;
SFTConfig's shuffle_dataset is off by default). SFTConfig: assistant_only_loss=True, packing=False,
max_length=--max_length, the optimizer and schedule given (the Trainer's default optimizer, adamw_torch_fused with
betas (0.9, 0.999) and eps 1e-8 as torch's AdamW; weight decay off biases and norms; cosine_with_min_lr),
logging every step, no evaluation, no saving, no trackers, no progress bar. SFTConfig's own defaults that differ
from the Trainer's are set as the recipe runs: activation (gradient) checkpointing off unless
--activation_checkpointing (SFTConfig: on), bf16 only with --precision bf16 (SFTConfig: on).

Writes to --out:
- metrics.jsonl, one line per optimizer step: step, loss (the Trainer's logged value as it is), grad_norm,
  learning_rate, step_time_s (perf_counter from the previous step's on_step_end to this one's: the data, the
  forward and backward, clipping, the optimizer and the previous step's logging, as the recipe's step_time_s),
  compute_s (on_step_begin to on_step_end: without loading and collating the step's micro-batches);
- tokens.jsonl: the prepared training rows (input_ids, labels), in order, for the mask check;
- summary.json: versions, threads, optimizer, scheduler, attention, wall time.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ATTENTION = "sdpa"  # transformers' default for Llama, which the recipe loads with


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a causal LM folder with its tokenizer (chat template)")
    p.add_argument("--train_file", required=True, help="JSON lines of {'messages': [...]}, read in order")
    p.add_argument("--out", required=True)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute each layer in the backward (SFTConfig's default; off here, as the recipe's)")
    return p.parse_args(argv)


def timing_callback(out: Path):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Per step: the time since the previous step ended, the time from on_step_begin, the logged values."""

        def __init__(self):
            self.times: dict[int, tuple[float, float]] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.times[state.global_step] = (now - self.last, now - self.began)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" not in (logs or {}):
                return
            step_time, compute = self.times.get(state.global_step, (None, None))
            record = {"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm"),
                      "learning_rate": logs.get("learning_rate"), "step_time_s": step_time, "compute_s": compute}
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    return StepTimes()


def main(argv=None) -> None:
    args = parse(argv)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    rows = [json.loads(line) for line in Path(args.train_file).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"messages": row["messages"]} for row in rows])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=ATTENTION)
    config = SFTConfig(
        output_dir=str(out / "trainer"), assistant_only_loss=True, packing=False, max_length=args.max_length,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        max_grad_norm=args.max_grad_norm, seed=args.seed, bf16=args.precision == "bf16", use_cpu=True,
        train_sampling_strategy="sequential", logging_strategy="steps", logging_steps=1, eval_strategy="no",
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_drop_last=True,
        activation_checkpointing=args.activation_checkpointing)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                         callbacks=[timing_callback(out)])
    with open(out / "tokens.jsonl", "w") as f:
        for row in trainer.train_dataset.select_columns(["input_ids", "labels"]):
            f.write(json.dumps({"input_ids": row["input_ids"], "labels": row["labels"]}) + "\n")
    optim = getattr(config.optim, "value", config.optim)
    print(f"trl peer: SFTTrainer (TRL {trl.__version__}, transformers {transformers.__version__}), "
          f"{model.config.model_type} {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{ATTENTION} attention, precision {args.precision}, optimizer {optim}, "
          f"{config.train_sampling_strategy} sampling, {torch.get_num_threads()} threads, {args.steps} steps", flush=True)
    started = time.perf_counter()
    trainer.train()
    summary = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "optimizer": optim,
               "sampling": config.train_sampling_strategy,
               "scheduler": getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type),
               "attention": ATTENTION, "precision": args.precision,
               "activation_checkpointing": config.activation_checkpointing,
               "rows": len(trainer.train_dataset), "wall_time_s": time.perf_counter() - started}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
