"""The pieces `recipes/train.py` hands everything but the training step to.

- startup: `start(cfg, accelerator, prec)` checks everything before the run folder is touched, opens it and
  builds the model, optimizer and schedule (a `Start`; `Finished` for a resume of a finished run);
- prepared: `Start.begin(model, optimizer)`, after `accelerator.prepare`: the checkpoint loaded, the banner, a `Run`;
- plan: steps, epochs, the schedule's length, where a resume continues;
- run: `Run`, the batches, the bookkeeping after each optimizer step, and the end of the run.
"""
from contextlib import contextmanager

from .startup import start

__all__ = ["start", "prepared_run"]


@contextmanager
def prepared_run(cfg):
    """recipes/train.py's start in one call, up to the `Run` (for tools that time its loop: benchmarks/loop_calls.py).
    A new run only: a resume of a finished run has no `Run`."""
    from .. import precision, tracking

    accelerator, prec = precision.build_accelerator(cfg, **tracking.accelerator_kwargs(cfg.tracking))
    with start(cfg, accelerator, prec) as begun:
        if begun.finished:
            raise RuntimeError("prepared_run: the run has finished already; nothing to train")
        model, optimizer = accelerator.prepare(begun.model, begun.optimizer)
        yield begun.begin(model, optimizer)
