"""The end of a language-model run: a short generated sample, printed and saved to <output_dir>/sample.txt,
so that a user sees what the model learned. Sampling: temperature 0.8, top-k 40, seeded by --seed; the
prompt is --sample_prompt, else the first 32 tokens of the first validation block (chat data: the first
validation conversation up to where its first answer starts). Evaluation precision
(--eval_precision) applies: fp32 by default.

Every process samples, with the same prompt and seed: engines that shard the weights (ZeRO-3, FSDP) gather
them in each forward pass, which needs every process; the main process writes the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import compat
from .validation import upcast
from ..unwrap import unwrap

PROMPT_TOKENS, TEMPERATURE, TOP_K = 32, 0.8, 40


def write_sample(model, bundle, cfg, accelerator, out: Path, fp32: bool) -> str | None:
    """Returns the text written, or None when there is nothing to sample."""
    raw = unwrap(accelerator, model)
    if not hasattr(raw, "generate") or bundle.decode is None or cfg.sample_tokens == 0:
        return None
    if cfg.sample_prompt:
        prompt = torch.as_tensor(bundle.encode(cfg.sample_prompt), dtype=torch.long)[-raw.block_size:]
    elif bundle.info.get("variable_targets"):  # chat: the first conversation up to its first answer
        row = bundle.validation[0]
        first = int((torch.as_tensor(row["labels"]) != -100).nonzero()[0])
        prompt = torch.as_tensor(row["inputs"][:first + 1]).long()
    else:
        prompt = torch.as_tensor(bundle.validation[0]["inputs"][:PROMPT_TOKENS]).long()
    generator = torch.Generator().manual_seed(cfg.seed)
    raw.eval()
    with torch.no_grad(), compat.autocast_off(model, accelerator, enabled=fp32), upcast(model, accelerator, fp32):
        ids = raw.generate(prompt[None].to(accelerator.device), cfg.sample_tokens, TEMPERATURE, TOP_K, generator)
    raw.train()
    if not accelerator.is_main_process:
        return None
    new = ids[0, len(prompt):].tolist()
    text = (f"# {cfg.model} on {cfg.dataset}: {len(new)} tokens sampled after the prompt "
            f"(temperature {TEMPERATURE}, top-k {TOP_K}, seed {cfg.seed})\n"
            f"--- prompt ---\n{bundle.decode(prompt.tolist())}\n--- generated ---\n{bundle.decode(new)}\n")
    (out / "sample.txt").write_text(text)
    print(f"sample ({out / 'sample.txt'}):\n{text}", flush=True)
    return text
