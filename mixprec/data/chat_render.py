"""Rows of `--dataset chat` as token ids and loss masks, then as training rows (mixprec.data.chat reads the data).

- 'messages': the conversation rendered with the tokenizer's chat template (`apply_chat_template`, text, then
  tokenized without special tokens, as `apply_chat_template(tokenize=True)` does). With --assistant_only_loss
  (the default here; TRL's default is off) the targets are the assistant's tokens: where the template marks them
  with `{% generation %}` tags, transformers' `return_assistant_tokens_mask`; otherwise, for each assistant message
  i, the tokens between the rendering of messages[:i] with the generation prompt and that of messages[:i + 1],
  each of which must be a token prefix of the whole conversation (else the template is not prefix-stable: one
  line). The targets are then the message's content and what the template writes after it up to the next turn
  (ChatML: `<|im_end|>` and its line break).
- 'prompt'/'completion' as lists of messages: the prompt rendered with the generation prompt must be a token prefix
  of prompt + completion rendered (TRL warns where it is not; here it is one line); with --completion_only_loss
  (TRL's default too) the targets are the tokens after it.
- 'prompt'/'completion' as text: the completion gets the tokenizer's EOS token unless it ends with it, and
  prompt + completion is tokenized as one text (special tokens added as the tokenizer adds them), as TRL does;
  the prompt's tokens must be a prefix of it (a token that spans both, e.g. a prompt ending in a space, is one
  line: TRL would cut the mask inside it).

A sequence keeps its first block_size + 1 tokens (TRL's truncation_mode 'keep_start'); `inputs` are ids[:-1],
`labels` ids[1:] with -100 where the token is not a target, both right-padded to block_size (padding: the
tokenizer's pad token, else its EOS; its labels -100). Under causal attention a real token never attends to a
later position, so right padding changes no target's loss and needs no attention mask. A row left without a
target token is dropped (counted).
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import UsageError

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
CONVERSATION_FORMATS = ("messages", "prompt_completion_messages")


def _shown(text: str, limit: int = 30) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class Renderer:
    """Token ids and targets of one row of `fmt`, and the training row they make. `tok`: a transformers
    tokenizer; `masked`: the loss on the assistant's (or completion's) tokens only; `flag_off`: the flag that
    turns the mask off, named in the errors."""

    def __init__(self, tok, fmt: str, masked: bool, block: int, source: str):
        self.tok, self.fmt, self.masked, self.block, self.source = tok, fmt, masked, block, source
        self.flag_off = "--no-assistant_only_loss" if fmt == "messages" else "--no-completion_only_loss"
        self.tags = bool(GENERATION_TAG.search(tok.chat_template or "")) and fmt == "messages"
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = 0 if pad is None else int(pad)

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]  # Arrow fills absent keys
        return self.tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, texts: list[str], special: bool = False) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=special)["input_ids"]

    def ids_and_targets(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token is a target) of one row."""
        if self.fmt == "messages":
            return self._messages(row["messages"], where)
        if self.fmt == "prompt_completion_messages":
            prompt, whole = self.encode([self.render(row["prompt"], True), self.render(row["prompt"] + row["completion"])])
        else:
            completion, eos = row["completion"], self.tok.eos_token
            if eos and not completion.endswith(eos):
                completion += eos
            prompt, whole = self.encode([row["prompt"], row["prompt"] + completion], special=True)
        if not self.masked:
            return whole, [1] * len(whole)
        if whole[:len(prompt)] != prompt:
            self._not_a_prefix(where, "the prompt", prompt, whole)
        return whole, [0] * len(prompt) + [1] * (len(whole) - len(prompt))

    def _messages(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        if self.masked and self.tags:
            clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
            out = self.tok.apply_chat_template(clean, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"] if self.masked else []
        texts = [self.render(messages)]
        for i in turns:
            texts += [self.render(messages[:i], True), self.render(messages[:i + 1])]
        whole, *parts = self.encode(texts)
        if not self.masked:
            return whole, [1] * len(whole)
        targets = [0] * len(whole)
        for n, i in enumerate(turns):
            before, through = parts[2 * n], parts[2 * n + 1]
            for part, what in ((before, f"messages[:{i}] with the generation prompt"), (through, f"messages[:{i + 1}]")):
                if whole[:len(part)] != part:
                    self._not_a_prefix(where, what, part, whole)
            targets[len(before):len(through)] = [1] * (len(through) - len(before))
        return whole, targets

    def _not_a_prefix(self, where: str, what: str, part: list[int], whole: list[int]) -> None:
        at = next((k for k, (a, b) in enumerate(zip(part, whole)) if a != b), min(len(part), len(whole)))
        said = (f"{_shown(self.tok.decode(part[at:at + 2]))} where the whole has "
                f"{_shown(self.tok.decode(whole[at:at + 2]))}")
        if self.fmt == "prompt_completion":
            fix = ("a token spans the prompt's end and the completion's start: end the prompt without a space and "
                   f"start the completion with it (' blue.'), or pass {self.flag_off}")
        else:
            fix = (f"the chat template is not prefix-stable: use a template with {{% generation %}} tags around the "
                   f"assistant's content, or pass {self.flag_off}")
        raise UsageError(f"{self.source}: {where}: the tokens of {what} are not the start of the whole row's (token "
                         f"{at}: {said}): {fix}")

    def block_row(self, ids: list[int], targets: list[int]) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """(inputs, labels, cut) padded to the block; None when no target token is left in it."""
        cut = len(ids) > self.block + 1
        ids, targets = ids[:self.block + 1], targets[:self.block + 1]
        labels = np.where(np.asarray(targets[1:], dtype=bool), ids[1:], -100) if len(ids) > 1 else np.zeros(0)
        if not (labels != -100).any():
            return None
        inputs = np.full(self.block, self.pad_token_id, dtype=np.int32)
        out = np.full(self.block, -100, dtype=np.int32)
        inputs[:len(ids) - 1], out[:len(labels)] = ids[:-1], labels
        return inputs, out, cut


def check_template(tok, fmt: str, flag: str | None, name: str) -> None:
    """A conversation format needs the tokenizer's chat template: one line naming how to add one."""
    if fmt in CONVERSATION_FORMATS and not tok.chat_template:
        raise UsageError(f"{flag or 'tokenizer'} {name}: the tokenizer has no chat template, which renders "
                         f"the conversations of --dataset chat: set \"chat_template\" in its tokenizer_config.json "
                         f"(or save a chat_template.jinja beside it: tokenizer.chat_template = \"...\"; "
                         f"tokenizer.save_pretrained(folder)), or give --tokenizer_name a tokenizer that has one")
