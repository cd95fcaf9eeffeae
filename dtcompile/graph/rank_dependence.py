"""Whether the ranks' graphs of one program may differ: the one place that decides it.

Each rank traces, partitions and rewrites its own graphs.  Where every rank holds
shards of one shape they are the same graph, and a decision one rank makes from
its own (what to bucket, where a collective goes, what the backward gathers
again) is every rank's.  Where a DTensor is sharded unevenly they need not be:
ranks hold shards of other shapes (padding on some ranks, an empty shard on
another), and decisions made from one rank's graph can differ on another, so the
ranks would issue different collectives and wait for each other forever.

- :func:`uneven_sharding`: why one DTensor's ranks may hold shards of other shapes
  (the Dynamo graph's DTensors, read into
  :attr:`dtcompile.annotations.DynamoGraphInfo.uneven`);
- :func:`padded_collective`: a collective of an AOT graph DTensor padded, where an
  op's own redistribution shards unevenly (``x @ x`` of a ``Partial`` vector of 3
  over 2 ranks reduce-scatters it), which the Dynamo graph's DTensors do not show;
- :func:`ranks_may_differ`: both, what the communication passes
  (:func:`dtcompile.passes.run_passes`) and the partitioner
  (:class:`dtcompile.pipeline.partition.Partitioner`) ask before deciding anything from
  one rank's graph.  The ranks' check (:mod:`dtcompile.ranks.check`) compares what
  ranks compiled and lets sizes the program itself decided differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dtcompile.base.notation import real_object
from dtcompile.base.op_facts import PADDING_RESHAPES, WAIT, op_name
from dtcompile.base.sizes import hint
from dtcompile.graph.collectives import is_collective

__all__ = ["padded_collective", "ranks_may_differ", "uneven_sharding"]


def ranks_may_differ(uneven: Sequence[str], gm: fx.GraphModule) -> tuple[str, ...]:
    """Why the ranks' versions of ``gm`` may differ, one text each; empty where they cannot.

    ``uneven``: the Dynamo graph's unevenly sharded DTensors
    (:attr:`~dtcompile.annotations.DynamoGraphInfo.uneven`); ``gm``: this rank's AOT
    graph, where DTensor may have padded a collective of its own (:func:`padded_collective`).
    """
    padded = padded_collective(gm)
    return (*uneven, padded) if padded is not None else tuple(uneven)


def uneven_sharding(dtensor: Any) -> str | None:
    """Why ``dtensor``'s ranks may hold shards of different shapes, or ``None`` if every rank's
    shard has one shape: each sharded dim a multiple of the ranks (and split factor) over it."""
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = real_object(dtensor.device_mesh)
    ways: dict[int, int] = {}
    for axis, placement in enumerate(dtensor.placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):
            factor = getattr(placement, "split_factor", 1)
            ways[placement.dim] = ways.get(placement.dim, 1) * mesh.size(axis) * int(factor)
    for dim, n in ways.items():
        size = dtensor.shape[dim]
        if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
            if statically_known_true(size % n == 0):
                continue
            return f"dim {dim} of symbolic size over {n} shards"
        if int(size) % n:
            return f"dim {dim} of size {int(size)} over {n} shards"
    return None


def padded_collective(gm: fx.GraphModule, steps: int = 6) -> str | None:
    """Whether DTensor padded an uneven shard for one of the graph's collectives, on every rank.

    DTensor pads the chunks of an unevenly split tensor to one size before a
    reduce-scatter or all-to-all (every rank: ``constant_pad_nd`` before it), and
    takes the padding off a gathered result (every rank: a ``slice``/``narrow``
    of a part of it after its wait).  Only ranks whose own shard is short pad
    before an all-gather, so the slice after it is what every rank sees.  The pad
    or slice is looked for within ``steps`` nodes of the collective, through the
    reshapes DTensor puts between them.
    """
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        pad = _first_within(
            node.all_input_nodes, steps, lambda n: n.all_input_nodes,
            found=lambda n: op_name(n.target) == "constant_pad_nd",
            through=lambda n: op_name(n.target) in PADDING_RESHAPES,
        )
        if pad is not None:
            return f"{node.name} (its input padded by {pad.name})"
        unpad = _first_within(
            list(node.users), steps, lambda n: list(n.users),
            found=lambda n: op_name(n.target) in ("slice", "narrow") and _takes_a_part(n),
            through=lambda n: op_name(n.target) in PADDING_RESHAPES or n.target is WAIT,
        )
        if unpad is not None:
            return f"{node.name} (its result unpadded by {unpad.name})"
    return None


def _first_within(
    start: list[fx.Node],
    steps: int,
    step: Callable[[fx.Node], list[fx.Node]],
    *,
    found: Callable[[fx.Node], bool],
    through: Callable[[fx.Node], bool],
) -> fx.Node | None:
    """The first ``call_function`` node ``found`` accepts within ``steps`` steps of ``start``,
    walking ``step`` only through nodes ``through`` accepts."""
    frontier, seen = start, set()
    for _ in range(steps):
        following = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if found(n):
                return n
            if through(n):
                following.extend(step(n))
        frontier = following
    return None


def _takes_a_part(node: fx.Node) -> bool:
    """Whether a slice/narrow keeps less than the whole of its input's dim."""
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    dim = node.args[1] if len(node.args) > 1 else 0
    out = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    return hint(out.shape[dim]) != hint(value.shape[dim])
