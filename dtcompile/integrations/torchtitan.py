"""dtcompile on torchtitan ``graph_trainer``'s whole-step graph: the ``dtcompile`` pass pipeline.

torchtitan's ``graph_trainer`` traces a training step (forward, loss and backward)
as one ``make_fx`` graph of plain tensors and functional collectives (DTensor
unwrapped: ``make_fx_tracer.minimal_fx_tracer``), then applies the pass pipeline
its config names from ``graph_trainer.registry.PASS_PIPELINE_REGISTRY``.  Importing
this module registers a pipeline named ``dtcompile``: graph_trainer's own default
passes (``construct_default_graph_passes``) with :class:`StepPass` first.

:class:`StepPass` describes the step graph as dtcompile describes an AOT graph
(graph kind :attr:`~dtcompile.base.channels.GraphKind.STEP`): every collective, its
mesh axis (from the meshes it is given, else the group's own name), its time
under the cost profile, the graph's memory estimate and simulated timeline, kept
as a :class:`~dtcompile.records.CompiledGraph` in :attr:`StepPass.records` and
logged as dtcompile's ``TORCH_TRACE`` artifacts (``dtcompile_step_graph``,
``dtcompile_step_collectives``), which ``dtcompile-report`` reads.  It runs
dtcompile's pass list (:func:`dtcompile.passes.run_passes`) on the step graph;
``async_tp``, ``bucketing`` and ``overlap`` rewrite it unless switched off by
``disable_passes``.

Where ranks can compile differently (:func:`dtcompile.rank_check.world_can_disagree`,
``check_ranks``), the pass compares the step graph's collectives with its peers'
before it returns (graph_trainer traces and applies the passes on every rank at the
same point, before the first step runs): ranks whose step graphs would not pair
up raise :class:`~dtcompile.rank_check.RanksDisagree` there, not in a hung collective.

The options of the registered pipeline are :func:`configure`'s (graph_trainer's
config has no place for them), dtcompile's rewrites off unless it switches them on
(:data:`REWRITES`: graph_trainer's own passes bucket and reorder after it); a
:class:`StepPass` made directly takes its own options, rewrites on by default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import fx

from dtcompile.annotations import DynamoGraphInfo
from dtcompile.artifacts import emit_artifacts, format_compiled_graph
from dtcompile.base.channels import GraphKind
from dtcompile.collectives import flattened_axes, graph_collectives, group_names_in, profile_for_groups, spmd_axes
from dtcompile.config import DTCompileConfig
from dtcompile.cost.simulate import simulate
from dtcompile.graph_compile import devices_of
from dtcompile.memory import MemoryPlan, estimate_memory
from dtcompile.passes import PassContext, run_passes
from dtcompile.rank_check import RanksDisagree, agree, check_groups, world_can_disagree
from dtcompile.rank_schedule import CheckOutcome, Obtained, Schedule, bucketed, decided_from, scheduled_collectives
from dtcompile.records import CompiledGraph, RankCheck

__all__ = ["PIPELINE_NAME", "REWRITES", "StepPass", "configure", "mesh_axes_of", "pipeline_passes", "register", "step_pipeline"]

log = logging.getLogger(__name__)

PIPELINE_NAME = "dtcompile"
"""The name graph_trainer's ``--compile.pass_pipeline`` selects this pipeline by."""

# The mesh names torchtitan's ParallelDims may hold (``get_optional_mesh``).
_TITAN_MESHES = ("fsdp", "dp_shard", "dp_replicate", "dp", "tp", "cp", "ep", "efsdp", "batch", "loss", "dp_cp")


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


