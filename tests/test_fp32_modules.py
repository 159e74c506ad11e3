"""--fp32_modules in training: the named modules' matmuls run in fp32 (forward and backward) while the rest run
in the autocast dtype; what matched is said in the banner and config.yaml; bad patterns and engines that cannot
honour the flag are refused with one line before anything is written."""
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.precision import policy
from helpers import (REPO, Run, assert_one_line_error, free_port, reset_accelerate, run_in_process, run_recipe,
                     snapshot)

MATMULS = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}
BATCH = 8
LAYERS = {"net.0": {BATCH, 100, 256}, "net.2": {BATCH, 256, 128}, "net.4": {BATCH, 128, 10}}  # the MLP's shapes


class LayerMatmuls(TorchDispatchMode):
    """The dtypes of the matmuls each Linear layer of the MLP runs, forward and backward. A matmul is the layer's
    when its operands' dimensions are the layer's (batch, in, out): unique in this MLP."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, list[torch.dtype]] = {name: [] for name in LAYERS}
        self.unattributed: list = []
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            dims = {d for t in tensors for d in t.shape}
            layer = next((name for name, shape in LAYERS.items() if dims == shape), None)
            (self.seen[layer] if layer else self.unattributed).append(tensors[-1].dtype)
        return func(*args, **(kwargs or {}))

    def start(self):
        self.__enter__()
        self.active = True

    def stop(self):
        if self.active:
            self.active = False
            self.__exit__(None, None, None)


def train_in_process(args, capsys, monkeypatch=None, mode=None):
    """recipes/train.py's main in this process: (exit code, stdout, stderr). With `mode`, the mode is on from each
    training batch to the end of that optimizer step (the training step only: not the start-up's FLOP count,
    not evaluation)."""
    from mixprec.training import run as run_module

    if mode is not None:
        batches, step_end = run_module.Run.batches, run_module.Run.step_end

        def recorded_batches(run):
            for batch in batches(run):
                mode.start()
                yield batch

        def recorded_step_end(run):
            mode.stop()
            return step_end(run)
        monkeypatch.setattr(run_module.Run, "batches", recorded_batches)
        monkeypatch.setattr(run_module.Run, "step_end", recorded_step_end)
    try:
        run = run_in_process(args, capsys)
    finally:
        if mode is not None:
            mode.stop()
        reset_accelerate()
    return run.returncode, run.stdout, run.stderr


TRAIN_ARGS = ["--mixed_precision", "bf16", "--batch_size", BATCH, "--max_steps", "1"]


def test_named_modules_train_in_fp32_and_the_rest_in_bf16(tmp_path, capsys, monkeypatch):
    mode = LayerMatmuls()
    code, out, err = train_in_process([*TRAIN_ARGS, "--fp32_modules", "net.2", "--output_dir", tmp_path / "run"],
                                      capsys, monkeypatch, mode)
    assert code == 0, err
    assert not mode.unattributed
    # forward: one addmm each; backward: the input and weight gradients (net.0's input needs none)
    assert mode.seen == {"net.0": [torch.bfloat16] * 2, "net.2": [torch.float32] * 3, "net.4": [torch.bfloat16] * 3}
    assert "fp32 modules   'net.2' -> net.2\n" in out
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["config"]["fp32_modules"] == ["net.2"]
    assert config["effective"]["fp32_modules"] == {"net.2": ["net.2"]}


def test_fp32_modules_as_a_yaml_list_of_globs(tmp_path, capsys):
    settings = tmp_path / "settings.yaml"
    settings.write_text("model: mlp\nfp32_modules:\n  - net.[24]\n  - net.0\n")
    code, out, err = train_in_process(["--config", settings, *TRAIN_ARGS, "--output_dir", tmp_path / "run"], capsys)
    assert code == 0, err
    assert "fp32 modules   'net.[24]' -> net.2, net.4; 'net.0' -> net.0\n" in out
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["effective"]["fp32_modules"] == {"net.[24]": ["net.2", "net.4"], "net.0": ["net.0"]}


@pytest.mark.parametrize("patterns", ["net.9", "net.2,h.*.attn"])
def test_a_pattern_that_matches_nothing_is_one_line_and_touches_nothing(tmp_path, capsys, patterns):
    out = tmp_path / "run"
    code, stdout, err = train_in_process([*TRAIN_ARGS, "--fp32_modules", patterns, "--output_dir", out], capsys)
    bad = patterns.split(",")[-1]
    assert_one_line_error(Run(code, stdout, err, out), f"--fp32_modules '{bad}' matches no module of --model mlp",
                          "net.0, net.1, net.2")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_resume_that_drops_or_changes_fp32_modules_is_refused_and_touches_nothing(tmp_path, capsys):
    """Which modules compute in fp32 is part of the run's trajectory (mixprec.run_folder.resume): a resume that drops
    (`--fp32_modules ""`) or changes --fp32_modules is refused in one line; the same patterns resume, and so does
    a resume that does not type the flag (the run's own setting, from its config.yaml)."""
    out = tmp_path / "run"
    first = [*TRAIN_ARGS, "--checkpointing_steps", "1", "--output_dir", out]
    code, _, err = train_in_process([*first, "--fp32_modules", "net.2"], capsys)
    assert code == 0, err
    before = snapshot(out)
    resume = [*first, "--max_steps", "2", "--resume_from_checkpoint", "latest"]
    for flag, new in [(["--fp32_modules", ""], "[]"), (["--fp32_modules", "net.0"], "['net.0']")]:
        code, stdout, err = train_in_process([*resume, *flag], capsys)
        assert_one_line_error(Run(code, stdout, err, out), f"fp32_modules: ['net.2'] -> {new}",
                              "fp32_modules cannot change within a run", "start a new --output_dir")
        assert snapshot(out) == before
    code, stdout, err = train_in_process([*resume, "--fp32_modules", "net.2"], capsys)
    assert code == 0 and "resumed from" in stdout, err
    code, stdout, err = train_in_process(["--max_steps", "3", "--output_dir", out, "--resume_from_checkpoint", "latest"],
                                         capsys)
    assert code == 0 and "resumed from" in stdout and "fp32_modules" in stdout, err


@pytest.mark.slow
def test_deepspeed_bf16_refuses_fp32_modules(tmp_path):
    out = tmp_path / "run"
    run = run_recipe("--mixed_precision", "bf16", "--fp32_modules", "net.2", "--max_steps", "1", out=out,
                     config=REPO / "accelerate_configs" / "deepspeed_zero2.yaml", check=False,
                     launch_args=("--num_processes", 1, "--main_process_port", free_port()))
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr  # the recipe's process exited 2
    lines = run.stderr.split("torch/distributed/elastic")[0].splitlines()  # before the launcher's report
    own = [line for line in lines if line.strip() and not line.startswith("E1")]  # E1...: the launcher's log line
    assert len(own) == 1 and own[0].startswith("error: --fp32_modules with DeepSpeed bf16 casts"), run.stderr
    assert "Traceback" not in run.stderr.split("exitcode: 2")[0] and not out.exists()


def _engine(effective, engine="ddp", distributed="MULTI_CPU", fp8_backend="AO"):
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name=distributed),
                                  fp8_backend=SimpleNamespace(value=fp8_backend))
    return accelerator, SimpleNamespace(effective=effective, engine=engine)


@pytest.mark.parametrize("engine, refused", [
    (_engine("bf16", engine="deepspeed"), "DeepSpeed bf16 casts the model's weights"),
    (_engine("fp16", engine="deepspeed"), "DeepSpeed fp16 casts the model's weights"),
    (_engine("bf16", distributed="FSDP"), "FSDP's mixed-precision policy"),
    (_engine("fp8", fp8_backend="TE"), "the fp8 backend TE"),
    (_engine("no", engine="deepspeed"), None),  # fp32: nothing to refuse, nothing to do
    (_engine("bf16"), None),
    (_engine("fp8"), None),  # torchao: the named modules' Linear layers stay out of fp8
])
def test_engines_that_cannot_keep_a_module_in_fp32_refuse(engine, refused):
    why = policy._engine_refusal(*engine)
    assert why is None if refused is None else why.startswith(refused)
