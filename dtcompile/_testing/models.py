"""The small models that tests, benchmarks and the demo share, and the ``build_*`` functions that make them.

Each model comes as a plain ``nn.Module`` (the single-process reference) and a
``parallelize_*`` function that turns a copy of it into its distributed form on a
given mesh.  The distributed form takes and returns *plain* tensors so that eager,
compiled and reference runs can be compared directly:

- :func:`parallelize_mlp`: tensor parallel MLP, ``ColwiseParallel`` then
  ``RowwiseParallel``; input and output replicated.
- :func:`parallelize_block`: Llama-style block (RMSNorm, causal attention, SwiGLU
  MLP) with tensor + sequence parallelism as torchtitan applies it; input and
  output replicated, the residual stream sharded on the sequence dim inside.
- :func:`parallelize_fsdp_mlp`: the MLP with every parameter a ``Shard(0)``
  DTensor that is all-gathered in forward (SimpleFSDP style); input and output
  are the rank's own batch shard, gradients are reduce-scattered.
- :func:`parallelize_gathered_stack`: :class:`ResidualStack` with every
  weight ``Shard(0)`` and gathered in forward by
  ``w.redistribute(placements=[Replicate()]).to_local()``: the gradient's
  placement is ``to_local``'s default (``Replicate``), so the backward slices
  this rank's chunk, an offset the compiled backward bakes in (what a compile
  cache shared by ranks must key on); input and output replicated.
- :func:`build_block_local_map`: the same block and plan, its attention core a
  ``local_map`` region on head-sharded q, k and v (:class:`RegionAttention`).
- :func:`parallelize_block_2d`: the block on a 2-D ``(dp, tp)`` mesh: tensor +
  sequence parallel over ``tp``, data parallel over ``dp`` (parameters
  replicated across ``dp``, gradients all-reduced there); input and output are
  the ``dp`` rank's batch shard.
- :func:`parallelize_block_fsdp_tp`: the same with SimpleFSDP over ``dp`` (FSDP x
  TP: each tensor-parallel shard sharded again over ``dp``, gathered in forward,
  gradients reduce-scattered there).
- :func:`parallelize_moe`: top-k routed experts with expert parallelism over
  the mesh's ``ep`` axis, tokens dispatched and combined by
  ``all_to_all_single`` with data-dependent split sizes (torchtitan's
  ``AllToAllTokenDispatcher``); input and output are the rank's own tokens.

:class:`SequenceParallelMLP` comes in its distributed form only: functional
collectives on a process group, no DTensor.

The ``build_*`` functions create the model, its distributed form and example
inputs in one call, seeded so every rank builds the same weights.

This module holds the MLPs and stacks, their plans, and every ``build_*``; the
Llama-style block and its plans are in :mod:`dtcompile._testing.transformer_block`,
the mixture of experts in :mod:`dtcompile._testing.moe`, and the parameter
storage that every data-parallel plan uses in :mod:`dtcompile._testing.data_parallel`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtcompile._testing.data_parallel import _data_parallel, parallelize_simple_fsdp
from dtcompile._testing.moe import MoE, parallelize_moe
from dtcompile._testing.transformer_block import (
    Attention,
    Block,
    BlockArgs,
    RegionAttention,
    parallelize_block,
    parallelize_block_2d,
    parallelize_block_fsdp_tp,
)

__all__ = [
    "MLP",
    "SequenceParallelMLP",
    "NormMLPBlock",
    "NormMLPStack",
    "ResidualStack",
    "build_block",
    "build_block_2d",
    "build_block_fsdp_tp",
    "build_block_local_map",
    "build_fsdp_mlp",
    "build_gathered_stack",
    "build_mlp",
    "build_moe",
    "build_norm_mlp_stack",
    "parallelize_fsdp_mlp",
    "parallelize_gathered_stack",
    "parallelize_mlp",
    # Defined in transformer_block, moe and data_parallel, used by the builds here,
    # and imported from here by tests and benchmarks.
    "Block",
    "BlockArgs",
    "MoE",
    "parallelize_block",
    "parallelize_simple_fsdp",
]


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class ResidualStack(nn.Module):
    """``layers`` residual blocks ``x + w2(relu(w1(x)))``, no biases."""

    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"w1": nn.Linear(dim, hidden, bias=False), "w2": nn.Linear(hidden, dim, bias=False)})
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["w2"](F.relu(layer["w1"](x)))
        return x


class NormMLPBlock(nn.Module):
    """``x + down(gelu(up(norm(x))))`` (``LayerNorm``, biases)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class NormMLPStack(nn.Module):
    """``layers`` :class:`NormMLPBlock` s: the stack FSDP's memory is measured on (issue #31)."""

    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NormMLPBlock(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _GatherTokens(torch.autograd.Function):
    """Sequence parallel: all-gather the token shards (dim 0); backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
        ctx.group_name, ctx.size = group_name, size
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, size, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        c10d = torch.ops._c10d_functional
        scattered = c10d.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.size, ctx.group_name)
        return c10d.wait_tensor(scattered), None, None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter partial sums to token shards (dim 0); backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
        ctx.group_name, ctx.size = group_name, size
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", size, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        c10d = torch.ops._c10d_functional
        gathered = c10d.all_gather_into_tensor(grad.contiguous(), ctx.size, ctx.group_name)
        return c10d.wait_tensor(gathered), None, None


class SequenceParallelMLP(nn.Module):
    """gather -> matmul -> relu -> matmul -> reduce-scatter on token shards, with the
    functional collectives on ``group_name`` directly (no DTensor): the pattern the
    ``async_tp`` pass fuses, forward and backward (``tests/cuda``, ``benchmarks/cuda_check.py``)."""

    def __init__(self, group_name: str, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.group_name = group_name
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = torch.distributed.get_world_size()
        h = torch.relu(_GatherTokens.apply(x, self.group_name, size) @ self.w1)
        return _ScatterTokens.apply(h @ self.w2, self.group_name, size)


def parallelize_mlp(model: MLP, mesh: DeviceMesh) -> MLP:
    """Tensor parallel: ``w1`` column-wise, ``w2`` row-wise (one all-reduce in forward)."""
    return parallelize_module(
        model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    )


def parallelize_fsdp_mlp(model: MLP, mesh: DeviceMesh) -> MLP:
    """FSDP-style: every parameter ``Shard(0)`` over the mesh, gathered in forward."""
    return _data_parallel(model, mesh, shard=True)


def parallelize_gathered_stack(model: ResidualStack, mesh: DeviceMesh) -> ResidualStack:
    """Every weight ``Shard(0)`` over the mesh, gathered in forward; gradients unreduced."""
    return _data_parallel(model, mesh, shard=True, reduce_gradients=False)


@contextlib.contextmanager
def _plain_tensors(seed: int) -> Iterator[torch.Generator]:
    """Yields a generator seeded with ``seed`` for weights and inputs.

    Weights are drawn from this generator (:func:`_init_weights`), not the
    global RNG, so ranks simulated as threads build identical models.  The
    reference model and inputs are plain tensors, also when built inside a
    ``LocalTensorMode`` (where factory functions would make per-rank tensors).
    """
    with maybe_disable_local_tensor_mode():
        yield torch.Generator().manual_seed(seed)


@torch.no_grad()
def _init_weights(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Deterministic init: weights ``N(0, 1/fan_in)`` (``fan_in``: dim 1, also of stacked
    experts' ``(experts, in, out)``), biases and norm scales near 0 and 1."""
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if param.dim() >= 2:
            param.copy_(noise / math.sqrt(param.shape[1]))
        elif name.endswith("bias"):
            param.copy_(0.1 * noise)
        else:
            param.copy_(1.0 + 0.1 * noise)
    return model


def _build(
    make_reference: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module, DeviceMesh], nn.Module],
    mesh: DeviceMesh,
    input_shape: tuple[int, ...],
    seed: int,
) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    with _plain_tensors(seed) as gen:
        reference = _init_weights(make_reference(), gen)
        x = torch.randn(input_shape, generator=gen)
    return reference, parallelize(copy.deepcopy(reference), mesh), x


