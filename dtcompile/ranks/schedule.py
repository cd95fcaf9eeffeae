"""What one rank compiled for one Dynamo graph, as its peers compare it (:mod:`dtcompile.ranks.check`).

A :class:`Schedule` is a graph's collectives in program order (:class:`Scheduled`,
one each: graph, place, op, mesh axis, group size, dtype, shape), how the graph was
got (compiled here, served from the compile cache, run eagerly) and what it was
decided from (options, cost profile, sources, the Dynamo graph).  Once a frame's
ranks agreed on a graph, :func:`agreement_marks` is what its later graphs are
matched against (:func:`agreed_earlier`): a recompile on one rank only needs no
exchange where it issues what they agreed on.  A compiled schedule is saved beside
the compile cache (:func:`save_schedule`) for a run the cache serves.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from dtcompile.base.beside_cache import load_beside_cache, save_beside_cache
from dtcompile.base.channels import BesideCacheFolders
from dtcompile.graph.collectives import CollectiveInfo
from dtcompile.ranks.pairing import Scheduled, shared_shape
from dtcompile.records import CheckOutcome

__all__ = [
    "CheckOutcome",
    "DYNAMO_GRAPH",
    "Obtained",
    "Schedule",
    "Scheduled",
    "agreed_axes",
    "agreed_earlier",
    "agreement_marks",
    "bucketed",
    "decided_from",
    "inputs_text",
    "load_schedule",
    "save_schedule",
    "scheduled_collectives",
    "short_digest",
    "traced_digest",
]

DYNAMO_GRAPH = "Dynamo graph"
"""The entry of :attr:`Schedule.decided_by` for the graph itself (its code and inputs)."""


@dataclass(frozen=True)
class Schedule:
    """What one rank compiled for one Dynamo graph, as the check compares it."""

    compile_id: str
    obtained: Obtained
    """How this rank got it: compiled here, served from the compile cache, or run eagerly."""
    collectives: tuple[Scheduled, ...] | None
    """Every collective of its graphs in program order (:func:`scheduled_collectives`);
    ``None`` where unknown (eager, or a cache entry without its saved schedule)."""
    decided_by: Mapping[str, str]
    """What the compile was decided from, by name: options, cost profile, sources, the graph."""
    why_eager: str = ""
    """Why torch could not trace it, where it runs eagerly."""
    bucketed: bool = False
    """Whether dtcompile merged collectives into buckets: their sizes are then its decision
    (from this rank's shapes), and a recompile must match an agreed schedule size for size."""
    traced_digest: str = ""
    """Digest of its collectives as traced, before dtcompile's passes (:func:`traced_digest`);
    empty where unknown (served from the cache, run eagerly).  Ranks that traced the same
    collectives with the same settings and compiled different ones differ by dtcompile's
    own making."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "obtained", Obtained(self.obtained))  # from JSON: its text

    @property
    def eager(self) -> bool:
        return self.obtained is Obtained.EAGER

    @property
    def how(self) -> str:
        """How this rank got it, for the messages, with the reason where it runs eagerly."""
        return f"{self.obtained} ({self.why_eager})" if self.eager else str(self.obtained)

    @property
    def frame(self) -> str:
        """The Dynamo frame the graph belongs to (its recompiles share it)."""
        return self.compile_id.split("/")[0]

    @property
    def digest(self) -> str:
        """Digest of the collectives; empty where they are unknown."""
        return "" if self.collectives is None else short_digest("\n".join(map(str, self.collectives)))

    @property
    def sizeless_digest(self) -> str:
        """Digest of the collectives without their sizes; empty where they are unknown or
        :attr:`bucketed` (then the sizes are dtcompile's decision, not the program's)."""
        return _sizeless(self.collectives, self.bucketed)

    def on_axis(self, axis: str) -> tuple[Scheduled, ...] | None:
        """The collectives on ``axis``'s groups: what the ranks of one such group must agree on.
        Ranks of two different groups of an axis need not (under uneven shards a rank
        whose shard is empty moves empty buffers with its own group)."""
        if self.collectives is None:
            return None
        return tuple(c for c in self.collectives if c.axis == axis)

    def digest_on(self, axis: str) -> str:
        on_axis = self.on_axis(axis)
        return "" if on_axis is None else short_digest("\n".join(map(str, on_axis)))

    def sizeless_digest_on(self, axis: str) -> str:
        """:attr:`sizeless_digest` of the collectives on ``axis``."""
        return _sizeless(self.on_axis(axis), self.bucketed)

    @property
    def decided_by_digest(self) -> str:
        return short_digest(json.dumps(dict(self.decided_by), sort_keys=True))

    @property
    def settings_digest(self) -> str:
        """Digest of what it was decided from but the Dynamo graph: what all graphs of a frame share."""
        return short_digest(json.dumps({k: v for k, v in self.decided_by.items() if k != DYNAMO_GRAPH}, sort_keys=True))

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "decided_by": dict(self.decided_by)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Schedule:
        data = json.loads(text)
        return cls(**{**data, "collectives": _scheduled_from_json(data["collectives"])})


def _sizeless(collectives: Sequence[Scheduled] | None, bucketed: bool) -> str:
    if collectives is None or bucketed:
        return ""
    return short_digest(json.dumps([c.sizeless for c in collectives]))


class Obtained(str, enum.Enum):
    """How a rank got a Dynamo graph's code."""

    COMPILED = "compiled here"
    SERVED = "served from the compile cache"
    EAGER = "run eagerly"
    """torch could not trace it here: the Dynamo graph runs as it is."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def agreement_marks(schedule: Schedule) -> set[tuple[str, str]]:
    """What a later graph of ``schedule``'s frame is matched against once its ranks agreed on it."""
    marks = {("settings", schedule.settings_digest)}
    if schedule.digest:
        marks.add(("sizes", schedule.digest))
    if schedule.sizeless_digest:
        marks.add(("sizeless", schedule.sizeless_digest))
    for axis in _axes(schedule):
        marks.update(_axis_marks(schedule, axis))
    return marks


def agreed_axes(schedule: Schedule, marks: Set[tuple[str, str]]) -> set[str]:
    """The mesh axes whose collectives in ``schedule`` its frame's ranks agreed on earlier
    (:func:`agreement_marks`), size for size or, where the sizes are the program's, whatever
    the sizes: ranks of those groups need not meet again.  A recompile on one dp coordinate
    of FSDP x TP changes its tensor-parallel collectives (sizes of its own), not its dp ones,
    and its dp peers, which did not recompile, never come to compare it."""
    if schedule.eager or schedule.collectives is None:
        return set()
    return {axis for axis in _axes(schedule) if _axis_marks(schedule, axis) & marks}


def _axes(schedule: Schedule) -> list[str]:
    return list(dict.fromkeys(c.axis for c in schedule.collectives or ()))


def _axis_marks(schedule: Schedule, axis: str) -> set[tuple[str, str]]:
    marks = {("sizes on axis", f"{axis}:{schedule.digest_on(axis)}")}
    if sizeless := schedule.sizeless_digest_on(axis):
        marks.add(("sizeless on axis", f"{axis}:{sizeless}"))
    return marks


def agreed_earlier(schedule: Schedule, marks: Set[tuple[str, str]]) -> CheckOutcome | None:
    """Whether ``schedule``, a graph of a frame whose ranks agreed on ``marks``
    (:func:`agreement_marks`), needs no exchange, and why; ``None`` where it does."""
    if schedule.eager:
        return None  # every rank must learn it, to run eagerly too
    if schedule.collectives is None:
        return CheckOutcome.EARLIER_SETTINGS if ("settings", schedule.settings_digest) in marks else None
    if ("sizes", schedule.digest) in marks:
        return CheckOutcome.EARLIER
    if schedule.sizeless_digest and ("sizeless", schedule.sizeless_digest) in marks:
        return CheckOutcome.EARLIER_OTHER_SIZES
    return None


def _scheduled_from_json(data: Any) -> tuple[Scheduled, ...] | None:
    """Collectives as :meth:`Schedule.to_json` wrote them; ``None`` for anything else."""
    if not isinstance(data, list) or not all(isinstance(c, dict) for c in data):
        return None
    return tuple(Scheduled(**{**c, "shape": None if c["shape"] is None else tuple(c["shape"])}) for c in data)


def short_digest(text: str) -> str:
    """16 hex digits of ``text``'s SHA-256: what ranks exchange and compare."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scheduled_collectives(graphs: Iterable[tuple[str, Sequence[CollectiveInfo]]]) -> tuple[Scheduled, ...]:
    """Each collective of each ``(kind, collectives)`` graph, as ranks must agree on it:
    ``forward collective 0: all_gather[dp] x2 float32[16, 8]`` (:func:`~dtcompile.ranks.pairing.shared_shape`:
    an all-to-all's and a data-dependent collective's shapes may differ between ranks, so they are left out)."""
    return tuple(
        Scheduled(
            kind=str(kind),
            index=i,
            label=c.label,
            axis=c.axis,
            group_size=c.group_size,
            dtype=str(c.dtype).removeprefix("torch."),
            shape=shared_shape(c.op, c.data_dependent, c.shape),
        )
        for kind, collectives in graphs
        for i, c in enumerate(collectives)
    )


def traced_digest(graphs: Iterable[Any]) -> str:
    """Digest of the collectives ``graphs`` (:class:`~dtcompile.records.CompiledGraph`) were
    traced with, before dtcompile's passes: :attr:`Schedule.traced_digest`."""
    collectives = scheduled_collectives((g.kind, g.collectives_traced) for g in graphs)
    return short_digest("\n".join(map(str, collectives))) if collectives else ""


def inputs_text(example_inputs: Sequence[Any]) -> str:
    """The Dynamo graph's inputs as every rank describes them alike (a DTensor by its spec)."""
    from torch.distributed.tensor import DTensor

    parts = []
    for x in example_inputs:
        if isinstance(x, DTensor):
            parts.append(f"DTensor({x._spec})")
        elif isinstance(x, torch.Tensor):
            parts.append(f"{x.dtype}{list(x.shape)}/{list(x.stride())}/{x.requires_grad}")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts)


