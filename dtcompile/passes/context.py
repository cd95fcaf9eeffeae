"""What a pass is given besides the graph: :class:`PassContext`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dtcompile.records import Action, Outcome, Price

if TYPE_CHECKING:
    from dtcompile.annotations import DynamoGraphInfo
    from dtcompile.config import DTCompileConfig
    from dtcompile.cost_model import HardwareProfile

__all__ = ["PassContext"]


@dataclass
class PassContext:
    """Everything a pass may read, and the one way it reports what it did.

    A pass is ``(gm, example_inputs, ctx) -> gm``; it reads the graph's kind,
    the backend's config and the Dynamo graph's placements from here, never
    from ``gm.meta``, and reports each decision with :meth:`record`.
    """

    kind: str
    """``forward``, ``backward`` or ``inference``."""
    config: DTCompileConfig
    info: DynamoGraphInfo
    """The Dynamo graph this AOT graph came from: placements, mesh axes, cost profile."""
    outcomes: list[Outcome] = field(default_factory=list)
    """The current pass's decisions (``run_passes`` takes them after each pass)."""

    @property
    def axes(self) -> dict[str, str]:
        """Process-group name -> mesh axis name, for the groups of this graph."""
        return self.info.axes

    @property
    def profile(self) -> HardwareProfile:
        """The cost profile this graph is priced with (``config.cost_profile``, or what ``auto`` chose)."""
        return self.info.profile

    def record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome

    def price(self, saves_us: float, costs_us: float, costs_what: str = "") -> Price:
        """A :class:`~dtcompile.records.Price` under this graph's profile."""
        return Price(saves_us, costs_us, costs_what, self.profile.name)

    def fused(self, text: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome(Action.FUSED, text, price=price))

    def bucketed(self, text: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome(Action.BUCKETED, text, price=price))

    def moved(self, node: str, text: str) -> Outcome:
        return self.record(Outcome(Action.MOVED, text, node))

    def skipped(self, node: str, reason: str, price: Price | None = None) -> Outcome:
        return self.record(Outcome.skipped(node, reason, price))
