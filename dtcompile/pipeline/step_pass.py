"""dtcompile's pass on a whole-step graph: forward, loss, backward (and optimizer) as one graph.

A whole-step graph is a graph of plain tensors and functional collectives (DTensor
unwrapped), as torchtitan ``graph_trainer``'s tracer makes it and as
:func:`dtcompile.compile_step` traces it.  :class:`StepPass` describes it as
dtcompile describes an AOT graph (graph kind
:attr:`~dtcompile.base.channels.GraphKind.STEP`): every collective, its mesh axis
(from the meshes it is given, else the group's own name), its time under the cost
profile, the graph's memory estimate and simulated timeline, kept as a
:class:`~dtcompile.records.CompiledGraph` in its
:class:`~dtcompile.pipeline.compile_log.CompileLog` (:attr:`StepPass.records`) and
logged as dtcompile's ``TORCH_TRACE`` artifacts (``dtcompile_step_graph``,
``dtcompile_step_collectives``), which ``dtcompile-report`` reads.  It runs
dtcompile's pass list (:func:`dtcompile.passes.run_passes`) on the step graph, the
same passes the Dynamo path runs; ``async_tp``, ``bucketing`` and ``overlap``
rewrite it unless switched off by ``disable_passes``.

Where ranks can compile differently (:func:`dtcompile.ranks.check.world_can_disagree`,
``check_ranks``), the pass compares the step graph's collectives with its peers'
before it returns (every rank traces and applies the pass at the same point, before
the first step runs): ranks whose step graphs would not pair up raise
:class:`~dtcompile.ranks.check.RanksDisagree` there, not in a hung collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from dtcompile.annotations import DynamoGraphInfo
from dtcompile.base.channels import GraphKind
from dtcompile.config import DTCompileConfig
from dtcompile.cost.auto import devices_of, profile_for_groups
from dtcompile.graph.collectives import flattened_axes, graph_collectives, group_names_in, spmd_axes
from dtcompile.graph.memory import MemoryPlan, prefetch_window
from dtcompile.passes import PassContext, compiled_graph, run_passes
from dtcompile.passes._graph import alias_roots, read_inputs, written_args
from dtcompile.passes.optimizer_updates import optimizer_of
from dtcompile.pipeline.compile_log import CompileLog
from dtcompile.pipeline.reshard import reshard_step_graph
from dtcompile.ranks.check import check_groups, world_can_disagree
from dtcompile.ranks.plans import PlanMeeting
from dtcompile.ranks.schedule import Obtained, Schedule, bucketed, decided_from, scheduled_collectives, traced_digest
from dtcompile.records import CompiledGraph, PassRecord, RankCheck, Stage

__all__ = ["StepPass", "TracedStep", "check_mutations_kept", "forward_nodes", "input_mutations", "mesh_axes_of", "step_parts"]

def mesh_axes_of(meshes: Iterable[Any]) -> dict[str, str]:
    """Process group name -> mesh axis name for every axis (and flattened axis) of ``meshes``."""
    axes: dict[str, str] = {}
    for mesh in meshes:
        names = getattr(mesh, "mesh_dim_names", None)
        groups = getattr(mesh, "_dim_group_names", None)
        if names and groups:
            for group, name in zip(groups, names):
                axes.setdefault(group, name)
            for group, name in flattened_axes(mesh).items():
                axes.setdefault(group, name)
    return axes


def forward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """A whole-step graph's forward: the nodes its first output (the loss) is computed from."""
    outputs = graph.output_node().args[0]
    first = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else outputs
    forward: set[fx.Node] = set()
    stack = [first] if isinstance(first, fx.Node) else []
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    return forward


def step_parts(graph: fx.Graph, forward: set[fx.Node]) -> dict[str, str]:
    """Each call node of a whole-step graph -> ``forward`` (in ``forward``, :func:`forward_nodes`),
    ``optimizer <name>`` (nodes :func:`dtcompile.compile_step` marked) or ``backward``,
    with the line of user code it was traced from where the trace kept one."""
    parts = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        optimizer = optimizer_of(node)
        part = f"optimizer {optimizer}" if optimizer else "forward" if node in forward else "backward"
        where = _code_line(node.meta.get("stack_trace"))
        parts[node.name] = f"{part} at {where}" if where else part
    return parts


