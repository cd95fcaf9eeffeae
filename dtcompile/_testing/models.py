"""The small models that tests, benchmarks and the demo share.

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
  this rank's chunk, an offset the compiled backward bakes in (issue #37's
  stack); input and output replicated.
- :func:`build_block_local_map`: the same block and plan, its attention core a
  ``local_map`` region on head-sharded q, k and v (:class:`RegionAttention`).
- :func:`parallelize_block_2d`: the block on a 2-D ``(dp, tp)`` mesh: tensor +
  sequence parallel over ``tp``, data parallel over ``dp`` (parameters
  replicated across ``dp``, gradients all-reduced there); input and output are
  the ``dp`` rank's batch shard.
- :func:`parallelize_moe`: top-k routed experts with expert parallelism over
  the mesh's ``ep`` axis, tokens dispatched and combined by
  ``all_to_all_single`` with data-dependent split sizes (torchtitan's
  ``AllToAllTokenDispatcher``); input and output are the rank's own tokens.

The ``build_*`` functions create the model, its distributed form and example
inputs in one call, seeded so every rank builds the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils import parametrize

from hops import local_map

__all__ = [
    "MLP",
    "SequenceParallelMLP",
    "Block",
    "BlockArgs",
    "MoE",
    "NormMLPBlock",
    "NormMLPStack",
    "RMSNorm",
    "RegionAttention",
    "ResidualStack",
    "build_block",
    "build_block_2d",
    "build_block_local_map",
    "build_fsdp_mlp",
    "build_gathered_stack",
    "build_mlp",
    "build_moe",
    "build_norm_mlp_stack",
    "parallelize_block",
    "parallelize_block_2d",
    "parallelize_fsdp_mlp",
    "parallelize_gathered_stack",
    "parallelize_mlp",
    "parallelize_moe",
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


def parallelize_mlp(model: MLP, mesh: DeviceMesh) -> MLP:
    """Tensor parallel: ``w1`` column-wise, ``w2`` row-wise (one all-reduce in forward)."""
    return parallelize_module(
        model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    )


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


class _GatherForCompute(nn.Module):
    """Parametrization: the stored DTensor parameter, redistributed for compute.

    Forward redistributes the stored parameter to ``compute_placements`` and hands
    the module a DTensor on ``compute_mesh`` (or a plain tensor when that is None).
    Backward follows from ``to_local(grad_placements=...)``: the gradient is
    ``Partial("avg")`` over the data-parallel axis, so redistributing it back to
    the stored placements reduce-scatters (sharded) or all-reduces (replicated).
    This is SimpleFSDP's ``ReplicateComputation``.

    With ``reduce_gradient=False`` the gradient keeps ``to_local``'s default
    placements (``Replicate``): each rank's gradient is sliced back to its own
    shard, unreduced.
    """

    def __init__(self, dp_axis: int, compute_mesh: DeviceMesh | None, reduce_gradient: bool = True) -> None:
        super().__init__()
        self.dp_axis = dp_axis
        self.compute_mesh = compute_mesh
        self.reduce_gradient = reduce_gradient

    def forward(self, stored: DTensor) -> torch.Tensor:
        placements = list(stored.placements)
        placements[self.dp_axis] = Replicate()
        grad_placements = list(placements)
        grad_placements[self.dp_axis] = Partial("avg")
        local = stored.redistribute(placements=placements).to_local(
            grad_placements=grad_placements if self.reduce_gradient else None
        )
        if self.compute_mesh is None:
            return local
        del placements[self.dp_axis]
        return DTensor.from_local(local, self.compute_mesh, placements, run_check=False)


def _data_parallel(
    model: nn.Module, mesh: DeviceMesh, *, shard: bool, dp_axis: int = 0, reduce_gradients: bool = True
) -> nn.Module:
    """Stores every parameter as a DTensor on ``mesh``, data parallel over ``dp_axis``.

    With ``shard=True`` the stored parameter is ``Shard(0)`` over ``dp_axis``
    (FSDP: all-gather in forward, reduce-scatter in backward), otherwise
    ``Replicate()`` (DDP: all-reduce in backward).  Parameters that already are
    DTensors on a sub-mesh of ``mesh`` (tensor parallel) keep their placements on
    the other axes and come back to the module as DTensors on that sub-mesh.
    Sharded, such a parameter's ``dp_axis`` shards its tensor-parallel shard
    (FSDP2's layout): ``_StridedShard(0)`` where a tensor-parallel axis shards dim 0 too.
    """
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                compute_mesh = param.device_mesh
                placements = list(param.placements)
                local = param.to_local()
            else:
                compute_mesh = None
                placements, local = [], param.data
            dp_placement: Placement = Replicate()
            if shard:
                split = math.prod(
                    compute_mesh.size(axis) for axis, p in enumerate(placements) if p.is_shard(0)
                ) if compute_mesh is not None else 1
                dp_placement = Shard(0) if split == 1 else _StridedShard(0, split_factor=split)
            placements.insert(dp_axis, dp_placement)
            if shard and compute_mesh is None:
                stored = distribute_tensor(local.detach(), mesh, placements)
            elif shard:
                own = local.detach().chunk(mesh.size(dp_axis))[mesh.get_local_rank(dp_axis)]
                stored = DTensor.from_local(own, mesh, placements, run_check=False)
            else:
                stored = DTensor.from_local(local.detach(), mesh, placements, run_check=False)
            setattr(module, name, nn.Parameter(stored))
            parametrize.register_parametrization(
                module, name, _GatherForCompute(dp_axis, compute_mesh, reduce_gradients), unsafe=True
            )
    return model


def parallelize_fsdp_mlp(model: MLP, mesh: DeviceMesh) -> MLP:
    """FSDP-style: every parameter ``Shard(0)`` over the mesh, gathered in forward."""
    return _data_parallel(model, mesh, shard=True)


def parallelize_simple_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """SimpleFSDP: every parameter ``Shard(0)`` over the mesh, gathered in forward,
    gradients reduce-scattered (the same as :func:`parallelize_fsdp_mlp`, any model)."""
    return _data_parallel(model, mesh, shard=True)


def parallelize_gathered_stack(model: ResidualStack, mesh: DeviceMesh) -> ResidualStack:
    """Every weight ``Shard(0)`` over the mesh, gathered in forward; gradients unreduced."""
    return _data_parallel(model, mesh, shard=True, reduce_gradients=False)


def parallelize_block_2d(model: Block, mesh: DeviceMesh) -> Block:
    """Tensor + sequence parallel over ``mesh["tp"]``, data parallel over ``mesh["dp"]``."""
    parallelize_block(model, mesh["tp"])
    return _data_parallel(model, mesh, shard=False)


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
) -> tuple[Block, Block, torch.Tensor]:
    """Returns ``(reference, parallel, global_input)``; ``batch`` rows per ``dp`` rank."""
    shape = (mesh.size(0) * batch, seq, args.dim)
    return _build(lambda: Block(args), parallelize_block_2d, mesh, shape, seed)


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


class MoE(nn.Module):
    """A mixture-of-experts feed-forward on ``(tokens, dim)``, pre-norm with a
    residual: a softmax router picks ``top_k`` experts per normed token, each a
    GELU MLP (``w1[e]``, ``w2[e]``), whose outputs are summed weighted by the
    router's scores.

    Single process (no ``ep_mesh``) every expert runs on every token and the
    picked outputs are kept: a computation independent of the dispatch below.
    With expert parallelism (:func:`parallelize_moe`) the rank holds
    ``num_experts / ep`` experts and sends each token to the ranks of its experts.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm = RMSNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.ep_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        top_scores, top_ids = self.router(h).softmax(-1).topk(self.top_k, dim=-1)
        if self.ep_mesh is None:
            return x + self._every_expert(h, top_scores, top_ids)
        return x + self._expert_parallel(h, top_scores, top_ids, self.ep_mesh)

    def _every_expert(self, x: torch.Tensor, top_scores: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("teh,ehd->ted", F.gelu(torch.einsum("td,edh->teh", x, self.w1)), self.w2)
        picked = out.gather(1, top_ids.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return (picked * top_scores.unsqueeze(-1)).sum(1)

    def _expert_parallel(
        self, x: torch.Tensor, top_scores: torch.Tensor, top_ids: torch.Tensor, ep_mesh: DeviceMesh
    ) -> torch.Tensor:
        ep = ep_mesh.size()
        # Token copies sorted by expert: rank r's experts are [r * E/ep, (r + 1) * E/ep).
        expert_ids = top_ids.reshape(-1)
        order = expert_ids.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.long).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        # received[r * E/ep + e]: how many tokens rank r sends to local expert e.
        received = funcol.all_to_all_single(counts, None, None, ep_mesh).wait()
        input_splits = counts.view(ep, -1).sum(1).tolist()
        output_splits = received.view(ep, -1).sum(1).tolist()
        routed = funcol.all_to_all_single(x[tokens], output_splits, input_splits, ep_mesh)
        # Rank-major, expert-sorted within each rank: the local expert of each token.
        local_expert = torch.arange(self.num_experts // ep).repeat(ep).repeat_interleave(received, output_size=routed.shape[0])
        hidden = F.gelu(torch.bmm(routed.unsqueeze(1), self.w1[local_expert]))
        out = torch.bmm(hidden, self.w2[local_expert]).squeeze(1)
        back = funcol.all_to_all_single(out, input_splits, output_splits, ep_mesh)
        weighted = back * top_scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, weighted)


class _LocalForCompute(nn.Module):
    """Parametrization: the stored DTensor parameter's local tensor, for modules that
    compute on plain tensors.  Its gradient is summed over the axes where the
    parameter is replicated (each rank's loss is its own tokens' part of the
    whole loss) and stays the shard's own on the others."""

    def forward(self, stored: DTensor) -> torch.Tensor:
        grad_placements = [Partial("sum") if p.is_replicate() else p for p in stored.placements]
        return stored.redistribute(placements=stored.placements).to_local(grad_placements=grad_placements)


def parallelize_moe(model: MoE, mesh: DeviceMesh) -> MoE:
    """Expert parallel over ``mesh["ep"]``: ``w1`` and ``w2`` ``Shard(0)`` there (whole
    experts per rank), replicated on any other axis, as the norm and the router are everywhere.

    Every rank feeds its own tokens.  Gradients are the sums of the ranks' losses':
    the loss of a rank is its part of the whole (``out.pow(2).sum() / all tokens``).
    """
    names = mesh.mesh_dim_names
    if names is None or "ep" not in names:
        raise ValueError(f"parallelize_moe: the mesh has axes {names}; name one of them 'ep'")
    ep_axis = names.index("ep")
    ep = mesh.size(ep_axis)
    if model.num_experts % ep:
        raise ValueError(f"parallelize_moe: {model.num_experts} experts do not divide over ep={ep} ranks")
    for module, name in [(model.norm, "weight"), (model.router, "weight"), (model, "w1"), (model, "w2")]:
        sharded = module is model
        placements = [Shard(0) if sharded and axis == ep_axis else Replicate() for axis in range(mesh.ndim)]
        # Every rank built the same weights: no communication to place them.
        stored = distribute_tensor(getattr(module, name).detach(), mesh, placements, src_data_rank=None)
        setattr(module, name, nn.Parameter(stored))
        parametrize.register_parametrization(module, name, _LocalForCompute(), unsafe=True)
    model.ep_mesh = mesh["ep"]
    return model


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
