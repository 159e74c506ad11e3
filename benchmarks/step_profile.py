#!/usr/bin/env python
"""Where one training step's time goes, in the recipe or a transformers peer: cProfile around optimizer steps
after the warm-up, summed into the step's phases.

    python benchmarks/step_profile.py --runner recipe --at 3 --steps 4 -- \\
        --config recipes/configs/hf_gpt2_small.yaml --mixed_precision bf16 --max_steps 9 --log_every 50

The runner (recipes/train.py, benchmarks/peers/hf_accelerate.py or benchmarks/peers/hf_trainer.py) runs in this
process with the flags after `--`; a global optimizer-step post-hook (torch.optim.optimizer.
register_optimizer_step_post_hook: it watches, it changes nothing) starts the profiler after optimizer step
--at and stops it after step --at + --steps, so that whole steps are profiled, from the end of one optimizer
step to the end of another. Give --max_steps beyond them and a --log_every that no profiled step reaches, to
profile steps that do not log (or one that does, to see what logging costs). Phases (milliseconds per step,
cumulative time of the calls named):

- forward: the transformers model's own forward (GPT-2's or Llama's *ForCausalLM), less the loss inside it;
- loss: mixprec.evaluation.loss_fn (the recipe) or transformers' ForCausalLMLoss (inside the peers' forward);
- fp32 copy of the output: Accelerate's convert_to_fp32 of the model's outputs under autocast;
- backward, clip, optimizer, zero_grad: Accelerate's backward, clip_grad_norm_, and its optimizer's step and
  zero_grad (the lost-update measurement of a logging step falls in the optimizer's step);
- rest: the step's wall time less all of these (the data, the schedule, the loop's own bookkeeping).

cProfile adds a little to every Python call (the forward of a transformers model makes a few thousand): compare
runners under the same profiler, not these times with unprofiled ones. Below the phases, the kernel's view of
the same steps (getrusage of the whole process, all threads): minor page faults, user and system CPU seconds
per step; these the profiler barely changes, and the phases cannot show them (a page fault is paid inside
whichever call first touches a fresh page).

`--step_times FILE` also writes the wall time of every optimizer step of the run (the first counted from the
runner's start in this process) and the process's kernel counts over it (minor page faults, user and system CPU
seconds) at the process's exit; with `--steps 0` nothing is profiled, so that whole runs
of the three runners can be compared step by step, logging steps included. `--turns IN OUT FIRST` makes the
run take turns with another, one optimizer step each (benchmarks/side_by_side.py --turns; each step's time
then counts from when the run got its turn, and the file also holds when each step ran). Prints a table;
--output FILE.json also writes it with the profile's wall time per step.
"""
from __future__ import annotations

import argparse
import atexit
import cProfile
import json
import pstats
import resource
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"recipe": "recipes/train.py", "hf_accelerate": "benchmarks/peers/hf_accelerate.py",
           "hf_trainer": "benchmarks/peers/hf_trainer.py"}
MODELS = ("transformers/models/gpt2/modeling_gpt2.py", "transformers/models/llama/modeling_llama.py")
CALLS = {"loss": [("mixprec/evaluation.py", "loss_fn"), ("transformers/loss/loss_utils.py", "ForCausalLMLoss")],
         "fp32 copy of the output": [("accelerate/utils/operations.py", "convert_to_fp32")],
         "backward": [("accelerate/accelerator.py", "backward")],
         "clip": [("accelerate/accelerator.py", "clip_grad_norm_")],
         "optimizer": [("accelerate/optimizer.py", "step")],
         "zero_grad": [("accelerate/optimizer.py", "zero_grad")]}


