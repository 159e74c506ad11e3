"""Config: defaults < YAML < flags, and every flag documented with its default."""
import subprocess
import sys

import pytest

from mixprec import config
from mixprec.errors import UsageError
from helpers import REPO, TRAIN

REQUIRED_FLAGS = ["config", "model", "dataset", "mixed_precision", "eval_precision", "batch_size",
                  "gradient_accumulation_steps", "lr", "scale_lr", "weight_decay", "warmup_steps", "lr_schedule",
                  "num_epochs", "max_steps", "max_grad_norm", "init_scale", "growth_interval", "seed", "output_dir",
                  "checkpointing_steps", "resume_from_checkpoint", "log_every"]


def test_help_lists_every_flag_with_its_default():
    text = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, check=True).stdout
    options = text.split("\noptions:\n", 1)[1]
    blocks = {}  # flag name -> its help text
    for block in options.split("\n  --")[1:]:
        blocks[block.split()[0].rstrip(",")] = " ".join(block.split())
    for name in REQUIRED_FLAGS:
        assert name in blocks, name
        assert "(default:" in blocks[name], name


def test_defaults_yaml_then_flags(tmp_path):
    cfg = config.parse_config([])
    assert (cfg.model, cfg.dataset, cfg.mixed_precision, cfg.eval_precision) == ("mlp", "synthetic", "auto", "fp32")
    yml = tmp_path / "c.yaml"
    yml.write_text("batch_size: 64\nlr: 3e-4\nmodel_args: {hidden: [32]}\nscale_lr: true\n")
    cfg = config.parse_config(["--config", str(yml)])
    assert cfg.batch_size == 64 and cfg.lr == pytest.approx(3e-4) and cfg.scale_lr is True
    cfg = config.parse_config(["--config", str(yml), "--batch_size", "8", "--no-scale_lr", "--model_args", "x=1"])
    assert cfg.batch_size == 8 and cfg.scale_lr is False and cfg.lr == pytest.approx(3e-4)
    assert cfg.model_args == {"hidden": [32], "x": 1}  # flags add to the YAML's model_args


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_config_parses(path, tmp_path, monkeypatch):
    """Every key is a setting and every value valid; a config naming a transformers model folder is read up to that
    folder, which parsing reads (the transformers flags are resolved there) and which is made first
    (scripts/make_tiny_hf.py): missing here, it is one line naming it."""
    monkeypatch.chdir(tmp_path)
    values = config.load_yaml(str(path)) or {}
    flag = next((f for f in ("model_name_or_path", "config_name") if values.get(f)), None)
    if flag:
        with pytest.raises(UsageError, match=f"--{flag} '{values[flag]}' not found"):
            config.parse_config(["--config", str(path)])
        return
    cfg = config.parse_config(["--config", str(path)])
    assert cfg.model and cfg.dataset


@pytest.mark.parametrize("argv, words", [
    (["--mixed_precision", "fp8x"], ["fp8x", "auto, no, fp16, bf16"]),
    (["--lr", "-1"], ["--lr -1", "positive"]),
    (["--warmup_steps", "-3"], ["--warmup_steps -3"]),
    (["--model_args", "oops"], ["oops", "key=value"]),
    (["--no_such_flag"], ["--no_such_flag"]),
    # found by tests/test_generated_input.py's YAML draws: a deque's maxlen raised OverflowError (a traceback)
    (["--flat_loss_window", str(2**63)], [f"--flat_loss_window {2**63}", "64-bit"]),
    (["--max_steps", str(2**64)], ["--max_steps", "64-bit"]),
])
def test_bad_values_raise_usage_errors(argv, words):
    with pytest.raises(UsageError) as err:
        config.parse_config(argv)
    for word in words:
        assert word in str(err.value)


def test_the_settings_are_sections_and_frozen_once_parsed():
    """TrainConfig is its sections, flat: each setting in exactly one section, in sections.ALL's order (--help and
    docs/configuration.md list them so); `cfg.precision` and friends are the sections' values; a parsed TrainConfig
    cannot be changed, and config.replace keeps where each setting came from."""
    import dataclasses

    from mixprec.config import sections

    names = [f.name for section in sections.ALL for f in dataclasses.fields(section)]
    assert names == [f.name for f in dataclasses.fields(config.TrainConfig)] and len(set(names)) == len(names)
    cfg = config.parse_config(["--lr", "0.01", "--mixed_precision", "bf16", "--report_to", "none"])
    assert cfg.optim == sections.OptimSettings.of(cfg) and cfg.optim.lr == 0.01
    assert cfg.precision.mixed_precision == "bf16" and cfg.tracking.report_to == "none"
    assert isinstance(cfg, sections.PrecisionSettings)  # a TrainConfig can stand where a section is asked for
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    changed = config.replace(cfg, lr=0.02)
    assert changed.lr == 0.02 and config.set_by_user(changed, "lr") and not config.set_by_user(changed, "seed")
