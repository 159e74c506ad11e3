"""The final transformers model exported with `save_pretrained` (weights, config, tokenizer, generation config)
into `<output_dir>/hf_model`, in the checkpoint's own dtype unless `--save_dtype` says otherwise, config.json's
`dtype` matching the weights.

Before every export a range audit counts, per tensor, the values that are already NaN or infinite, and for a
16-bit export the values that overflow (finite in fp32, infinite in the target dtype: fp16 from 65520, bf16 from
about 3.3961e38) and those that flush to zero (non-zero in fp32, zero in the target dtype). An export with a
non-finite value or an overflow, in any dtype, is refused: the run still completes (exit code 0), its
model.safetensors and checkpoints are kept, summary.json's `hf_export` says `refused` and why, and one line
names the tensors and the fix (an overflow: `--save_dtype bf16` or `fp32`, with recipes/export.py, or with
`--resume_from_checkpoint latest`, which exports the finished run again without training: `refused` says that its
export is owed; so does a `--save_dtype` or `--merge_lora` typed there that differs from the run's own).

recipes/export.py exports a finished run again, from its model.safetensors or a checkpoint, through `export`
(the same function as the end of the run; `folders` says where, mixprec.run_folder.run_loading rebuilds the
model and checks the folder first).

A classifier's config.json carries the run's classes (`id2label`/`label2id`: its class names, else the
checkpoint's or transformers' LABEL_i) and the pad token id it was trained with (`pad_token_id`, which
decoder-only classifiers pool by), set on the model when it was built (mixprec.models.hf.hf_classifier).

The export writes the tokenizer the run loaded at its start (`keep_tokenizer`; a tokenizer that had no pad token
gets its EOS as pad, as the run padded), not the one its folder holds at the end, and a `mixprec_export.json` that marks the folder as this recipe's (mixprec.run_folder.rundir: a folder
without it in hf_model/'s place is the user's, and refused at the start).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import compat
from ..unwrap import unwrap

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

EXPORT_MARK = "mixprec_export.json"  # written into each export: the folder is this recipe's, not the user's (run_folder.rundir)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FOLDER = "hf_model"


def audit(model, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """{tensor name: {"overflow": n, "flush_to_zero": n, "non_finite": n}} for the tensors (of a module or a state
    dict) where any is not zero: values already infinite or NaN, finite values that `dtype` rounds to infinity (fp16
    from 65520; bf16 from about 3.3961e38, halfway past its largest value 3.3895e38), non-zero values it flushes to zero."""
    out = {}
    for name, t in (model.state_dict() if isinstance(model, torch.nn.Module) else model).items():
        if not t.is_floating_point():
            continue
        x = t.detach().float()
        finite = torch.isfinite(x)
        non_finite = int((~finite).sum())
        overflow = flush = 0
        if dtype != torch.float32:
            cast = x.to(dtype)
            overflow = int((finite & ~torch.isfinite(cast)).sum())
            flush = int(((x != 0) & (cast == 0)).sum())
        if overflow or flush or non_finite:
            out[name] = {"overflow": overflow, "flush_to_zero": flush, "non_finite": non_finite}
    return out


def target_dtype(save_dtype: str, stored: str) -> torch.dtype:
    return getattr(torch, stored) if save_dtype == "auto" else DTYPES[save_dtype]


def refused(summary: dict) -> bool:
    """Whether a finished run's summary.json (read) says its export was refused: the run owes its export."""
    return (summary.get("hf_export") or {}).get("status") == "refused"


def deepspeed_masters(accelerator, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 master weight, whole, on the CPU} of `module`'s trained parameters under DeepSpeed
    ZeRO-1/2/3, on the main process ({} on the others and without DeepSpeed), from DeepSpeed's public
    `deepspeed.utils.safe_get_full_fp32_param`. Under bf16/fp16 DeepSpeed's model holds 16-bit copies and the
    fp32 masters live sharded in its optimizer; each call gathers one parameter's (an all-reduce under ZeRO-1/2,
    an all-gather under ZeRO-3), so every process must call this, with the same module (the others drop what
    they gathered: a whole fp32 model in every process would not fit a node). Frozen parameters have none
    (DeepSpeed returns None) and are left out; a parameter registered under several names (tied weights) is
    gathered once and given under each name."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is None:
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    names: dict[int, list[str]] = {}
    params = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    out = {}
    for key, p in params.items():  # the same order on every process: the module's registration order
        full = safe_get_full_fp32_param(p)  # a collective: every process calls it; the main one keeps the result
        if full is not None and accelerator.is_main_process:
            full = full.detach().to("cpu", torch.float32).reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
            out.update({name: full for name in names[key]})
    return out