def phases(stats: dict, steps: int, wall: float, recipe: bool) -> dict[str, float]:
    """Seconds per step of each phase from cProfile's `stats` over `steps` steps of `wall` seconds each."""
    def cumulative(path: str, name: str) -> float:
        return sum(v[3] for k, v in stats.items() if k[0].endswith(path) and k[2] == name)

    out = {name: sum(cumulative(*call) for call in calls) / steps for name, calls in CALLS.items()}
    model = max([v[3] for k, v in stats.items() if k[0].endswith(MODELS) and k[2] == "forward"] or [0.0]) / steps
    out = {"forward": model - (0.0 if recipe else out["loss"]), **out}  # the peers' loss is inside their forward
    out["rest"] = wall - sum(out.values())
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", choices=tuple(SCRIPTS), default="recipe")
    parser.add_argument("--at", type=int, default=3, help="profile from the end of this optimizer step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps profiled")
    parser.add_argument("--output", help="also write the table here (JSON)")
    parser.add_argument("--step_times", help="also write every optimizer step's wall time to this JSON file, at the "
                                             "process's exit (--steps 0: only these, nothing profiled)")
    parser.add_argument("--turns", nargs=3, metavar=("IN", "OUT", "FIRST"),
                        help="take turns with another run, step by step (benchmarks/side_by_side.py --turns): FIFOs "
                             "to wait on and to pass the turn through; FIRST 1 for the run that goes first, else 0")
    args, rest = parser.parse_args(argv[:cut]), argv[cut + 1:]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    state = {"count": 0, "profile": cProfile.Profile(), "started": None, "usage": None, "report": None,
             "steps": [], "usages": [], "resumed": time.monotonic()}
    turns = Turns(*args.turns) if args.turns else None
    if args.step_times:
        # the recipe's end_process runs exit functions
        atexit.register(write_step_times, args, state["steps"], state["usages"])
        state["usages"].append(resource.getrusage(resource.RUSAGE_SELF))

    def hook(optimizer, *_):
        state["count"] += 1
        now = time.monotonic()
        state["steps"].append((state["resumed"], now))
        if args.step_times:
            state["usages"].append(resource.getrusage(resource.RUSAGE_SELF))
        if turns is not None:
            turns.after_step(state["count"])
        state["resumed"] = time.monotonic() if turns is not None else now
        if not args.steps:
            return
        if state["count"] == args.at:
            state["started"] = time.perf_counter()
            state["usage"] = resource.getrusage(resource.RUSAGE_SELF)
            state["profile"].enable()
        elif state["count"] == args.at + args.steps:  # reported here: the run may end its process with os._exit
            state["profile"].disable()
            wall = (time.perf_counter() - state["started"]) / args.steps
            kernel = per_step(state["usage"], resource.getrusage(resource.RUSAGE_SELF), args.steps)
            state["report"] = report(args, argv, wall, pstats.Stats(state["profile"]).stats, kernel)

    register_optimizer_step_post_hook(hook)
    sys.argv = [str(REPO / SCRIPTS[args.runner]), *rest]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exited:
        if exited.code not in (None, 0):
            raise
    if state["report"] is None and args.steps:
        raise SystemExit(f"error: the run made {state['count']} optimizer steps; give --max_steps beyond "
                         f"--at + --steps ({args.at + args.steps})")
    return state["report"]


class Turns:
    """Two runs take turns, one optimizer step each: a token passed through two FIFOs. Both start up and run
    their first step at once; the first run starts its second step once the other has ended its first, and from
    then on each passes the turn on after each of its steps and waits for it to come back. A run that has ended
    (its FIFO closed) no longer holds the other up. A step's time counts from when its run got the turn."""

    def __init__(self, fifo_in: str, fifo_out: str, first: str):
        self.first, self.alone = first == "1", False
        if self.first:  # opened in the same order on both sides: each open waits for the other side's
            self.out, self.inp = open(fifo_out, "wb", buffering=0), open(fifo_in, "rb", buffering=0)
        else:
            self.inp, self.out = open(fifo_in, "rb", buffering=0), open(fifo_out, "wb", buffering=0)

    def after_step(self, count: int) -> None:
        if self.alone:
            return
        if count >= 2 or not self.first:  # the first run's first step passes nothing: it waits for the other's
            try:
                self.out.write(b"t")
            except BrokenPipeError:
                self.alone = True
                return
        self.alone = not self.inp.read(1)  # the other run has ended: go on alone


def write_step_times(args, steps: list[tuple[float, float]], usages: list) -> None:
    """Each optimizer step's wall time (the first from the runner's start in this process), in step order, and the
    process's kernel counts over it (`step_process`: minor page faults, user and system CPU seconds, from one
    getrusage at each step's end; with --turns the time between steps, waiting for the turn, is in the next
    step's counts, and it costs no CPU); with --turns, also when each ran (time.monotonic: one clock for every
    process of the machine)."""
    out = {"runner": args.runner, "step_times_s": [end - start for start, end in steps],
           "step_process": [per_step(a, b, 1) for a, b in zip(usages, usages[1:])]}
    if args.turns:
        out["step_spans"] = steps
    Path(args.step_times).write_text(json.dumps(out) + "\n")


def per_step(before, after, steps: int) -> dict[str, float]:
    """The process's minor page faults and user / system CPU seconds per step, between two getrusage readings."""
    return {"minor_faults": (after.ru_minflt - before.ru_minflt) / steps,
            "user_s": (after.ru_utime - before.ru_utime) / steps,
            "system_s": (after.ru_stime - before.ru_stime) / steps}


def report(args, argv: list[str], wall: float, stats: dict, kernel: dict) -> dict:
    """Print the phases of the profiled steps and the kernel's counts (and write them to --output)."""
    table = phases(stats, args.steps, wall, args.runner == "recipe")
    out = {"runner": args.runner, "steps": [args.at + 1, args.at + args.steps], "wall_s_per_step": wall,
           "phases_s_per_step": table, "process_per_step": kernel,
           "command": " ".join(["python", "benchmarks/step_profile.py", *argv])}
    lines = [f"{args.runner}: steps {args.at + 1}-{args.at + args.steps}, {wall * 1e3:.0f} ms a step (profiled)"]
    lines += [f"  {name:24s} {seconds * 1e3:8.1f} ms  {seconds / wall:6.1%}" for name, seconds in table.items()]
    lines += [f"  process: {kernel['minor_faults']:,.0f} minor page faults, {kernel['user_s'] * 1e3:,.0f} ms user and "
              f"{kernel['system_s'] * 1e3:,.0f} ms system CPU time a step"]
    print("\n" + "\n".join(lines), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
