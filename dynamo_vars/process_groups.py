"""ProcessGroup and ``torch.distributed`` queries in compiled code.

Stock torch registers ``ProcessGroup`` as an opaque reference type with
``rank()``, ``size()``, ``group_name`` evaluated at trace time, and Dynamo
constant-folds ``dist.get_rank(pg)``, ``dist.get_world_size(group=pg)``,
``dist.get_process_group_ranks(pg)`` and ``dist.group.WORLD``; functional
collectives take a group, a mesh or ``(mesh, axis)``.  All of that is covered
by the idiom corpus and left as it is.

What this module adds: creating a process group inside a compiled region
(``dist.new_group``, ``dist.new_subgroups``, ``dist.init_process_group``) is a
structured graph break that explains why and says to hoist the call, instead
of Dynamo's generic "function marked as skipped".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo_vars._trackers import Handler, graph_break

__all__: list[str] = []

_HOIST = [
    (
        "Create process groups once at setup, before the compiled function, and pass them in "
        "or close over them."
    ),
]


def ID_HANDLERS() -> dict[Callable[..., Any], Handler]:
    import torch.distributed as dist

    why = "{} creates a process group, which communicates with every rank; it cannot be part of a compiled graph."
    return {
        fn: graph_break(why.format(f"dist.{fn.__name__}"), _HOIST)
        for fn in (dist.new_group, dist.new_subgroups, dist.init_process_group)
    }