def full_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """The transformers model's whole state dict on the main process (every process must call it). Under
    DeepSpeed the trained weights are its fp32 master weights (`deepspeed_masters`, on the main process), not the
    16-bit copies its model holds under bf16/fp16; the rest (buffers, frozen weights) comes from
    `accelerator.get_state_dict`, which under ZeRO-3 gathers the shards to the main process only."""
    raw = unwrap(accelerator, model)
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        state = accelerator.get_state_dict(model)
        state = {k.removeprefix("hf."): v for k, v in (state or {}).items()}
        state.update(deepspeed_masters(accelerator, raw.hf))
    else:
        state = raw.hf.state_dict()
    return {k: v.detach().cpu() for k, v in state.items()}


def export(accelerator, model, cfg, out: Path, folders: dict[str, Path] | None = None) -> dict:
    """{"hf_export": {...}} for summary.json (with --use_peft: "lora_export", and "hf_export" with --merge_lora);
    {} for a model that is not a transformers one. Every process calls it: the end of a run, and
    recipes/export.py on a finished run. `folders` says where each export goes (the run's end:
    {"hf_export": out/hf_model, "lora_export": out/adapter}); an export it does not name is not written. The
    adapter's folder is always named adapter/ (mixprec.models.lora.export_adapter)."""
    raw = unwrap(accelerator, model)
    if not hasattr(raw, "hf"):
        return {}
    from . import lora

    folders = {"hf_export": out / FOLDER, "lora_export": out / lora.FOLDER} if folders is None else folders
    hf, result, done = raw.hf, {}, {}
    if raw.lora:
        masters = deepspeed_masters(accelerator, raw.hf)  # the fp32 adapters under DeepSpeed; every process calls
        if "lora_export" in folders:
            trained = {n: p.detach().cpu() for n, p in raw.hf.named_parameters() if p.requires_grad}
            verdict = _verdict(accelerator, {**trained, **masters}, torch.float32, {})  # NaN or inf: no adapter
            if verdict["status"] == "refused":
                return {"lora_export": verdict}
            done = {"lora_export": lora.export_adapter(accelerator, raw, folders["lora_export"].parent,
                                                       lambda f: _save_tokenizer(raw, f), masters, save_whole)}
        if not cfg.merge_lora or "hf_export" not in folders:
            return done
        hf, deltas = lora.merged(raw, masters)
        lost = lora.merge_lost(hf, deltas, target_dtype(cfg.save_dtype, raw.stored_dtype))
        result = {"merged_lora": {"merged_tensors": len(deltas), "rounded_away": lost}}
        state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}  # ZeRO-3 is refused with LoRA
    else:
        state = full_state_dict(accelerator, model)  # every process takes part under ZeRO-3
    if "hf_export" not in folders:
        return done
    return {**done, "hf_export": _export_full(accelerator, raw, hf, state, cfg.save_dtype, folders["hf_export"],
                                              result)}


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _decide(state: dict, dtype: torch.dtype, result: dict) -> dict:
    """The range audit of `state` in `dtype` and the verdict: "refused" (a non-finite value, or one that `dtype`
    cannot hold, with the line saying so) or "audited"."""
    name = str(dtype).removeprefix("torch.")
    report = audit(state, dtype)
    overflow = sorted(k for k, v in report.items() if v["overflow"])
    broken = sorted(k for k, v in report.items() if v["non_finite"])
    result = {**result, "dtype": name, "audit": report, "audited_tensors": len(state)}
    if broken:
        count = sum(report[k]["non_finite"] for k in broken)
        line = (f"export refused: {len(broken)} tensor(s) hold {count} NaN or infinite value(s) ({_names(broken)}); "
                f"the run and its checkpoints are kept: no dtype can export them; resume an earlier checkpoint "
                f"(--resume_from_checkpoint runs/NAME/checkpoints/step_N) with a lower --lr")
        return {**result, "status": "refused", "reason": line}
    if overflow:
        other = "--save_dtype bf16 or fp32" if dtype == torch.float16 else "--save_dtype fp32"
        line = (f"export refused: {len(overflow)} tensor(s) exceed {name}'s range ({_names(overflow)}); the run and "
                f"its checkpoints are kept: export with {other} (python recipes/export.py RUN_FOLDER "
                f"{other.split(' or ')[0]}, or the run's command with --resume_from_checkpoint latest)")
        return {**result, "status": "refused", "reason": line}
    return {**result, "status": "audited"}


