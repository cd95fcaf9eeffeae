"""What an idiom of the DTensor idiom corpus is, and the inputs its builders make.

Holds the :class:`Idiom` record, the mesh kinds an idiom runs on (:data:`MESHES`),
:func:`collector`, which makes the ``@idiom(...)`` decorator each family module
(``idioms_device_mesh``, ``idioms_placements``, ``idioms_process_group``,
``idioms_dtensor_api``) registers its builders with, and the seeded inputs the
builders take: ``_global`` (a plain tensor) and ``_dt`` (a DTensor of it, each rank
keeping its own shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

__all__ = ["MESHES", "Idiom", "collector"]

# Mesh kinds: name -> (world size, shape, dim names).
MESHES: dict[str, tuple[int, tuple[int, ...], tuple[str, ...]]] = {
    "1d": (4, (4,), ("tp",)),
    "2d": (8, (2, 4), ("dp", "tp")),
    "3d": (8, (2, 2, 2), ("dp", "cp", "tp")),
}


@dataclass(frozen=True)
class Idiom:
    name: str
    family: str
    """``device_mesh``, ``placements``, ``process_group`` or ``dtensor_api``."""
    build: Callable[[DeviceMesh], tuple[Any, ...]]
    """mesh -> ``(fn, args)`` or ``(fn, args, eager_reference)`` when eager ``fn`` cannot run here."""
    mesh: str = "1d"
    world: str = "fake"
    """``fake``: values on the fake PG; ``local``: values on LocalTensorMode."""
    backward: bool = False
    values: bool = True
    context: Callable[[], Any] | None = None
    """A context manager factory around each run (eager and compiled), backward included."""


def collector(into: list[Idiom]) -> Callable[..., Callable[[Callable], Callable]]:
    """The ``@idiom(family, mesh="1d", **fields)`` decorator of one family module.

    Each builder it decorates is appended to ``into`` as an :class:`Idiom` named
    after the builder, in the order they are defined; the builder is returned as it is.
    """

    def idiom(family: str, mesh: str = "1d", **kwargs: Any) -> Callable[[Callable], Callable]:
        def register(build: Callable) -> Callable:
            into.append(Idiom(build.__name__, family, build, mesh=mesh, **kwargs))
            return build

        return register

    return idiom


def _global(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).requires_grad_(requires_grad)


def _dt(mesh: DeviceMesh, placements: list[Placement], *shape: int, requires_grad: bool = False, seed: int = 0) -> DTensor:
    """A DTensor of a seeded global tensor, each rank keeping its own shard (no communication)."""
    out = distribute_tensor(_global(*shape, seed=seed), mesh, placements, src_data_rank=None)
    return out.requires_grad_(requires_grad)
