"""One collective as the ranks of its group must agree on it: the rule every reader of ranks' collectives shares.

:class:`Scheduled` is what the ranks' check (:mod:`dtcompile.ranks.check`) compares, one
per collective of a compiled graph, and :func:`shared_shape` which of its sizes peers
must share.  ``dtcompile-report`` judges the ranks' schedules of a ``TORCH_TRACE`` log by
the same rule (:func:`scheduled_from_artifact`), so a collective the check agreed on
(a MoE all-to-all whose token counts differ by rank) is not shown as a divergence.
Nothing here imports torch: the report reads logs without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Scheduled", "scheduled_from_artifact", "shared_shape"]


def shared_shape(op: str, data_dependent: bool, shape: Sequence[Any]) -> tuple[Any, ...] | None:
    """The shape of a collective that every rank of its group must issue alike, or ``None``
    where ranks need not share it: an all-to-all's (each rank's splits are its own) and a
    data-dependent collective's."""
    return None if op == "all_to_all" or data_dependent else tuple(shape)


@dataclass(frozen=True)
class Scheduled:
    """One collective of a compiled graph, as the ranks of its group must agree on it."""

    kind: str
    """The graph it is in: ``forward``, ``backward``, ``inference`` or ``step``."""
    index: int
    """Its place among that graph's collectives."""
    label: str
    """``all_gather``, or ``all_gather+matmul`` for a fused collective-matmul."""
    axis: str
    group_size: int
    dtype: str
    shape: tuple[int, ...] | None
    """``None`` where ranks need not share it: an all-to-all's, a data-dependent collective's."""

    @property
    def where(self) -> str:
        return f"{self.kind} collective {self.index}"

    @property
    def what(self) -> str:
        shape = "" if self.shape is None else str(list(self.shape))
        return f"{self.label}[{self.axis}] x{self.group_size} {self.dtype}{shape}"

    @property
    def sizeless(self) -> tuple[str, int, str, str, int, str]:
        """What pairs it with its peers' collective whatever the sizes: graph, place, op, group, dtype."""
        return (self.kind, self.index, self.label, self.axis, self.group_size, self.dtype)

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def scheduled_from_artifact(kind: str, collectives: Sequence[Mapping[str, Any]]) -> tuple[Scheduled, ...]:
    """The collectives of one graph's ``dtcompile_*_collectives`` artifact
    (:func:`dtcompile.artifacts.collectives_json`) as :class:`Scheduled` values, by
    :func:`shared_shape`'s rule (a log written before the artifact named each label
    gives its op)."""
    return tuple(
        Scheduled(
            kind=kind,
            index=i,
            label=c.get("label", c["op"]),
            axis=c["axis"],
            group_size=c["group_size"],
            dtype=c["dtype"],
            shape=shared_shape(c["op"], c.get("data_dependent", False), c["shape"]),
        )
        for i, c in enumerate(collectives)
    )
