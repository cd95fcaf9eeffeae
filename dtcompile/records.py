"""What dtcompile did with each graph: typed pass outcomes, pass records, compiled-graph records.

The passes report each decision as an :class:`Outcome` (what kind of change,
which node, why); :func:`dtcompile.passes.run_passes` gathers them into one
:class:`PassRecord` per pass; the backend keeps one :class:`CompiledGraph` per
AOT graph it compiled (``backend.records``), which the reports read, with the
seconds its compile spent in each :class:`Stage` (:class:`StageSeconds`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import fx

from dtcompile.annotations import DynamoGraphInfo, format_aot_graph
from dtcompile.base.channels import GraphKind
from dtcompile.base.notation import format_bytes
from dtcompile.cost.simulate import Timeline
from dtcompile.graph.collectives import CollectiveInfo
from dtcompile.graph.memory import MemoryEstimate
from dtcompile.graph.regions import RegionInfo

__all__ = [
    "Action",
    "CachedCompile",
    "CheckOutcome",
    "CompiledGraph",
    "EagerFallback",
    "MemoryBudget",
    "Outcome",
    "PassRecord",
    "Price",
    "RankCheck",
    "Stage",
    "StageSeconds",
]


class MemoryBudget(NamedTuple):
    """The peak a graph's passes kept to, and where that budget comes from (``memory_budget_bytes``,
    or the graph's peak as traced plus the prefetch window); ``0`` where none was set."""

    num_bytes: int
    why: str


class Action(enum.Enum):
    """What a pass did at one place of the graph."""

    FUSED = "fused"
    """Collective and compute became one fused op (``async_tp``)."""
    BUCKETED = "bucketed"
    """Several collectives became one (``bucketing``)."""
    MOVED = "moved"
    """Nodes were reordered (``overlap``)."""
    RESHARDED = "resharded"
    """A gathered parameter is gathered again in the backward instead of kept (``reshard_after_forward``)."""
    RECOMPUTED = "recomputed"
    """An activation is recomputed in the backward instead of saved, to fit the memory budget (``activation_budget``)."""
    AGREED = "agreed"
    """The ranks of a group settled a plan together, and this rank applies another rank's
    (``bucketing``: its own was priced from shapes its peers do not share)."""
    SKIPPED = "skipped"
    """The pass left a candidate as it was; the outcome says why."""


@dataclass(frozen=True)
class Price:
    """What a rewrite is estimated to save and to cost, in microseconds of a step,
    under the graph's cost profile; a pass applies a rewrite only when it :attr:`pays`."""

    saves_us: float
    """Time saved: launches merged, communication hidden under compute."""
    costs_us: float
    """Time added: copies into and out of a bucket, overlap lost by waiting for a bucket."""
    costs_what: str = ""
    """What the cost is made of, as the record says it (``of copies``)."""
    profile: str = ""
    """The cost profile's name."""
    adds_bytes: int | None = None
    """Bytes the rewrite adds to the graph's estimated peak (:mod:`dtcompile.graph.memory`),
    where the pass priced memory too."""

    @property
    def pays(self) -> bool:
        return self.saves_us > self.costs_us

    def __str__(self) -> str:
        costs = f"costs {_us(self.costs_us)}" + (f" {self.costs_what}" if self.costs_what else "")
        peak = f", {_peak_change(self.adds_bytes)}" if self.adds_bytes is not None else ""
        on = f" ({self.profile})" if self.profile else ""
        return f"saves {_us(self.saves_us)}, {costs}{peak}{on}"


def _us(value: float) -> str:
    """A time as a reader wants it: ``1.23 ms``, ``123 us``, ``12.3 us``, ``4.12 ns``, ``0 us``."""
    size = abs(value)
    if size >= 1000:
        return f"{value / 1000:.3g} ms"
    if size >= 100:
        return f"{value:.0f} us"
    if size >= 1:
        return f"{value:.1f} us"
    return f"{value * 1000:.3g} ns" if size else "0 us"


def _peak_change(num: int) -> str:
    """What a rewrite does to the peak: ``adds 8 MiB to the peak``, ``lowers the peak by 9 KiB``."""
    if num > 0:
        return f"adds {format_bytes(num)} to the peak"
    return f"lowers the peak by {format_bytes(-num)}" if num else "leaves the peak as it is"


