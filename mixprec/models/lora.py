"""LoRA through `peft` on the transformers causal LMs, with TRL's flag names: `--use_peft`, `--lora_r`,
`--lora_alpha`, `--lora_dropout`, `--lora_target_modules` (default: peft's own per-architecture list, q_proj and
v_proj for Llama, c_attn for GPT-2; `all-linear` for every linear layer but the output head).

Where each weight lives:
- the base model is frozen and stored in the autocast dtype: bf16 under `--mixed_precision bf16` (the default
  for LoRA), fp16 under `--mixed_precision fp16` (refused before training when a base weight is beyond fp16's
  range). It is loaded in fp32 and cast after the start-up measurements, so the load's peak is the fp32 model.
  Evaluation in fp32 (the default) upcasts it for the pass, exactly (every 16-bit value is an fp32 value).
- the adapters are fp32 parameters, trained by torch's AdamW with fp32 states, and run under autocast. Under
  DeepSpeed (ZeRO-2) DeepSpeed casts the whole model to 16 bits and keeps the adapters' fp32 master copies in
  its optimizer; the banner reads the dtypes from the prepared model, so it says which. The exports take the
  fp32 masters (hf_export.deepspeed_masters), not the 16-bit copies.
- ZeRO-3 is refused: it would shard and gather the frozen base every step for no optimizer memory to save (the
  base has no optimizer state), and its 16-bit model save is untested here with a peft model.
- `--master_weights bf16` is refused with LoRA: the base is already 16-bit and frozen; bf16 adapters would save
  a few bytes per adapter parameter (well under 1% of the model) and lose their small updates.

Exports (mixprec.models.hf_export): the adapter with peft's `save_pretrained` into `<output_dir>/adapter`
(loads with `peft.PeftModel.from_pretrained` on the base); `--merge_lora` also merges the adapters into an fp32
copy of the base and exports that through the full model's export and range audit into `<output_dir>/hf_model`,
counting the merged weights whose change a 16-bit export rounds away.

`check` reads the whole settings (LoRA against the model, precision and export flags); `check_engine` and
`check_targets` are given the LoRA section and the model's (the model section is the settings themselves:
`model` is a setting's name), `settings`, `target_modules`, `apply` and `freeze_base` the LoRA section alone
(`cfg.lora`, mixprec.config.sections.LoraSettings).
"""
from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING

import torch

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import LoraSettings, ModelSettings


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULTS = {"lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05}
FOLDER = "adapter"


def _given_without_peft(cfg) -> list[str]:
    """The LoRA flags typed (or in the --config file) without --use_peft; a resumed run's record is not the user's
    (the resume contract judges a change of `peft`). Where that is not known, those that differ from the defaults."""
    typed_here = getattr(cfg, "_given", None)  # what config.parse_config recorded as typed or in --config
    given = []
    for name, default in {**DEFAULTS, "lora_target_modules": [], "merge_lora": False}.items():
        typed, value = None if typed_here is None else name in typed_here, getattr(cfg, name)
        if (value is not False) if typed else (typed is None and value != default):  # --no-merge_lora is no LoRA
            given.append(f"--{name}")
    return given


def check(cfg) -> None:
    """The flags' combinations, when they are parsed (UsageError)."""
    if not cfg.use_peft:
        given = _given_without_peft(cfg)
        if given:
            raise UsageError(f"{given[0]} is for LoRA: add --use_peft (with a transformers model)")
        return
    if not cfg.merge_lora and cfg.save_dtype != "auto":
        raise UsageError(f"--save_dtype {cfg.save_dtype} is the dtype of a full model's export, and --use_peft "
                         f"exports only its fp32 adapter: add --merge_lora (the merged model is exported in "
                         f"{cfg.save_dtype}) or drop --save_dtype")
    if not (cfg.model_name_or_path or cfg.config_name):
        raise UsageError("--use_peft trains LoRA adapters on a transformers causal LM: add --model_name_or_path "
                         "PATH (or --config_name FOLDER --tokenizer_name FOLDER)")
    if cfg.dataset == "text_classification":
        raise UsageError("--use_peft is for causal LMs here, not classifiers (the head would need training too): "
                         "drop --use_peft for --dataset text_classification")
    if cfg.master_weights == "bf16":
        raise UsageError("--use_peft with --master_weights bf16: the base is already frozen in bf16 and only the "
                         "fp32 adapters train; bf16 adapters would save under 1% of the memory and lose their small "
                         "updates: drop --master_weights bf16")
    if cfg.fp32_modules:
        raise UsageError("--fp32_modules with --use_peft: the frozen base is stored in 16 bits and the adapters "
                         "are fp32 already: drop --fp32_modules")
    if cfg.lora_r < 1 or cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
        raise UsageError(f"--lora_r {cfg.lora_r}, --lora_alpha {cfg.lora_alpha:g}, --lora_dropout "
                         f"{cfg.lora_dropout:g}: give r >= 1, alpha > 0 and dropout in [0, 1)")


def check_engine(lora: LoraSettings, cfg: ModelSettings, prec, engine: str) -> None:
    """At the start, with the precision resolved and the engine known (UsageError)."""
    if not lora.use_peft:
        return
    if prec.effective not in DTYPES:
        raise UsageError(f"--use_peft freezes the base in 16 bits and trains under autocast: it needs "
                         f"--mixed_precision bf16 or fp16 (this run resolved to {prec.effective.replace('no', 'fp32')})")
    if engine == "deepspeed-zero3":
        raise UsageError("--use_peft is refused under ZeRO-3: it would shard and gather the frozen base every step "
                         "with no optimizer state to save (the base has none), and its 16-bit save of a peft model "
                         "is untested here; use ZeRO-2 or DDP (accelerate_configs/multi_cpu.yaml)")
    check_targets(lora, cfg)


ADAPTABLE = ("Linear", "Conv1D", "Embedding", "Conv1d", "Conv2d", "Conv3d", "MultiheadAttention")  # peft's


def linear_names(model) -> str:
    """The last part of the names of `model`'s linear layers (GPT-2's Conv1D too), for a message."""
    return ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if type(m).__name__ in ("Linear", "Conv1D")}))