class StepPass:
    """dtcompile's pass on a whole-step graph: ``(gm, example_inputs) -> gm``, graph_trainer's
    pass contract (see the module doc).  ``options``: :class:`~dtcompile.config.DTCompileConfig`
    fields, as for ``dtcompile.backend(**options)`` (an unknown one is a ``ValueError``);
    ``meshes``: the device meshes whose group names name the collectives' mesh axes."""

    __name__ = "dtcompile_step_pass"
    """What graph_trainer names the pass by (its logs, ``--compile.disable_passes``)."""

    def __init__(self, options: Mapping[str, Any] | None = None, meshes: Sequence[Any] = ()) -> None:
        self.config = DTCompileConfig.from_options(dict(options or {}))
        self.meshes = tuple(meshes)
        self.records: list[CompiledGraph] = []
        """One :class:`~dtcompile.records.CompiledGraph` per step graph this pass saw."""
        self.checks: list[RankCheck] = []
        """The ranks' check of each step graph, where one ran."""

    def __repr__(self) -> str:
        return f"StepPass({self.config})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        compile_id = f"step/{len(self.records)}"
        axes = mesh_axes_of(self.meshes)
        for group, name in spmd_axes(group_names_in(gm)).items():
            axes.setdefault(group, name)
        priced = profile_for_groups(self.config.cost_profile, devices_of(example_inputs), list(axes) or group_names_in(gm))
        info = DynamoGraphInfo(compile_id, axes, priced.profile, priced.why)
        info.node_names = frozenset(node.name for node in gm.graph.nodes)
        ctx = PassContext(kind=GraphKind.STEP, config=self.config, info=info, memory=MemoryPlan())
        gm, passes = run_passes(gm, example_inputs, ctx)
        gm.recompile()
        record = CompiledGraph(
            compile_id=compile_id,
            kind=GraphKind.STEP,
            graph=gm,
            collectives=tuple(graph_collectives(gm.graph, axes)),
            passes=tuple(passes),
            info=info,
            memory=estimate_memory(gm, GraphKind.STEP),
            memory_traced=ctx.traced_memory,
            memory_budget=(ctx.budget_bytes or 0, ctx.budget_why),
            timeline=simulate(gm.graph, info.profile),
            timeline_traced=ctx.traced_timeline,
        )
        self.records.append(record)
        log.info(
            "%s step graph: %d nodes, %d collectives, cost profile %s",
            compile_id, len(gm.graph.nodes), len(record.collectives), priced,
        )
        emit_artifacts(record)
        if self.config.report:
            print(format_compiled_graph(record), flush=True)
        self._check_ranks(record, gm, example_inputs, priced)
        return gm

    def _check_ranks(self, record: CompiledGraph, gm: fx.GraphModule, example_inputs: Sequence[Any], priced: Any) -> None:
        """The ranks compare the step graph's collectives (:func:`dtcompile.rank_check.agree`)."""
        if not (self.config.check_ranks and world_can_disagree()) or not record.collectives:
            return
        groups = check_groups(gm, self.meshes)
        if not groups:
            return
        schedule = Schedule(
            record.compile_id,
            str(Obtained.COMPILED),
            scheduled_collectives([(record.kind, record.collectives)]),
            decided_from(self.config, priced, gm, example_inputs),
            bucketed=bucketed([record]),
        )
        start = time.perf_counter()
        try:
            agree(schedule, groups, self.config.check_ranks_timeout_s, record.info.axes)
        except RanksDisagree:
            self._checked(record, groups, CheckOutcome.DISAGREE, start)
            raise
        self._checked(record, groups, CheckOutcome.AGREED, start)

    def _checked(self, record: CompiledGraph, groups: Sequence[str], outcome: CheckOutcome, start: float) -> None:
        check = RankCheck(record.compile_id, tuple(groups), str(outcome), time.perf_counter() - start, True)
        self.checks.append(check)
        log.info("%s", check)


# ---------------------------------------------------------------------------
# The registered pipeline.

REWRITES = frozenset({"async_tp", "bucketing", "overlap"})
"""dtcompile's passes that rewrite collectives: off in the registered pipeline unless
:func:`configure` says otherwise, since graph_trainer's default passes after it bucket and
reorder the FSDP collectives themselves, matching the gather chains as traced."""

_options: dict[str, Any] = {"disable_passes": REWRITES}
pipeline_passes: list[StepPass] = []
"""The :class:`StepPass` each call of the registered pipeline made, oldest first (their records)."""


def configure(**options: Any) -> None:
    """The dtcompile options of the ``dtcompile`` pipeline's passes made from now on
    (validated now: an unknown option is a ``ValueError``); ``disable_passes`` is
    :data:`REWRITES` unless given (``disable_passes=set()`` lets dtcompile rewrite)."""
    options = {"disable_passes": REWRITES, **options}
    DTCompileConfig.from_options(dict(options))
    _options.clear()
    _options.update(options)


def _meshes_of(parallel_dims: Any) -> list[Any]:
    """The device meshes torchtitan's ``ParallelDims`` holds (none without one)."""
    meshes = []
    get = getattr(parallel_dims, "get_optional_mesh", None)
    for name in _TITAN_MESHES if get is not None else ():
        try:
            mesh = get(name)
        except (KeyError, ValueError, AttributeError, RuntimeError):
            continue
        if mesh is not None and all(mesh is not m for m in meshes):
            meshes.append(mesh)
    return meshes


def step_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable[..., Any]]:
    """graph_trainer's default passes with dtcompile's :class:`StepPass` first (the
    ``dtcompile`` pipeline; its options are :func:`configure`'s)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    step = StepPass(_options, _meshes_of(parallel_dims))
    pipeline_passes.append(step)
    return [step, *construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)]


def register() -> None:
    """Registers :func:`step_pipeline` as graph_trainer's ``dtcompile`` pipeline (done on import)."""
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    # What graph_trainer's register_pass_pipeline(name) decorator does.
    PASS_PIPELINE_REGISTRY[PIPELINE_NAME] = step_pipeline


register()