@dataclass(frozen=True)
class Outcome:
    """One decision of a pass: ``str()`` is the line the log and the reports show."""

    action: Action
    text: str
    """What was done, or for :attr:`Action.SKIPPED` why not."""
    node: str | None = None
    """The node the decision is about, when there is one."""
    price: Price | None = None
    """For a priced rewrite, applied or skipped: what it saves and costs."""

    def __str__(self) -> str:
        text = f"{self.node}: {self.text}" if self.node else self.text
        return f"{text}: {self.price}" if self.price is not None else text

    @classmethod
    def skipped(cls, node: str, reason: str, price: Price | None = None) -> Outcome:
        return cls(Action.SKIPPED, reason, node, price)


@dataclass(frozen=True)
class PassRecord:
    """What one pass did to one graph."""

    name: str
    ran: bool
    """False when the pass was switched off by name."""
    nodes_before: int
    nodes_after: int
    collectives_before: int
    collectives_after: int
    decisions: tuple[Outcome, ...] = ()
    """What the pass did, and what it left alone and why, one outcome each."""
    seconds: float = 0.0
    """Wall time the pass took."""


class Stage(str, enum.Enum):
    """A stage of one graph's compile, as :class:`StageSeconds` times it, in the order a
    compile goes through them.  A ``str``: it prints and serializes as its value (``AOTAutograd``)."""

    DYNAMO = "Dynamo"
    """Dynamo's tracing of the frame: from when it began compiling the frame (or, where one
    frame's compile calls the backend again, from the backend's last return) to its call of
    the backend; charged to the Dynamo graph's first AOT graph.  Absent where torch does not
    say when it began (:func:`dtcompile.base.torch_compat.frame_compile_started_ns`)."""
    AOT_AUTOGRAD = "AOTAutograd"
    """AOTAutograd's trace of the joint graph (with Inductor, also ``compile_fx``'s own work
    around it): the time inside the backend's trace that no other stage took, charged to
    the graph it led to (the forward or inference graph first; a backward gets what
    elapsed since its forward was done; one compiled lazily at the first backward, outside
    the trace, gets none).  For a whole-step graph: the front door's trace of the step
    (``compile_step``'s ``make_fx``); absent where the front door did not measure it
    (graph_trainer's own tracer)."""
    PARTITIONER = "partitioner"
    """dtcompile's :class:`~dtcompile.pipeline.partition.Partitioner` (torch's min-cut
    included), charged to the forward graph it made with the backward."""
    SPMD_TYPES = "SPMD types"
    """The check of the AOT graph's SPMD types as traced (:func:`dtcompile.spmd.inference.type_graph`),
    where its inputs are typed."""
    PASSES = "passes"
    """dtcompile's passes: the sum of the graph's :attr:`PassRecord.seconds`."""
    SIMULATIONS = "simulations"
    """The memory estimates and simulated timelines of the graph as traced and as lowered
    (:func:`dtcompile.graph.memory.estimate_memory`, :func:`dtcompile.cost.simulate.simulate`)."""
    ARTIFACTS = "artifacts"
    """Logging the graph and emitting its ``TORCH_TRACE`` artifacts (printing it with
    ``report=True``), and keeping them beside the compile cache."""
    INDUCTOR = "Inductor"
    """Inductor's ``compile_fx_inner`` on the graph (``inductor=True``; ``compile_step``'s
    ``compile_fx`` of the step graph)."""
    RANKS_CHECK = "ranks' check"
    """The exchange of the ranks' check (:attr:`RankCheck.seconds`), where its ranks exchanged:
    charged to the compile's last graph, the check being one for all its graphs."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def _seconds_text(seconds: float) -> str:
    """A stage's seconds as a reader wants them: ``1.20 s``, ``0.05 s``, ``4.2 ms``, ``0.028 ms``."""
    return f"{seconds:.2f} s" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"


