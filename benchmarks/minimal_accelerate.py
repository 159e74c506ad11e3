#!/usr/bin/env python
"""The floor of a launched Accelerate script, for benchmarks/startup.py: import torch and accelerate, build an
Accelerator, prepare the lesson's MLP and an AdamW optimizer, take one step. Nothing of mixprec is imported."""
import torch
from accelerate import Accelerator


def main() -> None:
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs = torch.randn(64, 100, device=accelerator.device)
    labels = torch.randint(0, 10, (64,), device=accelerator.device)
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"one step: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
