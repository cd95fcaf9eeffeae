"""DTensor's sharding caches, emptied: a bottom-layer helper of the backend and the test worlds.

DTensor caches sharding decisions keyed by meshes that compare by ``==``.
AOTAutograd's metadata pass runs DTensor ops on inputs whose mesh is a
trace-time fake, outside what DTensor counts as tracing, so the fake lands in
those caches and a later hit handed it to compiled gradients and even to eager
results.  The backend empties them around AOTAutograd; the test worlds around a
world, so that one world's meshes do not answer for the next's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["clear_sharding_caches", "fresh_sharding_caches"]


def clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribute-plan caches (this thread's)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    # (torch.distributed.tensor.debug._clear_sharding_prop_cache does these two,
    # but importing that package needs numpy.)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()


@contextlib.contextmanager
def fresh_sharding_caches() -> Iterator[None]:
    """The caches empty on entry to the block and emptied on its exit."""
    clear_sharding_caches()
    try:
        yield
    finally:
        clear_sharding_caches()
