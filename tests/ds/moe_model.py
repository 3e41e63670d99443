"""A tiny mixture-of-experts torch model on DeepSpeed's `deepspeed.moe.layer.MoE`, and its data.

Embedding, one pre-LN MoE block (4 GELU-MLP experts, top-2 gate) and an untied head; the loss is
next-token cross-entropy plus 0.01 x the gate's load-balancing loss. Every expert is initialised
from its global index, so the model is the same whatever the expert-parallel size. Needs DeepSpeed
(imported by the torchrun script only; the tests read what it wrote without it).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 37
DIM = 16
HIDDEN = 24
EXPERTS = 4
SEQ = 8
BATCH = 12  # per step, split over the DP ranks (2, 3 or 4 of them)
AUX = 0.01


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class TinyMoE(nn.Module):
    """With `second_ep`, a second MoE block of 2 x EXPERTS experts at that expert-parallel size
    follows (a pyramid MoE: layers of different sizes, so the optimizer has one MoE param group
    per expert-parallel size)."""

    def __init__(self, ep_size: int, rank: int, second_ep: int | None = None) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.moe = MoE(hidden_size=DIM, expert=Expert(), num_experts=EXPERTS, ep_size=ep_size,
                       k=2, capacity_factor=4.0, min_capacity=64, drop_tokens=False,
                       use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip
        self.ep_sizes = {"moe": ep_size}
        if second_ep:
            self.ln2 = nn.LayerNorm(DIM)
            self.moe2 = MoE(hidden_size=DIM, expert=Expert(), num_experts=2 * EXPERTS,
                            ep_size=second_ep, k=2, capacity_factor=4.0, min_capacity=64,
                            drop_tokens=False, use_rts=False,
                            top2_2nd_expert_sampling=False)  # fmt: skip
            self.ep_sizes["moe2"] = second_ep
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for li, (attr, ep) in enumerate(self.ep_sizes.items()):
                local = getattr(self, attr).deepspeed_moe.experts.deepspeed_experts
                for i, expert in enumerate(local):
                    g = torch.Generator().manual_seed(
                        1000 * li + 100 + (rank % ep) * len(local) + i
                    )
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `tokens` [batch, SEQ + 1] plus the gates' aux loss."""
        x = self.emb(tokens[:, :-1])
        h, aux, _ = self.moe(self.ln(x))
        x = x + h
        if "moe2" in self.ep_sizes:
            h2, aux2, _ = self.moe2(self.ln2(x))
            x, aux = x + h2, aux + aux2
        logits = self.head(x).float()
        ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return ce + AUX * aux


def batch(step: int, size: int = BATCH) -> torch.Tensor:
    """The global batch of training step `step` (deterministic)."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
