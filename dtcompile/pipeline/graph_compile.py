"""One Dynamo graph's compile: one object per backend call, one method per stage.

:class:`GraphCompile` is made by :class:`~dtcompile.compiler.DTCompileBackend` for
each graph Dynamo hands it, with the backend's
:class:`~dtcompile.pipeline.compile_log.CompileLog` (where what it makes lands), and
holds everything that compile decides once: the
graph's description and cost profile, its cache key, where its artifacts are kept
beside the compile cache, the partitioner.  Its stages, in order:

1. :meth:`~GraphCompile.trace`: AOTAutograd traces the joint graph (with Inductor's
   decompositions, under Inductor's ``compile_fx`` where ``inductor=True``), or its
   cache serves it;
2. :meth:`~GraphCompile.partitioned`: the partitioner has started, so this graph is
   traced here (the partitioner calls it);
3. :meth:`~GraphCompile.passes`: dtcompile's passes run on each AOT graph;
4. :meth:`~GraphCompile.lower`: the regions are inlined and the lowering settings read;
5. :meth:`~GraphCompile.record`: the :class:`~dtcompile.records.CompiledGraph` is
   handed to the log (kept, logged, its artifacts emitted) and its artifacts kept
   beside the cache;
6. Inductor's ``compile_fx_inner`` (``inductor=True``), after which the log emits the
   graph's compile seconds.

Each stage is timed where it runs, into the record's
:class:`~dtcompile.records.StageSeconds`: Dynamo's tracing (from when it began compiling
the frame, given by the backend), AOTAutograd's (the time inside :meth:`trace` that no
other stage took, charged to the graph it led to), the partitioner's, the SPMD types'
check, the passes', the simulations', the artifacts' and Inductor's; the ranks' check
adds its exchange at the first call (:meth:`~dtcompile.pipeline.compile_log.CompileLog.checked`).

The cache hit is a fact, not an inference: :meth:`~GraphCompile.served_from_cache`
is true when AOTAutograd counted a hit during :meth:`trace` and nothing was traced
here; a trace that neither ran nor was served is an error, never recorded as a hit.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from dtcompile.annotations import describe_dynamo_graph
from dtcompile.artifacts import emit_saved_artifacts, keep_artifacts
from dtcompile.base.beside_cache import load_beside_cache, save_beside_cache
from dtcompile.base.channels import BesideCacheFolders, GraphKind
from dtcompile.base.op_facts import is_ordering_barrier
from dtcompile.base.sharding_cache import fresh_sharding_caches
from dtcompile.base.torch_compat import INDUCTOR_SIMPLE_OVERLAP, inductor_reorders_collectives
from dtcompile.cache_keys import compile_key, rank_position, stable_mesh_keys
from dtcompile.config import DTCompileConfig
from dtcompile.cost.auto import devices_of, profile_for_groups
from dtcompile.graph.collectives import is_collective, mesh_axes
from dtcompile.graph.memory import MemoryPlan, prefetch_window
from dtcompile.graph.regions import format_with_regions, is_region
from dtcompile.hops import keep_regions
from dtcompile.pass_names import SCHEDULE_OWNERS
from dtcompile.passes import PassContext, compiled_graph, run_passes
from dtcompile.pipeline.compile_log import CompileLog
from dtcompile.pipeline.dynamo_output import split_constant_outputs, split_input_views
from dtcompile.pipeline.lowering import inline_regions
from dtcompile.pipeline.partition import Partitioner
from dtcompile.pipeline.reshard import param_names
from dtcompile.ranks.check import world_can_disagree
from dtcompile.ranks.plans import PlanMeeting
from dtcompile.ranks.schedule import (
    Obtained,
    Schedule,
    Scheduled,
    bucketed,
    decided_from,
    inputs_text,
    load_schedule,
    save_schedule,
    scheduled_collectives,
    traced_digest,
)
from dtcompile.records import Action, CachedCompile, CompiledGraph, EagerFallback, PassRecord, Stage
from dtcompile.spmd.carry import SpmdCarry, outputs_from_json, outputs_to_json, traced_copy
from dtcompile.spmd.inference import axis_objects, input_types, type_graph
from dtcompile.spmd.layouts import with_declared_types
from dynamo_vars.dtensor_state import loss_parallel_backward

__all__ = ["GraphCompile", "NeitherTracedNorServed", "schedule_owned_by_dtcompile", "symbolic_dtensor"]

logger = logging.getLogger("dtcompile.compiler")  # the backend's logger, as users configure it


def symbolic_dtensor(gm: fx.GraphModule) -> str | None:
    """The first input or output of ``gm`` that is a DTensor of symbolic size, or ``None``.

    AOTAutograd's cache keeps each DTensor input's and output's ``__tensor_flatten__``
    metadata, its ``DTensorSpec``; under dynamic shapes the spec's sizes are SymInts that
    hold their ShapeEnv, which cannot be pickled, so torch logs "AOTAutograd cache unable
    to serialize compiled graph" on every compile and caches nothing (stock Inductor
    alike; torch makes the subclass's outer sizes safe to save, not its metadata)."""
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    def symbolic(value: Any) -> bool:
        return isinstance(value, DTensor) and any(
            isinstance(d, torch.SymInt) for d in (*value._spec.shape, *value._spec.stride)
        )

    for node in gm.graph.nodes:
        if node.op == "placeholder" and symbolic(node.meta.get("example_value")):
            return f"input {node.name}"
        if node.op == "output":
            for arg in pytree.tree_leaves(node.args):
                if isinstance(arg, fx.Node) and symbolic(arg.meta.get("example_value")):
                    return f"output {arg.name}"
    return None


