"""The flag names of transformers' Trainer (TrainingArguments), TRL's SFTTrainer (SFTConfig, ScriptArguments,
ModelConfig) and transformers' example scripts (run_clm.py, run_clm_no_trainer.py, run_glue.py) that the recipe
has under another name, or not at all: typed, each is answered with the recipe's own (one line, exit code 2; the
Parser of mixprec.config.arg_parser). One table: the parser, the --config file's keys and docs/configuration.md
(`markdown`) read it. No torch import here."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

TA = "transformers' name (TrainingArguments)"
TA4 = "transformers 4's name (TrainingArguments)"
SFT = "TRL's name (SFTConfig)"
OLD_SFT = "older TRL's name (SFTConfig)"
TRL_SCRIPT = "TRL's name (ScriptArguments)"
TRL_MODEL = "TRL's name (ModelConfig)"
SCRIPTS = "transformers' name (run_clm.py)"
NO_TRAINER = "transformers' name (run_clm_no_trainer.py)"
VALIDATION = ("validation is taken from the data: the last 5% of the lines for --dataset text, the last 20% "
              "of the rows for --dataset text_classification, a seeded 20% for --dataset file, a Hub dataset's "
              "validation split (else its test split, else a seeded share of train); --dataset_args "
              "val_fraction=F sets the share, --validation_file FILE gives it for the sources that read --train_file")
STEP_COUNTS = ("checkpointing_steps", "log_every", "eval_steps", "warmup_steps", "max_steps")  # theirs: <1 a fraction
FRACTION = re.compile(r"argument --(\w+): invalid int value: '(0?\.\d+)'")
TRUE, FALSE = {"true", "t", "yes", "y", "1"}, {"false", "f", "no", "n", "0"}  # HfArgumentParser's booleans


@dataclass(frozen=True)
class Row:
    """Their flag (`theirs`, without dashes) and the recipe's setting (`ours`, None: none), with the value it takes
    (`value`: a text where {} is the value they typed, or a function of it; None: the value typed carries over);
    `takes`: the value's name there, None for a boolean flag there; `note`: said after the hint."""

    theirs: str
    whose: str
    ours: str | None
    value: str | Callable[[str | None], str] | None = None
    takes: str | None = "N"
    note: str = ""

    def ours_text(self, typed: str | None, yaml: bool = False) -> str | None:
        """The recipe's setting for the value typed: '--lr' (or 'lr' for a --config file), '--mixed_precision bf16'."""
        if self.ours is None:
            return None
        value = self.value(typed) if callable(self.value) else self.value
        if isinstance(value, str) and "{}" in value:
            value = value.format(typed if typed is not None else self.takes)
        if yaml:  # a key of a --config file; a dict setting's key as a mapping
            key, eq, sub = (value or "").partition("=")
            return self.ours if not value else f"{self.ours}: {{{key}: {sub}}}" if eq else f"{self.ours}: {value}"
        return f"--{self.ours} {value}" if value else f"--{self.ours}"


def _schedule(typed: str | None) -> str:
    """--lr_scheduler_type's values here: warmup is always linear over --warmup_steps."""
    known = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
             "cosine_with_min_lr": "cosine"}
    return known.get(typed or "", "{constant,linear,cosine}")


def _percent(typed: str | None) -> str:
    try:
        return f"val_fraction={float(typed) / 100:g}"
    except (TypeError, ValueError):
        return "val_fraction=F"


