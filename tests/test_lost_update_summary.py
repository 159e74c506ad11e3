"""The lost-update summary computed slice by slice (mixprec.precision.lost_updates._summarise) gives what the
whole-tensor definition gives: the same counts and the exact same median |update| / ulp(before)."""
from __future__ import annotations

import pytest
import torch

from mixprec.precision import lost_updates
from mixprec.precision.master_weights import ulp


def reference(triples, dtype):
    """The definition, whole tensors at once: non-zero updates, lost ones, median ratio over the non-zero ones."""
    moved = [u != 0 for u, _, _ in triples]
    nonzero = sum(int(m.sum()) for m in moved)
    lost = sum(int((m & (after == before)).sum()) for m, (_, before, after) in zip(moved, triples))
    ratios = torch.cat([(u.abs() / ulp(before, dtype))[m] for m, (u, before, _) in zip(moved, triples)])
    return [float(nonzero), float(lost), float(ratios.median())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_spacing_read_off_the_exponent_bits_is_ulp(dtype):
    """Zero, subnormals, the smallest normal, powers of two and their neighbours, large and negative weights."""
    tiny = torch.finfo(torch.float32).tiny
    w = torch.tensor([0.0, -0.0, 1e-45, 1e-40, tiny, tiny * 1.5, 0.5, 1.0, 1.0 - 2**-24, 1.5, -3.0, 1e30, -1e-20])
    u = torch.full_like(w, 1e-3)
    counts, ratios = torch.zeros(2, dtype=torch.int64), torch.empty_like(w)
    lost_updates._tally(u, w, w + 1, dtype, counts, ratios)
    assert torch.equal(ratios, u / ulp(w, dtype))


def test_slices_give_the_whole_tensors_counts_and_median(monkeypatch):
    monkeypatch.setattr(lost_updates, "CHUNK", 1000)  # several slices per tensor, one shorter than the rest
    g = torch.Generator().manual_seed(0)
    triples = []
    for n in (4321, 17, 2000):
        before = torch.randn(n, generator=g)
        u = torch.randn(n, generator=g) * 1e-7
        u[::7] = 0  # updates that are zero are left out of the median
        after = before + u  # many of these round away: lost
        triples.append((u, before, after))
    assert lost_updates._summarise(triples, torch.float32).tolist() == reference(triples, torch.float32)


def test_the_update_may_be_computed_slice_by_slice():
    """An update given as a function of (a slice of the weights before, that slice), as for torch's AdamW."""
    g = torch.Generator().manual_seed(1)
    before, step = torch.randn(3000, generator=g), torch.randn(3000, generator=g) * 1e-6
    triples = [(lambda old, part: step[part] - old * 1e-9, before, before + step)]
    full = [(step - before * 1e-9, before, before + step)]
    assert lost_updates._summarise(triples, torch.float32).tolist() == reference(full, torch.float32)
