#!/usr/bin/env python
"""Tiny transformers models for offline runs and tests, built from configs in about 3 s, nothing downloaded.

    python scripts/make_tiny_hf.py OUT [--arch llama|gpt2] [--dtype float32|bfloat16|float16]

OUT/model: a causal LM (2 layers, hidden 64) with fresh weights, saved with save_pretrained in --dtype, and
its tokenizer: byte-level BPE (vocabulary 512) trained with the `tokenizers` library on this Python's
standard library sources. OUT/config: the same config.json alone (for --config_name) and OUT/tokenizer.
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

VOCAB = 512


def train_tokenizer(vocab_size: int = VOCAB, max_files: int = 200):
    """A byte-level BPE tokenizer trained on standard library files, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:max_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p.read_text(encoding="utf-8", errors="replace") for p in files), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def config(arch: str):
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                          eos_token_id=0)
    raise SystemExit(f"--arch {arch}: pick llama or gpt2")


def make(out: Path, arch: str = "llama", dtype: str = "float32", seed: int = 0) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = train_tokenizer()
    cfg = config(arch)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    paths = {name: out / name for name in ("model", "config", "tokenizer")}
    model.save_pretrained(paths["model"])
    tok.save_pretrained(paths["model"])
    tok.save_pretrained(paths["tokenizer"])
    cfg.save_pretrained(paths["config"])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    for name, path in make(Path(args.out), args.arch, args.dtype).items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