def build_mlp(
    mesh: DeviceMesh,
    *,
    batch: int = 4,
    dim: int = 16,
    hidden: int = 32,
    bias: bool = True,
    seed: int = 0,
) -> tuple[MLP, MLP, torch.Tensor]:
    """Returns ``(reference, parallel, input)``; the input is replicated."""
    return _build(
        lambda: MLP(dim, hidden, bias=bias), parallelize_mlp, mesh, (batch, dim), seed
    )


def build_block(
    mesh: DeviceMesh,
    *,
    batch: int = 2,
    seq: int = 8,
    args: BlockArgs = BlockArgs(),
    seed: int = 0,
    attention: type[Attention] = Attention,
) -> tuple[Block, Block, torch.Tensor]:
    """Returns ``(reference, parallel, input)``; the input is replicated, ``seq`` must divide by the TP degree."""
    return _build(lambda: Block(args, attention), parallelize_block, mesh, (batch, seq, args.dim), seed)


build_block_local_map = functools.partial(build_block, attention=RegionAttention)
"""``build_block`` with the attention core a ``local_map`` region (:class:`RegionAttention`)."""


def build_fsdp_mlp(
    mesh: DeviceMesh, *, batch: int = 4, dim: int = 16, hidden: int = 32, seed: int = 0
) -> tuple[MLP, MLP, torch.Tensor]:
    """Returns ``(reference, parallel, global_input)``.

    ``global_input`` is the whole batch, ``batch`` rows per rank; rank ``r``
    feeds rows ``[r * batch, (r + 1) * batch)`` (see ``ModelCase.local_input``).
    """
    shape = (mesh.size() * batch, dim)
    return _build(lambda: MLP(dim, hidden), parallelize_fsdp_mlp, mesh, shape, seed)


