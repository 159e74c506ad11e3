#!/usr/bin/env python
"""A peer for recipes/benchmark.py: Hugging Face's Trainer with a GPT2LMHeadModel of the recipe's GPT size, or
with the recipe's own transformers model (--config_name / --model_name_or_path, e.g.
recipes/configs/hf_gpt2_small.yaml): then the very model the recipe builds (the same config, seed and
initial weights, tokenizer and token blocks: mixprec.models.hf_flags, mixprec.data).

For a built-in GPT config, the model is transformers' GPT-2 with the size of the mixprec GPT that the config builds (n_layer, n_head,
n_embd, context, vocabulary: 256 byte tokens for --dataset stdlib), dropout as in --model_args (mixprec's
default 0.0, not GPT-2's 0.1). The data are the same token blocks (mixprec.data.build); the Trainer gets
labels = inputs and shifts them itself, so each block predicts its last 255 of 256 targets (the recipe:
256). Batch, peak lr, weight decay, warmup, clipping, seed and precision come from the same --config and flags
as recipes/train.py; the schedule is the Trainer's closest (cosine_with_min_lr with min_lr_rate
--min_lr_ratio, linear, constant_with_warmup). No evaluation, saving, trackers or progress bar.
The Trainer's defaults are kept where the recipe has no equivalent: its optimizer (transformers 5.24 with
torch >= 2.8: adamw_torch_fused, also on a CPU; no decay on biases and norms, as the recipe), its DataLoader and
collator, sdpa attention. What the recipe's process does besides is done here too, so that only the loops
differ: OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE unless set), the CPU threads are chosen by the
recipe's rule from the model's work (mixprec.devices.threads), and the model builds no KV cache in training
(`use_cache=False`, as the recipe's forward; transformers' default builds one that nothing reads). Peer-only
flags for the investigation: --hf_optim NAME (e.g. adamw_torch), --hf_attn sdpa|eager.

    python benchmarks/peers/hf_trainer.py --config recipes/configs/gpt_small.yaml --mixed_precision bf16 \\
        --max_steps 40 --log_every 10 --output_dir runs/hf_trainer

Writes metrics.jsonl (per window of --log_every steps: step, loss, step_time_s, samples_per_s, tokens_per_s)
and summary.json, as benchmarks/baselines/handwritten_loop.py does, so the benchmark reads it the same way.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mixprec.devices import threads

threads.quiet_waiting()  # as the recipe: before torch loads, idle OpenMP threads sleep instead of spinning

import torch  # noqa: E402

from mixprec import config, data, metrics, models, precision
from mixprec.devices import hardware
from mixprec.data.batches import columns_of
from mixprec.errors import UsageError, exit_on_usage_error

SCHEDULES = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}


class Blocks(torch.utils.data.Dataset):
    def __init__(self, inputs: torch.Tensor):
        self.inputs = inputs.long()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.inputs[i], "labels": self.inputs[i]}


def peer_args(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hf_optim", default=None)
    parser.add_argument("--hf_attn", default="sdpa", choices=("sdpa", "eager"))
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))
    return parser.parse_known_args(argv)


def hf_model(cfg, attn: str):
    """(token blocks, the transformers model, its training cost) for `cfg`: the recipe's own transformers model
    when the config names one (config.parse_config resolved it: mixprec.models.hf_flags), else GPT-2 at the size of
    its GPT."""
    bundle = data.build(cfg)
    if cfg.model == "hf_causal_lm":
        ours = models.build(cfg.model, bundle.info, cfg.model_args)
        ours.hf.set_attn_implementation(attn)
        model, cost = ours.hf, metrics.training_cost(ours, bundle.train[0]["inputs"], bundle.info)
    else:
        model, cost = gpt2_like(cfg, bundle, attn)
    model.config.use_cache = False  # as the recipe's forward: no KV cache while training
    return bundle, model, cost


def gpt2_like(cfg, bundle, attn: str):
    """GPT2LMHeadModel with the size of the mixprec GPT of `cfg`, and that model's training cost."""
    from transformers import AutoModelForCausalLM, GPT2Config

    if not cfg.model.startswith("gpt"):
        raise UsageError(f"the hf_trainer peer trains a causal LM: give a gpt model or --config_name / "
                         f"--model_name_or_path with a text dataset, not --model {cfg.model}")
    ours = models.build(cfg.model, bundle.info, cfg.model_args)
    dropout = float(cfg.model_args.get("dropout", 0.0))
    gpt2 = GPT2Config(vocab_size=ours.wte.num_embeddings, n_positions=ours.block_size, n_embd=ours.n_embd,
                      n_layer=ours.n_layer, n_head=ours.n_head, resid_pdrop=dropout, embd_pdrop=dropout,
                      attn_pdrop=dropout, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(gpt2, attn_implementation=attn)
    return model, metrics.training_cost(ours, bundle.train[0]["inputs"], bundle.info)


def timing_callback(cfg, out: Path, cost: dict, records: list):
    from transformers import TrainerCallback

    class Windows(TrainerCallback):
        """Step time of every window of --log_every steps, and the Trainer's mean loss over it."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.pending = time.perf_counter(), None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % cfg.log_every == 0 or state.global_step == state.max_steps:
                now = time.perf_counter()
                steps = (state.global_step - 1) % cfg.log_every + 1
                self.pending, self.start = (state.global_step, (now - self.start) / steps), now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is None or "loss" not in (logs or {}):
                return
            step, step_time = self.pending
            record = {"step": step, "loss": logs["loss"], "step_time_s": step_time,
                      "samples_per_s": cfg.batch_size * cfg.gradient_accumulation_steps / step_time}
            if cost["tokens_per_sample"] > 1:
                record["tokens_per_s"] = record["samples_per_s"] * cost["tokens_per_sample"]
            records.append(record)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step}, Loss: {logs['loss']:.4f}, {step_time * 1e3:.1f} ms/step", flush=True)
            self.pending = None

    return Windows()


def training_args(cfg, out: Path, mp: str, optim_name: str | None):
    from transformers import TrainingArguments

    extra = {"optim": optim_name} if optim_name else {}
    if cfg.lr_schedule == "cosine":
        extra["lr_scheduler_kwargs"] = {"min_lr_rate": cfg.min_lr_ratio}
    return TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_steps=cfg.max_steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps, lr_scheduler_type=SCHEDULES[cfg.lr_schedule],
        max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, bf16=mp == "bf16", fp16=mp == "fp16",
        use_cpu=hardware.device_type() == "cpu", torch_compile=cfg.compile, eval_strategy="no", save_strategy="no",
        logging_strategy="steps", logging_steps=cfg.log_every, report_to="none", disable_tqdm=True,
        dataloader_num_workers=cfg.num_workers, **extra)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    import sys

    peer, rest = peer_args(sys.argv[1:] if argv is None else argv)
    cfg = config.parse_config(rest, description=__doc__)
    if not cfg.max_steps:
        raise UsageError("the hf_trainer peer needs --max_steps")
    device = torch.device(hardware.device_type())
    mp, why = precision.resolve(cfg.mixed_precision, device.type)
    if mp not in ("no", "bf16", "fp16"):
        raise UsageError(f"--mixed_precision {mp}: the hf_trainer peer does fp32, bf16 or fp16 only")
    out = Path(cfg.output_dir or "runs/hf_trainer")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    torch.manual_seed(cfg.seed)
    bundle, model, cost = hf_model(cfg, peer.hf_attn)
    if device.type == "cpu":  # the recipe's choice of threads (mixprec.devices.threads)
        hardware.set_cpu_threads(cfg.cpu_threads, cost["flops_per_sample"] * cfg.batch_size / 1e9)
    from transformers import Trainer

    args = training_args(cfg, out, mp, peer.hf_optim)
    records: list[dict] = []
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(columns_of(bundle.train)["inputs"]),
                      callbacks=[timing_callback(cfg, out, cost, records)])
    optim_name = getattr(args.optim, "value", args.optim)
    print(f"hf_trainer peer: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{peer.hf_attn} attention) on {cfg.dataset}, {device} ({hardware.device_name(device)}), precision {mp} "
          f"({why}), optimizer {optim_name}, {cfg.max_steps} steps", flush=True)
    started = time.perf_counter()
    trainer.train()
    summary = {"steps": cfg.max_steps, "train_loss": records[-1]["loss"] if records else None,
               "effective_precision": mp, "samples_per_step": cfg.batch_size * cfg.gradient_accumulation_steps,
               "optimizer": optim_name, "attention": peer.hf_attn, "wall_time_s": time.perf_counter() - started,
               "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
               **cost, **metrics.peak_memory(device)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