@contextlib.contextmanager
def _aot_settings(config: DTCompileConfig, *, backward_now: bool, cacheable: bool = True) -> Iterator[None]:
    """AOTAutograd as this compile needs it.  Its cache as the user set it, except where
    this compile must run here (``aot_cache=False``, or ``report`` / ``trace_pass_graphs``,
    which show the graphs as they compile): a hit there would trace nothing; and where
    torch cannot save the graph (``cacheable``: :func:`symbolic_dtensor`).  Both
    caches key on :func:`~dtcompile.cache_keys.compile_key` through the partitioner, so
    a hit is a graph compiled with these options.  ``backward_now``: the backward is
    compiled with the forward, not at its first call, so that the ranks' check
    (:mod:`dtcompile.ranks.check`) sees its collectives before either runs."""
    from torch._functorch import config as functorch_config

    settings = {}
    if not config.aot_cache or config.report or config.trace_pass_graphs or not cacheable:
        settings["enable_autograd_cache"] = False
    if backward_now:
        settings["force_non_lazy_backward_lowering"] = True
    with functorch_config.patch(settings):
        yield


def schedule_owned_by_dtcompile(
    config: DTCompileConfig, passes: Sequence[PassRecord], graph: fx.Graph | None = None
) -> dict[str, Any]:
    """Inductor settings that leave the order of ``graph``'s communication to dtcompile,
    given what its passes did to it.

    From torch 2.14 Inductor reorders collectives itself (``simple_overlap``, on by
    default; :func:`dtcompile.base.torch_compat.inductor_reorders_collectives`), and it
    sees only the functional collectives (``_c10d_functional``, P2P included) as
    communication: an op that communicates inside a ``FallbackKernel`` (a custom op such
    as torchcomms', a fused collective-matmul) is invisible to its rule, so it can move a
    collective across one on some ranks only and the ranks pair the wrong collectives
    (pytorch/pytorch#189454).  Its pass is switched off for this compile where

    - ``graph`` holds an ordering barrier
      (:func:`dtcompile.base.op_facts.is_ordering_barrier`) and something else that
      communicates (a collective or another barrier): the order the ranks traced is
      the order they issue;
    - dtcompile's ``overlap`` pass has placed the collectives and waits, or its
      ``async_tp`` pass has put collectives inside fused ops: dtcompile owns the
      schedule, and Inductor would redo it without dtcompile's cost model.

    Elsewhere (no barrier, and those passes disabled or their rewrites did not pay
    under the profile), or where the setting is given explicitly in
    ``config.inductor_config``, Inductor's own choice stands.  Inductor's other
    reorderings on by default in 2.14 and 2.15 keep that order: ``reorder_for_locality``
    (inference graphs) moves no collective (its users are waits) and keeps a
    ``with_effects`` op next to its outputs; ``reorder_for_peak_memory`` only sorts the
    scheduler's nodes by their dependencies; ``reorder_for_compute_comm_overlap`` and
    ``enable_overlap_scheduling`` are off.  Without ``graph`` (a caller that has none)
    only the passes' record decides.
    """
    if not inductor_reorders_collectives() or INDUCTOR_SIMPLE_OVERLAP in config.inductor_config:
        return {}
    scheduled = any(
        decision.action in (Action.MOVED, Action.FUSED)
        for record in passes
        if record.name in SCHEDULE_OWNERS
        for decision in record.decisions
    )
    nodes = list(graph.nodes) if graph is not None else []
    barriers = sum(1 for n in nodes if is_ordering_barrier(n))
    crossable = barriers > 1 or (barriers == 1 and any(is_collective(n) for n in nodes))
    return {INDUCTOR_SIMPLE_OVERLAP: False} if scheduled or crossable else {}


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class NeitherTracedNorServed(RuntimeError):
    """AOTAutograd returned a graph it neither traced here nor served from its cache."""