def check_targets(lora: LoraSettings, cfg: ModelSettings) -> None:
    """Every named target module exists and is a layer peft adapts, checked on the model built from its config on
    the meta device (no weights loaded, nothing printed): a UsageError naming the wrong ones and the model's
    linear layers."""
    mods = target_modules(lora)
    if not lora.use_peft or not isinstance(mods, list):
        return
    from transformers import AutoConfig

    from .hf_folder import meta_model, remote_code

    model = meta_model(AutoConfig.from_pretrained(cfg.model_name_or_path or cfg.config_name, **remote_code()))
    found = {m: [type(mod).__name__ for n, mod in model.named_modules() if n == m or n.endswith("." + m)]
             for m in mods}
    kind = model.config.model_type
    missing = [m for m, types in found.items() if not types]
    if missing:
        raise UsageError(f"--lora_target_modules {','.join(missing)}: no such module in this {kind} model: name "
                         f"some of {linear_names(model)}, or give all-linear")
    other = {m: t for m, types in found.items() for t in types if t not in ADAPTABLE}
    if other:
        m, t = next(iter(other.items()))
        raise UsageError(f"--lora_target_modules {m} names a {t}, not a linear layer (LoRA adapts linear layers): "
                         f"name some of this {kind} model's linear layers: {linear_names(model)}, or give all-linear")


def settings(lora: LoraSettings) -> dict | None:
    """What the resume contract keeps fixed (None without LoRA)."""
    if not lora.use_peft:
        return None
    return {"r": lora.lora_r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout,
            "target_modules": target_modules(lora)}


def target_modules(lora: LoraSettings):
    mods = list(lora.lora_target_modules)
    return "all-linear" if mods == ["all-linear"] else (mods or None)


def apply(lora: LoraSettings, model, prec):
    """Wrap `model.hf` (fp32) with LoRA adapters; the base frozen. A missing target module is a UsageError."""
    if not lora.use_peft:
        return model
    from peft import LoraConfig, get_peft_model

    hf = model.hf
    fan_in_fan_out = hf.config.model_type == "gpt2"  # its Conv1D layers store weights transposed
    config = LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules=target_modules(lora), task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out)
    try:
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question; nothing for the user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model.hf = get_peft_model(hf, config)
    except ValueError as err:  # check_targets said the usual ones at the start; peft's text holds a module's repr
        said = " ".join(str(err).split())
        said = said[:100] + "..." if len(said) > 100 else said
        raise UsageError(f"--lora_target_modules {','.join(lora.lora_target_modules) or '(peft default)'}: peft "
                         f"refused it ({said}): name some of this model's linear layers: {linear_names(hf)}, or give "
                         f"all-linear") from None
    dtype = DTYPES[prec.effective]
    if dtype == torch.float16:
        limit = torch.finfo(dtype).max
        over = sorted(n for n, p in model.hf.named_parameters()
                      if not p.requires_grad and bool((p.detach().abs() > limit).any()))
        if over:
            raise UsageError(f"--use_peft under fp16: {len(over)} base weight(s) exceed fp16's range ({over[0]}): "
                             f"use --mixed_precision bf16")
    model.lora = {"base_dtype": str(dtype).removeprefix("torch.")}
    return model


