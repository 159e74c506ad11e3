"""One optimizer step of gpt_tiny (fp32, no dropout) on token rows whose targets vary (a masked prompt of random
length, then padding: label -100), through the recipe's own pieces and loop lines: mixprec.data.batches'
TrainBatches (the seeded order, this process's share, the window's target count summed over processes),
`accelerator.accumulate`, mixprec.evaluation.loss_fn and `accelerator.backward`. Saves the step's gradient (after
DDP's mean over processes) to --out on the main process. Run by tests/test_token_weighting.py with python (one
process) or accelerate launch (two).

    python tests/weighting_probe.py --batch_size 8 --accumulation 4 --out g.pt [--per_micro_batch_mean]
"""
import argparse

import torch
from accelerate import Accelerator

from mixprec import models
from mixprec.data.batches import Layout, TrainBatches
from mixprec.evaluation import loss_fn

ROWS, BLOCK, VOCAB = 32, 32, 64


def table():
    """32 rows of 32 tokens: row i has a random length and a random masked prefix (at least one target each)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (ROWS, BLOCK + 1), generator=g)
    length = torch.randint(2, BLOCK + 1, (ROWS,), generator=g)
    prompt = (length.float() * torch.rand(ROWS, generator=g) * 0.9).long()
    position = torch.arange(BLOCK)
    labels = ids[:, 1:].masked_fill((position >= length[:, None]) | (position < prompt[:, None]), -100)
    inputs = ids[:, :-1].masked_fill(position >= length[:, None], 0)
    return Dataset.from_dict({"inputs": inputs.numpy(), "labels": labels.numpy()})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--accumulation", type=int, required=True)
    p.add_argument("--per_micro_batch_mean", action="store_true", help="each micro-batch's own mean, unweighted")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(0)
    model = models.build("gpt_tiny", {"task": "language_modeling", "vocab_size": VOCAB, "block_size": BLOCK})
    model = accelerator.prepare(model)
    layout = Layout(args.batch_size, args.accumulation, accelerator.process_index, accelerator.num_processes)
    assert ROWS == args.batch_size * args.accumulation * layout.world_size, "one optimizer step over all rows"
    batches = TrainBatches(table(), layout, 0, accelerator.device, variable_targets=not args.per_micro_batch_mean,
                           sum_over_processes=(lambda t: accelerator.reduce(t, "sum")) if layout.world_size > 1 else None)
    for batch in batches.epoch(0):
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["inputs"]), batch["labels"], batch.get("targets"))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                break
    grads = torch.cat([q.grad.flatten() for q in accelerator.unwrap_model(model).parameters()])
    if accelerator.is_main_process:
        torch.save(grads, args.out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