def dynamo_outputs_in_aot_forward() -> tuple[int, int]:
    """Where the Dynamo graph's outputs are among those of the AOT forward (or inference) graph
    being compiled: (after how many, how many); AOTAutograd returns the inputs it mutates first."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return 0, 0
    return meta.num_mutated_inp_runtime_indices, len(meta.output_info)


def _aot_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


class GraphCompile:
    """The compile of Dynamo graph ``gm`` with ``config``, kept in ``log`` (see the module doc);
    ``dynamo_seconds``: how long Dynamo traced it before calling the backend, where known."""

    def __init__(
        self,
        log: CompileLog,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        config: DTCompileConfig,
        dynamo_seconds: float | None = None,
    ) -> None:
        self.log, self.gm, self.example_inputs, self.config = log, gm, example_inputs, config
        self.dynamo_seconds = dynamo_seconds
        compile_id = torch._guards.CompileContext.current_compile_id()
        axes = mesh_axes(gm, example_inputs)
        # Priced for its devices and its meshes' groups (the default group's when it has none).
        self.profile_choice = profile_for_groups(config.cost_profile, devices_of(example_inputs), list(axes))
        self.info = describe_dynamo_graph(
            gm, str(compile_id) if compile_id is not None else "?", axes, self.profile_choice.profile, self.profile_choice.why
        )
        self.info.spmd_inputs = with_declared_types(gm, example_inputs, input_types(gm, example_inputs, axes))
        logger.info("%s: cost profile %s", self.info.compile_id, self.profile_choice)
        self.constants = split_constant_outputs(gm)
        self.views = split_input_views(gm)
        # Keyed on this rank's place in the graph's meshes: the trace bakes its coordinates in.
        self.key = compile_key(config, self.profile_choice.profile, rank_position(gm, example_inputs), self.info.spmd_inputs)
        # Where a compile cache can serve this graph, what is kept beside it for the graph
        # (its artifacts, its schedule) is found again by this; None where none can.
        self.uncacheable = symbolic_dtensor(gm)
        if self.uncacheable is not None and config.aot_cache:
            logger.info(
                "%s: AOTAutograd's cache is off for this graph: its %s is a DTensor of symbolic size, whose "
                "spec torch cannot save", self.info.compile_id, self.uncacheable,
            )
        cacheable = config.inductor and config.aot_cache and self.uncacheable is None
        self.beside_cache_key = f"{self.key}\n{gm.code}\n{inputs_text(example_inputs)}" if cacheable else None
        self.checking = config.check_ranks and world_can_disagree()
        self.partitioner = Partitioner(
            self.info.uneven,
            self.key,
            on_start=self.partitioned,
            params=param_names(gm, example_inputs),
            reshard=config.reshard_after_forward,
            keep_gathered=config.keep_gathered,
            memory_budget=config.memory_budget_bytes,
            name=f"compile {self.info.compile_id}",
        )
        self.traced = False
        """Whether AOTAutograd traced this graph here (a failure after that never runs eagerly)."""
        self.graphs: list[CompiledGraph] = []
        self.obtained: Obtained | None = None
        """How this rank got the graph's code, once :meth:`trace` (or the fallback) ended."""
        self.eager_because = ""
        """Why it runs eagerly, where it does."""
        self._hits_before = 0
        self._hits_during = 0
        self._kept: dict[str, list[str]] = {}
        self.spmd_types_traced: dict[GraphKind, dict[str, dict[str, str]]] = {}
        """Per AOT graph, its nodes' SPMD types as traced (checked), before the passes."""
        self.spmd_carry: SpmdCarry | None = None
        """Where the inputs are typed and the graph was traced here: what its outputs are
        stamped with, and what a call with inputs typed otherwise is checked on."""
        self._aot_since: float | None = None
        """While :meth:`trace` runs: since when AOTAutograd's time counts for the next AOT graph
        (the trace's start, then the end of the graph before)."""

    # ---- stage 1: trace (or be served)
    def trace(self) -> Callable[..., Any]:
        """AOTAutograd (and Inductor) on the graph; the later stages run inside, per AOT graph."""
        self._hits_before = _aot_cache_hits()
        self._aot_since = time.perf_counter()
        with (
            _aot_settings(self.config, backward_now=self.checking, cacheable=self.uncacheable is None),
            stable_mesh_keys(),
            fresh_sharding_caches(),
            keep_regions(),
            loss_parallel_backward(self.gm),
        ):
            try:
                compiled = self._inductor() if self.config.inductor else self._aot_only()
            finally:
                self._aot_since = None  # a backward compiled later, at its first call, gets no AOTAutograd time
        self._hits_during = _aot_cache_hits() - self._hits_before
        self.obtained = Obtained.COMPILED if self.traced else Obtained.SERVED
        return compiled

    def served_from_cache(self) -> bool:
        """Whether AOTAutograd's cache served this graph: it counted a hit during :meth:`trace`
        and nothing was traced here.  (Ranks as threads share the counter; the trace is ours.)"""
        if self.traced:
            return False
        if self._hits_during <= 0:
            raise NeitherTracedNorServed(
                f"dtcompile: graph {self.info.compile_id}: AOTAutograd returned it without tracing it here and "
                "without a cache hit; dtcompile cannot say what was compiled. Please report this with the "
                "TORCH_LOGS=aot log of the run"
            )
        return True

    def _inductor(self) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        patches = dict(self.config.inductor_config)
        patches["custom_partitioner_fn"] = self.partitioner
        return compile_fx(self.gm, self.example_inputs, inner_compile=self._inductor_inner, config_patches=patches)

    def _inductor_inner(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner

        if kwargs.get("is_backward"):
            kind = GraphKind.BACKWARD
        elif kwargs.get("is_inference"):
            kind = GraphKind.INFERENCE
        else:
            kind = GraphKind.FORWARD
        with contextlib.ExitStack() as stack:
            traced, kind, records, memory, ctx, stages = self.passes(gm, example_inputs, kind)

            def lowering(passes: Sequence[PassRecord]) -> dict[str, Any]:
                """Patches Inductor for this graph (until it is compiled); what it will read.
                Called on the graph as it is lowered: after the passes, its regions inlined."""
                communicates = any(is_collective(n) or is_ordering_barrier(n) for n in traced.graph.nodes)
                owned = schedule_owned_by_dtcompile(self.config, passes, traced.graph) if communicates else {}
                stack.enter_context(inductor_config.patch(owned))
                current = inductor_config.get_config_copy()
                settings = {name: current[name] for name in self.config.inductor_config}
                if communicates and inductor_reorders_collectives():
                    settings[INDUCTOR_SIMPLE_OVERLAP] = current[INDUCTOR_SIMPLE_OVERLAP]
                return settings

            record = self.lower(traced, kind, records, memory, ctx, stages, lowering)
            start = time.perf_counter()
            compiled = compile_fx_inner(record.graph, example_inputs, **kwargs)
            record.stages.add(Stage.INDUCTOR, time.perf_counter() - start)
        self._graph_done(record)
        return compiled

    def _aot_only(self) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.compile_fx import select_decomp_table

        def compiler(kind: GraphKind) -> Callable[..., Any]:
            def compile_graph(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                from torch._functorch.aot_autograd import make_boxed_func

                record = self.lower(*self.passes(graph, inputs, kind), lambda _: {})
                self._graph_done(record)
                return make_boxed_func(record.graph.forward)

            return compile_graph

        return aot_autograd(
            fw_compiler=compiler(GraphKind.FORWARD),
            bw_compiler=compiler(GraphKind.BACKWARD),
            inference_compiler=compiler(GraphKind.INFERENCE),
            decompositions=select_decomp_table(),
            partition_fn=self.partitioner,
            keep_inference_input_mutations=True,
        )(self.gm, self.example_inputs)

    # ---- stage 2: partitioned (the partitioner says the trace happened here)
    def partitioned(self) -> None:
        self.traced = True

    # ---- stage 3: the passes, per AOT graph
    def passes(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], kind: GraphKind
    ) -> tuple[fx.GraphModule, GraphKind, list[PassRecord], MemoryPlan, PassContext, dict[Stage, float]]:
        """dtcompile's passes on one AOT graph (a forward's records start with the
        partitioner's ``reshard_after_forward`` decisions), with the seconds of the stages
        that led to it (:meth:`_stages_before`) and of its SPMD types' check."""
        self.traced = True  # an inference graph is traced without a partition
        stages = self._stages_before(kind)
        memory = MemoryPlan(
            held_bytes=self.partitioner.held_during_backward if kind == GraphKind.BACKWARD else 0,
            prefetch_bytes=prefetch_window(self.partitioner.resharding.gathered),
        )
        ctx = PassContext(
            kind=kind, config=self.config, info=self.info, memory=memory,
            plans=PlanMeeting(self.config.check_ranks_timeout_s),
        )
        start = time.perf_counter()
        self.spmd_types_traced[kind] = self.check_spmd_types(gm, kind)
        if self.info.spmd_inputs:  # where it ran
            stages[Stage.SPMD_TYPES] = time.perf_counter() - start
        gm, records = run_passes(gm, example_inputs, ctx)
        if kind == GraphKind.FORWARD:
            records[:0] = self.partitioner.records(gm)
        return gm, kind, records, memory, ctx, stages

    def _stages_before(self, kind: GraphKind) -> dict[Stage, float]:
        """The seconds of the stages that led to this AOT graph of kind ``kind``: Dynamo's
        tracing (the first graph only), inside :meth:`trace` AOTAutograd's since the trace
        began or the graph before ended, less the partitioner's, which a forward gets."""
        stages: dict[Stage, float] = {}
        if not self.graphs and self.dynamo_seconds is not None:
            stages[Stage.DYNAMO] = self.dynamo_seconds
        partitioned = self.partitioner.seconds if kind == GraphKind.FORWARD else 0.0
        if self._aot_since is not None:
            stages[Stage.AOT_AUTOGRAD] = max(0.0, time.perf_counter() - self._aot_since - partitioned)
        if partitioned:
            stages[Stage.PARTITIONER] = partitioned
        return stages

    def _graph_done(self, record: CompiledGraph) -> None:
        """``record``'s stages are done: the log emits its compile seconds, and AOTAutograd's
        time for the next graph counts from now."""
        self.log.finished(record)
        if self._aot_since is not None:
            self._aot_since = time.perf_counter()

    def check_spmd_types(self, gm: fx.GraphModule, kind: GraphKind) -> dict[str, dict[str, str]]:
        """Types the AOT graph as traced, before any pass rewrites it, and checks them
        (:func:`dtcompile.spmd.inference.type_graph`): node name -> types per axis; empty
        where no input is typed.  A forward's types carry to its backward."""
        if not self.info.spmd_inputs:
            return {}
        info = self.info
        traced = traced_copy(gm) if kind != GraphKind.BACKWARD else None
        typed, outputs = type_graph(gm, kind, info.spmd_inputs, info.axes, info.spmd_forward, info.spmd_forward_outputs)
        if kind == GraphKind.FORWARD:
            info.spmd_forward, info.spmd_forward_outputs = typed, outputs
        if traced is not None:
            offset, count = dynamo_outputs_in_aot_forward()
            self._keep_spmd_carry(list(outputs[offset : offset + count]), traced, kind, offset)
            if self.beside_cache_key is not None:
                save_beside_cache(BesideCacheFolders.SPMD_TYPES, self.beside_cache_key, outputs_to_json(self.spmd_carry.outputs))
        return typed

    def _keep_spmd_carry(self, outputs: list[Any], traced: fx.GraphModule | None = None,
                         kind: GraphKind = GraphKind.FORWARD, offset: int = 0) -> None:
        """What the compiled graph's wrapper stamps and re-checks (:mod:`dtcompile.spmd.carry`):
        the Dynamo graph's ``outputs``' types, and its AOT graph as ``traced`` where it was."""
        info = self.info
        self.spmd_carry = SpmdCarry(
            dynamo_graph=self.gm, traced=traced, kind=kind, axes=info.axes, inputs=tuple(info.spmd_inputs),
            outputs=outputs, axis_objects=axis_objects(self.gm, info.axes), output_offset=offset,
        )

    # ---- stage 4: lower
    def lower(
        self,
        gm: fx.GraphModule,
        kind: GraphKind,
        records: list[PassRecord],
        memory: MemoryPlan,
        ctx: PassContext,
        stages: Mapping[Stage, float],
        lowering: Callable[[Sequence[PassRecord]], Mapping[str, Any]],
    ) -> CompiledGraph:
        """The record of the graph with its regions inlined (its :attr:`~CompiledGraph.graph`,
        to lower), with the settings it will be lowered with (``lowering`` is told what the
        passes did and returns them) and the seconds of its ``stages`` so far."""
        with_regions = format_with_regions(gm) if any(is_region(n) for n in gm.graph.nodes) else ""
        regions = inline_regions(gm, self.info, kind)
        gm.recompile()
        record = compiled_graph(
            gm, ctx, records,
            held_bytes=memory.held_bytes,
            regions=regions,
            with_regions=with_regions,
            spmd_types_traced=self.spmd_types_traced.get(kind, {}),
            lowering=lowering(records),
            stages=stages,
        )
        self.record(record)
        return record

    # ---- stage 5: record
    def record(self, record: CompiledGraph) -> None:
        """Hands ``record`` to the log, and keeps its artifacts beside the compile cache
        where one can serve this graph."""
        self.graphs.append(record)
        if self.beside_cache_key is not None:
            start = time.perf_counter()
            # Made now: lowering rewrites the graph in place (Inductor's reinplacing).
            keep_artifacts(record, self._kept)
            save_beside_cache(BesideCacheFolders.REPORTS, self.beside_cache_key, list(self._kept.values()))
            record.stages.add(Stage.ARTIFACTS, time.perf_counter() - start)
        self.log.compiled(record, report=self.config.report)

    # ---- the other endings: served from the cache, run eagerly
    def record_cache_hit(self) -> None:
        """Records a graph AOTAutograd's cache served (nothing traced here); says so in the log,
        and logs again the artifacts the run that compiled it kept beside the cache."""
        saved = load_beside_cache(BesideCacheFolders.REPORTS, self.beside_cache_key) if self.beside_cache_key is not None else None
        kept = load_beside_cache(BesideCacheFolders.SPMD_TYPES, self.beside_cache_key) if self.info.spmd_inputs and self.beside_cache_key else None
        outputs = outputs_from_json(kept) if kept is not None else None
        if outputs is not None:
            self._keep_spmd_carry(outputs)
        self.log.served(CachedCompile(compile_id=self.info.compile_id, graph=self.gm, reported=bool(saved)))
        if saved:
            emit_saved_artifacts(saved)

    def fall_back_to_eager(self, exc: Exception) -> Callable[..., Any]:
        """The Dynamo graph as it is (DTensor's eager ops: eager's numbers and collectives),
        for a graph torch's AOTAutograd could not trace; says so (a warning,
        ``backend.fallbacks``, an eager-fallback artifact)."""
        fallback = EagerFallback(compile_id=self.info.compile_id, error=_one_line(exc), graph=self.gm)
        self.log.fell_back(fallback)
        warnings.warn(f"dtcompile: {fallback}", stacklevel=2)  # points at the backend's call
        self.obtained, self.eager_because = Obtained.EAGER, fallback.error
        return self.gm.forward

    def schedule(self) -> Schedule:
        """What this rank compiled, as its ranks' check compares it; a compiled schedule is
        saved beside the compile cache (as :attr:`entry`), for a run the cache serves."""
        collectives: tuple[Scheduled, ...] | None = None
        merged = False
        if self.graphs:
            collectives = scheduled_collectives((g.kind, g.collectives) for g in self.graphs)
            merged = bucketed(self.graphs)
        elif self.obtained is Obtained.SERVED and self.beside_cache_key is not None:
            collectives, merged = load_schedule(self.beside_cache_key) or (None, False)
        decided = decided_from(self.config, self.profile_choice, self.gm, self.example_inputs)
        traced = traced_digest(self.graphs) if self.graphs else ""
        schedule = Schedule(self.info.compile_id, self.obtained, collectives, decided, self.eager_because, merged, traced)
        if self.graphs and self.beside_cache_key is not None:
            save_schedule(self.beside_cache_key, schedule)
        return schedule