def _verdict(accelerator, state: dict, dtype: torch.dtype, result: dict) -> dict:
    """`_decide` on the main process, which holds the whole state (under ZeRO-3 too); the others follow. A refusal
    is said in one line."""
    from accelerate.utils import broadcast_object_list

    verdict = [_decide(state, dtype, result) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict)
    if verdict[0]["status"] == "refused" and accelerator.is_main_process:
        print(verdict[0]["reason"], flush=True)
    return verdict[0]


def _export_full(accelerator, raw, hf, state: dict, save_dtype: str, folder: Path, result: dict) -> dict:
    """save_pretrained of `hf` with the weights `state` into `folder` after the range audit (refused for a
    non-finite value or an overflow)."""
    dtype = target_dtype(save_dtype, raw.stored_dtype)
    result = _verdict(accelerator, state, dtype, result)
    if result["status"] == "refused":
        return result
    name, report = result["dtype"], result["audit"]
    if accelerator.is_main_process:
        config = copy.deepcopy(hf.config)
        config.dtype = dtype
        with compat.whole_weights_under_zero3():  # whole, in fp32; then the gathered weights in the export's dtype
            twin = type(hf)(config)
        twin.load_state_dict(state)
        if getattr(hf, "generation_config", None) is not None:  # the checkpoint's own, not one rebuilt from config
            twin.generation_config = copy.deepcopy(hf.generation_config)
        twin = twin.to(dtype)
        save_whole(folder, lambda tmp: (twin.save_pretrained(tmp), _save_tokenizer(raw, tmp)))
        print(f"exported {folder} with save_pretrained in {name}" + _merge_words(result, name)
              + f" ({_audit_words(report, len(state), dtype)})", flush=True)
    accelerator.wait_for_everyone()
    return {**result, "status": "saved", "path": str(folder)}


def _merge_words(result: dict, name: str) -> str:
    if "merged_lora" not in result:
        return ""
    lost = sum(v["rounded_away"] for v in result["merged_lora"]["rounded_away"].values())
    rounded = f"; {name} rounds {lost} changed weights back to the base's" if lost else ""
    return " (LoRA merged in fp32" + rounded + ")"


def _audit_words(report: dict, tensors: int, dtype: torch.dtype) -> str:
    """What the range audit found, said even when it found nothing."""
    if dtype == torch.float32:
        return f"fp32: all {tensors} tensors finite"
    if not report:
        return f"range audit: all {tensors} tensors fit, no value overflows or flushes to zero"
    flushed = sum(v["flush_to_zero"] for v in report.values())
    return f"range audit: {flushed} values flushed to zero in {len(report)} of {tensors} tensors"


def save_whole(folder: Path, save) -> None:
    """`save` into a hidden `.NAME.tmp` folder, then put it in place: the previous export is moved aside to
    `.NAME.old`, the new one renamed in, and only then the old one deleted. A full disk or a crash leaves the
    previous export or the new one whole, never half of one and never none (temporary folders are removed on
    failure; a `.NAME.old` left by a crash between the two renames is put back first)."""
    import os
    import shutil

    tmp, old = folder.with_name(f".{folder.name}.tmp"), folder.with_name(f".{folder.name}.old")
    if old.is_dir() and not folder.exists():
        os.replace(old, folder)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    try:
        save(tmp)
        (tmp / EXPORT_MARK).write_text(json.dumps({"written_by": "mixprec", "run_folder": str(folder.parent)}) + "\n")
        compat.umask_modes(tmp)
        if folder.is_dir():
            os.replace(folder, old)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir() and not folder.exists():
            os.replace(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def keep_tokenizer(cfg: ModelSettings, data: DataSettings, model) -> None:
    """The run's tokenizer (the one its data was tokenized with), loaded at the start and kept on the
    transformers model (`model.tokenizer`), so that the export writes the tokenizer the run used, even when its
    folder has moved or changed since. None for byte tokens (no transformers tokenizer to export)."""
    if not hasattr(model, "hf"):
        return
    from transformers import AutoTokenizer

    from .hf_folder import remote_code

    args = cfg.model_args or {}
    name = ((data.dataset_args or {}).get("tokenizer") or args.get("tokenizer_name") or args.get("name_or_path")
            or args.get("config_name"))
    model.tokenizer = None if name in (None, "bytes") else AutoTokenizer.from_pretrained(name, **remote_code())
    if model.tokenizer is not None and (getattr(model, "labels", None) or {}).get("pad_from_eos"):
        model.tokenizer.pad_token = model.tokenizer.eos_token  # as the run padded: the export pads the same way


def _save_tokenizer(raw, folder: Path) -> None:
    if raw.tokenizer is not None:
        raw.tokenizer.save_pretrained(folder)
