"""A decoder-only transformer in the GPT-2 style (after nanoGPT): pre-LayerNorm blocks, causal
`scaled_dot_product_attention`, GELU MLPs, input and output embeddings tied (`lm_head` computes the logits
with `wte`'s weight), GPT-2 initialisation.

Presets: `gpt_tiny` (CPU tests), `gpt_small` (about 10M parameters with the byte vocabulary: d=384,
6 layers, 6 heads, context 256; also what `gpt` alone builds), `gpt2` (124M with GPT-2's tokenizer,
context 1024, for GPUs). Any other size by config alone: `model: gpt` and `model_args: {n_layer: 8, ...}`.
The vocabulary comes from the dataset (`info["vocab_size"]`), rounded up to a multiple of 64 above 256
(GPT-2's 50,257 becomes 50,304, as in nanoGPT: faster matmuls; the extra logits are never a label).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError
from ..typed_args import Setting, positive
from . import register

SETTINGS = {"n_layer": positive(6), "n_head": positive(6), "n_embd": positive(384), "block_size": positive(256),
            "dropout": Setting(0.0, float, 0, 1, open_high=True), "bias": Setting(True, bool)}


class TiedLinear(nn.Module):
    """The output layer tied to the token embedding: logits = x @ wte.weight^T, no weights of its own (the
    embedding is held as a plain reference, not a submodule, so a checkpoint holds its weight once, under
    `wte`). A module rather than an F.linear in the model's forward, so that the per-module tools see the
    logits matmul: the precision diff measures it alone, `--fp32_modules lm_head` keeps it in fp32, the health
    checks name it. Not an nn.Linear: fp8 conversion leaves it alone, as it left the F.linear."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embedding.weight)

    def extra_repr(self) -> str:
        vocab, n_embd = self.embedding.weight.shape
        return f"in_features={n_embd}, out_features={vocab}, bias=False, weight=wte.weight (tied)"


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.block_size, self.n_layer, self.n_head, self.n_embd = block_size, n_layer, n_head, n_embd
        self.activation_checkpointing = False  # set by --activation_checkpointing (mixprec.training.speed)
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = TiedLinear(self.wte)  # the output layer is the input embedding
        # GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 * layers)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab)."""
        T = inputs.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the context {self.block_size}")
        x = self.drop(self.wte(inputs) + self.wpe(torch.arange(T, device=inputs.device)))
        for block in self.h:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # keep only the block's input; recompute inside
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))  # tied: F.linear(x, wte.weight)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameters; without the position embeddings by default (the token embedding is also the output
        layer, so its matmul is counted), as nanoGPT counts them for FLOPs."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward and backward (PaLM appendix B, nanoGPT): 6N + 12 * L * H * Q * T."""
        return 6 * self.num_parameters() + 12 * self.n_layer * self.n_head * (self.n_embd // self.n_head) * seq_len

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` after `ids` (1, T), feeding back at most the last `block_size` tokens."""
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.block_size:])[:, -1, :].float() / temperature  # through the hooks (ZeRO-3)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(ids.device)
            ids = torch.cat([ids, nxt], dim=1)
        return ids


def _check(info: dict, block_size: int, n_embd: int, n_head: int, name: str) -> int:
    if info.get("task") != "language_modeling":
        raise UsageError(f"--model {name} is a language model: train it on text (--dataset stdlib, text or hub)")
    if n_embd % n_head:
        raise UsageError(f"n_embd={n_embd} is not a multiple of n_head={n_head}: fix --model_args")
    if info["block_size"] > block_size:
        raise UsageError(f"text blocks of {info['block_size']} tokens are longer than the context {block_size}")
    vocab = info["vocab_size"]
    return vocab if vocab <= 256 else math.ceil(vocab / 64) * 64


def _factory(name: str):
    def gpt(info: dict, n_layer: int, n_head: int, n_embd: int, block_size: int, dropout: float, bias: bool) -> GPT:
        vocab = _check(info, block_size, n_embd, n_head, name)
        return GPT(vocab, block_size, n_layer, n_head, n_embd, dropout, bias)
    gpt.supports = ("activation_checkpointing", "gradient_checkpointing")
    return gpt


register("gpt", SETTINGS)(_factory("gpt"))
register("gpt_tiny", SETTINGS, n_layer=2, n_head=4, n_embd=128, block_size=64)(_factory("gpt_tiny"))
register("gpt_small", SETTINGS, n_layer=6, n_head=6, n_embd=384, block_size=256)(_factory("gpt_small"))
register("gpt2", SETTINGS, n_layer=12, n_head=12, n_embd=768, block_size=1024)(_factory("gpt2"))
