"""DTensor's sharding caches, emptied: a bottom-layer helper of the backend and the test worlds.

DTensor caches sharding decisions keyed by meshes that compare by ``==``.
AOTAutograd's metadata pass runs DTensor ops on inputs whose mesh is a
trace-time fake, outside what DTensor counts as tracing, so the fake lands in
those caches and a later hit handed it to compiled gradients and even to eager
results.  The backend empties them around AOTAutograd; the test worlds around a
world, so that one world's meshes do not answer for the next's.

Rank threads make that second reason sharper: a threaded world's mesh compares
equal to another world's when their threads have the same ident, and CPython
hands a dead thread's ident to the next thread.  The redistribute plan cached
for the dead thread's rank (its coordinate decides the sizes of an uneven
shard) then answered for another rank of the next world.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["clear_sharding_caches", "fresh_sharding_caches"]


def clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribute-plan caches.

    The sharding propagator's cache is this thread's; the planners and the plans
    (``_gen_transform_infos``, whose sizes are per rank) are the process's.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    # (torch.distributed.tensor.debug._clear_sharding_prop_cache does these two,
    # but importing that package needs numpy.)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()


@contextlib.contextmanager
def fresh_sharding_caches() -> Iterator[None]:
    """The caches empty on entry to the block and emptied on its exit."""
    clear_sharding_caches()
    try:
        yield
    finally:
        clear_sharding_caches()
