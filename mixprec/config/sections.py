"""The settings in sections, one frozen dataclass each: what a module reads, typed. `TrainConfig`
(mixprec.config) is all of them at once, flat, as the flags and YAML keys are (`--lr`, `lr: 3e-4`); a module that
needs one section is given `Section.of(cfg)`, and a TrainConfig is also each of its sections."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

PRECISIONS = ("auto", "no", "fp16", "bf16", "fp8")  # fp8: GPUs with fp8 tensor cores only
EVAL_PRECISIONS = ("fp32", "same")
LR_SCHEDULES = ("constant", "linear", "cosine")
ON_NAN = ("skip", "halt")
SAVE_DTYPES = ("auto", "fp32", "bf16", "fp16")
# what a resume may change (--allow_config_change; mixprec.run_folder.resume)
CHANGEABLE = ("lr", "weight_decay", "max_grad_norm", "init_scale", "growth_interval", "warmup_steps", "lr_schedule",
              "min_lr_ratio", "global_batch", "tf32")


def _opt(default, help, type=str, choices=None):
    meta = {"help": help, "type": type, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Section:
    title: ClassVar[str] = ""

    @classmethod
    def of(cls, cfg):
        """This section of `cfg` (a TrainConfig, or another section holding these fields)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ModelSettings(Section):
    """What to train: the model, a transformers checkpoint and its export."""

    title: ClassVar[str] = "Model"
    config: str | None = _opt(None, "YAML recipe config (see recipes/configs/); flags override its values (default: none)")
    model: str = _opt("mlp", "model from the registry in mixprec/models/")
    model_args: dict = _opt({}, "model settings as key=value,key=value (override the preset); a list in brackets: "
                                "hidden=[512,256]", dict)
    model_name_or_path: str | None = _opt(None, "a transformers causal LM to fine-tune: a folder saved with "
                                                "save_pretrained, or a Hub id (sets --model hf_causal_lm; "
                                                "docs/hf-models.md) (default: none)")
    config_name: str | None = _opt(None, "a folder with a transformers config.json: train that model from fresh "
                                         "weights (needs --tokenizer_name) (default: none)")
    tokenizer_name: str | None = _opt(None, "the tokenizer of --model_name_or_path / --config_name (default: the "
                                            "model's own folder)")
    trust_remote_code: bool = _opt(False, "transformers models: run the Python files of a model folder or Hub repo "
                                   "whose config.json names its own classes (auto_map); only for a source you trust",
                                   bool)
    save_dtype: str = _opt("auto", "transformers models: dtype of the save_pretrained export; auto = the "
                           "checkpoint's own", choices=SAVE_DTYPES)


@dataclass(frozen=True)
class LoraSettings(Section):
    """LoRA adapters (peft) on a transformers model."""

    title: ClassVar[str] = "LoRA"
    use_peft: bool = _opt(False, "train LoRA adapters (peft) in fp32 on the transformers model's base, frozen in "
                          "the autocast dtype (bf16 by default; docs/hf-models.md)", bool)
    lora_r: int = _opt(16, "LoRA rank (with --use_peft)", int)
    lora_alpha: float = _opt(32.0, "LoRA alpha: the adapters' output is scaled by alpha / r (with --use_peft)", float)
    lora_dropout: float = _opt(0.05, "dropout on the adapters' input (with --use_peft)", float)
    lora_target_modules: list = _opt([], "modules that get adapters: names such as q_proj,v_proj, or all-linear "
                                     "(default: peft's list for the architecture: q_proj,v_proj for Llama, c_attn "
                                     "for GPT-2)", list)
    merge_lora: bool = _opt(False, "with --use_peft, also export the model with the adapters merged in "
                            "(hf_model/, the full model's export and range audit)", bool)


