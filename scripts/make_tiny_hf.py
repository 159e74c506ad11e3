#!/usr/bin/env python
"""Tiny transformers models for offline runs and tests, built from configs in seconds, nothing downloaded.

    python scripts/make_tiny_hf.py OUT [--arch llama|llama_small|gpt2|gpt2_small|bert] [--dtype float32|bfloat16|float16]
                                       [--vocab N]

OUT/model: a causal LM (2 layers, hidden 64) with fresh weights, saved with save_pretrained in --dtype, and
its tokenizer: byte-level BPE (vocabulary 512) trained with the `tokenizers` library on this Python's
standard library sources. OUT/config: the same config.json alone (for --config_name) and OUT/tokenizer.
--arch gpt2_small: GPT-2 at the size of recipes/configs/gpt_small.yaml's GPT (6 layers, 6 heads, d=384, 256
positions, no dropout), the model of the peer benchmark (recipes/configs/hf_gpt2_small.yaml); --arch
llama_small: Llama at that size (6 layers, 6 heads, d=384, MLP 1024, 256 positions, untied head).
--vocab N: the tokenizer's and the model's vocabulary (default 512; e.g. 8192 for a head that costs as much
as a small real model's share: recipes/configs/hf_gpt2_small_8k.yaml).
--arch bert: a BERT-style sequence classifier (2 labels) with a word-level tokenizer (with a pad token), and
OUT/classify.csv: a keyword task (label 1 when a row holds the word "urgent"), 600 rows.
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


WORDS = ("the report is ready for review today please check the numbers and send them back when you can "
         "meeting moved to friday lunch is on the team budget draft notes").split()


def keyword_rows(n: int = 600, seed: int = 0) -> list[tuple[str, int]]:
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.choices(WORDS, k=rng.randint(4, 12))
        if i % 2:
            words.insert(rng.randrange(len(words) + 1), "urgent")
        rows.append((" ".join(words), i % 2))
    return rows


def word_tokenizer(texts: list[str]):
    """A word-level tokenizer with [PAD], [UNK], [CLS] and [SEP], trained on `texts`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def make_classifier(out: Path, dtype: str = "float32", seed: int = 0) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    torch.manual_seed(seed)
    rows = keyword_rows()
    tok = word_tokenizer([text for text, _ in rows])
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2, pad_token_id=0)
    model = AutoModelForSequenceClassification.from_config(cfg).to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    paths = {name: out / name for name in ("model", "config", "tokenizer")}
    model.save_pretrained(paths["model"])
    for folder in ("model", "tokenizer"):
        tok.save_pretrained(paths[folder])
    cfg.save_pretrained(paths["config"])
    paths["csv"] = write_rows(out / "classify.csv", rows)
    return paths


def write_rows(path: Path, rows: list[tuple[str, int]]) -> Path:
    """A text classification CSV: a header (text, label), then `rows`."""
    import csv

    with path.open("w", newline="") as f:
        csv.writer(f).writerows([("text", "label"), *rows])
    return path


def config(arch: str, vocab: int = VOCAB):
    VOCAB = vocab  # noqa: N806 (the configs below read it)
    if arch == "llama_small":  # gpt_small's size as a Llama: SwiGLU MLP of 8/3 x d, untied head
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                           num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=256,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                          eos_token_id=0)
    if arch == "gpt2_small":  # gpt_small's size; dropout 0.0 as mixprec's GPT (GPT-2's default is 0.1)
        from transformers import GPT2Config

        return GPT2Config(vocab_size=VOCAB, n_embd=384, n_layer=6, n_head=6, n_positions=256, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    raise SystemExit(f"--arch {arch}: pick llama, llama_small, gpt2 or gpt2_small")


def make(out: Path, arch: str = "llama", dtype: str = "float32", seed: int = 0,
         vocab: int = VOCAB) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = train_tokenizer(vocab)
    cfg = config(arch, vocab)
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
    parser.add_argument("--arch", default="llama", choices=("llama", "llama_small", "gpt2", "gpt2_small", "bert"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary of the tokenizer and the causal LM")
    args = parser.parse_args()
    build = (make_classifier if args.arch == "bert"
             else lambda out, dtype: make(out, args.arch, dtype, vocab=args.vocab))
    for name, path in build(Path(args.out), args.dtype).items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
