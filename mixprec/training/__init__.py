"""The pieces `recipes/train.py` hands everything but the training step to.

- startup: `start(cfg)` checks everything before the run folder is touched, then builds the run;
- plan: steps, epochs, the schedule's length, where a resume continues;
- run: `Run`, the batches, the bookkeeping after each optimizer step, and the end of the run.
"""
from .startup import start

__all__ = ["start"]
