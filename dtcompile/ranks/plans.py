"""Decisions that change what ranks send, made once for every rank of a group.

A pass that merges collectives (``bucketing``) prices each merge from its rank's
own graph: the compute between two collectives, the activations alive at the
peak.  Those are the rank's own shapes, and ranks legitimately see other shapes
(a batch padded to its own longest sequence, packed sequences, a short last
batch, an evaluation set that does not divide by the world): priced alone, two
ranks can bucket the same collectives differently, and their collectives no
longer pair (gloo aborts on the size, NCCL hangs or moves the wrong bytes).

So such a pass prices its plan locally, and the ranks of each group the plan is
about settle on one (:meth:`PlanMeeting.agree`):

- the plan is written over what every rank of the group shares, the group's
  candidate collectives in program order (their op, group size, dtype, reduce
  op and bytes); its topic is a digest of those, so ranks that settle it are
  deciding about the same collectives;
- one plan serves every group of the mesh axis (the dp groups of an FSDP x TP mesh
  alike): ranks of one tensor-parallel group sit in different dp groups, and must
  issue the same graph, dp buckets included, so each dp group settling its own (one
  from a rank fed 3 rows, the other from a rank fed 1) made tensor-parallel peers
  compile different graphs (the 1,000-program run's FSDP x TP finds);
- the first rank of the axis's groups to compile that topic settles it with its own
  plan, through the job's store (:func:`dtcompile.ranks.check.settle`), and goes
  on; every other rank adopts what was settled, waiting only for that rank,
  which waits for nobody.  So ranks compiling at once (processes), one after
  another (ranks as threads compile under Dynamo's one lock) or alone (a
  recompile for a batch of another size, which its peers do not make) never
  wait for each other, and every rank applies the same plan.  Which rank's
  plan it is depends on which compiled first: where their own plans differ
  (their shapes do), the record of every rank that adopted another's says so.

Nothing is exchanged where the ranks cannot differ: no process group, the fake
group, a group of one rank.  A rank that waits ``check_ranks_timeout_s`` for the
settled plan (the rank that claimed it stopped) ends with
:class:`~dtcompile.ranks.check.RanksDisagree`.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtcompile.ranks.check import is_simulated, settle, settled, world_can_disagree
from dtcompile.ranks.schedule import short_digest

__all__ = ["Adoption", "AgreedPlan", "GroupPlan", "PlanMeeting"]

log = logging.getLogger(__name__)

Plan = tuple[tuple[int, ...], ...]
"""A plan over a group's candidates: the groups of candidate ordinals that become one (a bucket)."""


@dataclass(frozen=True)
class GroupPlan:
    """One rank's own plan for one process group's candidates."""

    group: str
    """The process group's name: the ranks that must decide alike."""
    candidates: str
    """What the plan is over, as every rank of the group describes it alike."""
    plan: Plan
    axis: str = ""
    """The group's mesh axis: every group of it applies one plan (the group's name where empty)."""


class Adoption(enum.Enum):
    """Where the plan a rank applies came from."""

    LOCAL = "this rank's own: no other rank can differ"
    SETTLED = "this rank's own, settled for every rank of the group"
    AGREED = "settled by another rank, the same as this rank's own"
    ADOPTED = "settled by another rank, not this rank's own"


@dataclass(frozen=True)
class AgreedPlan:
    group: str
    plan: Plan
    how: Adoption
    source: int | None = None
    """The rank that settled the plan, where one did."""
    rank: int | None = None
    """This rank."""

    def describe(self, what: str) -> str:
        """The record's text, where this rank applies a plan not its own."""
        if self.source is not None and self.source == self.rank:
            return (
                f"{what} on group {self.group}: the plan this rank settled for an earlier graph with these "
                "collectives, applied by every rank (this graph's own prices, from its shapes, differ)"
            )
        return (
            f"{what} on group {self.group}: rank {self.source}'s plan, settled for these collectives by the first "
            "rank to compile them and applied by every rank (this rank priced another from its own shapes, "
            "which its peers do not share)"
        )


def _ranks_of(group_name: str) -> list[int] | None:
    """The global ranks of ``group_name``, or ``None`` where its ranks cannot differ."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if group.size() < 2 or is_simulated(group):
        return None
    return dist.get_process_group_ranks(group)


@dataclass(frozen=True)
class PlanMeeting:
    """How the ranks of a graph's groups settle a pass's plans (see the module docstring)."""

    timeout_s: float = 300.0
    """How long a rank waits for its peers' plans (``check_ranks_timeout_s``)."""

    def agree(self, what: str, plans: Sequence[GroupPlan]) -> list[AgreedPlan]:
        """The plan every rank of each group applies, for ``plans`` (this rank's own);
        ``what`` names the decision (pass and graph kind)."""
        if not plans or not world_can_disagree():
            return [AgreedPlan(p.group, p.plan, Adoption.LOCAL) for p in plans]
        import torch.distributed as dist

        rank = dist.get_rank()
        found = []
        for mine in plans:
            ranks = _ranks_of(mine.group)
            if ranks is None:
                found.append(AgreedPlan(mine.group, mine.plan, Adoption.LOCAL))
                continue
            # One topic for every group of the axis: the store's keys are the world's.
            topic = f"plans/{what}/{mine.axis or mine.group}/{short_digest(mine.candidates)}"
            world = list(range(dist.get_world_size()))
            if settle(topic, world, json.dumps({"rank": rank, "plan": [list(b) for b in mine.plan]})):
                found.append(AgreedPlan(mine.group, mine.plan, Adoption.SETTLED, rank, rank))
                continue
            settled_by = json.loads(settled(
                topic, world, self.timeout_s,
                waiting=f"rank {rank} waits for the {what} plan of group {mine.group} {ranks}",
                late=(
                    f"dtcompile: rank {rank} waited check_ranks_timeout_s={self.timeout_s:g} s for the {what} plan "
                    f"of group {mine.group} {ranks}, which the first rank of its axis's groups to compile these "
                    "collectives settles: "
                    "it has stopped, or is still compiling (raise check_ranks_timeout_s where compiles take longer)"
                ),
            ))
            plan = _plan(settled_by["plan"])
            how = Adoption.AGREED if plan == mine.plan else Adoption.ADOPTED
            if how is Adoption.ADOPTED:
                log.info("dtcompile: %s on group %s: rank %d's settled plan adopted", what, mine.group, settled_by["rank"])
            found.append(AgreedPlan(mine.group, plan, how, settled_by["rank"], rank))
        return found


def _plan(data: Any) -> Plan:
    return tuple(tuple(int(i) for i in bucket) for bucket in data)