class StageSeconds:
    """The seconds one graph's compile spent in each :class:`Stage` it went through, in the
    stages' order; a stage it did not go through is absent (no Inductor with ``inductor=False``).

    Filled as the stages end.  The :class:`CompiledGraph` holding it is made after the
    passes, and the stages after that add to it (:meth:`add`): its artifacts, Inductor,
    the ranks' check at the compiled function's first call.  So this is the one part of
    the frozen record that changes, and it is complete once that first call returned.
    The :attr:`Stage.PASSES` seconds are not kept here: they are the sum of the
    :attr:`PassRecord.seconds` of ``passes``, the graph's own records.
    """

    def __init__(self, measured: Mapping[Stage, float] | None = None, passes: Sequence[PassRecord] = ()) -> None:
        self._measured: dict[Stage, float] = {}
        self._passes = tuple(passes)
        for stage, seconds in (measured or {}).items():
            self.add(stage, seconds)

    def add(self, stage: Stage, seconds: float) -> None:
        """Adds ``seconds`` to ``stage`` (a stage may end more than once: the artifacts)."""
        stage = Stage(stage)
        if stage is Stage.PASSES:
            raise ValueError("StageSeconds.add: the passes' seconds are their records' (PassRecord.seconds), not added")
        if seconds < 0:
            raise ValueError(f"StageSeconds.add: {stage} took {seconds} s; a stage's seconds are 0 or more")
        self._measured[stage] = self._measured.get(stage, 0.0) + seconds

    def add_check(self, check: RankCheck) -> None:
        """Charges the ranks' check ``check`` (:attr:`Stage.RANKS_CHECK`), where its ranks exchanged."""
        if check.seconds > 0:
            self.add(Stage.RANKS_CHECK, check.seconds)

    def items(self) -> list[tuple[Stage, float]]:
        """``(stage, seconds)`` for each stage gone through, in :class:`Stage` order."""
        passes = sum(p.seconds for p in self._passes)
        found = {**self._measured, **({Stage.PASSES: passes} if passes > 0 else {})}
        return [(stage, found[stage]) for stage in Stage if stage in found]

    def get(self, stage: Stage) -> float | None:
        """The seconds of ``stage``, ``None`` where the compile did not go through it."""
        return dict(self.items()).get(Stage(stage))

    def __contains__(self, stage: object) -> bool:
        return stage in dict(self.items())

    def __iter__(self) -> Iterator[Stage]:
        return (stage for stage, _ in self.items())

    def __len__(self) -> int:
        return len(self.items())

    @property
    def total(self) -> float:
        """The seconds of every stage together."""
        return sum(seconds for _, seconds in self.items())

    def __str__(self) -> str:
        stages = ", ".join(f"{stage} {_seconds_text(seconds)}" for stage, seconds in self.items())
        return f"{stages}; total {_seconds_text(self.total)}" if stages else "no stage timed"

    def __repr__(self) -> str:
        return f"StageSeconds({', '.join(f'{stage.name}={seconds:.6f}' for stage, seconds in self.items())})"


@dataclass(frozen=True)
class CompiledGraph:
    """What dtcompile did with one graph: an AOT graph (forward, backward or inference) of the
    Dynamo backend, or a whole-step graph (``GraphKind.STEP``) of ``compile_step`` or graph_trainer."""

    compile_id: str
    """Dynamo's compile id, e.g. ``"0/0"`` (frame 0, first compile)."""
    kind: GraphKind
    """Which graph: forward, backward, inference, or a whole step."""
    graph: fx.GraphModule
    """The graph after the passes and with its regions inlined, as handed to lowering."""
    collectives: tuple[CollectiveInfo, ...]
    passes: tuple[PassRecord, ...]
    info: DynamoGraphInfo
    """The Dynamo graph it came from: placements, and collectives charged to its nodes."""
    regions: tuple[RegionInfo, ...] = ()
    """The ``local_map`` regions the passes saw as one op each (inlined at lowering)."""
    with_regions: str = ""
    """The graph as the passes left it, regions as one op (:func:`~dtcompile.graph.regions.format_with_regions`);
    empty when it has none."""
    memory: MemoryEstimate | None = None
    """Its live bytes along the schedule and its peak, as lowered (:mod:`dtcompile.graph.memory`)."""
    memory_traced: MemoryEstimate | None = None
    """The same before any pass: what the passes added is the difference."""
    memory_budget: MemoryBudget = MemoryBudget(0, "")
    """The budget the passes kept to, and where it comes from."""
    timeline: Timeline | None = None
    """Its schedule played on its cost profile, as lowered (:func:`dtcompile.cost.simulate.simulate`)."""
    timeline_traced: Timeline | None = None
    """The same before any pass: what the passes hid is the difference."""
    collectives_traced: tuple[CollectiveInfo, ...] = ()
    """Its collectives before dtcompile's passes, as traced: what the ranks' check tells
    from what the passes made of them (:mod:`dtcompile.ranks.check`)."""
    spmd_types_traced: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Its nodes' SPMD types per mesh axis as traced, before the passes (where they were
    checked: :mod:`dtcompile.spmd.inference`); the graph's nodes carry them as lowered."""
    lowering: Mapping[str, Any] = field(default_factory=dict)
    """How it was lowered: ``{}`` without Inductor, else the Inductor settings this
    backend asked for (from ``inductor_config``, ``options=`` and ``mode=``) as
    ``torch._inductor.config`` read them while Inductor compiled this graph."""
    stages: StageSeconds = field(default_factory=StageSeconds, compare=False)
    """The seconds its compile spent in each stage (:class:`StageSeconds`: filled as the
    stages end, complete once the compiled function's first call returned); none measured
    for a record made otherwise than by a front door."""

    def annotated(self) -> str:
        """The graph one line per call node with its annotation (see :mod:`dtcompile.annotations`)."""
        return format_aot_graph(self.graph)


