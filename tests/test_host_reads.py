"""No host-device synchronisation in a training step that does not log: every read of a tensor's value by the host
(`item`, `tolist`, `float()`, `bool()`, `.cpu()`, ...) is counted per optimizer step while the recipe trains. On a
GPU each such read stalls the queue of kernels; on a CPU it is free, so this test, not a timing, keeps them out."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import REPO, run_in_process

READS = {"item", "tolist", "__float__", "__bool__", "__int__", "__index__", "cpu", "numpy"}
LOG_EVERY = 5


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(tmp_path, capsys, monkeypatch, *args) -> dict[int, int]:
    """Host reads during each optimizer step (its forward, backward, step and the bookkeeping after it)."""
    from mixprec.training import run as run_module

    reads, per_step, last = HostReads(), {}, [0]
    original = run_module.Run.step_end

    def step_end(run):
        done = original(run)
        per_step[run.step] = reads.count - last[0]
        last[0] = reads.count
        return done

    monkeypatch.setattr(run_module.Run, "step_end", step_end)
    monkeypatch.chdir(REPO)
    with reads:
        result = run_in_process(["--max_steps", "20", "--log_every", LOG_EVERY, "--checkpointing_steps", 20,
                                 "--output_dir", tmp_path / "r", *args], capsys)
    assert result.returncode == 0, result.stderr
    return per_step


@pytest.mark.parametrize("precision", [pytest.param("no", marks=pytest.mark.slow), "fp16"])  # fp16 quick: its scaler
def test_no_host_read_in_a_step_that_does_not_log_without_health_checks(tmp_path, capsys, monkeypatch, precision,
                                                                          fresh_accelerate_state):
    per_step = reads_per_step(tmp_path, capsys, monkeypatch, "--mixed_precision", precision, "--no-health_checks")
    quiet = {s: n for s, n in per_step.items() if s % LOG_EVERY and s > 1}
    assert quiet and set(quiet.values()) == {0}, quiet


@pytest.mark.parametrize("precision", [pytest.param("no", marks=pytest.mark.slow), "fp16"])  # fp16 quick: its scaler
def test_one_host_read_per_step_with_health_checks(tmp_path, capsys, monkeypatch, precision, fresh_accelerate_state):
    per_step = reads_per_step(tmp_path, capsys, monkeypatch, "--mixed_precision", precision)
    quiet = {s: n for s, n in per_step.items() if s % LOG_EVERY and s > 1}
    assert quiet and set(quiet.values()) == {1}, quiet


@pytest.mark.parametrize("update", ["kahan", pytest.param("stochastic", marks=pytest.mark.slow)])
def test_bf16_master_weights_add_no_host_read_outside_logging_steps(tmp_path, capsys, monkeypatch, update,
                                                                     fresh_accelerate_state):
    """The lost-update metric is measured on logging steps only; BF16AdamW's own step reads nothing back."""
    per_step = reads_per_step(tmp_path, capsys, monkeypatch, "--mixed_precision", "bf16", "--master_weights", "bf16",
                              "--bf16_update", update, "--no-health_checks")
    quiet = {s: n for s, n in per_step.items() if s % LOG_EVERY and s > 1}
    assert quiet and set(quiet.values()) == {0}, quiet


def test_the_counter_sees_the_reads_it_is_meant_to_see():
    t = torch.ones(1)
    with HostReads() as reads:
        float(t), bool(t), t.item(), t.tolist(), t.cpu()
    assert reads.count == 5


class DeviceOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_health_checks_do_little_device_work_per_step_and_none_per_logged_step(tmp_path, capsys, monkeypatch,
                                                                                   fresh_accelerate_state):
    """The health checks' own tensor operations (each a kernel launch on a GPU, 5-40 us of Python and dispatch on
    a CPU, where the lesson's MLP steps in about 3 ms): two per step without accumulation (the loss's detach and
    the read's stack; the loss is kept as it is and the window's sum is made on the host from the values read),
    and a logging step's work that does not grow with the window (nothing kept per step to stack again). The label
    probe (once, after step 1 of a classification run; its cost is in docs/health.md) is turned off here."""
    from mixprec.health import monitor

    ops, per_step, at_log = DeviceOps(), {}, []
    for name in ("add_loss", "allows_step", "step_done", "window"):
        original = getattr(monitor.Monitor, name)

        def counted(self, *args, _original=original, _name=name):
            before = ops.count
            with ops:
                out = _original(self, *args)
            if _name == "window":
                at_log.append(ops.count - before)
            else:
                per_step[self.step + (_name != "step_done")] = per_step.get(self.step + (_name != "step_done"), 0) \
                    + ops.count - before
            return out

        monkeypatch.setattr(monitor.Monitor, name, counted)
    monkeypatch.chdir(REPO)
    result = run_in_process(["--max_steps", "20", "--log_every", 10, "--checkpointing_steps", 20,
                             "--label_probe_samples", 0,
                             "--output_dir", tmp_path / "r"], capsys)
    assert result.returncode == 0, result.stderr
    assert len(per_step) == 20 and set(per_step.values()) == {2}, per_step  # the loss's detach, the read's stack
    assert len(at_log) == 2 and max(at_log) <= 4, at_log  # the read (stack, float32), zero_, the host sum added
