"""The ordered list of FX passes dtcompile runs on every AOT graph.

Every pass has one contract, ``(gm, example_inputs, ctx) -> gm``: ``ctx`` is a
:class:`~dtcompile.passes.context.PassContext` (the graph's kind, the
backend's config, the Dynamo graph's placement info, and ``ctx.record`` for
its decisions, typed :class:`~dtcompile.records.Outcome` values).  Each has a
unique name by which ``DTCompileConfig.disable_passes`` switches it off;
:func:`run_passes` times it, checks that it returned a ``GraphModule``, logs
its decisions, and with ``trace_pass_graphs`` logs the graph before and after
it to ``TORCH_TRACE``.  They run on the forward and backward graphs after
AOTAutograd's partitioner and before lowering.  A pass rewrites ``gm.graph`` and
leaves ``gm.code`` as it was: the front door recompiles the graph once, after the
last pass (Dynamo's lowering, :class:`~dtcompile.pipeline.step_pass.StepPass`), since
generating a whole-step graph's Python takes about a second at 16 layers.

Where each pass lives:

- ``async_tp`` (:mod:`dtcompile.passes.async_tp`): all-gather -> matmul(s) and
  matmul -> reduce-scatter become ``dtcompile::fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (:mod:`dtcompile.base.fused_ops`).
- ``bucketing`` (:mod:`dtcompile.passes.bucketing`): independent all-gathers,
  reduce-scatters and all-reduces on one group become one collective, under
  ``config.bucket_cap_bytes``.
- ``overlap`` (:mod:`dtcompile.passes.overlap`): collectives issued as early
  as their inputs allow and waited on as late as their users allow, within
  ``config.overlap_memory_budget_bytes``.
- ``optimizer_updates`` (:mod:`dtcompile.passes.optimizer_updates`): in a
  whole-step graph with an optimizer inside (:func:`dtcompile.compile_step`),
  each parameter's update right after its gradient, so the gradient is freed
  once consumed; nothing to do on other graphs.
- ``annotate`` (:mod:`dtcompile.passes.annotate`): every call node gets
  ``node.meta["dtcompile_annotation"]``; every functional collective also its
  :class:`~dtcompile.CollectiveInfo` in ``node.meta["dtcompile_collective"]``
  and its estimated time in ``node.meta["dtcompile_cost_us"]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from dtcompile.base.channels import Artifact
from dtcompile.base.torch_contract import require
from dtcompile.cost.simulate import simulate
from dtcompile.graph.collectives import graph_collectives, is_collective
from dtcompile.graph.rank_dependence import ranks_may_differ
from dtcompile.pass_names import PASS_SPECS, PassSpec
from dtcompile.passes.annotate import annotate
from dtcompile.passes.async_tp import fuse_async_tp
from dtcompile.passes.bucketing import bucket_collectives
from dtcompile.passes.context import PassContext
from dtcompile.passes.optimizer_updates import place_optimizer_updates
from dtcompile.passes.overlap import reorder_for_overlap
from dtcompile.records import CompiledGraph, MemoryBudget, Outcome, PassRecord, Stage, StageSeconds

__all__ = ["PASSES", "GraphPass", "PassContext", "compiled_graph", "run_passes"]

log = logging.getLogger(__name__)

_TORCH_NAMES: tuple[str, ...] = (
    "torch._C._DisablePythonDispatcher",
    "torch._guards.detect_fake_mode",
    "torch._logging.trace_structured",
    "torch._ops.OpOverload",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorConverter.from_meta_and_device",
    "torch._subclasses.fake_tensor.in_kernel_invocation_manager",
    "torch.ops._c10d_functional.all_gather_into_tensor.default",
    "torch.ops._c10d_functional.wait_tensor.default",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map",
    "torch.utils._pytree.tree_map_only",
)
"""The private torch names the passes' modules use (each in ``torch_contract.PRIVATE_NAMES``),
checked by :func:`run_passes` (``torch_contract.require``); ``tests/architecture/test_newer_torch.py``
fails on one used and missing here."""

PassFn = Callable[[fx.GraphModule, Sequence[Any], PassContext], fx.GraphModule]


@dataclass(frozen=True)
class GraphPass:
    """A pass of :data:`dtcompile.pass_names.PASS_SPECS` with the function that runs it."""

    spec: PassSpec
    fn: PassFn

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def changes_collectives(self) -> bool:
        """Whether it merges, fuses or reorders collectives: every rank must decide the same."""
        return self.spec.rewrites_collectives


_FUNCTIONS: dict[str, PassFn] = {
    "async_tp": fuse_async_tp,
    "bucketing": bucket_collectives,
    "overlap": reorder_for_overlap,
    "optimizer_updates": place_optimizer_updates,
    "annotate": annotate,
}

PASSES: tuple[GraphPass, ...] = tuple(GraphPass(s, _FUNCTIONS[s.name]) for s in PASS_SPECS)
"""Every pass of :data:`~dtcompile.pass_names.PASS_SPECS`, in its order."""


def _rank_dependent(ctx: PassContext, gm: fx.GraphModule) -> Outcome | None:
    """Why a pass that changes collectives must not run on this graph, or ``None``.

    Each rank runs the passes on its own AOT graph; where the ranks' graphs may
    differ (:func:`dtcompile.graph.rank_dependence.ranks_may_differ`: uneven shards), a
    decision made from one rank's graph (what to bucket, where a collective goes,
    by its bytes and position) can differ on another, and the ranks would issue
    different collectives.  Such graphs keep the collectives DTensor chose.
    """
    uneven = ranks_may_differ(ctx.info.uneven, gm)
    if not uneven:
        return None
    more = f" and {len(uneven) - 1} more" if len(uneven) > 1 else ""
    return Outcome.skipped(
        "graph",
        f"not run: sharded unevenly: {uneven[0]}{more}; the ranks' graphs can differ, and a "
        "decision each rank made from its own could have them issue different collectives",
    )


def _num_collectives(gm: fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if is_collective(node))


def _trace_graph(ctx: PassContext, when: str, name: str, gm: fx.GraphModule) -> None:
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": Artifact.pass_graph(ctx.kind, when, name), "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False),
    )


def run_passes(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    ctx: PassContext,
    passes: Sequence[GraphPass] = PASSES,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Runs ``passes`` (default :data:`PASSES`) in order, skipping those in ``ctx.config.disable_passes``."""
    require(_TORCH_NAMES, "dtcompile.passes")
    records = []
    start = time.perf_counter()
    ctx.set_budget(gm)
    ctx.traced_timeline = simulate(gm.graph, ctx.profile)
    ctx.traced_seconds = time.perf_counter() - start
    ctx.traced_collectives = tuple(graph_collectives(gm.graph, ctx.axes))
    # Judged on the graph as traced: a pass's own rewrites (bucketing's slices of
    # its flat buffers) must not read as DTensor's padding to the passes after it.
    rank_dependent = _rank_dependent(ctx, gm)
    for graph_pass in passes:
        nodes = len(gm.graph.nodes)
        collectives = _num_collectives(gm)
        if graph_pass.name in ctx.config.disable_passes:
            log.debug("%s: pass %s switched off", ctx.kind, graph_pass.name)
            records.append(PassRecord(graph_pass.name, False, nodes, nodes, collectives, collectives))
            continue
        refused = rank_dependent if graph_pass.changes_collectives else None
        if refused is not None:
            log.info("%s: %s: %s", ctx.kind, graph_pass.name, refused)
            records.append(PassRecord(graph_pass.name, True, nodes, nodes, collectives, collectives, (refused,)))
            continue
        if ctx.config.trace_pass_graphs:
            _trace_graph(ctx, "before", graph_pass.name, gm)
        ctx.outcomes = []
        start = time.perf_counter()
        result = graph_pass.fn(gm, example_inputs, ctx)
        seconds = time.perf_counter() - start
        if not isinstance(result, fx.GraphModule):
            raise TypeError(
                f"dtcompile: pass {graph_pass.name} returned {type(result).__name__}, not the "
                "fx.GraphModule every pass must return"
            )
        gm = result
        if ctx.config.trace_pass_graphs:
            _trace_graph(ctx, "after", graph_pass.name, gm)
        record = PassRecord(
            graph_pass.name,
            True,
            nodes,
            len(gm.graph.nodes),
            collectives,
            _num_collectives(gm),
            tuple(ctx.outcomes),
            seconds,
        )
        # One INFO line a pass; its decisions (one a collective, hundreds on a real model's step)
        # at DEBUG: they are in the record, explain() and the report.
        for outcome in record.decisions:
            log.debug("%s: %s: %s", ctx.kind, graph_pass.name, outcome)
        log.info(
            "%s: pass %s: nodes %d -> %d, collectives %d -> %d, %.1f ms",
            ctx.kind,
            record.name,
            record.nodes_before,
            record.nodes_after,
            record.collectives_before,
            record.collectives_after,
            seconds * 1e3,
        )
        records.append(record)
    ctx.outcomes = []
    return gm, records