def build_gathered_stack(
    mesh: DeviceMesh, *, rows: int = 32, dim: int = 64, hidden: int = 128, layers: int = 4, seed: int = 0
) -> tuple[ResidualStack, ResidualStack, torch.Tensor]:
    """Returns ``(reference, parallel, input)``; the input is replicated (every rank's
    unreduced gradient shard is then the reference's)."""
    return _build(lambda: ResidualStack(dim, hidden, layers), parallelize_gathered_stack, mesh, (rows, dim), seed)


def build_norm_mlp_stack(
    mesh: DeviceMesh, *, rows: int = 64, dim: int = 256, hidden: int = 1024, layers: int = 4, seed: int = 0
) -> tuple[NormMLPStack, NormMLPStack, torch.Tensor]:
    """Returns ``(reference, parallel, global_input)`` for :class:`NormMLPStack` under
    SimpleFSDP (:func:`parallelize_simple_fsdp`); ``rows`` rows per rank."""
    shape = (mesh.size() * rows, dim)
    return _build(lambda: NormMLPStack(dim, hidden, layers), parallelize_simple_fsdp, mesh, shape, seed)


def build_block_2d(
    mesh: DeviceMesh,
    *,
    batch: int = 2,
    seq: int = 8,
    args: BlockArgs = BlockArgs(),
    seed: int = 0,
    parallelize: Callable[[nn.Module, DeviceMesh], nn.Module] = parallelize_block_2d,
) -> tuple[Block, Block, torch.Tensor]:
    """Returns ``(reference, parallel, global_input)``; ``batch`` rows per ``dp`` rank."""
    shape = (mesh.size(0) * batch, seq, args.dim)
    return _build(lambda: Block(args), parallelize, mesh, shape, seed)


build_block_fsdp_tp = functools.partial(build_block_2d, parallelize=parallelize_block_fsdp_tp)
"""``build_block_2d`` with SimpleFSDP over ``dp`` (:func:`parallelize_block_fsdp_tp`): FSDP x TP."""


def build_moe(
    mesh: DeviceMesh,
    *,
    tokens: int = 8,
    dim: int = 8,
    hidden: int = 16,
    num_experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
) -> tuple[MoE, MoE, torch.Tensor]:
    """Returns ``(reference, parallel, global_input)``.

    ``global_input`` is ``tokens`` per rank of the whole mesh; rank ``r`` (its
    index in the flattened mesh) feeds ``global_input.chunk(mesh.size())[r]``.
    """
    shape = (mesh.size() * tokens, dim)
    return _build(lambda: MoE(dim, hidden, num_experts, top_k), parallelize_moe, mesh, shape, seed)
