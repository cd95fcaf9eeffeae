"""Decisions that change what ranks send, made once for every rank of a group.

A pass that merges collectives (``bucketing``) prices each merge from its rank's
own graph: the compute between two collectives, the activations alive at the
peak.  Those are the rank's own shapes, and ranks legitimately see other shapes
(a batch padded to its own longest sequence, packed sequences, a short last
batch, an evaluation set that does not divide by the world): priced alone, two
ranks can bucket the same collectives differently, and their collectives no
longer pair (gloo aborts on the size, NCCL hangs or moves the wrong bytes).

So such a pass decides its plan locally, then the ranks of each group the plan
is about settle on one (:meth:`PlanMeeting.agree`):

- the plan is written over what every rank of the group shares, the group's
  candidate collectives in program order (their op, group size, dtype, reduce
  op and bytes); its topic is a digest of those, so ranks that meet on it are
  deciding about the same collectives;
- each rank posts its own plan and the peak its graph was traced with, then
  reads its peers' (one store round per graph: every group's entry is posted
  before any is read, so ranks that meet on several groups cannot deadlock);
  every rank adopts the plan of the rank with the highest traced peak (the one
  whose memory its buckets were priced against most tightly; ties by the plan's
  text), so all adopt the same;
- what was adopted is kept in the store (:func:`dtcompile.rank_check.settle`):
  a rank that meets the same topic again on its own (a recompile for a batch of
  another size, which its peers do not make) adopts it without waiting.

Nothing is exchanged where the ranks cannot differ: no process group, the fake
group, a group of one rank.  A peer that does not come within
``check_ranks_timeout_s`` (it is running another graph, with other collectives
on this group) ends the wait with :class:`~dtcompile.rank_check.RanksDisagree`.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtcompile.rank_check import collect, is_simulated, post, settle, settled, world_can_disagree
from dtcompile.rank_schedule import short_digest

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


class Adoption(enum.Enum):
    """Where the plan a rank applies came from."""

    LOCAL = "this rank's own: no other rank can differ"
    AGREED = "every rank's own"
    ADOPTED = "another rank's"
    EARLIER = "settled by the ranks for an earlier graph"


@dataclass(frozen=True)
class AgreedPlan:
    group: str
    plan: Plan
    how: Adoption
    source: int | None = None
    """The rank whose plan was adopted, where one was."""
    differed: tuple[int, ...] = ()
    """The ranks whose own plan was not the adopted one."""

    def describe(self, what: str) -> str:
        """The record's text, where this rank applies a plan not its own."""
        if self.how is Adoption.EARLIER:
            return f"{what} on group {self.group}: the plan its ranks settled for an earlier graph with these collectives"
        return (
            f"{what} on group {self.group}: rank {self.source}'s plan, adopted by every rank (rank(s) "
            f"{list(self.differed)} priced another from their own shapes, which their peers do not share)"
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

    def agree(self, what: str, peak_bytes: int, plans: Sequence[GroupPlan]) -> list[AgreedPlan]:
        """The plan every rank of each group applies, for ``plans`` (this rank's own);
        ``what`` names the decision (pass and graph kind), ``peak_bytes`` the peak this
        rank's graph was traced with."""
        if not plans or not world_can_disagree():
            return [AgreedPlan(p.group, p.plan, Adoption.LOCAL) for p in plans]
        import torch.distributed as dist

        rank = dist.get_rank()
        found: dict[str, AgreedPlan] = {}
        pending = []
        for mine in plans:
            ranks = _ranks_of(mine.group)
            if ranks is None:
                found[mine.group] = AgreedPlan(mine.group, mine.plan, Adoption.LOCAL)
                continue
            topic = f"plans/{what}/{short_digest(mine.candidates)}"
            earlier = settled(topic, ranks)
            if earlier is not None:
                found[mine.group] = AgreedPlan(mine.group, _plan(json.loads(earlier)), Adoption.EARLIER)
                continue
            entry = {"plan": [list(b) for b in mine.plan], "peak": int(peak_bytes)}
            pending.append((mine, ranks, topic, post(topic, ranks, entry, "")))
        for mine, ranks, topic, posted in pending:
            peers = collect(
                posted, self.timeout_s,
                waiting=f"rank {rank} waits for the {what} plans of group {mine.group} {ranks}",
                ended=f"dtcompile: the {what} plans of group {mine.group} {ranks} were not settled",
                late=lambda missing, mine=mine, ranks=ranks: (
                    f"dtcompile: rank(s) {missing} of group {mine.group} {ranks} did not come to settle the {what} "
                    f"plan with rank {rank} within check_ranks_timeout_s={self.timeout_s:g} s: they are running "
                    "another graph (with other collectives on this group), are still compiling (raise "
                    "check_ranks_timeout_s where compiles take longer), or have stopped"
                ),
            )
            chosen = max(peers, key=lambda p: (p["peak"], json.dumps(p["plan"]), -p["rank"]))
            plan = _plan(chosen["plan"])
            settle(topic, ranks, json.dumps(chosen["plan"]))
            differed = tuple(sorted(p["rank"] for p in peers if _plan(p["plan"]) != plan))
            how = Adoption.AGREED if not differed else Adoption.ADOPTED
            if differed:
                log.info("dtcompile: %s on group %s: rank %d's plan adopted (ranks %s differed)",
                         what, mine.group, chosen["rank"], list(differed))
            found[mine.group] = AgreedPlan(mine.group, plan, how, chosen["rank"], differed)
        return [found[p.group] for p in plans]


def _plan(data: Any) -> Plan:
    return tuple(tuple(int(i) for i in bucket) for bucket in data)