def compiled_graph(
    gm: fx.GraphModule,
    ctx: PassContext,
    records: Sequence[PassRecord],
    *,
    held_bytes: int = 0,
    regions: Sequence[Any] = (),
    with_regions: str = "",
    spmd_types_traced: Mapping[str, Mapping[str, str]] | None = None,
    lowering: Mapping[str, Any] | None = None,
    stages: Mapping[Stage, float] | None = None,
) -> CompiledGraph:
    """What dtcompile did with ``gm``, the graph :func:`run_passes` rewrote under ``ctx``
    and its ``records``, as it is lowered: the one place a
    :class:`~dtcompile.records.CompiledGraph` is made, for every front door.  Its memory and
    timeline are measured here, beside the traced ones ``ctx`` kept; ``held_bytes``: what
    the caller holds while it runs (a backward: what its forward saved).  ``stages``: the
    seconds of the stages the caller timed before the passes (Dynamo, AOTAutograd...); the
    record's :attr:`~dtcompile.records.CompiledGraph.stages` adds the simulations, traced
    and final, and reads the passes' from ``records``."""
    info = ctx.info
    start = time.perf_counter()
    memory = ctx.estimate(gm, held_bytes)
    timeline = simulate(gm.graph, info.profile)
    simulated = ctx.traced_seconds + time.perf_counter() - start
    passes = tuple(records)
    return CompiledGraph(
        compile_id=info.compile_id,
        kind=ctx.kind,
        graph=gm,
        collectives=tuple(graph_collectives(gm.graph, info.axes)),
        passes=passes,
        info=info,
        regions=tuple(regions),
        with_regions=with_regions,
        memory=memory,
        memory_traced=ctx.traced_memory,
        memory_budget=MemoryBudget(ctx.budget_bytes or 0, ctx.budget_why),
        timeline=timeline,
        timeline_traced=ctx.traced_timeline,
        collectives_traced=ctx.traced_collectives,
        spmd_types_traced=dict(spmd_types_traced or {}),
        lowering=dict(lowering or {}),
        stages=StageSeconds({**(stages or {}), Stage.SIMULATIONS: simulated}, passes),
    )
