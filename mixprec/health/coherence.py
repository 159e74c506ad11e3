"""Do the labels belong to the inputs? A probe after the first optimizer step of a classification run.

When the labels depend on the inputs, the examples' gradients agree: the part of the loss's gradient that
depends on the labels is larger with the examples' own labels than with the same labels permuted among them
(random labels give incoherent gradients: Chatterjee, "Coherent Gradients", 2020). When they do not (shuffled
or unrelated labels), the labels are one more random permutation, and the two are alike: their ratio is 1.

`label_ratio(model, batches)` measures that ratio on training batches (the recipe gives them in the seeded order
of its first epoch, without touching any random state), up to `max_examples` rows, stopping as soon as the
ratio is clearly above `floor` (labels that belong to their inputs usually show it within the first few hundred
rows). The label-dependent part of a batch's gradient is the gradient of its loss minus the loss averaged over
all permutations of its labels (each row's target: the batch's label frequencies), so it needs no stored copy
of the permuted gradients: per permutation, one backward. The passes run with autocast off (a prepared model's
own autocast still applies; the logits are taken in fp32), in eval mode (batch-norm statistics and dropout left
alone), with `torch.autograd.grad` (the parameters' `.grad` is not touched) under
`torch.random.fork_rng`, with the probe's own generator for the permutations: the training's trajectory is the
same with the probe or without it. Only the last parameters in registration order (the classifier head, up to
`MAX_ELEMENTS` values) are looked at, so that a large model's probe holds a few small gradient sums only.
Language models (labels per token: the next tokens) are not probed.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

PERMUTATIONS = 8  # label permutations: the permuted part is their mean
MAX_ELEMENTS = 2_000_000  # the last parameters looked at, in values
CHECKS = (256, 1024)  # rows after which the ratio is looked at before `max_examples`


def classification(batch: dict) -> bool:
    labels = batch.get("labels")
    return torch.is_tensor(labels) and labels.dim() == 1 and not labels.is_floating_point()


def _head(model: torch.nn.Module) -> list[torch.Tensor]:
    params, size = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if params and size + p.numel() > MAX_ELEMENTS:
            break
        params.append(p)
        size += p.numel()
    return params


def label_ratio(model: torch.nn.Module, batches: Iterable[dict], max_examples: int, floor: float,
                permutations: int = PERMUTATIONS) -> tuple[float, int] | None:
    """(ratio of the label-dependent gradient's norm with the real labels to that with permuted labels, rows
    seen), or None when a batch is not a classification one or holds non-finite values."""
    params = _head(model)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params for _ in range(permutations + 1)]
    generator = torch.Generator().manual_seed(0)
    rows, checks = 0, [c for c in CHECKS if c < max_examples] + [max_examples]
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.random.fork_rng(devices=[]), torch.autocast(params[0].device.type, enabled=False):
            model.eval()
            for batch in batches:
                if not classification(batch) or not torch.is_tensor(batch.get("inputs")):
                    return None
                _add(model, batch, params, sums, generator, permutations)
                rows += len(batch["labels"])
                if rows >= checks[0]:
                    ratio = _ratio(sums, len(params), permutations)
                    if not math.isfinite(ratio):
                        return None
                    if ratio >= floor or rows >= max_examples:
                        return ratio, rows
                    checks = [c for c in checks if c > rows] or [max_examples]
    finally:
        for m, mode in modes.items():
            m.training = mode
    ratio = _ratio(sums, len(params), permutations) if rows else math.nan
    return (ratio, rows) if math.isfinite(ratio) else None


def _add(model, batch: dict, params: list, sums: list, generator: torch.Generator, permutations: int) -> None:
    """The batch's label-dependent gradient, real and permuted, added to `sums` (real first, then each
    permutation's, per parameter)."""
    from ..evaluation import loss_fn

    logits = model(batch["inputs"]).float()
    labels = batch["labels"].to(logits.device)
    frequencies = torch.bincount(labels, minlength=logits.shape[-1]).float() / len(labels)
    mean = -(torch.log_softmax(logits, -1) @ frequencies).sum()  # the loss summed, averaged over permutations
    for i in range(permutations + 1):
        order = torch.randperm(len(labels), generator=generator).to(labels.device) if i else None
        loss = loss_fn(logits, labels if order is None else labels[order], reduction="sum") - mean
        grads = torch.autograd.grad(loss, params, retain_graph=i < permutations, allow_unused=True)
        for j, g in enumerate(grads):
            if g is not None:
                sums[j * (permutations + 1) + i] += g.float()


def _ratio(sums: list, count: int, permutations: int) -> float:
    stride = permutations + 1
    real = sum(float(sums[j * stride].pow(2).sum()) for j in range(count))
    permuted = sum(float(sums[j * stride + i].pow(2).sum()) for j in range(count)
                   for i in range(1, stride)) / permutations
    return math.sqrt(real / permuted) if permuted > 0 else math.inf
