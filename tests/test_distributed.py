"""Distributed set-up without launching anything: the Accelerate configs, the launch checks, and the
DeepSpeed config derived from the recipe's settings (one source of truth for precision and batch)."""
import json

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from mixprec import config, precision
from mixprec.devices import distributed
from mixprec.errors import UsageError
from helpers import REPO

CONFIGS = REPO / "accelerate_configs"
# file -> (distributed type, mixed precision, processes, machines) as Accelerate's own loader resolves them
EXPECTED = {
    "cpu.yaml": (DistributedType.NO, "no", 1, 1),
    "multi_cpu.yaml": (DistributedType.MULTI_GPU, "no", 2, 1),  # MULTI_GPU: the launcher that starts 2 processes
    "single_gpu.yaml": (DistributedType.NO, "no", 1, 1),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, "no", 8, 1),
    "fsdp.yaml": (DistributedType.FSDP, "bf16", 8, 1),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, "no", 8, 1),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, "no", 8, 1),
    "multi_node.yaml": (DistributedType.MULTI_GPU, "no", 16, 2),
    "fp8.yaml": (DistributedType.MULTI_GPU, "fp8", 8, 1),
}


def test_every_accelerate_config_loads_and_resolves():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)
    for name, (kind, mp, procs, machines) in EXPECTED.items():
        cfg = load_config_from_file(str(CONFIGS / name))
        assert (cfg.distributed_type, cfg.mixed_precision, cfg.num_processes, cfg.num_machines) == \
            (kind, mp, procs, machines), name
        lines = (CONFIGS / name).read_text().splitlines()
        header = "\n".join(line for line in lines[:lines.index(next(x for x in lines if not x.startswith("#")))])
        assert lines[0].startswith("# Hardware: ") and "\n# Launch:" in header, name
        assert f"accelerate launch --config_file accelerate_configs/{name}" in header, name


def test_config_details_the_issue_asks_for():
    fsdp = load_config_from_file(str(CONFIGS / "fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    zero2 = load_config_from_file(str(CONFIGS / "deepspeed_zero2.yaml")).deepspeed_config
    zero3 = load_config_from_file(str(CONFIGS / "deepspeed_zero3.yaml")).deepspeed_config
    assert zero2["zero_stage"] == 2 and zero3["zero_stage"] == 3 and zero3["zero3_save_16bit_model"] is True
    assert load_config_from_file(str(CONFIGS / "fp8.yaml")).fp8_config["backend"] in ("AO", "TE")
    multi_cpu = load_config_from_file(str(CONFIGS / "multi_cpu.yaml"))
    assert multi_cpu.gpu_ids == "-1,-1"  # CUDA_VISIBLE_DEVICES=-1,-1: CPUs even on a GPU machine


# --- launches that would train alone ---------------------------------------------------------------

SIMPLE_LAUNCHER = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_a_multi_process_launch_that_started_one_process_is_refused():
    with pytest.raises(UsageError, match="started only this one.*multi_cpu.yaml"):
        distributed.check_launch(SIMPLE_LAUNCHER)
    distributed.check_launch({"ACCELERATE_USE_CPU": "True"})  # one process asked for, one started
    distributed.check_launch({**SIMPLE_LAUNCHER, "PMI_SIZE": "2"})  # mpirun started them all
    distributed.check_launch({**SIMPLE_LAUNCHER, "LOCAL_RANK": "0", "WORLD_SIZE": "2"})  # torchrun


class FakeAccelerator:
    def __init__(self, num_processes, kind=DistributedType.NO):
        self.num_processes, self.distributed_type = num_processes, kind


def test_processes_that_each_train_alone_are_refused():
    launch = distributed.Launch("cpu", world_size=2)
    with pytest.raises(UsageError, match="2 processes were launched but each would train alone"):
        launch.check_world(FakeAccelerator(1))
    launch.check_world(FakeAccelerator(2, DistributedType.MULTI_CPU))
    distributed.Launch("cpu", world_size=1).check_world(FakeAccelerator(1))


def test_fsdp_and_ddp_are_described_truthfully():
    from types import SimpleNamespace

    from torch.distributed.fsdp import StateDictType

    fsdp = FakeAccelerator(2, DistributedType.FSDP)
    fsdp.state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2,
                                                             state_dict_type=StateDictType.SHARDED_STATE_DICT))
    info = distributed.describe(fsdp, torch.nn.Linear(2, 2), "bf16")
    assert info["engine"] == "FSDP2 (sharded_state_dict)" and info["eval_precision"].startswith("bf16 (FSDP")
    assert distributed.describe(FakeAccelerator(2, DistributedType.MULTI_CPU), None, "bf16") == \
        {"engine": "DDP (DistributedDataParallel)"}
    assert distributed.describe(FakeAccelerator(1), None, "bf16") == {}