@dataclass(frozen=True)
class DataSettings(Section):
    """What to train on, and how it is read."""

    title: ClassVar[str] = "Data"
    dataset: str = _opt("synthetic", "dataset from the registry in mixprec/data/")
    dataset_args: dict = _opt({}, "dataset settings as key=value,key=value (a list in brackets: key=[a,b])", dict)
    train_file: str | None = _opt(None, "local data: a CSV / JSON lines file with a 'label' column for --dataset "
                                        "file, a .txt file or folder for --dataset text, an image folder for "
                                        "--dataset imagefolder (default: none)")
    validation_file: str | None = _opt(None, "validation data in --train_file's form, for every source that reads "
                                             "--train_file (default: a share of the training data, said in the "
                                             "banner: --dataset_args val_fraction=F)")
    dataset_name: str | None = _opt(None, "Hugging Face Hub dataset for --dataset hub, e.g. mnist, cifar10, "
                                          "wikitext, or text_classification, e.g. glue (default: none)")
    dataset_config: str | None = _opt(None, "its configuration, e.g. wikitext-2-raw-v1 (default: none)")
    block_size: int | None = _opt(None, "transformers models: tokens per training block (default: the model's "
                                        "positions, at most 1024)", int)
    assistant_only_loss: bool = _opt(True, "--dataset chat, conversations ('messages'): the loss on the assistant's "
                                           "tokens only (TRL's name; TRL's default is off); "
                                           "--no-assistant_only_loss: on every token", bool)
    completion_only_loss: bool = _opt(True, "--dataset chat, 'prompt'/'completion' rows: the loss on the completion's "
                                            "tokens only (TRL's name and default); --no-completion_only_loss: on the "
                                            "prompt's too", bool)
    num_labels: int | None = _opt(None, "transformers classifiers: the number of classes (default: the data's, "
                                        "else the checkpoint's); a checkpoint's head of another size is replaced, "
                                        "said in the banner", int)
    allow_nonfinite_data: bool = _opt(False, "keep NaN, inf and empty values of --train_file's features (refused by "
                                             "default, naming the file, row and column)", bool)


@dataclass(frozen=True)
class PrecisionSettings(Section):
    """The precision of the run: autocast, the GradScaler, the master weights."""

    title: ClassVar[str] = "Precision"
    mixed_precision: str = _opt("auto", "training precision; auto = bf16 where native, else fp16 on CUDA, else fp32; "
                                "fp8 needs an Ada/Hopper GPU and TransformerEngine or torchao",
                                choices=PRECISIONS)
    eval_precision: str = _opt("fp32", "evaluation precision: fp32 (autocast off) or same as training",
                               choices=EVAL_PRECISIONS)
    fp32_modules: list = _opt([], "modules kept in fp32 under mixed precision: comma-separated globs over the model's "
                              "module names, e.g. 'head,h.*.ln_*' (a list in YAML); auto: chosen before training "
                              "by a short measurement on the run's first batches (overflow, relative error above "
                              "0.02; docs/precision.md)", list)
    master_weights: str = _opt("fp32", "where the master weights live: fp32 (autocast on fp32 weights) or bf16 (the "
                               "weights themselves bf16, no fp32 copy; needs --mixed_precision bf16; see "
                               "docs/master-weights.md)", choices=("fp32", "bf16"))
    bf16_update: str = _opt("kahan", "with --master_weights bf16, how an update reaches the bf16 weight: round (to "
                            "nearest: small updates are lost), kahan (compensated) or stochastic (rounding)",
                            choices=("round", "kahan", "stochastic"))
    init_scale: float = _opt(65536.0, "GradScaler initial loss scale (fp16 only)", float)
    growth_interval: int = _opt(2000, "GradScaler: steps without overflow before the scale doubles (fp16 only)", int)


@dataclass(frozen=True)
class OptimSettings(Section):
    """The batch, the optimizer, the schedule and the run's length."""

    title: ClassVar[str] = "Batch and optimisation"
    batch_size: int = _opt(32, "batch size per device (per process)", int)
    eval_batch_size: int | None = _opt(None, "evaluation batch size per device (default: --batch_size)", int)
    gradient_accumulation_steps: int = _opt(1, "micro-batches accumulated into one optimizer step", int)
    lr: float = _opt(1e-3, "peak learning rate (AdamW)", float)
    scale_lr: bool = _opt(False, "scale --lr by global batch / --base_batch_size (the lesson's rule)", bool)
    base_batch_size: int = _opt(32, "the global batch size that --lr is tuned for (used by --scale_lr)", int)
    weight_decay: float = _opt(0.01, "AdamW weight decay", float)
    warmup_steps: int = _opt(20, "optimizer steps of linear warmup from 0 to --lr", int)
    lr_schedule: str = _opt("cosine", "learning rate after warmup", choices=LR_SCHEDULES)
    min_lr_ratio: float = _opt(0.1, "final learning rate of linear/cosine decay, as a fraction of --lr", float)
    num_epochs: int = _opt(10, "passes over the training set", int)
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (default: --num_epochs decides)", int)
    max_grad_norm: float = _opt(1.0, "clip the gradient norm to this value; 0 turns clipping off", float)
    seed: int = _opt(42, "random seed for data, initialisation and shuffling", int)


