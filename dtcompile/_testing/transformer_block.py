"""A Llama-style transformer block and its tensor + sequence parallel plans.

Holds the block (:class:`Block`: :class:`RMSNorm`, causal :class:`Attention`, a
SwiGLU :class:`FeedForward`; its sizes in :class:`BlockArgs`),
:class:`RegionAttention` (the attention core a ``local_map`` region on
head-sharded q, k and v), :func:`parallelize_block` (torchtitan's tensor +
sequence parallel plan), :func:`parallelize_block_2d` (that plan over ``tp``,
data parallel over ``dp``) and :func:`parallelize_block_fsdp_tp` (that plan over
``tp``, SimpleFSDP over ``dp``).  Its builds, seeded with example inputs, are
``build_block``, ``build_block_local_map``, ``build_block_2d`` and
``build_block_fsdp_tp`` in
:mod:`dtcompile._testing.models`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtcompile._testing.data_parallel import _data_parallel
from dtcompile.hops import local_map

__all__ = [
    "Attention",
    "Block",
    "BlockArgs",
    "FeedForward",
    "RMSNorm",
    "RegionAttention",
    "causal_attention",
    "parallelize_block",
    "parallelize_block_2d",
    "parallelize_block_fsdp_tp",
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@dataclass(frozen=True)
class BlockArgs:
    """Sizes of :class:`Block`. ``n_heads`` and ``hidden`` must divide by the TP degree."""

    dim: int = 64
    n_heads: int = 4
    hidden: int = 128
    eps: float = 1e-6


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention over ``(batch, heads, seq, head_dim)``."""
    seq = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    return scores.softmax(dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, args: BlockArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    core = staticmethod(causal_attention)
    """The attention on heads; :class:`RegionAttention` runs it as a ``local_map`` region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism the projections return the local heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class RegionAttention(Attention):
    """:class:`Attention` whose core is a ``local_map`` region on head-sharded DTensors.

    Parallelized with ``ColwiseParallel(use_local_output=False)`` the projections
    return DTensors sharded on heads (``Shard(1)`` after the transpose), and the
    region runs the attention on the local heads.  On plain tensors (the
    reference) the region is the plain function.
    """

    core = staticmethod(
        local_map(causal_attention, [Shard(1)], ([Shard(1)],) * 3, ([Shard(1)],) * 3)
    )


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A Llama-style transformer block: pre-norm attention and SwiGLU MLP."""

    def __init__(self, args: BlockArgs, attention: type[Attention] = Attention) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.eps)
        self.attention = attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.eps)
        self.feed_forward = FeedForward(args.dim, args.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def parallelize_block(model: Block, mesh: DeviceMesh) -> Block:
    """Tensor + sequence parallel, as torchtitan's Llama plan applies it to a block.

    Norms run sequence-sharded (``Shard(1)``); attention and the MLP all-gather
    the sequence, compute on local heads / hidden columns and reduce-scatter back
    to the sequence shard.  The block's own input is replicated and its output is
    gathered again, so it can be compared with the single-process model.  With a
    :class:`RegionAttention`, q, k and v stay DTensors for its region.
    """
    heads_as_dtensors = isinstance(model.attention, RegionAttention)
    projection = ColwiseParallel(use_local_output=not heads_as_dtensors)
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.wq": projection,
        "attention.wk": projection,
        "attention.wv": projection,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    parallelize_module(model, mesh, plan)
    # The block boundary: replicated in, sequence-sharded residual stream inside
    # (a local slice, no communication), all-gathered again on the way out.
    return parallelize_module(
        model,
        mesh,
        PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        ),
    )


def parallelize_block_2d(model: Block, mesh: DeviceMesh) -> Block:
    """Tensor + sequence parallel over ``mesh["tp"]``, data parallel over ``mesh["dp"]``."""
    parallelize_block(model, mesh["tp"])
    return _data_parallel(model, mesh, shard=False)


def parallelize_block_fsdp_tp(model: Block, mesh: DeviceMesh) -> Block:
    """Tensor + sequence parallel over ``mesh["tp"]``, SimpleFSDP over ``mesh["dp"]``
    (every parameter's tensor-parallel shard sharded again over ``dp``, gathered in forward)."""
    parallelize_block(model, mesh["tp"])
    return _data_parallel(model, mesh, shard=True)
