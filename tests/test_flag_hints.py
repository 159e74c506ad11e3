"""The flags of transformers' Trainer, TRL's SFTTrainer and transformers' example scripts that the recipe names
differently (mixprec.config.hints.ROWS) are answered with the recipe's own: every row of the table through
parse_config (a UsageError naming the recipe's setting, the value typed taken as that flag's), two through
`python recipes/train.py` (one line, exit code 2, nothing written); and --trust_remote_code (off by default;
a model folder with code of its own is one line naming it)."""
import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, assert_one_line_error, base_env
from mixprec import config
from mixprec.config import hints
from mixprec.errors import UsageError, one_line

VALUES = {"N": "7", "LR": "3e-4", "R": "0.1", "S": "steps", "NAME": "cosine", "P": "5", "DIR": "logs",
          "FILE": "val.jsonl", "DTYPE": "bfloat16"}


def refused(argv: list[str]) -> str:
    with pytest.raises(UsageError) as err:
        config.parse_config(argv)
    message = str(err.value)
    assert one_line(message) == message
    return message


@pytest.mark.parametrize("row", hints.ROWS, ids=lambda row: row.theirs)
def test_each_of_their_flags_names_the_recipes(row):
    typed = [] if row.takes is None else [VALUES[row.takes]]
    message = refused([f"--{row.theirs}", *typed])
    assert message.startswith(f"--{row.theirs} is ") and message.endswith("(see --help)")
    assert "unrecognized" not in message  # the value typed is the flag's, not another word of the command line
    said = row.ours_text(typed[0] if typed else None)
    assert said is None or f"did you mean {said}?" in message
    assert row.note in message


def trainer_flags() -> set[str]:
    """The fields of the installed transformers' TrainingArguments, read from its source (importing it takes
    seconds: torch, accelerate)."""
    source = Path(importlib.util.find_spec("transformers").origin).parent / "training_args.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_the_table_names_real_flags_theirs_and_ours():
    trainer = trainer_flags()
    assert {"bf16", "save_steps", "learning_rate", "output_dir"} <= trainer
    for row in hints.ROWS:
        assert row.theirs not in config.FIELDS  # a flag the recipe has needs no hint: drop its row
        assert row.ours is None or row.ours in config.FIELDS, row
        assert (row.theirs in trainer) == (row.whose == hints.TA), row  # today's TrainingArguments, by name
    assert set(hints.SAME) <= set(config.FIELDS)
    assert len(hints.BY_NAME) == len(hints.ROWS)


@pytest.mark.parametrize("argv, words", [
    (["--bf16", "false"], ["--bf16 false", "drop it"]),
    (["--bf16=True"], ["--mixed_precision bf16"]),
    (["--save_steps=100"], ["--checkpointing_steps"]),
    (["--lr_scheduler_type", "constant_with_warmup"], ["--lr_schedule constant?"]),
    (["--validation_split_percentage", "5"], ["--dataset_args val_fraction=0.05"]),
    (["--dataset_text_field", "body"], ["--dataset_args text_column=body"]),
    (["--learning_rate", "-1e-3"], ["did you mean --lr?"]),
])
def test_the_value_typed_goes_into_the_hint(argv, words):
    message = refused(argv)
    assert "unrecognized" not in message and all(word in message for word in words), message


def test_a_word_after_a_boolean_of_theirs_is_not_its_value():
    message = refused(["--bf16", "train.txt", "--lr", "0.1"])
    assert "--mixed_precision bf16" in message and "unrecognized arguments: train.txt" in message
    message = refused(["--fp16", "--max_seq_length", "512", "--max_step", "5"])
    assert "--mixed_precision fp16" in message and "did you mean --block_size?" in message
    assert "--max_step: did you mean --max_steps?" in message and "512" not in message


def test_a_key_of_theirs_in_a_config_file_names_the_recipes(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("bf16: true\nlearning_rate: 2.0e-5\npacking_of_mine: false\n")
    message = refused(["--config", str(path)])
    assert message.startswith(f"unknown keys in {path}: bf16 is transformers' name")
    assert "did you mean mixed_precision: bf16?" in message and "did you mean lr?" in message
    assert "packing_of_mine is no setting" in message


@pytest.mark.parametrize("argv, words", [
    (["--warmup_steps", "0.1"], ["--warmup_steps 0.1 as a fraction of the run", "optimizer steps"]),
    (["--save_steps", "0.25"], ["did you mean --checkpointing_steps?", "not a fraction of the run"]),
])
def test_transformers_fraction_of_the_run_is_said_to_be_steps_here(argv, words):
    message = refused(argv)
    assert all(word in message for word in words), message


def test_the_reference_lists_the_table():
    text = config.reference_markdown()
    assert "## Coming from transformers or TRL" in text
    assert all(f"| `--{row.theirs}` |" in text for row in hints.ROWS)


@pytest.mark.parametrize("argv, words", [
    (["--save_steps", "100"], ["--save_steps", "did you mean --checkpointing_steps?"]),
    (["--bf16", "--max_length", "256"], ["--mixed_precision bf16", "did you mean --block_size?"]),
])
def test_the_recipe_says_it_in_one_line_and_writes_nothing(tmp_path, argv, words):
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "recipes/train.py", *argv, "--output_dir", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=base_env())
    assert_one_line_error(run, *words)
    assert not out.exists()


