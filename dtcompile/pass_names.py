"""dtcompile's graph passes as a table: one :class:`PassSpec` each, in the order they run.

Every fact about a pass that other modules act on is read from :data:`PASS_SPECS`:
its name (``disable_passes`` is validated against :data:`PASS_NAMES`), whether it
rewrites collectives (:data:`COMMUNICATION_PASSES`: every rank must decide it alike,
the ranks' refusals and torchtitan's registered pipeline name these), and whether
it places communication itself (:data:`SCHEDULE_OWNERS`: where it did, Inductor's
own reordering stays off).  Below both :mod:`dtcompile.config` and
:mod:`dtcompile.passes` (whose ``PASSES`` pair each spec with its function, in this
order; a test checks), so neither imports the other to know them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["COMMUNICATION_PASSES", "PASS_NAMES", "PASS_SPECS", "SCHEDULE_OWNERS", "PassSpec", "Stage"]


class Stage(str, enum.Enum):
    """What a pass does to the graph."""

    COMMUNICATION = "communication"
    """Rewrites what the ranks send, or when: every rank must decide it alike."""
    PLACEMENT = "placement"
    """Moves local work (the optimizer's updates) and no collective."""
    DESCRIPTION = "description"
    """Changes nothing: describes the graph that is lowered."""


@dataclass(frozen=True)
class PassSpec:
    """One graph pass as the rest of dtcompile knows it."""

    name: str
    """What ``disable_passes`` and the records name it by."""
    stage: Stage
    owns_schedule: bool = False
    """Whether what it does places collectives and waits itself (a move, a fusion): then
    Inductor's ``simple_overlap`` would redo that schedule without dtcompile's costs."""

    @property
    def rewrites_collectives(self) -> bool:
        return self.stage is Stage.COMMUNICATION


PASS_SPECS: tuple[PassSpec, ...] = (
    PassSpec("async_tp", Stage.COMMUNICATION, owns_schedule=True),
    PassSpec("bucketing", Stage.COMMUNICATION),
    PassSpec("overlap", Stage.COMMUNICATION, owns_schedule=True),
    PassSpec("optimizer_updates", Stage.PLACEMENT),
    PassSpec("annotate", Stage.DESCRIPTION),
)
"""Every pass, in the order :func:`dtcompile.passes.run_passes` runs them: rewrites first,
then ``annotate``, which describes the graph that is lowered."""

PASS_NAMES: tuple[str, ...] = tuple(s.name for s in PASS_SPECS)
COMMUNICATION_PASSES: frozenset[str] = frozenset(s.name for s in PASS_SPECS if s.rewrites_collectives)
"""The passes that change what collectives run, or when."""
SCHEDULE_OWNERS: frozenset[str] = frozenset(s.name for s in PASS_SPECS if s.owns_schedule)