@dataclass(frozen=True)
class EagerFallback:
    """A Dynamo graph the backend runs eagerly: torch's AOTAutograd raised while tracing it.

    DTensor's traced paths (the decompositions AOTAutograd traces, the backward
    it derives, its output-aliasing rules) refuse some programs that DTensor's
    eager ops run, e.g. the in-place ``masked_fill_`` of ``norm``'s backward on a
    ``Partial`` tensor.  Such a graph runs as the Dynamo graph, op by op on
    DTensors: eager's results and eager's collectives, not compiled code.  Every
    refusal seen so far is decided from global shapes and placements (DTensor's
    sharding propagation, AOTAutograd's aliasing rule), so every rank falls back
    alike; one that depended on a rank's own uneven shard could split the ranks.
    """

    compile_id: str
    error: str
    """What torch raised, on one line."""
    graph: fx.GraphModule
    """The Dynamo graph that runs eagerly."""

    def __str__(self) -> str:
        return (
            f"compile {self.compile_id}: torch's AOTAutograd could not trace this graph over DTensor "
            f"({self.error}); it runs eagerly instead (DTensor's own ops: eager's results, not compiled code). "
            "This is a limitation of stock torch, not of your program; "
            "dtcompile.backend(eager_fallback=False) raises the error instead"
        )


@dataclass(frozen=True)
class CachedCompile:
    """A Dynamo graph whose compiled forward and backward came from AOTAutograd's cache.

    A process with the same compile cache (``TORCHINDUCTOR_CACHE_DIR``, or
    artifacts loaded with ``torch.compiler.load_cache_artifacts()``) compiled this
    graph with the same dtcompile source and options
    (:func:`dtcompile.cache_keys.compile_key`): nothing was traced, partitioned or
    passed here, so there is no :class:`CompiledGraph` to inspect for it; the
    ``TORCH_TRACE`` artifacts of the run that compiled it, kept beside the cache
    (:mod:`dtcompile.base.beside_cache`), are logged again instead.
    ``dtcompile.backend(report=True)`` or ``trace_pass_graphs=True`` compile
    without that cache, to show the graphs.
    """

    compile_id: str
    graph: fx.GraphModule
    """The Dynamo graph."""
    reported: bool = False
    """Whether the artifacts of the run that compiled it were found and logged again."""

    def __str__(self) -> str:
        again = (
            "its report sections, kept beside the cache, are logged again"
            if self.reported
            else "its graphs were inspected there; what was kept of them beside the cache is gone"
        )
        return (
            f"compile {self.compile_id}: loaded from AOTAutograd's cache (compiled by dtcompile with the same "
            f"options in an earlier run; {again})"
        )


class CheckOutcome(str, enum.Enum):
    """How one graph's check ended (:attr:`dtcompile.records.RankCheck.outcome`)."""

    AGREED = "agreed"
    EARLIER = "agreed on by an earlier graph"
    """A recompile with collectives its frame's ranks agreed on: nothing exchanged."""
    EARLIER_OTHER_SIZES = "agreed on by an earlier graph, with this rank's sizes"
    """A recompile with its frame's agreed collectives but other sizes, which the program
    decided (this rank's own shapes specialized, an uneven shard): nothing exchanged."""
    EARLIER_SETTINGS = "decided as an earlier graph (its collectives unknown here)"
    """A recompile served from the cache without its schedule, decided from the settings its
    frame's ranks agreed on: nothing exchanged."""
    EAGER = "every rank runs it eagerly"
    DISAGREE = "ranks disagree"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True)
class RankCheck:
    """One graph's check that its ranks compiled the same collectives (:mod:`dtcompile.ranks.check`)."""

    compile_id: str
    groups: tuple[str, ...]
    """The process groups compared on, by name."""
    outcome: CheckOutcome
    """``agreed``, one of the ``agreed on by an earlier graph`` kinds (a recompile whose
    collectives its frame's ranks agreed on: nothing exchanged), ``every rank runs it
    eagerly`` or ``ranks disagree``."""
    seconds: float
    """Wall time of the exchange (0 where nothing was exchanged)."""
    known: bool
    """Whether this rank knew its graph's collectives (not: eager, or served from the
    cache without them); where a rank did not, what they were decided from is compared."""

    def __str__(self) -> str:
        what = "collectives" if self.known else "what they were decided from"
        return (
            f"compile {self.compile_id}: ranks' check of {what} on groups {list(self.groups)}: "
            f"{self.outcome} ({self.seconds * 1e3:.1f} ms)"
        )
