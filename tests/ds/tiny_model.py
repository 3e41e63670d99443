"""A tiny GPT-ish torch model (embedding, pre-LN attention + MLP blocks, untied head) and its data.

Shared by the DeepSpeed training script (run under torchrun) and the tests, which compute the torch
loss on a batch from imported fp32 weights and compare it with a JAX re-implementation.
Sizes are odd on purpose so that ZeRO's flat partitions straddle parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB = 53
DIM = 24
HIDDEN = 40
LAYERS = 2
SEQ = 12
BATCH = 6  # per step, split over the DP ranks by the training script


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=-1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `tokens` [batch, SEQ + 1]."""
        x = self.emb(tokens[:, :-1]) + self.pos
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, size: int = BATCH) -> torch.Tensor:
    """The global batch of training step `step` (deterministic)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)


def eval_batch() -> torch.Tensor:
    """A fixed batch for comparing losses across frameworks."""
    return batch(-999, 8)


def init_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    m = TinyGPT()
    with torch.no_grad():
        m.pos.normal_(0, 0.02)
    return m