def _code_line(stack_trace: str | None) -> str | None:
    """``file:line in function`` of the innermost frame outside torch of a traced node's
    stack trace (the user's model code; torch's own module code if that is all there is)."""
    if not stack_trace:
        return None
    frames = [line.strip() for line in stack_trace.strip().splitlines() if line.strip().startswith("File ")]
    if not frames:
        return None
    own = [frame for frame in frames if "/torch/" not in frame and "/dtcompile/step" not in frame]
    parts = (own or frames)[-1].split(", ")
    if len(parts) < 3:
        return None
    path, line, function = parts[0][len('File "'):-1], parts[1].removeprefix("line "), parts[2].removeprefix("in ")
    return f"{path.rsplit('/', 1)[-1]}:{line} in {function}"


def input_mutations(graph: fx.Graph) -> dict[str, tuple[str, list[str]]]:
    """Every graph input the graph writes in place (an optimizer's step): input name ->
    (the first node that writes it, the nodes that read it or a view of it before that write,
    a collective's wait among them: the collective reads its input until then).
    A pass that moves a read after the write, or drops the write, changes what the step computes."""
    roots = alias_roots(graph)
    found: dict[str, tuple[str, list[str]]] = {}
    readers: dict[fx.Node, list[str]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        written = {roots[w] for w in written_args(node) if roots[w].op == "placeholder"}
        for source in read_inputs(node):
            root = roots[source]
            if root.op == "placeholder" and root not in written and root.name not in found:
                readers.setdefault(root, []).append(node.name)
        for root in written:
            found.setdefault(root.name, (node.name, readers.get(root, [])))
    return found


def check_mutations_kept(before: dict[str, tuple[str, list[str]]], graph: fx.Graph, compile_id: str) -> None:
    """Raises where dtcompile's passes dropped an in-place write of a graph input
    (:func:`input_mutations` of the graph before them), or moved a read of that input
    to after the write: never a silently wrong step."""
    after = input_mutations(graph)
    alive = {node.name for node in graph.nodes}
    for name, (write, reads) in before.items():
        if name not in after:
            raise AssertionError(f"dtcompile {compile_id}: a pass dropped the in-place write of input {name} ({write})")
        late = [read for read in reads if read in alive and read not in after[name][1]]
        if late:
            raise AssertionError(
                f"dtcompile {compile_id}: a pass moved {', '.join(late)} (reading input {name}) after its "
                f"in-place write {after[name][0]}; please report this with the step graph"
            )


@dataclass(frozen=True)
class TracedStep:
    """What a step front door hands the back half, shaped like graph_trainer's ``TracedResult``:
    the whole-step graph, its example inputs, its inputs' names (a parameter's FQN for
    each input its state unwraps into; placeholder names where empty) and the device
    meshes whose groups name its collectives' mesh axes.  :func:`dtcompile.compile_step`
    makes one per trace, the ``dtcompile`` pipeline of graph_trainer one per traced step
    (:mod:`dtcompile.integrations.torchtitan`)."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    input_names: Sequence[str] = ()
    meshes: Sequence[Any] = ()
    trace_seconds: float | None = None
    """How long the front door's trace of the step took (``compile_step``'s ``make_fx``), the
    record's :attr:`~dtcompile.records.Stage.AOT_AUTOGRAD` stage; ``None`` where it was not
    measured (graph_trainer's tracer, before its passes)."""


class StepPass:
    """dtcompile's pass on a whole-step graph: ``(gm, example_inputs) -> gm``, graph_trainer's
    pass contract (see the module doc).  ``options``: :class:`~dtcompile.config.DTCompileConfig`
    fields, as for ``dtcompile.backend(**options)`` (an unknown one is a ``ValueError``);
    ``meshes``: the device meshes whose group names name the collectives' mesh axes;
    ``input_names``: the graph's inputs' names (parameters' FQNs, for the decisions; a call
    may give its graph's own), placeholder names where empty."""

    __name__ = "dtcompile_step_pass"
    """What graph_trainer names the pass by (its logs, ``--compile.disable_passes``)."""

    def __init__(
        self, options: Mapping[str, Any] | None = None, meshes: Sequence[Any] = (), input_names: Sequence[str] = ()
    ) -> None:
        self.config = DTCompileConfig.from_options(dict(options or {}))
        self.meshes = tuple(meshes)
        self.input_names = tuple(input_names)
        self.log = CompileLog()
        """Where the step graphs this pass saw land (:class:`~dtcompile.pipeline.compile_log.CompileLog`)."""

    @property
    def records(self) -> Sequence[CompiledGraph]:
        """One :class:`~dtcompile.records.CompiledGraph` per step graph this pass saw, oldest first."""
        return self.log.records

    @property
    def checks(self) -> Sequence[RankCheck]:
        """The ranks' check of each step graph, where one ran."""
        return self.log.checks

    def __repr__(self) -> str:
        return f"StepPass({self.config})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        """graph_trainer's pass contract: the step graph after dtcompile's pass."""
        return self.compile(TracedStep(gm, example_inputs, self.input_names, self.meshes)).graph

    def compile(self, traced: TracedStep, *, lowered_after: bool = False) -> CompiledGraph:
        """dtcompile's pass on ``traced`` (see the module doc): its record, also kept in :attr:`records`,
        whose compile seconds the log emits once its ranks' check is done; ``lowered_after``:
        the front door lowers the graph next, adds that stage and emits them itself
        (``compile_step`` with Inductor), so that they are logged once."""
        gm, example_inputs = traced.gm, traced.example_inputs
        compile_id = f"step/{len(self.records)}"
        axes = mesh_axes_of(traced.meshes)
        for group, name in spmd_axes(group_names_in(gm)).items():
            axes.setdefault(group, name)
        priced = profile_for_groups(self.config.cost_profile, devices_of(example_inputs), list(axes) or group_names_in(gm))
        info = DynamoGraphInfo(compile_id, axes, priced.profile, priced.why)
        info.node_names = frozenset(node.name for node in gm.graph.nodes)
        forward = forward_nodes(gm.graph)
        info.step_parts = step_parts(gm.graph, forward)
        # FSDP's gathered weights gathered again in the backward, as the Dynamo path's partitioner does.
        nodes, collectives = len(gm.graph.nodes), len(graph_collectives(gm.graph, axes))
        resharding = reshard_step_graph(
            gm, traced.input_names, forward,
            enabled=self.config.reshard_after_forward, keep=self.config.keep_gathered,
        )
        resharded = PassRecord(
            "reshard_after_forward", True, nodes, len(gm.graph.nodes), collectives,
            len(graph_collectives(gm.graph, axes)), resharding.decisions,
        )
        memory = MemoryPlan(prefetch_bytes=prefetch_window(resharding.gathered))
        ctx = PassContext(
            kind=GraphKind.STEP, config=self.config, info=info, memory=memory,
            plans=PlanMeeting(self.config.check_ranks_timeout_s),
        )
        before = input_mutations(gm.graph)
        gm, passes = run_passes(gm, example_inputs, ctx)
        if resharding.decisions:
            passes.insert(0, resharded)
        gm.recompile()
        check_mutations_kept(before, gm.graph, compile_id)
        traced_for = {Stage.AOT_AUTOGRAD: traced.trace_seconds} if traced.trace_seconds is not None else {}
        record = compiled_graph(gm, ctx, passes, stages=traced_for)
        self.log.compiled(record, report=self.config.report, profile=priced)
        self._check_ranks(record, traced, priced)
        if not lowered_after:
            self.log.finished(record)
        return record

    def _check_ranks(self, record: CompiledGraph, traced: TracedStep, priced: Any) -> None:
        """The ranks compare the step graph's collectives, as the Dynamo path's graphs
        (:class:`dtcompile.ranks.check.RankChecker`): a re-trace on this rank alone (a batch
        of another size) whose collectives the ranks already agreed on is not exchanged."""
        if not (self.config.check_ranks and world_can_disagree()) or not record.collectives:
            return
        groups = check_groups(traced.gm, traced.meshes)
        if not groups:
            return
        schedule = Schedule(
            record.compile_id,
            Obtained.COMPILED,
            scheduled_collectives([(record.kind, record.collectives)]),
            decided_from(self.config, priced, traced.gm, traced.example_inputs),
            bucketed=bucketed([record]),
            traced_digest=traced_digest([record]),
        )
        self.log.checker.check(schedule, groups, self.config.check_ranks_timeout_s, record.info.axes, charge=record.stages.add_check)
