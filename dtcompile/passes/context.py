"""What a pass is given besides the graph: :class:`PassContext`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import fx

from dtcompile.base.channels import GraphKind
from dtcompile.cost.simulate import Timeline
from dtcompile.graph.collectives import CollectiveInfo, largest_collective
from dtcompile.graph.memory import Estimates, MemoryEstimate, MemoryPlan, PeakTracker
from dtcompile.ranks.plans import PlanMeeting
from dtcompile.records import Action, Outcome, Price

if TYPE_CHECKING:
    from dtcompile.annotations import DynamoGraphInfo
    from dtcompile.config import DTCompileConfig
    from dtcompile.cost import HardwareProfile

__all__ = ["PassContext"]


@dataclass
class PassContext:
    """Everything a pass may read, and the one way it reports what it did.

    A pass is ``(gm, example_inputs, ctx) -> gm``; it reads the graph's kind,
    the backend's config and the Dynamo graph's placements from here, never
    from ``gm.meta``, and reports each decision with :meth:`record`.
    """

    kind: GraphKind
    """``forward``, ``backward``, ``inference``, or ``step`` for a whole-step graph."""
    config: DTCompileConfig
    info: DynamoGraphInfo
    """The Dynamo graph this AOT graph came from: placements, mesh axes, cost profile."""
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    """What the graph's passes may spend in bytes: its budget, and what the caller holds meanwhile."""
    budget_bytes: int | None = None
    """The graph's memory budget (:meth:`MemoryPlan.budget_for`), set by :meth:`set_budget`
    on the graph as traced (``run_passes`` calls it before the first pass)."""
    budget_why: str = ""
    """Where :attr:`budget_bytes` comes from, as the records say it."""
    traced_memory: MemoryEstimate | None = None
    """The graph's memory before any pass, set by ``run_passes``."""
    traced_timeline: Timeline | None = None
    """The graph before any pass played on its profile (:func:`~dtcompile.cost.simulate.simulate`), set by ``run_passes``."""
    traced_seconds: float = 0.0
    """Wall time ``run_passes`` spent on :attr:`traced_memory` and :attr:`traced_timeline`:
    the first part of the graph's simulations (:attr:`dtcompile.records.Stage.SIMULATIONS`)."""
    traced_collectives: tuple[CollectiveInfo, ...] = ()
    """The graph's collectives before any pass, set by ``run_passes``: what the ranks traced,
    which the ranks' check tells from what dtcompile's passes made of them."""
    plans: PlanMeeting = field(default_factory=PlanMeeting)
    """How a decision that changes what ranks send is settled by every rank of its group
    (:mod:`dtcompile.ranks.plans`): a pass never applies a plan priced from its rank's own
    shapes alone."""
    outcomes: list[Outcome] = field(default_factory=list)
    """The current pass's decisions (``run_passes`` takes them after each pass)."""
    estimates: Estimates = field(default_factory=Estimates)
    """The graph's memory estimates, each kept while no pass changed the graph (:meth:`estimate`)."""

    @property
    def axes(self) -> dict[str, str]:
        """Process-group name -> mesh axis name, for the groups of this graph."""
        return self.info.axes

    @property
    def profile(self) -> HardwareProfile:
        """The cost profile this graph is priced with (``config.cost_profile``, or what ``auto`` chose)."""
        return self.info.profile

    def estimate(self, gm: fx.GraphModule, held_bytes: int | None = None) -> MemoryEstimate:
        """The graph's memory as it is now (:func:`~dtcompile.graph.memory.estimate_memory`),
        the caller holding ``held_bytes`` (default: what :attr:`memory` says it holds); the
        same estimate again where the graph did not change since it was asked."""
        return self.estimates(gm, self.kind, self.memory.held_bytes if held_bytes is None else held_bytes)

    def set_budget(self, gm: fx.GraphModule) -> int:
        """Sets :attr:`traced_memory` and :attr:`budget_bytes` from ``gm``, the graph before
        any pass; a graph that gathers no parameters gets twice its largest collective's
        buffer as its window."""
        self.traced_memory = self.estimate(gm)
        plan, budget = self.memory, self.config.memory_budget_bytes
        if budget is None and not plan.prefetch_bytes:
            plan = dataclasses.replace(plan, prefetch_bytes=2 * largest_collective(gm))
        graph = f"the {self.kind} graph of compile {self.info.compile_id}"
        self.budget_bytes, self.budget_why = plan.budget_for(self.traced_memory, graph, budget)
        return self.budget_bytes

    def peak_tracker(self, gm: fx.GraphModule) -> PeakTracker:
        """The graph's memory as it is now, to price rewrites against :attr:`budget_bytes`
        (set from ``gm`` if no budget was set yet)."""
        budget = self.budget_bytes if self.budget_bytes is not None else self.set_budget(gm)
        return PeakTracker(self.estimate(gm), budget)

    def record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome

    def price(self, saves_us: float, costs_us: float, costs_what: str = "", adds_bytes: int | None = None) -> Price:
        """A :class:`~dtcompile.records.Price` under this graph's profile."""
        return Price(saves_us, costs_us, costs_what, self.profile.name, adds_bytes)

    def fused(self, text: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome(Action.FUSED, text, price=price))

    def bucketed(self, text: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome(Action.BUCKETED, text, price=price))

    def moved(self, node: str, text: str) -> Outcome:
        return self.record(Outcome(Action.MOVED, text, node))

    def skipped(self, node: str, reason: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome.skipped(node, reason, price))
