"""Batches: this process's share of each global batch, in a seeded order, from where a resume left off.

Training. Each epoch is a permutation of the training rows, seeded by (--seed, epoch), the same on every
process. It is cut into global micro-batches of `batch_size x processes` rows, and process r takes rows
[r*b, (r+1)*b) of each. An epoch uses only whole windows of `gradient_accumulation_steps` micro-batches:
the rows that do not fill one at its end are left out, as `drop_last` leaves out a short batch, so every
optimizer step sees the same number of samples. The position in the data is (epoch, micro-batches done),
which means the same samples however the global micro-batch is split over processes: a checkpoint written by
2 processes of batch 16 resumes on 1 process of batch 32.

Two ways to the rows, with the same order:
- in memory (tables, the digits, token blocks: anything under `IN_MEMORY_LIMIT`): the columns are tensors
  and a batch is an index into them (no DataLoader, no collation, no per-row Python);
- streamed: a DataLoader over the `datasets` table with the same batch sampler, for data that does not fit
  in memory, with --num_workers worker processes.
Integer columns reach the model as int64 (as `datasets`' torch format gives them), floats as they are stored.

Variable targets (chat data: label -100 on the prompt's tokens and on padding). The `accumulation` micro-batches
of an optimizer step are read together; their target tokens are counted and summed over processes (one
all-reduce of one number per step), and each micro-batch carries `targets`: that count over (micro-batches x
processes), the window's mean per micro-batch. mixprec.evaluation.loss_fn divides the micro-batch's summed loss
by it, so that after Accelerate's division by the accumulation steps and DDP's mean over processes the step's
loss is the sum over every target token of the window, on every process, divided by their count: the same
gradient whatever the split into micro-batches and processes. Each micro-batch is also cut after its last
target token (right padding under causal attention: the positions after it change no target's loss).

Evaluation: the validation rows in order, split over processes in turn (row i on process i mod N); every
process runs the same number of batches, the last ones padded with row 0 and a weight of 0, so that
engines that gather parameters in every forward (ZeRO-3, FSDP) never wait for a process that has finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

IN_MEMORY_LIMIT = 4 * 2**30  # bytes of the arrow table; above this, rows are streamed by a DataLoader


def _as_batch(columns: dict[str, torch.Tensor], index, device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name, column in columns.items():
        value = column[index]
        if not value.is_floating_point() and value.dtype != torch.int64:
            value = value.long()
        out[name] = value.to(device, non_blocking=True) if device.type != "cpu" else value
    return out


def columns_of(table) -> dict[str, torch.Tensor]:
    """The `inputs` and `labels` columns of a `datasets` table as CPU tensors, in their stored dtypes."""
    arrays = table.with_format("numpy", columns=["inputs", "labels"])[:]
    return {name: torch.from_numpy(np.ascontiguousarray(arrays[name])) for name in ("inputs", "labels")}


def table_bytes(table) -> int:
    """The bytes of a `datasets` table's arrow data, or of a mixprec.data.arrays table's arrays."""
    return table.in_memory_bytes if hasattr(table, "in_memory_bytes") else table.data.nbytes


def in_memory(table) -> bool:
    return table_bytes(table) <= IN_MEMORY_LIMIT


@dataclass
class Layout:
    """How a global micro-batch is split: `batch_size` rows for each of `world_size` processes."""
    batch_size: int
    accumulation: int = 1
    rank: int = 0
    world_size: int = 1

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size


class TrainBatches:
    """The training rows, epoch by epoch. `len(self)` is the micro-batches per epoch for each process."""

    def __init__(self, table, layout: Layout, seed: int, device: torch.device, num_workers: int = 0,
                 pin_memory: bool = False, variable_targets: bool = False, sum_over_processes=None):
        self.table, self.layout, self.seed, self.device = table, layout, seed, device
        self.variable_targets = variable_targets  # label -100 marks tokens without a loss: windows weighted
        self.sum_over_processes = sum_over_processes  # a tensor summed over processes (several processes)
        self.rows = len(table)
        whole = self.rows // layout.global_batch
        self.per_epoch = whole - whole % layout.accumulation
        self.streamed = not in_memory(table)
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.columns = None if self.streamed else columns_of(table)

    def __len__(self) -> int:
        return self.per_epoch

    def describe(self) -> str:
        size = f"{table_bytes(self.table) / 2**20:,.1f} MB"
        if self.streamed:
            return f"streamed by a DataLoader ({self.rows:,} rows, {size}, {self.num_workers} workers)"
        unused = f"; --num_workers {self.num_workers} not needed" if self.num_workers else ""
        return f"in memory ({self.rows:,} rows, {size}): batches by index{unused}"

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of row indices: the same on every process and in every run."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.rows, generator=generator)

    def indices(self, epoch: int, start: int = 0) -> Iterator[torch.Tensor]:
        """This process's row indices for micro-batches start, start + 1, ... of `epoch`."""
        order, lay = self.order(epoch), self.layout
        for i in range(start, self.per_epoch):
            first = i * lay.global_batch + lay.rank * lay.batch_size
            yield order[first:first + lay.batch_size]

    def forever(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches epoch after epoch (a new seeded order each time), for loops that count steps only."""
        epoch = 0
        while True:
            yield from self.epoch(epoch)
            epoch += 1

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        batches = self._rows(epoch, start)
        if not self.variable_targets:
            yield from batches
            return
        window, size = [], self.layout.accumulation
        for batch in batches:
            window.append(batch)
            if len(window) == size:
                yield from weighted(window, self.layout, self.sum_over_processes)
                window = []

    def _rows(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        if not self.streamed:
            for index in self.indices(epoch, start):
                yield _as_batch(self.columns, index, self.device)
            return
        loader = torch.utils.data.DataLoader(
            self.table.with_format("torch", columns=["inputs", "labels"]),
            batch_sampler=[index.tolist() for index in self.indices(epoch, start)],
            num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


def weighted(window: list[dict], layout: Layout, sum_over_processes=None) -> list[dict]:
    """The micro-batches of one optimizer step, each with `targets` (the step's target tokens on all processes
    over micro-batches x processes) and cut after its last target token."""
    masks = [batch["labels"] != -100 for batch in window]
    count = torch.stack([mask.sum() for mask in masks]).sum()
    if sum_over_processes is not None:
        count = sum_over_processes(count)
    targets = count.float() / (len(window) * layout.world_size)
    for batch, mask in zip(window, masks):
        has_target = mask.any(0)
        width = int(has_target.nonzero().max()) + 1 if bool(has_target.any()) else 1
        batch["inputs"], batch["labels"] = batch["inputs"][:, :width], batch["labels"][:, :width]
        batch["targets"] = targets
    return window


class EvalBatches:
    """The validation rows, split over processes, each batch with a `weight` column (0 for padding)."""

    def __init__(self, table, batch_size: int, rank: int, world_size: int, device: torch.device):
        self.batch_size, self.device = batch_size, device
        n = len(table)
        per_process = -(-n // world_size)
        self.num_batches = -(-per_process // batch_size)
        rows = torch.arange(rank, per_process * world_size, world_size)
        self.weights = (rows < n).float()
        self.rows = torch.where(rows < n, rows, torch.zeros_like(rows))
        self.table = table
        self.columns = columns_of(table) if in_memory(table) else None

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.num_batches):
            index = self.rows[i * self.batch_size:(i + 1) * self.batch_size]
            if self.columns is not None:
                batch = _as_batch(self.columns, index, self.device)
            else:
                rows = self.table.with_format("torch", columns=["inputs", "labels"])[index.tolist()]
                batch = {k: v.to(self.device) for k, v in rows.items()}
            batch["weight"] = self.weights[i * self.batch_size:(i + 1) * self.batch_size].to(self.device)
            yield batch
