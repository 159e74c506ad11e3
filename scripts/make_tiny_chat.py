#!/usr/bin/env python
"""The committed tiny chat example (recipes/configs/chat_tiny.yaml), written again from nothing in seconds:

    python scripts/make_tiny_chat.py [OUT]    (default: recipes/configs/chat_tiny)

OUT/train.jsonl and OUT/validation.jsonl: conversations in TRL's 'messages' format where the assistant says the
user's words backwards (some with a system message, some of two exchanges), seeded; OUT/tokenizer: a byte-level
BPE tokenizer (vocabulary 400) trained by the `tokenizers` library on those conversations, with ChatML's
<|im_start|> and <|im_end|> as special tokens (EOS: <|im_end|>, pad: <|endoftext|>) and a ChatML chat template;
OUT/config: a Llama config.json (2 layers, hidden 64, 128 positions) for `--config_name` (fresh weights: no
weights are committed). About 80 KB in all.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("red green blue black white cat dog bird fish sun moon star tree rock rain snow one two three four "
         "apple pear plum bread milk").split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 400


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": "Say the words backwards."}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.2 else 1):
        words = rng.choices(WORDS, k=rng.randint(2, 4))
        messages += [{"role": "user", "content": " ".join(words)},
                     {"role": "assistant", "content": " ".join(reversed(words))}]
    return {"messages": messages}


def tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def make(out: Path, train_rows: int = 400, validation_rows: int = 40, seed: int = 0) -> dict[str, Path]:
    from transformers import LlamaConfig

    rng = random.Random(seed)
    rows = [conversation(rng) for _ in range(train_rows + validation_rows)]
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "validation": out / "validation.jsonl", "tokenizer": out / "tokenizer",
             "config": out / "config"}
    for name, part in (("train", rows[:train_rows]), ("validation", rows[train_rows:])):
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in part))
    tok = tokenizer(["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["messages"])
                     for row in rows])  # the conversations as CHATML renders them
    tok.save_pretrained(paths["tokenizer"])
    LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False).save_pretrained(paths["config"])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="recipes/configs/chat_tiny")
    for name, path in make(Path(parser.parse_args().out)).items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
