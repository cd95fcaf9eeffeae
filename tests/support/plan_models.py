"""Random small ``nn.Module``\\ s from the torch.nn catalogue, and random planning options, from a seed.

A model is a stack of 1 to 4 blocks over activations ``(batch, seq, dim)``,
each block drawn from the catalogue: ``Linear`` (to another width), a norm
(``LayerNorm``, ``RMSNorm``), an activation (GELU, ReLU, SiLU, tanh, sigmoid,
softmax, Hardswish, PReLU), a residual MLP, a gated MLP (SiLU-gated, or ``F.glu``), self-attention (``nn.MultiheadAttention``
or ``F.scaled_dot_product_attention``, causal or not), or a reshape (transposed
sequence mixing); it may start from an ``Embedding`` of token ids.  The options
are a mesh (1-D of 2 or 4, 2 x 2), random ``fixed`` pins of up to two parameters
(each to a random even layout, drawn by :func:`build`) and a memory budget
(none, or 1/2 or 1/4 of the replicated bytes).  :class:`Case` is plain data: the same seed gives the same
model, inputs and options anywhere, so a failure is its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MESHES = {"1d2": ((2,), ("tp",)), "1d4": ((4,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}
BLOCKS = ("linear", "norm", "activation", "residual_mlp", "gated_mlp", "mha", "sdpa", "seq_mix")
ACTIVATIONS = {
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "softmax": lambda x: F.softmax(x, dim=-1), "hardswish": F.hardswish, "prelu": None,  # nn.PReLU: a parameter
}
BATCH, SEQ, VOCAB = 4, 8, 16


@dataclass(frozen=True)
class Case:
    seed: int
    mesh: str
    blocks: tuple[tuple[str, str, int], ...]
    """Per block ``(kind, variant, width)``."""
    embed: bool
    dim: int
    budget_share: int = 0
    """0: no budget; else the budget is the replicated bytes // this."""

    def describe(self) -> str:
        return (f"seed {self.seed}: mesh {self.mesh}, {'embedding, ' if self.embed else ''}dim {self.dim}, "
                f"blocks {list(self.blocks)}, budget 1/{self.budget_share or 1}")


class Block(nn.Module):
    def __init__(self, kind: str, variant: str, dim: int, width: int) -> None:
        super().__init__()
        self.kind, self.variant = kind, variant
        if kind == "linear":
            self.proj = nn.Linear(dim, width, bias=variant == "bias")
        elif kind == "norm":
            self.norm = nn.LayerNorm(dim) if variant == "layer" else nn.RMSNorm(dim)
        elif kind == "activation" and variant == "prelu":
            self.prelu = nn.PReLU()
        elif kind in ("residual_mlp", "gated_mlp"):
            self.up = nn.Linear(dim, width)
            self.gate = nn.Linear(dim, width, bias=False) if kind == "gated_mlp" else None
            self.down = nn.Linear(width, dim)
        elif kind == "mha":
            self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        elif kind == "sdpa":
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        elif kind == "seq_mix":
            self.mix = nn.Linear(SEQ, SEQ)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind, variant = self.kind, self.variant
        if kind == "linear":
            return self.proj(x)
        if kind == "norm":
            return self.norm(x)
        if kind == "activation":
            return self.prelu(x) if variant == "prelu" else ACTIVATIONS[variant](x)
        if kind == "residual_mlp":
            return x + self.down(F.gelu(self.up(x)))
        if kind == "gated_mlp" and variant == "glu":
            return x + self.down(F.glu(torch.cat([self.up(x), self.gate(x)], dim=-1), dim=-1))
        if kind == "gated_mlp":
            return x + self.down(F.silu(self.gate(x)) * self.up(x))
        if kind == "mha":
            return x + self.attn(x, x, x, need_weights=False)[0]
        if kind == "sdpa":
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal")
            return x + y.transpose(1, 2).reshape(b, s, d)
        return x + self.mix(x.transpose(1, 2)).transpose(1, 2)  # seq_mix


class FuzzModel(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, case.dim) if case.embed else None
        blocks, dim = [], case.dim
        for kind, variant, width in case.blocks:
            blocks.append(Block(kind, variant, dim, width))
            if kind == "linear":
                dim = width
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x) if self.embed is not None else x)


def draw_case(seed: int, mesh: str) -> Case:
    """The case of ``seed`` on ``mesh`` (its pins are drawn by :func:`build`, which knows the parameters)."""
    rng = random.Random(seed)
    dim = rng.choice((8, 16))
    blocks, width = [], dim
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(BLOCKS)
        variant = {
            "linear": rng.choice(("bias", "nobias")), "norm": rng.choice(("layer", "rms")),
            "activation": rng.choice(sorted(ACTIVATIONS)), "sdpa": rng.choice(("causal", "full")),
            "gated_mlp": rng.choice(("silu", "glu")),
        }.get(kind, "")
        size = rng.choice((8, 16, 32))
        if kind in ("mha", "sdpa", "seq_mix", "residual_mlp", "gated_mlp", "norm") and width != dim:
            kind, variant, size = "linear", "bias", dim  # back to the model width first
        blocks.append((kind, variant, size))
        if kind == "linear":
            width = size
    if all(kind == "activation" for kind, _, _ in blocks):
        blocks.append(("linear", "bias", dim))  # something to differentiate
    return Case(seed, mesh, tuple(blocks), rng.random() < 0.3, dim,
                budget_share=rng.choice((0, 0, 2, 4)))


def build(case: Case) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any], int | None]:
    """``(model, args, fixed, budget)`` of ``case``, the same on every call."""
    from dtcompile.auto_parallel.placements import layouts

    with torch.random.fork_rng():
        torch.manual_seed(case.seed)
        model = FuzzModel(case)
        x = torch.randint(0, VOCAB, (BATCH, SEQ)) if case.embed else torch.randn(BATCH, SEQ, case.dim)
    rng = random.Random(case.seed + 1)
    params = list(model.named_parameters())
    shape = MESHES[case.mesh][0]
    fixed = {}
    for name, p in rng.sample(params, k=min(len(params), rng.choice((0, 0, 1, 2)))):
        options = layouts(tuple(p.shape), shape)
        fixed[name] = options[rng.randrange(len(options))]
    replicated = sum(p.numel() * p.element_size() for _, p in params)
    budget = replicated // case.budget_share if case.budget_share else None
    return model, (x,), fixed, budget