def freeze_base(lora: LoraSettings, model, prec) -> None:
    """The frozen base's weights to the autocast dtype (after the fp32 start-up measurements)."""
    if not lora.use_peft:
        return
    dtype = DTYPES[prec.effective]
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def weights(model) -> dict:
    """Trainable and total parameters and the dtype of each, read from the (prepared) model."""
    def count(params):
        by = {}
        for p in params:
            name = str(p.dtype).removeprefix("torch.")
            by[name] = by.get(name, 0) + p.numel()
        return by

    params = list(model.hf.parameters())
    trainable, frozen = count(p for p in params if p.requires_grad), count(p for p in params if not p.requires_grad)
    n_train, n_total = sum(trainable.values()), sum(p.numel() for p in params)
    bytes_ = sum(p.numel() * p.element_size() for p in params)
    return {"source": model.source, "stored_dtype": model.stored_dtype, "lora": True,
            "trainable_parameters": n_train, "total_parameters": n_total, "trainable_dtypes": trainable,
            "frozen_dtypes": frozen, "weights_mb": round(bytes_ / 2**20, 2),
            "trainable_share": round(n_train / n_total, 6)}


def describe(model) -> str:
    w = weights(model)

    def dtypes(by):
        return " + ".join(f"{k}" for k in by) or "none"
    return (f"hf weights     {w['source']}: LoRA, trainable {w['trainable_parameters']:,} "
            f"({dtypes(w['trainable_dtypes'])}) of {w['total_parameters']:,} parameters "
            f"({100 * w['trainable_share']:.2f}%); frozen base {dtypes(w['frozen_dtypes'])}, stored "
            f"{w['stored_dtype']}; {w['weights_mb']:g} MB of weights")


def export_adapter(accelerator, raw, out, tokenizer_saver, masters: dict, place) -> dict:
    """The adapters with peft's save_pretrained into out/adapter (main process), put in place whole by
    `place(folder, save)` (hf_export.save_whole); `masters` ({name: fp32 weight}, DeepSpeed's master weights,
    hf_export.deepspeed_masters) replace the 16-bit copies DeepSpeed's model holds."""
    folder = out / FOLDER
    if accelerator.is_main_process:
        state = {**raw.hf.state_dict(), **masters} if masters else None
        place(folder, lambda tmp: (raw.hf.save_pretrained(tmp, state_dict=state), tokenizer_saver(tmp)))
        print(f"exported the LoRA adapter to {folder} with save_pretrained (peft.PeftModel.from_pretrained on "
              f"the base loads it)", flush=True)
    accelerator.wait_for_everyone()
    return {"status": "saved", "path": str(folder)}


def merged(raw, masters: dict | None = None) -> tuple[torch.nn.Module, dict]:
    """(an fp32 copy of the base with the adapters merged in, {name: fp32 delta} of the merged weights); the
    adapters from `masters` ({name: fp32 weight}) where given (DeepSpeed's master weights)."""
    twin = copy.deepcopy(raw.hf).float()
    if masters:
        params = dict(twin.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, weight in masters.items():
                params[name].copy_(weight)
    before = {n.replace(".base_layer", ""): p.detach().clone() for n, p in twin.get_base_model().named_parameters()
              if "lora_" not in n}
    plain = twin.merge_and_unload()
    deltas = {n: p.detach() - before[n] for n, p in plain.named_parameters()
              if n in before and not torch.equal(p.detach(), before[n])}
    return plain, deltas


def merge_lost(plain, deltas: dict, dtype: torch.dtype) -> dict:
    """Per merged weight: the elements whose adapter change a `dtype` export rounds back to the base value."""
    if dtype == torch.float32:
        return {}
    params = dict(plain.named_parameters())
    out = {}
    for name, delta in deltas.items():
        merged_w = params[name].detach()
        base = merged_w - delta
        lost = int(((delta != 0) & (merged_w.to(dtype) == base.to(dtype))).sum())
        if lost:
            out[name] = {"changed": int((delta != 0).sum()), "rounded_away": lost}
    return out
