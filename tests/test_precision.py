"""Precision is chosen for a reason, made real, and never silently dropped."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import config, models, precision
from mixprec.training import validation
from mixprec.errors import UsageError

MATMULS = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default}


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matmul that actually runs."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.dtypes.add(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def test_auto_on_cpu_follows_the_cpu_features(monkeypatch):
    from mixprec.devices import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert precision.resolve("auto", "cpu")[0] == "bf16"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2"})
    effective, why = precision.resolve("auto", "cpu")
    assert effective == "no" and "AVX512-BF16" in why


def test_the_launchers_default_no_is_said_to_be_ignored_where_the_run_is_not_fp32(monkeypatch):
    """`accelerate launch` without a config sets mixed_precision 'no' and warns "`--mixed_precision` was set to a
    value of 'no'": the banner's reason says that 'no' was its default, ignored (not where the run is fp32)."""
    from mixprec.devices import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    effective, why = precision.resolve("auto", "cpu", "no")
    assert effective == "bf16" and why.endswith("the launcher's mixed_precision 'no' is its default, ignored")
    assert precision.resolve("fp16", "cpu", "no") == ("fp16", "requested; the launcher's mixed_precision 'no' is "
                                                               "its default, ignored")
    assert "launcher" not in precision.resolve("no", "cpu", "no")[1]
    assert "launcher" not in precision.resolve("auto", "cpu")[1]  # python recipes/train.py: no launcher


def test_auto_on_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert precision.resolve("auto", "cuda")[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    assert precision.resolve("auto", "cuda")[0] == "fp16"
    with pytest.raises(UsageError, match="use --mixed_precision fp16"):
        precision.resolve("bf16", "cuda")


def test_launcher_precision_is_a_requirement():
    assert precision.resolve("auto", "cpu", launcher="fp16")[0] == "fp16"
    assert precision.resolve("bf16", "cpu", launcher="no")[0] == "bf16"  # 'no' is Accelerate's default
    with pytest.raises(UsageError, match="disagrees"):
        precision.resolve("bf16", "cpu", launcher="fp16")


def _prepared(mixed_precision, extra=()):
    cfg = config.parse_config(["--mixed_precision", mixed_precision, *extra])
    accelerator, prec = precision.build_accelerator(cfg)
    torch.manual_seed(0)
    model = models.build("mlp", {"num_features": 100, "num_classes": 10})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, prec, model, opt


def test_fp16_on_cpu_is_real_autocast_and_loss_scaling(fresh_accelerate_state):
    accelerator, prec, model, opt = _prepared("fp16", ["--init_scale", "1024"])
    assert prec.made_real and isinstance(accelerator.scaler, torch.amp.GradScaler)
    assert accelerator.scaler.get_scale() == 1024
    with MatmulDtypes() as seen:
        loss = model(torch.randn(8, 100)).float().pow(2).mean()
    assert seen.dtypes == {torch.float16}
    accelerator.backward(loss)
    grad = next(model.parameters()).grad
    # the gradient is scaled by 1024 until unscale_ (Accelerate's clip_grad_norm_ does it)
    scaled = grad.clone()
    accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(scaled / 1024, grad)
    info = precision.describe(accelerator, prec, model)
    assert info["autocast_dtype"] == "float16" and info["grad_scaler"]["init_scale"] == 1024
    assert info["master_weight_dtype"] == "float32"


@pytest.mark.parametrize("mixed_precision, low", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_evaluation_matmuls_run_in_fp32_unless_same(fresh_accelerate_state, mixed_precision, low):
    accelerator, _, model, _ = _prepared(mixed_precision)
    batches = [{"inputs": torch.randn(16, 100), "labels": torch.randint(0, 10, (16,)), "weight": torch.ones(16)}
               for _ in range(2)]
    with MatmulDtypes() as seen:
        model(batches[0]["inputs"])
    assert seen.dtypes == {low}  # training forward: autocast
    with MatmulDtypes() as seen:
        fp32 = validation.evaluate(model, batches, accelerator, fp32=True)
    assert seen.dtypes == {torch.float32}
    with MatmulDtypes() as seen:
        same = validation.evaluate(model, batches, accelerator, fp32=False)
    assert seen.dtypes == {low}
    assert fp32["val_loss"] != same["val_loss"]
    with MatmulDtypes() as seen:
        model(batches[0]["inputs"])
    assert seen.dtypes == {low}  # autocast is back for training
    assert model.training


@pytest.mark.parametrize("flags, effective", [({"avx2"}, "no"), ({"avx2", "avx512_bf16"}, "bf16")])
def test_auto_is_said_as_what_it_resolved_to_in_the_banner_config_and_summary(tmp_path, capsys, monkeypatch, flags,
                                                                               effective):
    """The banner, config.yaml and summary.json carry the effective precision, never the request 'auto'."""
    import json

    import yaml

    from mixprec.devices import hardware
    from helpers import reset_accelerate, run_in_process

    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    out = tmp_path / "run"
    try:
        run = run_in_process(["--mixed_precision", "auto", "--max_steps", "1", "--output_dir", out], capsys)
    finally:
        reset_accelerate()
    assert run.returncode == 0, run.stderr
    assert f"precision      requested auto -> effective {effective} (" in run.stdout
    recorded = yaml.safe_load((out / "config.yaml").read_text())["effective"]
    assert (recorded["requested_precision"], recorded["effective_precision"]) == ("auto", effective)
    assert json.loads((out / "summary.json").read_text())["effective_precision"] == effective
    assert f"({effective}); outputs in" in run.stdout
