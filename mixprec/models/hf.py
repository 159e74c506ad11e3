"""A Hugging Face transformers causal language model behind the recipe's model interface (`hf_causal_lm`).

`--model_name_or_path` (a folder with config.json, or a Hub id) loads a checkpoint; `--config_name` (a folder
with config.json) builds a freshly initialised model with `--tokenizer_name`. `mixprec.models.hf_flags` maps
those flags onto this model's settings before anything loads; the text datasets tokenize with the model's
tokenizer into blocks of `--block_size` tokens.

`CausalLM` is a thin adapter: `model(inputs)` returns the logits, the recipe's `loss_fn` computes the loss, so
the training loop is the same as for the built-in models. The weights are always trained in fp32 (master
weights under autocast): a 16-bit checkpoint is upcast at load, and `weights` says what was stored and what
that costs in memory. Exporting with `save_pretrained` is mixprec.models.hf_export.

The folder was checked at the start (mixprec.models.hf_folder: config.json, the safetensors headers, the
tokenizer); `_load` refuses in one line what only loading finds: weights whose shapes differ from config.json, a
checkpoint that lacks parameters its config describes or holds weights of the model's body it has no place for,
and NaN or inf in a parameter (which training would otherwise blame on the learning rate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..typed_args import Setting
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
        self.fresh_head: list[str] = []  # a classifier's head the checkpoint lacked: freshly initialised

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
        if self.fresh_head:
            out["new_head"] = self.fresh_head
        return out

    def describe(self) -> str:
        if self.lora:
            from .lora import describe

            return describe(self)
        w = self.weights()
        return (f"hf weights     {w['source']}: stored {w['stored_dtype']}, trained {w['trained_dtype']}"
                + (f" ({w['note']})" if "note" in w else f" ({w['trained_mb']:g} MB)")
                + (f"; new head {_names(w['new_head'])} (not in the checkpoint)" if "new_head" in w else ""))


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
    """`forward(inputs) -> logits (B, num_labels)` over an `AutoModelForSequenceClassification`; padding masked.
    `labels`: what the banner and config.yaml say of the head (its classes, where they come from, the pad)."""

    def __init__(self, hf, block_size: int, source: str, stored_dtype: str, pad_token_id: int):
        super().__init__(hf, block_size, source, stored_dtype)
        self.pad_token_id = pad_token_id
        self.labels: dict = {}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids = inputs.long()
        return self.hf(input_ids=ids, attention_mask=(ids != self.pad_token_id).long()).logits

    def weights(self) -> dict:
        return {**super().weights(), **self.labels}

    def describe(self) -> str:
        c = self.labels
        names = list(c["id2label"].values())
        said = (f"; {c['num_labels']} classes ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                f"{': ' + c['classes_from'] if c.get('classes_from') else ''})")
        if c.get("pad_from_eos"):
            said += f"; pad token: the tokenizer has none, its EOS {c['pad_from_eos']!r} pads (id {self.pad_token_id})"
        return super().describe().replace(" (not in the checkpoint)", f" ({c.get('head', 'not in the checkpoint')})") + said


def _load(name_or_path: str | None, config_name: str | None, auto: str = "AutoModelForCausalLM",
          labels: dict | None = None):
    """(transformers model in fp32, stored dtype name, the head's parameters the checkpoint lacked or had in
    another size: freshly initialised, those it had in another size). `labels` (a classifier): the head's `num_labels` and `id2label` set in
    the config before the model is built, a checkpoint's head of another size replaced (transformers'
    `ignore_mismatched_sizes=True`). The folder was checked at the start (mixprec.models.hf_folder); what only
    loading finds is a UsageError here: weights whose shapes differ from config.json, weights a causal LM lacks or
    has no place for, NaN or inf in a parameter."""
    import transformers
    from transformers import AutoConfig

    from .. import compat
    from .hf_folder import large, quiet_transformers, remote_code

    cls = getattr(transformers, auto)
    if not name_or_path:
        config = _classes(AutoConfig.from_pretrained(config_name, **remote_code()), labels)
        with compat.whole_weights_under_zero3():
            return cls.from_config(config, dtype=torch.float32, **remote_code()), "float32", [], []
    flag = f"--model_name_or_path {name_or_path}"
    try:
        config = AutoConfig.from_pretrained(name_or_path, **remote_code())
        stored = _dtype_name(getattr(config, "dtype", None) or torch.float32)
        before = config.num_labels
        config = _classes(config, labels)
        # its load report is said below, in one line; the loading bar only where loading takes a while
        with compat.whole_weights_under_zero3(), quiet_transformers(bar=large(name_or_path)):
            hf, info = cls.from_pretrained(name_or_path, config=config, dtype=torch.float32, output_loading_info=True,
                                           ignore_mismatched_sizes=config.num_labels != before, **remote_code())
    except (OSError, ValueError) as err:
        raise UsageError(f"{flag} could not be loaded ({type(err).__name__}): check the folder, or the network for "
                         f"a Hub id") from None
    except RuntimeError as err:
        if "mismatched" not in str(err).lower() and "size mismatch" not in str(err).lower():
            raise
        raise UsageError(f"{flag}: its weights' shapes differ from its config.json's (a changed vocab_size, "
                         f"hidden_size or layer size?): repair config.json, or copy the folder again") from None
    fresh = _check_loaded(flag, hf, info, auto)
    _check_finite(flag, hf)
    replaced = sorted({key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys") or ()})
    return hf, stored, fresh, replaced


def _classes(config, labels: dict | None):
    """`config` with the classifier's head size and label names (`labels`: "num_labels", "id2label" or None: the
    checkpoint's where the size is its own, else transformers' LABEL_i)."""
    if labels is None:
        return config
    if labels.get("id2label"):
        config.id2label = {int(i): str(name) for i, name in labels["id2label"].items()}
        config.label2id = {name: i for i, name in config.id2label.items()}
    else:
        config.num_labels = labels["num_labels"]  # transformers' setter: LABEL_i names where the size changes
    return config


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _check_loaded(flag: str, hf, info: dict, auto: str) -> list[str]:
    """Refuse a checkpoint that does not fill the model its config.json describes: a parameter it lacks (a
    classifier's head may be new: returned, said in the banner), or weights of the model's body that the config
    has no place for (fewer layers). Other weights it holds (a value head, an MLM head) are left, as transformers
    leaves them; so are buffers, which the model's code makes."""
    params = {n for n, _ in hf.named_parameters()}
    body = f"{hf.base_model_prefix}." if hf.base_model_prefix else None
    missing = set(info.get("missing_keys") or ()) & params
    mismatched = {key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys") or ()}
    if body and any(k.startswith(body) for k in mismatched):  # only a classifier's head may change its size
        raise UsageError(f"{flag}: its weights' shapes differ from its config.json's ({_names(mismatched)}): "
                         f"repair config.json, or copy the folder again")
    missing |= mismatched & params
    fresh = sorted(k for k in missing if body and not k.startswith(body)) if auto.endswith("Classification") else []
    missing -= set(fresh)
    unexpected = {k for k in info.get("unexpected_keys") or () if body and k.startswith(body)}
    if missing or unexpected:
        said = [f"lacks {len(missing)} weight(s) its config.json describes ({_names(missing)})"] * bool(missing)
        said += [f"holds {len(unexpected)} weight(s) its config.json has no place for ({_names(unexpected)})"] * bool(unexpected)
        raise UsageError(f"{flag} does not match its config.json: it {' and '.join(said)}: repair the folder "
                         f"(config.json and the weights from one save_pretrained)")
    return fresh


def _check_finite(flag: str, hf) -> None:
    """Refuse NaN or inf in a parameter (buffers may hold -inf masks): training would blame the learning rate."""
    bad = {n: p for n, p in hf.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())}
    if bad:
        count = sum(int((~torch.isfinite(p)).sum()) for p in bad.values())
        shown = ", ".join(list(bad)[:3]) + (", ..." if len(bad) > 3 else "")
        raise UsageError(f"{flag} holds non-finite weights: {count:,} values in {len(bad)} tensors ({shown}): "
                         f"repair the checkpoint or load another")


def parameters_from_config(name: str, model_args: dict) -> int:
    """The parameters of model `name` (hf_causal_lm or hf_classifier) with `model_args`, counted on torch's meta
    device from its config alone (no weights read, no memory): what from_pretrained would load."""
    from transformers import AutoConfig

    from .hf_folder import meta_model, remote_code

    config = AutoConfig.from_pretrained(model_args.get("name_or_path") or model_args["config_name"], **remote_code())
    return sum(p.numel() for p in meta_model(config, name == "hf_classifier").parameters())


@register("hf_classifier", SETTINGS)
def hf_classifier(info: dict, name_or_path, config_name, tokenizer_name, block_size) -> Classifier:
    if info.get("task") != "classification" or "pad_token_id" not in info:
        raise UsageError("model hf_classifier classifies text: use --dataset text_classification")
    num, before = info["num_classes"], info.get("checkpoint_num_labels", info["num_classes"])
    hf, stored, fresh, replaced = _load(name_or_path, config_name, "AutoModelForSequenceClassification",
                              {"num_labels": num, "id2label": info.get("id2label")})
    if info["vocab_size"] > hf.get_input_embeddings().weight.shape[0]:
        raise UsageError("the tokenizer has more tokens than the model's embedding: give the model's own tokenizer "
                         "(--tokenizer_name)")
    hf.config.pad_token_id = info["pad_token_id"]  # the last-token pooling of decoder-only models (Llama, GPT-2)
    source = name_or_path or f"{config_name} (fresh weights from its config)"
    model = Classifier(hf, info["block_size"], source, stored, info["pad_token_id"])
    model.fresh_head = fresh
    model.labels = {"num_labels": hf.config.num_labels,
                    "id2label": {int(i): name for i, name in hf.config.id2label.items()},
                    "classes_from": (info.get("classes_from") or "class names, sorted") if info.get("label_names") else ""}
    if replaced:
        model.labels["head"] = f"replaced: the checkpoint's has {before} outputs, this run {num}"
        model.labels["checkpoint_num_labels"] = before
    if info.get("pad_from_eos"):
        model.labels["pad_from_eos"] = info["pad_from_eos"]
    return model


@register("hf_causal_lm", SETTINGS)
def hf_causal_lm(info: dict, name_or_path, config_name, tokenizer_name, block_size) -> CausalLM:
    if not (name_or_path or config_name):
        raise UsageError("model hf_causal_lm needs --model_name_or_path PATH or --config_name FOLDER")
    if info.get("task") != "language_modeling":
        raise UsageError("--model_name_or_path trains a causal language model: use a text dataset "
                         "(--dataset stdlib, text or hub)")
    hf, stored, *_ = _load(name_or_path, config_name)
    vocab = hf.get_input_embeddings().weight.shape[0]
    if info["vocab_size"] > vocab:
        raise UsageError(f"the tokenizer has {info['vocab_size']} tokens but the model's embedding only {vocab}: "
                         f"give the model's own tokenizer (--tokenizer_name)")
    source = name_or_path or f"{config_name} (fresh weights from its config)"
    return CausalLM(hf, info["block_size"], source, stored)


hf_causal_lm.supports = hf_classifier.supports = ("gradient_checkpointing",)