def test_fsdp_without_cuda_is_refused():
    env = {"ACCELERATE_USE_FSDP": "true", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(UsageError, match="FSDP needs CUDA GPUs.*quietly wrap the model in DDP"):
        distributed.Launch.from_env("cpu", env)
    assert distributed.Launch.from_env("cuda", env).fsdp


def test_plain_launches_ask_accelerate_for_the_cpu():
    cfg = config.parse_config([])
    assert distributed.Launch("cpu", 2).accelerator_kwargs(cfg.optim, cfg.precision, "bf16") == {
        "cpu": True, "kwargs_handlers": []}
    assert distributed.Launch("cuda", 2).accelerator_kwargs(cfg.optim, cfg.precision, "bf16")["cpu"] is False


# --- DeepSpeed: derived from the recipe, conflicts refused -----------------------------------------

def derive(raw=None, source="ds.json", **overrides):
    settings = dict(micro_batch=32, accumulation=2, world_size=4, clipping=1.0, precision="bf16",
                    init_scale=65536.0, growth_interval=2000)
    settings.update(overrides)
    return distributed.deepspeed_config({"zero_optimization": {"stage": 2}, **(raw or {})}, source, **settings)


def test_deepspeed_batch_and_clipping_come_from_the_recipe():
    ds = derive()
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 32 * 2 * 4 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert derive(clipping=0.0)["gradient_clipping"] == 0.0  # --max_grad_norm 0: no clipping
    same = derive({"train_batch_size": 256, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                   "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True}})
    assert same["train_batch_size"] == 256  # explicit values that agree are fine


@pytest.mark.parametrize("raw, message", [
    ({"train_micro_batch_size_per_gpu": 16}, "train_micro_batch_size_per_gpu=16 in the DeepSpeed config ds.json"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4 .* disagrees with the recipe"),
    ({"train_batch_size": 64}, "must be micro batch 32 x accumulation 2 x world size 4"),
    ({"gradient_clipping": 0.5}, "gradient_clipping=0.5"),
    ({"fp16": {"enabled": True}}, "fp16.enabled=True but the recipe trains in bf16"),
    ({"bf16": {"enabled": False}}, "bf16.enabled=False but the recipe trains in bf16"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
     "could not write the final weights"),
])
def test_deepspeed_values_that_disagree_are_refused(raw, message):
    with pytest.raises(UsageError, match=message):
        derive(raw)


def test_deepspeed_fp16_loss_scaling_follows_the_gradscaler_settings():
    ds = derive(precision="fp16", init_scale=1024.0, growth_interval=100)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 100,
                          "hysteresis": 1, "min_loss_scale": 1}
    with pytest.raises(UsageError, match="--init_scale 1000 is not a power of two.*1024"):
        derive(precision="fp16", init_scale=1000.0)
    assert derive(source=None, precision="no")["bf16"]["enabled"] is False


def test_zero3_always_gathers_full_weights_on_save():
    ds = derive({"zero_optimization": {"stage": 3}})
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_the_deepspeed_config_file_is_a_precision_requirement():
    launch = distributed.Launch("cpu", 2, deepspeed=True, ds_file="ds.json",
                                ds_raw={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert launch.precision_requirement("auto", None) == "bf16"  # auto adopts it
    assert precision.resolve("auto", "cpu", launch.precision_requirement("auto", "no"))[0] == "bf16"
    with pytest.raises(UsageError, match="--mixed_precision fp16 disagrees with the DeepSpeed config ds.json"):
        launch.precision_requirement("fp16", None)
    with pytest.raises(UsageError, match="mixed_precision=fp16 disagrees with the DeepSpeed config"):
        launch.precision_requirement("auto", "fp16")
    both = distributed.Launch("cpu", 2, deepspeed=True, ds_file="x.json",
                              ds_raw={"fp16": {"enabled": True}, "bf16": {"enabled": "true"}})
    with pytest.raises(UsageError, match="enables both fp16 and bf16"):
        both.precision_requirement("auto", None)
    off = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    assert distributed.deepspeed_precision(off, "x") == "no"
    assert distributed.deepspeed_precision({"bf16": {"enabled": "auto"}}, "x") is None


def test_deepspeed_settings_from_the_accelerate_config_or_a_json_file(tmp_path):
    env = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
           "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    source, raw = distributed.deepspeed_source(env)
    assert source is None and raw["zero_optimization"]["stage"] == 3 and raw["gradient_accumulation_steps"] == 4
    with pytest.raises(UsageError, match="gradient_accumulation_steps=4 in the accelerate config's deepspeed_config"):
        derive(raw, source=None)
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    assert distributed.deepspeed_source({distributed.DS_FILE_VAR: str(good)})[0] == str(good)
    for text, message in [(None, "not found"), ("{oops", "not valid JSON"), ("{}", "no zero_optimization"),
                          ('{"zero_optimization": {}, "optimizer": {}}', "'optimizer' section.*remove the section")]:
        bad = tmp_path / "bad.json"
        bad.unlink(missing_ok=True)
        if text is not None:
            bad.write_text(text)
        with pytest.raises(UsageError, match=message):
            distributed.deepspeed_source({distributed.DS_FILE_VAR: str(bad)})


def test_the_deepspeed_plugin_holds_the_derived_values(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    cfg = config.parse_config(["--batch_size", "16", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"])
    launch = distributed.Launch("cpu", 2, deepspeed=True, ds_raw=distributed.deepspeed_source({})[1])
    kwargs = launch.accelerator_kwargs(cfg.optim, cfg.precision, "bf16")
    ds = kwargs["deepspeed_plugin"].deepspeed_config
    assert kwargs["cpu"] is False and [h.backend for h in kwargs["kwargs_handlers"]] == ["gloo"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"],
            ds["gradient_clipping"], ds["bf16"]["enabled"]) == (16, 2, 64, 0.5, True)
    with pytest.raises(UsageError, match="fp8 with DeepSpeed needs MS-AMP"):
        launch.accelerator_kwargs(cfg.optim, cfg.precision, "fp8")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # CPU-only SLURM jobs export it; it would turn DeepSpeed off
    launch.accelerator_kwargs(cfg.optim, cfg.precision, "bf16")
    assert __import__("os").environ["ACCELERATE_USE_CPU"] == "false"
    with pytest.raises(UsageError, match="asked for DeepSpeed but Accelerate set up DistributedType.MULTI_CPU"):
        launch.check_world(FakeAccelerator(2, DistributedType.MULTI_CPU))


# --- fp8 only where it can run ---------------------------------------------------------------------

def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(UsageError, match="fp8 needs an NVIDIA GPU with fp8 tensor cores.*no CUDA GPU"):
        precision.resolve("fp8", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(UsageError, match=r"compute capability 8.0\) has no fp8 tensor cores"):
        precision.resolve("fp8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    import accelerate.utils as au
    monkeypatch.setattr(au, "is_torchao_available", lambda: False)
    monkeypatch.setattr(au, "is_transformer_engine_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_FP8_BACKEND", raising=False)
    with pytest.raises(UsageError, match="needs TransformerEngine or torchao: pip install torchao"):
        precision.resolve("fp8", "cuda")
    monkeypatch.setattr(au, "is_torchao_available", lambda: True)
    effective, why = precision.resolve("auto", "cuda", launcher="fp8")  # fp8.yaml: mixed_precision fp8
    assert effective == "fp8" and "backend torchao" in why
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "TE")
    with pytest.raises(UsageError, match="fp8 backend TE needs transformer-engine"):
        precision.resolve("fp8", "cuda")
    assert precision.resolve("auto", "cuda")[0] == "bf16"  # auto never picks fp8
