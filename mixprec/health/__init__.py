"""Health checks during training: NaN/Inf, skipped steps, a falling loss scale, stalls and exploding
gradients, diagnosed as they happen with the lesson's advice.

- monitor: what the loop calls (one host read per optimizer step), and `Halted` (--on_nan halt, exit code 3);
- watch: the pure state machine that turns each step's numbers into events with a diagnosis.
"""
from .monitor import HALT_EXIT_CODE, Halted, Monitor, forward_order
from .watch import Event, Watch

__all__ = ["Event", "HALT_EXIT_CODE", "Halted", "Monitor", "Watch", "forward_order"]
