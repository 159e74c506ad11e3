#!/usr/bin/env python
r"""Fine-tune a transformers causal language model in bf16 with Accelerate: fp32 master weights under bf16
autocast, and an export in the checkpoint's own dtype.

    accelerate launch recipes/standalone/causal_lm.py --model_name_or_path runs/tiny_hf/model \
        --train_file notes.txt
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/standalone/causal_lm.py ...
    python scripts/make_tiny_hf.py runs/tiny_hf --dtype bfloat16     # a tiny bf16 Llama to try it on

The one idea: a checkpoint stored in bf16 is *trained* in fp32. bf16 keeps 8 significant bits: an update
under half the spacing of bf16 values at a weight (about 2^-9 of it) rounds away, and AdamW moves each weight by
about the learning rate, at fine-tuning rates often less than that (1e-5 on a weight of 0.02 is 2^-11 of it).
So the weights are loaded in fp32 (the master copy the optimizer updates) and autocast runs the matmuls in
bf16, where the speed is. At the end the model is saved in the dtype it came in.

This is `recipes/train.py --model_name_or_path M --dataset text --train_file F` without the package around it
(checks, evaluation, checkpoints, resume): tests/test_standalone_hf.py shows the two loss curves are the same
bit for bit. It writes <output_dir>/metrics.jsonl (a line per optimizer step) and <output_dir>/hf_model.
"""
import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="a folder saved with save_pretrained")
    p.add_argument("--train_file", required=True, help="a UTF-8 text file")
    p.add_argument("--output_dir", default="runs/standalone-causal_lm")
    p.add_argument("--block_size", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--mixed_precision", default="bf16", choices=["bf16", "no"])
    p.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch, per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def text_blocks(path, tokenizer, block_size: int) -> torch.Tensor:
    """The training text as rows of block_size + 1 token ids, cut as recipes/train.py --dataset text cuts it.
    The file's lines (line ends kept) are tokenized one by one; the last 5% of them are held out for validation
    (not used here). 1,000 lines at a time are joined and cut into blocks that overlap by one token: a block's
    first block_size tokens are the inputs, the same shifted by one the labels, so every token is predicted
    once. What does not fill a block at the end of the 1,000 lines is dropped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    lines = lines[:len(lines) - max(1, round(len(lines) * 0.05))]
    blocks = []
    for start in range(0, len(lines), 1000):
        per_line = tokenizer(lines[start:start + 1000], add_special_tokens=False)["input_ids"]
        ids = list(itertools.chain.from_iterable(per_line))
        blocks += [ids[k * block_size:(k + 1) * block_size + 1] for k in range((len(ids) - 1) // block_size)]
    return torch.tensor(blocks, dtype=torch.long)


def micro_batches(blocks: torch.Tensor, batch_size: int, accumulation: int, rank: int, world_size: int, seed: int):
    """This process's micro-batches, epoch after epoch, in recipes/train.py's order (mixprec/data/batches.py),
    written out so that the two runs see the same rows in the same order. Each epoch is a permutation seeded by
    (seed, epoch), the same on every process, cut into global batches of batch_size x world_size rows; process r
    takes the r-th batch_size rows of each (the split a DataLoader prepared by Accelerate makes too). The rows
    that do not fill a whole accumulation window at the end of an epoch are left out (drop_last), so every
    optimizer step sees as many samples."""
    global_batch = batch_size * world_size
    per_epoch = len(blocks) // global_batch // accumulation * accumulation
    if per_epoch == 0:
        raise SystemExit(f"{len(blocks)} blocks: fewer than one optimizer step's worth; give more text")
    for epoch in itertools.count():
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for i in range(per_epoch):
            yield blocks[order[i * global_batch + rank * batch_size:][:batch_size]]


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to the peak, then cosine decay to 10% of it at the last step (recipes/train.py's default)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def main(argv=None):
    args = parse_args(argv)
    # The precision is this one argument: under "bf16" the prepared model's forward (and accelerator.autocast())
    # runs in torch.autocast(dtype=torch.bfloat16); the weights stay in the dtype we load them in. cpu=: on CPUs,
    # several launched processes form one (gloo) process group only when Accelerate is told to use the CPU.
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    blocks = text_blocks(args.train_file, tokenizer, args.block_size)
    # The dtype the checkpoint is stored in: config.json's "dtype" ("torch_dtype" before transformers 5, which
    # AutoConfig reads as dtype too); a config that says none was saved in fp32.
    stored_dtype = AutoConfig.from_pretrained(args.model_name_or_path).dtype or torch.float32
    stored_dtype = getattr(torch, str(stored_dtype).removeprefix("torch."))
    # fp32 master weights: transformers 5 loads a checkpoint in its stored dtype, and AdamW would then add its
    # small updates to bf16 weights, where they round away. In fp32 they land; autocast still computes in bf16.
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    # AdamW with its states in fp32 too; weight decay on matrices only (not biases or norm gains); fused: one
    # kernel for the whole update (CPUs and CUDA).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, fused=True)
    # Stepped by us once per optimizer step: given to prepare(), Accelerate would step it once per process.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: lr_factor(s, args.warmup_steps, args.max_steps))
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP over several processes; autocast on forward
    set_seed(args.seed + accelerator.process_index)  # from here on, each process draws its own dropout masks

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "metrics.jsonl").open("w") if accelerator.is_main_process else None
    model.train()
    step, step_loss = 0, 0.0
    for batch in micro_batches(blocks, args.batch_size, args.gradient_accumulation_steps,
                               accelerator.process_index, accelerator.num_processes, args.seed):
        batch = batch.to(accelerator.device)
        with accelerator.accumulate(model):  # DDP syncs gradients on the last micro-batch of a window only
            with accelerator.autocast():
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # bf16 matmuls
                # the labels are the block's next tokens (already shifted). The loss in fp32, said explicitly:
                # its log-sum-exp over the vocabulary is a long sum, which bf16's 8 bits would round at every term
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            accelerator.backward(loss)  # the loss divided by gradient_accumulation_steps, then backward
            step_loss += loss.detach().double()
            if accelerator.sync_gradients:  # the window's last micro-batch: clip, step, schedule
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()  # the fp32 masters move by lr x Adam's update, however small
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # the step's loss: the micro-batches' mean, averaged over the processes
                mean = accelerator.reduce(step_loss, "mean").item() / args.gradient_accumulation_steps
                step_loss = 0.0
                if log:
                    record = {"step": step, "loss": mean, "grad_norm": grad_norm.item(), "lr": lr}
                    log.write(json.dumps(record) + "\n")
                if step % 10 == 0 or step == args.max_steps:
                    accelerator.print(f"step {step}: loss {mean:.4f}, lr {lr:.2e}")
                if step == args.max_steps:
                    break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        log.close()
        # The export in the checkpoint's dtype: the fp32 masters rounded once, to what a bf16 checkpoint holds
        # (save_pretrained writes the dtype into config.json). The tokenizer goes with it.
        hf_model = accelerator.unwrap_model(model).to(stored_dtype)
        hf_model.save_pretrained(out / "hf_model")
        tokenizer.save_pretrained(out / "hf_model")
        print(f"saved {out / 'hf_model'} in {str(stored_dtype).removeprefix('torch.')}")
    # Free the DDP wrapper before its process group: freed after it (when main returns), its Reducer ends gloo's
    # group holding the GIL and the process can hang at exit (torch 2.13; mixprec/compat/teardown.py says why)
    model = None
    accelerator.free_memory()  # drops Accelerate's references to the prepared objects
    accelerator.end_training()


if __name__ == "__main__":
    main()
