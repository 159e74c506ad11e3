"""A Hugging Face transformers causal language model behind the recipe's model interface (`hf_causal_lm`).

`--model_name_or_path` (a folder with config.json, or a Hub id) loads a checkpoint; `--config_name` (a folder
with config.json) builds a freshly initialised model with `--tokenizer_name`. `mixprec.models.hf_flags` maps
those flags onto this model's settings before anything loads; the text datasets tokenize with the model's
tokenizer into blocks of `--block_size` tokens.

`CausalLM` is a thin adapter: `model(inputs)` returns the logits, the recipe's `loss_fn` computes the loss, so
the training loop is the same as for the built-in models. The weights are always trained in fp32 (master
weights under autocast): a 16-bit checkpoint is upcast at load, and `weights` says what was stored and what
that costs in memory. Exporting with `save_pretrained` is mixprec.models.hf_export.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..settings import Setting
from . import register

SETTINGS = {"name_or_path": Setting(None, str, optional=True), "config_name": Setting(None, str, optional=True),
            "tokenizer_name": Setting(None, str, optional=True), "block_size": Setting(None, int, 1, optional=True)}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


class _Adapter(nn.Module):
    """A transformers model `.hf` and what its checkpoint stored."""

    def __init__(self, hf, block_size: int, source: str, stored_dtype: str):
        super().__init__()
        self.hf, self.block_size, self.source, self.stored_dtype = hf, block_size, source, stored_dtype
        self.lora = None  # --use_peft: mixprec.models.lora sets it

    def weights(self) -> dict:
        """What the checkpoint stored and what is trained, for the banner and config.yaml."""
        if self.lora:
            from .lora import weights

            return weights(self)
        numel = sum(p.numel() for p in self.hf.parameters())
        held = next(self.hf.parameters()).dtype
        trained = _dtype_name(held)
        stored_bytes = numel * torch.empty(0, dtype=getattr(torch, self.stored_dtype)).element_size()
        out = {"source": self.source, "stored_dtype": self.stored_dtype, "trained_dtype": trained,
               "parameters": numel, "stored_mb": round(stored_bytes / 2**20, 2),
               "trained_mb": round(numel * torch.empty(0, dtype=held).element_size() / 2**20, 2)}
        sizes = f"{out['trained_mb']:g} MB instead of {out['stored_mb']:g} MB"
        if self.stored_dtype != trained and held == torch.float32:
            out["note"] = (f"upcast from {self.stored_dtype} at load: fp32 master weights, so small updates are not "
                           f"rounded away; {sizes}")
        elif self.stored_dtype != trained:  # DeepSpeed's 16-bit copy, or --master_weights bf16
            out["note"] = f"the model holds {trained} weights, {sizes}; where the updates land: 'master weights'"
        return out

    def describe(self) -> str:
        if self.lora:
            from .lora import describe

            return describe(self)
        w = self.weights()
        return (f"hf weights     {w['source']}: stored {w['stored_dtype']}, trained {w['trained_dtype']}"
                + (f" ({w['note']})" if "note" in w else f" ({w['trained_mb']:g} MB)"))


class CausalLM(_Adapter):
    """`forward(inputs) -> logits` over an `AutoModelForCausalLM`; `.hf` is the transformers model."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=inputs.long(), use_cache=False).logits

    def flops_per_token(self, seq_len: int) -> float:
        """6N + 12*L*H*Q*T (PaLM), N the parameters without the input embeddings, from the model's config."""
        c = self.hf.config
        n = sum(p.numel() for p in self.hf.parameters()) - self.hf.get_input_embeddings().weight.numel()
        return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len

    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` after `ids` (1, T), as the built-in GPT does (the same sample.txt)."""
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.block_size:])[:, -1, :].float() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(ids.device)
            ids = torch.cat([ids, nxt], dim=1)
        return ids


class Classifier(_Adapter):
    """`forward(inputs) -> logits (B, num_labels)` over an `AutoModelForSequenceClassification`; padding masked."""

    def __init__(self, hf, block_size: int, source: str, stored_dtype: str, pad_token_id: int):
        super().__init__(hf, block_size, source, stored_dtype)
        self.pad_token_id = pad_token_id

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids = inputs.long()
        return self.hf(input_ids=ids, attention_mask=(ids != self.pad_token_id).long()).logits


def _load(name_or_path: str | None, config_name: str | None, auto: str = "AutoModelForCausalLM"):
    """(transformers model in fp32, stored dtype name)."""
    import transformers
    from transformers import AutoConfig

    from .. import compat

    cls = getattr(transformers, auto)
    if name_or_path:
        try:
            config = AutoConfig.from_pretrained(name_or_path)
            stored = _dtype_name(getattr(config, "dtype", None) or torch.float32)
            with compat.whole_weights_under_zero3():
                return cls.from_pretrained(name_or_path, dtype=torch.float32), stored
        except (OSError, ValueError) as err:
            raise UsageError(f"--model_name_or_path {name_or_path} could not be loaded ({type(err).__name__}): check "
                             f"the folder, or the network for a Hub id") from None
    config = AutoConfig.from_pretrained(config_name)
    with compat.whole_weights_under_zero3():
        return cls.from_config(config, dtype=torch.float32), "float32"


def parameters_from_config(name: str, model_args: dict) -> int:
    """The parameters of model `name` (hf_causal_lm or hf_classifier) with `model_args`, counted on torch's meta
    device from its config alone (no weights read, no memory): what from_pretrained would load."""
    import transformers
    from transformers import AutoConfig

    from .. import compat

    auto = "AutoModelForSequenceClassification" if name == "hf_classifier" else "AutoModelForCausalLM"
    config = AutoConfig.from_pretrained(model_args["name_or_path"] or model_args["config_name"])
    with torch.device("meta"), compat.whole_weights_under_zero3():
        model = getattr(transformers, auto).from_config(config, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


@register("hf_classifier", SETTINGS)
def hf_classifier(info: dict, name_or_path, config_name, tokenizer_name, block_size) -> Classifier:
    if info.get("task") != "classification" or "pad_token_id" not in info:
        raise UsageError("model hf_classifier classifies text: use --dataset text_classification")
    hf, stored = _load(name_or_path, config_name, "AutoModelForSequenceClassification")
    if info["vocab_size"] > hf.get_input_embeddings().weight.shape[0]:
        raise UsageError("the tokenizer has more tokens than the model's embedding: give the model's own tokenizer "
                         "(--tokenizer_name)")
    source = name_or_path or f"{config_name} (fresh weights from its config)"
    return Classifier(hf, info["block_size"], source, stored, info["pad_token_id"])


@register("hf_causal_lm", SETTINGS)
def hf_causal_lm(info: dict, name_or_path, config_name, tokenizer_name, block_size) -> CausalLM:
    if not (name_or_path or config_name):
        raise UsageError("model hf_causal_lm needs --model_name_or_path PATH or --config_name FOLDER")
    if info.get("task") != "language_modeling":
        raise UsageError("--model_name_or_path trains a causal language model: use a text dataset "
                         "(--dataset stdlib, text or hub)")
    hf, stored = _load(name_or_path, config_name)
    vocab = hf.get_input_embeddings().weight.shape[0]
    if info["vocab_size"] > vocab:
        raise UsageError(f"the tokenizer has {info['vocab_size']} tokens but the model's embedding only {vocab}: "
                         f"give the model's own tokenizer (--tokenizer_name)")
    source = name_or_path or f"{config_name} (fresh weights from its config)"
    return CausalLM(hf, info["block_size"], source, stored)


hf_causal_lm.supports = hf_classifier.supports = ("gradient_checkpointing",)
