"""The learning-rate schedule: warmup, then constant / linear / cosine to min_lr_ratio."""
import pytest
import torch

from mixprec import optim


@pytest.mark.parametrize("schedule, end", [("constant", 1.0), ("linear", 0.1), ("cosine", 0.1)])
def test_warmup_then_decay(schedule, end):
    f = [optim.lr_factor(s, warmup=10, total=110, schedule=schedule, min_ratio=0.1) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warmup, no step at lr 0
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))
    assert f[110] == pytest.approx(end)
    assert all(a >= b - 1e-12 for a, b in zip(f[10:], f[11:]))  # never rises after warmup


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = optim.adamw(model, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
