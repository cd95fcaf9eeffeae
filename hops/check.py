"""``check_placements``: do a region's outputs hold what their placements declare, on every rank?

The analogue of JAX ``shard_map``'s ``check_vma``: a region that forgets an
all-reduce returns a partial sum it declares ``Replicate()``; eager DTensor
believes the declaration (``from_local`` does not look at other ranks), and the
error surfaces steps later.  Under ``LocalTensorMode`` every rank's value is at
hand, so the declaration can be checked where it is made:

- ``Replicate()`` on mesh axis ``a``: the value is the same on all ranks that
  differ only in their coordinate on ``a``;
- ``Shard(d)`` on any axis: the shards agree in shape on every dimension but
  ``d`` (each rank's shard of one tensor);
- ``Partial`` makes no promise across ranks, so nothing is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtcompile.hops.spec import LocalMapError, RegionSpec, parse_placements

__all__ = ["PlacementCheckError", "check_region_outputs"]


class PlacementCheckError(LocalMapError):
    """A region output that does not hold what its placements declare on all ranks."""


def _rank_values(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, AsyncCollectiveTensor):
        t = t.trigger_wait()
    return dict(t._local_tensors) if isinstance(t, LocalTensor) else None


def check_region_outputs(spec: RegionSpec, mesh: Any, outputs: Sequence[Any]) -> None:
    """Raises :class:`PlacementCheckError` for the first output that breaks its placements.

    ``outputs`` are the region's flat outputs: its local results (``LocalTensor``
    values, one per rank) or DTensors over them.  Outside ``LocalTensorMode``
    there is one rank's value only and the check cannot run: that is an error
    too, not a silent pass.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    coords = mesh.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    for i, (out, text) in enumerate(zip(outputs, spec.out_placements)):
        if text is None or not isinstance(out, torch.Tensor):
            continue
        values = _rank_values(out._local_tensor if isinstance(out, DTensor) else out)
        if values is None:
            raise PlacementCheckError(
                f"local_map {spec.name}: check_placements=True needs every rank's value, but "
                f"output {i} is a plain tensor; run the region under "
                "torch.distributed._local_tensor.LocalTensorMode(world_size)"
            )
        placements = parse_placements(text)
        for axis, p in enumerate(placements):
            for group in _groups_along(coords, axis):
                if isinstance(p, Replicate):
                    _check_equal(spec, i, text, names[axis], group, values)
                elif isinstance(p, Shard):
                    _check_shapes(spec, i, text, names[axis], p.dim, group, values)


def _groups_along(coords: torch.Tensor, axis: int) -> list[list[int]]:
    """The rank groups that differ only in their coordinate on ``axis``."""
    moved = coords.movedim(axis, -1).reshape(-1, coords.shape[axis])
    return [row.tolist() for row in moved]


def _check_equal(
    spec: RegionSpec,
    index: int,
    text: str,
    axis: str,
    group: list[int],
    values: dict[int, torch.Tensor],
) -> None:
    first = values[group[0]]
    for rank in group[1:]:
        other = values[rank]
        if other.shape != first.shape or not torch.allclose(
            other, first, rtol=1e-5, atol=1e-6, equal_nan=True
        ):
            diff = (
                (other - first).abs().max().item()
                if other.shape == first.shape
                else "shape"
            )
            raise PlacementCheckError(
                f"local_map {spec.name}: output {index} is declared {text} (Replicate on mesh axis "
                f"{axis!r}) but differs between ranks {group[0]} and {rank} (max abs diff {diff}); "
                f"reduce it inside the region (e.g. funcol.all_reduce over {axis!r}) or declare it Partial()"
            )


def _check_shapes(
    spec: RegionSpec,
    index: int,
    text: str,
    axis: str,
    dim: int,
    group: list[int],
    values: dict[int, torch.Tensor],
) -> None:
    shapes = {rank: tuple(values[rank].shape) for rank in group}
    first = shapes[group[0]]
    for rank, shape in shapes.items():
        if len(shape) != len(first) or any(
            a != b for d, (a, b) in enumerate(zip(shape, first)) if d != dim
        ):
            raise PlacementCheckError(
                f"local_map {spec.name}: output {index} is declared {text} (Shard({dim}) on mesh axis "
                f"{axis!r}) but its shards have shapes {first} on rank {group[0]} and {shape} on rank "
                f"{rank}; shards may differ only along dim {dim}"
            )