def decided_from(config: Any, priced: Any, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, str]:
    """What a compile of ``gm`` with ``config`` (a :class:`~dtcompile.config.DTCompileConfig`),
    priced by ``priced`` (a :class:`~dtcompile.cost.ProfileChoice`), is decided from, by name:
    the options that change graphs, the cost profile and its numbers, the sources, the graph."""
    from dtcompile.cache_keys import key_fields, profile_text, source_digest

    return {
        **key_fields(config),
        "cost profile": f"{priced}, numbers {profile_text(priced.profile)}",
        "dtcompile source": source_digest(),
        "torch": torch.__version__,
        DYNAMO_GRAPH: short_digest(gm.code + inputs_text(example_inputs)),
    }


def bucketed(graphs: Iterable[Any]) -> bool:
    """Whether the passes merged collectives in any of ``graphs`` (:class:`~dtcompile.records.CompiledGraph`)."""
    from dtcompile.records import Action

    return any(d.action == Action.BUCKETED for g in graphs for p in g.passes for d in p.decisions)


def save_schedule(key: str, schedule: Schedule) -> None:
    """Writes a compiled graph's collectives beside torch's compile cache, for a run the cache serves."""
    save_beside_cache(BesideCacheFolders.SCHEDULES, key, {"collectives": [dataclasses.asdict(c) for c in schedule.collectives or ()],
                                              "bucketed": schedule.bucketed})


def load_schedule(key: str) -> tuple[tuple[Scheduled, ...], bool] | None:
    """The collectives :func:`save_schedule` wrote for ``key`` and whether they were bucketed, or ``None``."""
    saved = load_beside_cache(BesideCacheFolders.SCHEDULES, key)
    collectives = _scheduled_from_json(saved.get("collectives")) if isinstance(saved, dict) else None
    return None if collectives is None else (collectives, bool(saved.get("bucketed")))