ROWS = (
    Row("bf16", TA, "mixed_precision", "bf16", None),
    Row("fp16", TA, "mixed_precision", "fp16", None),
    Row("bf16_full_eval", TA, "eval_precision", "same", None, "with --mixed_precision bf16"),
    Row("fp16_full_eval", TA, "eval_precision", "same", None, "with --mixed_precision fp16"),
    Row("learning_rate", TA, "lr", takes="LR"),
    Row("per_device_train_batch_size", TA, "batch_size"),
    Row("per_device_eval_batch_size", TA, "eval_batch_size"),
    Row("num_train_epochs", TA, "num_epochs"),
    Row("max_train_steps", NO_TRAINER, "max_steps"),
    Row("num_warmup_steps", NO_TRAINER, "warmup_steps"),
    Row("warmup_ratio", TA4, "warmup_steps", "N", "R", "optimizer steps, not a fraction of the run"),
    Row("lr_scheduler_type", TA, "lr_schedule", _schedule, "NAME", "after a linear warmup of --warmup_steps"),
    Row("save_steps", TA, "checkpointing_steps"),
    Row("save_strategy", TA, "checkpointing_steps", "N", "S", "default: one checkpoint, at the end"),
    Row("save_total_limit", TA, "checkpoints_total_limit"),
    Row("logging_steps", TA, "log_every"),
    Row("logging_strategy", TA, "log_every", "N", "S"),
    Row("logging_dir", TA4, None, takes="DIR", note="TensorBoard's logs go to <output_dir>/tensorboard with "
        "--report_to tensorboard"),
    Row("eval_strategy", TA, "eval_steps", "N", "S", "the recipe evaluates after each epoch, and every N "
        "optimizer steps with it"),
    Row("evaluation_strategy", TA4, "eval_steps", "N", "S", "the recipe evaluates after each epoch, and every N "
        "optimizer steps with it"),
    Row("max_length", SFT, "block_size"),
    Row("max_seq_length", OLD_SFT, "block_size"),
    Row("torch_compile", TA, "compile", takes=None),
    Row("dataloader_num_workers", TA, "num_workers"),
    Row("dataset_text_field", SFT, "dataset_args", "text_column={}", "NAME", "--dataset hub"),
    Row("packing", SFT, None, takes=None, note="not offered: packed rows would attend to each other through the "
        "recipe's model adapter (token ids only); padding after each micro-batch's last target is cut instead "
        "(docs/hf-models.md)"),
    Row("padding_free", SFT, None, takes=None, note="not offered: it needs flash attention's variable lengths or "
        "restarting position ids; padding after each micro-batch's last target is cut instead (docs/hf-models.md)"),
    Row("chat_template_path", SFT, None, takes="FILE", note="put the template in the tokenizer's folder "
        "(chat_template.jinja, or chat_template in tokenizer_config.json), where the resume check and the export "
        "see it (docs/hf-models.md)"),
    Row("dataset_config_name", SCRIPTS, "dataset_config", takes="NAME"),
    Row("validation_split_percentage", SCRIPTS, "dataset_args", _percent, "P", "a fraction, not a percentage"),
    Row("max_eval_samples", SCRIPTS, "dataset_args", "max_val_samples={}", note="text datasets: validation blocks"),
    Row("dataset_test_split", TRL_SCRIPT, None, takes="NAME", note=f"not offered: {VALIDATION}"),
    Row("with_tracking", NO_TRAINER, "report_to", "{wandb,tensorboard,all}", None),
    Row("torch_dtype", SCRIPTS, None, takes="DTYPE", note="the recipe loads the weights in fp32 and trains them under "
        "--mixed_precision (docs/hf-models.md); the export's dtype is --save_dtype"),
    Row("dtype", TRL_MODEL, None, takes="DTYPE", note="the recipe loads the weights in fp32 and trains them under "
        "--mixed_precision (docs/hf-models.md); the export's dtype is --save_dtype"),
    Row("do_train", TA, None, takes=None, note="not needed: the recipe always trains, then evaluates"),
    Row("do_eval", TA, None, takes=None, note="not needed: the recipe evaluates on the validation split after "
        "each epoch (--eval_steps N: also every N optimizer steps)"),
    Row("optim", TA, None, takes="NAME", note="not offered: the optimizer is torch's AdamW (--lr, --weight_decay)"),
    Row("use_cpu", TA, None, takes=None, note="launch on the CPU with accelerate launch --cpu recipes/train.py ... "
        "(docs/distributed.md)"),
    Row("deepspeed", TA, None, takes="FILE", note="DeepSpeed is Accelerate's choice: accelerate launch --config_file "
        "accelerate_configs/deepspeed_zero2.yaml recipes/train.py ... (docs/distributed.md)"),
)
BY_NAME = {row.theirs: row for row in ROWS}
# the same name here as in TrainingArguments, TRL's configs or run_clm.py: no hint needed (tests/test_flag_hints.py)
SAME = ("output_dir", "overwrite_output_dir", "report_to", "run_name", "project", "gradient_accumulation_steps",
        "max_steps", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "eval_steps", "gradient_checkpointing",
        "tf32", "resume_from_checkpoint", "model_name_or_path", "config_name",
        "tokenizer_name", "trust_remote_code", "train_file", "dataset_name", "dataset_config", "block_size",
        "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "validation_file",
        "assistant_only_loss", "completion_only_loss")