def remote_code_folder(tmp: Path) -> Path:
    """A model folder whose config.json names classes of its own (auto_map), as a Hub repo with custom code does;
    its code is never run (the flag is off)."""
    folder = tmp / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "tiny_custom", "architectures": ["TinyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyCustomConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"}}))
    (folder / "configuration_tiny.py").write_text("raise SystemExit('remote code ran')\n")
    return folder


def test_trust_remote_code_is_off_by_default_and_a_folder_with_code_names_it(tmp_path):
    assert config.TrainConfig().trust_remote_code is False
    folder = remote_code_folder(tmp_path)
    for flag in ("--model_name_or_path", "--config_name"):
        extra = ["--tokenizer_name", str(folder)] if flag == "--config_name" else []
        message = refused([flag, str(folder), *extra, "--dataset", "stdlib"])
        assert "--trust_remote_code" in message and "auto_map" in message, message


def test_trust_remote_code_reaches_every_transformers_load():
    from mixprec.models import hf_folder

    config.parse_config(["--trust_remote_code"])
    assert hf_folder.remote_code() == {"trust_remote_code": True}
    config.parse_config([])
    assert hf_folder.remote_code() == {"trust_remote_code": False}  # said, so transformers never asks
    calls = []
    for path in [*(REPO / "mixprec").rglob("*.py")]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"(Auto\w+|cls|\))\.from_(pretrained|config)\(", line) and "`" not in line:
                calls.append((path.relative_to(REPO).as_posix(), i + 1, line + lines[i + 1]))
    assert len(calls) >= 10
    missing = [(p, n) for p, n, text in calls if "remote_code()" not in text]
    assert not missing


CUSTOM_CONFIG = ("from transformers import LlamaConfig\n\n\nclass TinyCustomConfig(LlamaConfig):\n"
                 "    model_type = 'tiny_custom'\n")
CUSTOM_MODEL = ("from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyCustomConfig\n\n\n"
                "class TinyCustomForCausalLM(LlamaForCausalLM):\n    config_class = TinyCustomConfig\n")


@pytest.mark.slow
def test_a_model_with_code_of_its_own_trains_with_trust_remote_code(tmp_path):
    """A tiny Llama under a model_type of its own, its classes in the folder (auto_map): refused without the flag,
    trained with it (fresh weights from --config_name; transformers' copy of the code goes to tmp_path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "tiny_custom", "architectures": ["TinyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyCustomConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"},
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}))
    words = Tokenizer(models.WordLevel({chr(i): i - 32 for i in range(32, 96)}, unk_token=" "))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="A").save_pretrained(tmp_path / "tok")
    (tmp_path / "train.txt").write_text("".join(f"LINE {i} OF THE TEXT\n" for i in range(400)))
    args = ["--config_name", folder, "--tokenizer_name", tmp_path / "tok", "--dataset", "text", "--train_file",
            tmp_path / "train.txt", "--block_size", "16", "--max_steps", "2", "--batch_size", "4", "--sample_tokens",
            "0", "--output_dir", tmp_path / "run"]
    env = base_env({"HF_MODULES_CACHE": str(tmp_path / "modules")})

    def run(*extra):
        return subprocess.run([sys.executable, "recipes/train.py", *map(str, args), *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=env)

    assert_one_line_error(run(), "--trust_remote_code", "auto_map")
    assert not (tmp_path / "run").exists() and not (tmp_path / "modules").exists()  # its code never ran
    trained = run("--trust_remote_code")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()


@pytest.mark.parametrize("argv, name, value", [
    (["--completion_only_loss", "False"], "completion_only_loss", False),  # how TRL's users turn it off
    (["--assistant_only_loss=false"], "assistant_only_loss", False),
    (["--health_checks", "0"], "health_checks", False),
    (["--no-lost_updates"], "lost_updates", False),
    (["--compile", "True"], "compile", True),
])
def test_a_boolean_of_ours_takes_a_value_as_hf_argument_parser_does(argv, name, value):
    """transformers' HfArgumentParser takes `--flag False`; argparse's BooleanOptionalAction only `--no-flag`:
    both are taken (mixprec.config.arg_parser.Parser.hf_booleans)."""
    assert getattr(config.parse_config(argv), name) is value


def test_a_word_that_is_no_boolean_after_a_boolean_of_ours_is_refused():
    with pytest.raises(UsageError, match="unrecognized arguments: maybe"):
        config.parse_config(["--health_checks", "maybe"])
