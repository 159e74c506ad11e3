#!/usr/bin/env python
r"""LoRA with peft and Accelerate on a 16-bit base: the frozen base in bf16, the adapters trained in fp32 under
bf16 autocast.

    accelerate launch recipes/standalone/lora.py --model_name_or_path runs/tiny_hf/model \
        --train_file notes.txt --lora_r 16
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/standalone/lora.py ...

The one idea: where each weight lives. The base model is frozen: no gradient, no optimizer state, no update,
so no small update can round away in it, and 16 bits hold it in half the memory of fp32 (a bf16 checkpoint
loses nothing at all). The adapters (two small matrices beside each adapted layer, A of r x in and B of out x r)
are the only weights that learn: they are fp32, with AdamW's states in fp32, so their small updates land.
Autocast runs the matmuls of both in bf16. Only the adapters are saved; peft loads them onto the base.

This is `recipes/train.py --model_name_or_path M --dataset text --train_file F --use_peft` without the package
around it: tests/test_standalone_hf.py shows the two loss curves are the same bit for bit. The data, its
order and the schedule are those of causal_lm.py (read that one first). It writes <output_dir>/metrics.jsonl
and <output_dir>/adapter. Imports: torch, accelerate, transformers, peft.
"""
import argparse
import itertools
import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="a folder saved with save_pretrained")
    p.add_argument("--train_file", required=True, help="a UTF-8 text file")
    p.add_argument("--output_dir", default="runs/standalone-lora")
    p.add_argument("--block_size", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--mixed_precision", default="bf16", choices=["bf16"], help="the base's dtype and autocast's")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch, per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lora_r", type=int, default=16, help="the adapters' rank")
    p.add_argument("--lora_alpha", type=float, default=32.0, help="the adapters' output is scaled by alpha / r")
    p.add_argument("--lora_dropout", type=float, default=0.05, help="dropout on the adapters' input")
    return p.parse_args(argv)


def text_blocks(path, tokenizer, block_size: int) -> torch.Tensor:
    """Rows of block_size + 1 token ids, overlapping by one, as causal_lm.py cuts them (the last 5% of the
    lines held out, 1,000 lines joined at a time)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    lines = lines[:len(lines) - max(1, round(len(lines) * 0.05))]
    blocks = []
    for start in range(0, len(lines), 1000):
        per_line = tokenizer(lines[start:start + 1000], add_special_tokens=False)["input_ids"]
        ids = list(itertools.chain.from_iterable(per_line))
        blocks += [ids[k * block_size:(k + 1) * block_size + 1] for k in range((len(ids) - 1) // block_size)]
    return torch.tensor(blocks, dtype=torch.long)


def micro_batches(blocks: torch.Tensor, batch_size: int, accumulation: int, rank: int, world_size: int, seed: int):
    """This process's micro-batches in recipes/train.py's order (causal_lm.py says why it is written out): a
    seeded permutation per epoch; process r takes the r-th batch_size rows of each global batch."""
    global_batch = batch_size * world_size
    per_epoch = len(blocks) // global_batch // accumulation * accumulation
    if per_epoch == 0:
        raise SystemExit(f"{len(blocks)} blocks: fewer than one optimizer step's worth; give more text")
    for epoch in itertools.count():
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for i in range(per_epoch):
            yield blocks[order[i * global_batch + rank * batch_size:][:batch_size]]


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def dtypes(params) -> str:
    by = {}
    for p in params:
        by[str(p.dtype).removeprefix("torch.")] = by.get(str(p.dtype).removeprefix("torch."), 0) + p.numel()
    return ", ".join(f"{n:,} {name}" for name, n in by.items())


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)  # the adapters' initial weights: the same on every process
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    blocks = text_blocks(args.train_file, tokenizer, args.block_size)
    # Loaded in fp32 so that the adapters are made and initialised in fp32 beside it: on a bf16 base peft casts
    # new adapters to bf16 and back to fp32, rounding their initial values. B starts at zero: at step 0 the
    # model is the base.
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        task_type="CAUSAL_LM")  # target_modules: peft's default per architecture (Llama: q, v)
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question; nothing to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, config)  # the base frozen (requires_grad False), the adapters trainable
    # Then the frozen base to bf16: exact for a bf16 checkpoint (bf16 -> fp32 -> bf16 changes no bit), a
    # rounding of each weight once for an fp32 one. Nothing updates it, so nothing is lost later.
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    accelerator.print(f"trainable {dtypes(trainable)}; frozen base "
                      f"{dtypes(p for p in model.parameters() if not p.requires_grad)}")
    # AdamW over the adapters alone: the base has no optimizer state at all. Weight decay on matrices only.
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,  # stepped by us, once per optimizer step
                                                  lambda s: lr_factor(s, args.warmup_steps, args.max_steps))
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP syncs the adapters' gradients only
    set_seed(args.seed + accelerator.process_index)  # each process its own dropout masks (lora_dropout)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "metrics.jsonl").open("w") if accelerator.is_main_process else None
    model.train()
    step, step_loss = 0, 0.0
    for batch in micro_batches(blocks, args.batch_size, args.gradient_accumulation_steps,
                               accelerator.process_index, accelerator.num_processes, args.seed):
        batch = batch.to(accelerator.device)
        with accelerator.accumulate(model):
            with accelerator.autocast():  # bf16 base weights and fp32 adapters both run their matmuls in bf16
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())  # in fp32
            accelerator.backward(loss)  # gradients reach the adapters only, in fp32 (autocast casts them back)
            step_loss += loss.detach().double()
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
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
        # peft's save_pretrained writes the adapters alone (fp32) and adapter_config.json: load them with
        # PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_folder)
        model = accelerator.unwrap_model(model)
        model.save_pretrained(out / "adapter")
        tokenizer.save_pretrained(out / "adapter")
        frozen = dtypes(p for p in model.parameters() if not p.requires_grad)
        print(f"saved the adapter to {out / 'adapter'}; the frozen base is still {frozen}")
    # Free the DDP wrapper before its process group: freed after it (when main returns), its Reducer ends gloo's
    # group holding the GIL and the process can hang at exit (torch 2.13; mixprec/compat/teardown.py says why)
    model = None
    accelerator.free_memory()  # drops Accelerate's references to the prepared objects
    accelerator.end_training()


if __name__ == "__main__":
    main()