def hint(name: str, typed: str | None, yaml: bool = False) -> str | None:
    """One sentence for their flag `name` (no dashes) typed with value `typed` (None: none), or None when it is
    none of theirs. `yaml`: a key of a --config file."""
    row = BY_NAME.get(name)
    if row is None:
        return None
    shown = name if yaml else f"--{name}"
    if row.takes is None and typed is not None and typed.lower() in FALSE:
        return f"{shown} {typed} is {row.whose}, turned off: drop it"
    ours = row.ours_text(typed, yaml)
    said = f"{shown} is {row.whose}: " + (f"did you mean {ours}?" if ours else row.note)
    note = row.note or (_fraction(typed) if row.ours in STEP_COUNTS else "")
    return f"{said} ({note})" if ours and note else said


def _fraction(typed: str | None) -> str:
    try:
        return "optimizer steps here, not a fraction of the run" if 0 < float(typed or "") < 1 else ""
    except ValueError:
        return ""


def fraction(message: str) -> str | None:
    """What to say to argparse's refusal of `--warmup_steps 0.1` (or --eval_steps, --max_steps): transformers
    takes a value below 1 as a fraction of the run; here it is a number of optimizer steps."""
    found = FRACTION.match(message)
    if found and found[1] in STEP_COUNTS:
        return f"transformers reads --{found[1]} {found[2]} as a fraction of the run: here it counts optimizer steps"
    return None


def config_keys(path: str, unknown: list[str], data: dict) -> str:
    """The line for keys of a --config file that are no settings: theirs answered with ours (`hint`)."""
    said = {key: hint(key, None if data[key] is None else str(data[key]), yaml=True) for key in unknown}
    if not any(said.values()):
        return f"unknown key '{unknown[0]}' in {path}: valid keys are the flags listed by --help"
    parts = [text or f"{key} is no setting" for key, text in said.items()]
    return (f"unknown key{'s' if len(parts) > 1 else ''} in {path}: {'; '.join(parts)} (valid keys are the flags "
            f"listed by --help)")


def explain(argv: list[str], unrecognized: list[str]) -> tuple[list[str], list[str]]:
    """The hints for their flags among the `unrecognized` words of the command line `argv`, and the words left
    unexplained. A value typed after a flag of theirs that takes one is that flag's (`--save_steps 100`), and
    after a boolean only true or false is (`--bf16 true`); `--save_steps=100` too."""
    left = list(unrecognized)
    hints = []
    for i, word in enumerate(argv):
        name, eq, typed = word.partition("=")
        if not name.startswith("--") or name[2:] not in BY_NAME or word not in left:
            continue
        left.remove(word)
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if not eq and nxt is not None and nxt in left and _is_value(nxt, BY_NAME[name[2:]]):
            typed = nxt
            left.remove(nxt)
        hints.append(hint(name[2:], typed if eq or typed else None))
    return hints, left


def _is_value(word: str, row: Row) -> bool:
    if row.takes is None:
        return word.lower() in TRUE | FALSE
    if not word.startswith("-"):
        return True
    try:
        float(word)  # a negative number
        return True
    except ValueError:
        return False


def markdown() -> list[str]:
    """docs/configuration.md's paragraph and table: their flags and the recipe's (from ROWS, so they cannot drift)."""
    lines = ["## Coming from transformers or TRL", "",
             "The flags of transformers' Trainer (`TrainingArguments`), TRL's `SFTTrainer` (`SFTConfig`) and "
             "transformers' example scripts that the recipe names differently are answered with the recipe's own, "
             "on the command line and as keys of a `--config` file: one line, exit code 2, nothing written. Where "
             "transformers reads a value below 1 as a fraction of the run (`--warmup_steps 0.1`, `--save_steps`, "
             "`--logging_steps`, `--eval_steps`), the recipe counts optimizer steps, and says so. These are the same "
             "here: " + ", ".join(f"`--{name}`" for name in SAME) + ".", "",
             "| their flag | from | here |", "|---|---|---|"]
    for row in ROWS:
        ours = row.ours_text(None)
        here = f"`{ours}`" + (f" ({row.note})" if row.note else "") if ours else row.note
        source = row.whose.replace("'s name", "").replace("' name", "")
        lines.append(f"| `--{row.theirs}` | {source} | {here} |")
    return lines