@dataclass(frozen=True)
class RunFolderSettings(Section):
    """Where the run writes, when it checkpoints, logs and evaluates."""

    title: ClassVar[str] = "Run folder, checkpoints, logging"
    output_dir: str | None = _opt(None, "run folder (default: runs/<model>-<dataset>-<date>-<time>)")
    overwrite_output_dir: bool = _opt(False, "replace another run's files in --output_dir", bool)
    checkpointing_steps: int | None = _opt(None, "save a checkpoint every N optimizer steps (default: only at the end)", int)
    checkpoints_total_limit: int = _opt(2, "keep at most this many checkpoints (oldest removed)", int)
    resume_from_checkpoint: str | None = _opt(None, "'latest' (in --output_dir) or a checkpoint folder to resume (default: start afresh)")
    allow_config_change: list = _opt([], "on resume, settings that may differ from the checkpoint's and take effect "
                                     "from the resume step: lr, weight_decay, max_grad_norm, init_scale, "
                                     "growth_interval, warmup_steps, lr_schedule, min_lr_ratio, global_batch, tf32",
                                     list)
    log_every: int = _opt(50, "log metrics every N optimizer steps", int)
    eval_steps: int | None = _opt(None, "also evaluate every N optimizer steps (default: after each epoch only)", int)
    sample_tokens: int = _opt(200, "language models: tokens to generate after training (0: none)", int)
    sample_prompt: str | None = _opt(None, "language models: the prompt (default: the start of the first "
                                           "validation block)")


@dataclass(frozen=True)
class SpeedSettings(Section):
    """Threads, DataLoader workers, compilation and memory-for-speed trades."""

    title: ClassVar[str] = "Speed options"
    num_workers: int = _opt(0, "DataLoader worker processes", int)
    cpu_threads: int | None = _opt(None, "CPU threads per process (default: usable cores / processes per node; one for "
                                              "a model too small to split, see docs/performance.md)", int)
    compile: bool = _opt(False, "torch.compile the model (in place: checkpoints stay interchangeable)", bool)
    tf32: bool = _opt(False, "fp32 matmuls and convolutions in TF32 (CUDA, Ampere or newer)", bool)
    activation_checkpointing: bool = _opt(False, "recompute each GPT block in the backward pass to save memory", bool)
    gradient_checkpointing: bool = _opt(False, "transformers' name: recompute each layer of a transformers model (and "
                                               "of the GPT) in the backward pass to save memory", bool)
    peak_flops: float | None = _opt(None, "the device's peak FLOP/s for MFU (default: the table in mixprec/metrics.py, "
                                          "else measured at start-up)", float)


@dataclass(frozen=True)
class TrackingSettings(Section):
    """Weights & Biases and TensorBoard."""

    title: ClassVar[str] = "Experiment tracking"
    report_to: str = _opt("none", "experiment trackers: wandb (online when logged in, else offline), tensorboard, "
                          "all (both) or none; metrics.jsonl and metrics.png are written in every case",
                          choices=("none", "wandb", "tensorboard", "all"))
    project: str = _opt("mixprec", "W&B project of the run")
    run_name: str | None = _opt(None, "W&B run name (default: the name of --output_dir)")
    tags: list = _opt([], "W&B tags, comma-separated: --tags fp16,baseline (a list in YAML)", list)


@dataclass(frozen=True)
class HealthSettings(Section):
    """Checks on every optimizer step, and what a NaN does."""

    title: ClassVar[str] = "Health checks"
    health_checks: bool = _opt(True, "watch every optimizer step for NaN/Inf, overflow, stalls and exploding gradients "
                               "(one host sync per step)", bool)
    on_nan: str = _opt("skip", "a NaN/Inf loss (or, in bf16/fp32, gradient): skip that optimizer step, or halt "
                       "(exit code 3, last checkpoint kept)", choices=ON_NAN)
    max_skipped_steps: int = _opt(10, "diagnose this many skipped optimizer steps in a row (0: off)", int)
    min_loss_scale: float = _opt(1.0, "fp16: diagnose a GradScaler scale below this (0: off)", float)
    flat_loss_window: int = _opt(200, "diagnose a stall: a loss flat over this many optimizer steps that has not "
                                 "fallen from its start (0: off)", int)
    flat_loss_tolerance: float = _opt(0.01, "flat: the mean loss of the window's second half differs from the first "
                                      "half's by less than this fraction", float)
    label_probe_samples: int = _opt(2048, "classification: after the first step, compare the gradient on up to this "
                                    "many training rows with their labels and with them shuffled, to say at once "
                                    "when the labels do not belong to the inputs (0: off)", int)
    lost_updates: bool = _opt(True, "on each logging step, measure the share of optimizer updates that round away "
                              "(lost_update_share, update_ulp_ratio; a health event when most are lost): a copy of "
                              "the weights and a pass over them on that step only (docs/performance.md); "
                              "--no-lost_updates: off", bool)
    grad_spike_factor: float = _opt(10.0, "diagnose a gradient norm above this many times its median over the last "
                                    "100 steps (0: off)", float)


ALL = (ModelSettings, LoraSettings, DataSettings, PrecisionSettings, OptimSettings, RunFolderSettings, SpeedSettings,
       TrackingSettings, HealthSettings)  # in the order of --help and docs/configuration.md
