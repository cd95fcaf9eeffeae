"""The collectives a compiled program issues, as plain data with a stable text form.

    schedule = collective_schedule(model, x)
    assert_expected_inline(str(schedule), '''...''')

A change that adds, drops or resizes a collective changes the text, and the
snapshot diff shows which one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtcompile.base.channels import GraphKind
from dtcompile.graph.collectives import CollectiveInfo

__all__ = ["CollectiveSchedule", "ScheduledCollective", "collective_schedule"]


@dataclass(frozen=True)
class ScheduledCollective(CollectiveInfo):
    """One collective (see :class:`~dtcompile.CollectiveInfo`) and the graph that issues it."""

    graph: str = ""
    """Dynamo's compile id of the graph, e.g. ``0/0``."""

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.data_dependent:  # its shape and bytes are estimates: not part of the text
            return f"{self.label:<21} {self.axis:<6} x{self.group_size:<4} {dtype}  data-dependent"
        shape = ", ".join(map(str, self.shape))
        return f"{self.label:<21} {self.axis:<6} x{self.group_size:<4} {dtype}[{shape}]  {self.bytes} B"


@dataclass(frozen=True)
class CollectiveSchedule:
    """The forward (or inference) and backward collectives, each in graph order."""

    forward: tuple[ScheduledCollective, ...]
    backward: tuple[ScheduledCollective, ...]
    graphs: tuple[tuple[str, str], ...]
    """``(kind, compile id)`` of every graph compiled, collectives or not, in order."""

    def __str__(self) -> str:
        lines = []
        for kind, graph in self.graphs:
            items = [c for c in (self.backward if kind == GraphKind.BACKWARD else self.forward) if c.graph == graph]
            lines.append(f"{kind} {graph}:" + ("" if items else " (no collectives)"))
            lines += [f"  {c}" for c in items]
        for kind, items in ((GraphKind.FORWARD, self.forward), (GraphKind.BACKWARD, self.backward)):
            known = sum(c.bytes for c in items if not c.data_dependent)
            unknown = sum(c.data_dependent for c in items)
            more = f" and {unknown} data-dependent" if unknown else ""
            lines.append(f"{kind} total: {len(items)} collectives, {known} B per rank{more}")
        return "\n".join(lines)


def collective_schedule(
    fn: Callable[..., Any],
    *args: Any,
    backend: Any = "dtcompile",
    backward: bool = True,
    **kwargs: Any,
) -> CollectiveSchedule:
    """Compile ``fn`` once (``fullgraph=True``), run it on ``args``, and return its collectives.

    ``backward=True`` also runs a backward pass (from the sum of every output
    that requires grad) so the backward graph is compiled and listed.  The
    default backend is dtcompile without Inductor lowering (same graphs and
    passes, faster); pass ``backend=dtcompile.backend(...)`` for other options.
    Resets Dynamo's caches first, so compile ids start at ``0/0`` (but where ranks are
    threads of one process, which share them: :func:`dtcompile.ranks.check.reset_dynamo_of_this_rank`).
    """
    import dtcompile
    from dtcompile.compiler import DTCompileBackend
    from dtcompile.ranks.check import reset_dynamo_of_this_rank
    from dtcompile.testing.asserts import backward_from_sum

    if backend == "dtcompile":
        backend = dtcompile.backend(inductor=False)
    if not isinstance(backend, DTCompileBackend):
        raise TypeError(
            f"collective_schedule: backend must be 'dtcompile' or a dtcompile.backend(...), "
            f"got {backend!r}; the schedule is read from what dtcompile records"
        )
    reset_dynamo_of_this_rank()
    # backend.records is bounded: once full, each new record drops the oldest, so
    # neither its length nor a position in it marks where this call began.  A record
    # of this call is one that was not there before; `earlier` keeps those alive, so
    # no new record can reuse one of their ids.
    earlier = list(backend.records)
    known = {id(record) for record in earlier}
    # Read from what dtcompile compiles here: no graph may come from AOTAutograd's
    # cache (an earlier run's compile leaves no record in this process).
    compiling = backend.sharing_records(aot_cache=False)
    out = torch.compile(fn, backend=compiling, fullgraph=True)(*args, **kwargs)
    if backward:
        backward_from_sum(out)
    records = [record for record in backend.records if id(record) not in known]
    if len(records) >= backend.records.maxlen:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise RuntimeError(
            f"collective_schedule: {name} compiled {len(records)} or more graphs, as many as "
            f"backend.records keeps ({backend.records.maxlen}), so the first may be lost; "
            "schedule a smaller program, or one that does not recompile"
        )
    forward, backward_items = [], []
    for record in records:
        items = backward_items if record.kind == GraphKind.BACKWARD else forward
        items += [ScheduledCollective(**_fields(c), graph=record.compile_id) for c in record.collectives]
    graphs = tuple((GraphKind.BACKWARD if r.kind == GraphKind.BACKWARD else GraphKind.FORWARD, r.compile_id) for r in records)
    return CollectiveSchedule(tuple(forward), tuple(backward_items), graphs)


def _fields(collective: CollectiveInfo) -> dict[str, Any]:
    return {f.name: getattr(collective, f.name) for f in dataclasses.fields(CollectiveInfo)}
