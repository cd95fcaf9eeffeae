"""The dtcompile ``torch.compile`` backend.

:class:`DTCompileBackend` is the compiler function ``torch.compile`` calls;
:mod:`dtcompile.registry` makes them (``dtcompile.backend(**options)``, and the
name ``"dtcompile"``), installing :mod:`dynamo_vars` (nothing is installed at import).

torch.compile's own knobs reach the backend: ``options={...}`` keys that are
:class:`~dtcompile.config.DTCompileConfig` fields set them and the others are
Inductor settings; ``mode=`` adds Inductor's settings for that mode
(``torch._inductor.list_mode_options``).  Settings that cannot take effect
(Inductor settings with ``inductor=False``, CUDA graphs on a CPU graph) are
dropped with one warning that names them.

The pipeline for one Dynamo graph:

1. AOTAutograd traces the joint forward/backward graph with Inductor's
   decomposition table, DTensor desugars to local ops plus functional
   collectives, and :class:`dtcompile.partition.Partitioner` (the min-cut
   partitioner, or one that keeps collectives under uneven shards) splits it
   into a forward and a backward graph (exactly the graphs Inductor would get).
   ``local_map`` regions stay one ``local_map_region`` node each, forward and
   backward (:func:`hops.keep_regions` is on while AOTAutograd traces).
2. :func:`dtcompile.passes.run_passes` runs the ordered pass list on each.
3. Lowering: the regions are inlined (:func:`dtcompile.lowering.inline_regions`),
   then Inductor's ``compile_fx_inner`` (``inductor=True``), or the graph as
   it is (``inductor=False``).
4. Where ranks can compile differently (a real process group; ``check_ranks``),
   the compiled graph's first call first checks that every rank of its groups
   compiled the same collectives (:mod:`dtcompile.rank_check`); the backward is
   then compiled with the forward, not at its first call, so that the check
   covers both.

Where step 1 fails in torch on a program eager DTensor runs (stock AOTAutograd
refuses some DTensor programs), the Dynamo graph runs eagerly instead, with a
warning and a ``backend.fallbacks`` record (``eager_fallback``, see
:class:`~dtcompile.records.EagerFallback`); a failure in dtcompile's own code,
or after the trace, raises.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx

import dynamo_vars
from dtcompile.annotations import DynamoGraphInfo, describe_dynamo_graph
from dtcompile.artifacts import (
    emit_artifacts,
    emit_cached_artifact,
    emit_fallback_artifact,
    emit_saved_artifacts,
    format_compiled_graph,
    keep_artifacts,
)
from dtcompile.base.beside_cache import load_beside_cache, save_beside_cache
from dtcompile.base.channels import Beside, GraphKind
from dtcompile.base.sharding_cache import fresh_sharding_caches
from dtcompile.base.torch_compat import INDUCTOR_SIMPLE_OVERLAP, inductor_reorders_collectives
from dtcompile.cache_keys import (
    compile_key,
    key_fields,
    meshes_held,
    profile_text,
    rank_position,
    source_digest,
    stable_mesh_keys,
)
from dtcompile.collectives import graph_collectives, is_collective, mesh_axes, profile_for_groups
from dtcompile.config import DTCompileConfig, config_for
from dtcompile.cost import ProfileChoice
from dtcompile.cost.simulate import simulate
from dtcompile.dynamo_output import split_constant_outputs, split_input_views, with_outputs_put_back
from dtcompile.lowering import inline_regions
from dtcompile.memory import MemoryPlan, estimate_memory, prefetch_window
from dtcompile.partition import Partitioner
from dtcompile.passes import PassContext, run_passes
from dtcompile.rank_check import (
    CheckedOnFirstCall,
    RanksDisagree,
    Schedule,
    agree,
    check_groups,
    collective_lines,
    decided_from,
    inputs_text,
    load_schedule,
    save_schedule,
    world_can_disagree,
)
from dtcompile.records import Action, CachedCompile, CompiledGraph, EagerFallback, PassRecord, RankCheck
from dtcompile.regions import format_with_regions, is_region
from dtcompile.reshard import param_names
from dtcompile.spmd_typing import input_types
from dynamo_vars.dtensor_state import loss_parallel_backward
from hops import keep_regions

__all__ = ["DTCompileBackend"]

log = logging.getLogger(__name__)

# How many compiled graphs a backend keeps for inspection; older ones are dropped.
_MAX_RECORDS = 256


@contextlib.contextmanager
def _aot_settings(config: DTCompileConfig, *, backward_now: bool) -> Iterator[None]:
    """AOTAutograd as this compile needs it.  Its cache as the user set it, except where
    this compile must run here (``aot_cache=False``, or ``report`` / ``trace_pass_graphs``,
    which show the graphs as they compile): a hit there would trace nothing.  Both
    caches key on :func:`~dtcompile.cache_keys.compile_key` through the partitioner, so
    a hit is a graph compiled with these options.  ``backward_now``: the backward is
    compiled with the forward, not at its first call, so that the ranks' check
    (:mod:`dtcompile.rank_check`) sees its collectives before either runs."""
    from torch._functorch import config as functorch_config

    settings = {}
    if not config.aot_cache or config.report or config.trace_pass_graphs:
        settings["enable_autograd_cache"] = False
    if backward_now:
        settings["force_non_lazy_backward_lowering"] = True
    with functorch_config.patch(settings):
        yield


class _Progress:
    """How far one backend call got: past AOTAutograd's trace (into the partitioner or
    dtcompile's passes) or not, and the graphs it compiled.  A failure after the trace
    is never run eagerly instead; a call that returns without ever getting there was
    served from AOTAutograd's cache.  ``kept_as``: where the graphs' artifacts are kept
    beside the compile cache as each compiles (the backward may compile at its first
    call), ``None`` where no cache can serve them."""

    def __init__(self, kept_as: str | None = None) -> None:
        self.traced = False
        self.graphs: list[CompiledGraph] = []
        self.kept_as = kept_as
        self._kept: dict[str, list[str]] = {}

    def compiled(self, record: CompiledGraph) -> None:
        self.graphs.append(record)
        if self.kept_as is not None:
            # Made now: lowering rewrites the graph in place (Inductor's reinplacing).
            keep_artifacts(record, self._kept)
            save_beside_cache(Beside.REPORTS, self.kept_as, list(self._kept.values()))

    def trace_finished(self) -> None:
        self.traced = True


def _schedule_owned_by_dtcompile(config: DTCompileConfig, passes: Sequence[PassRecord]) -> dict[str, Any]:
    """Inductor settings that leave the collectives' schedule to dtcompile's passes,
    given what they did to this graph.

    From torch 2.14 Inductor reorders collectives itself (``simple_overlap``, on by
    default; :func:`dtcompile.base.torch_compat.inductor_reorders_collectives`).  Where
    dtcompile's ``overlap`` pass has placed the collectives and waits, or its
    ``async_tp`` pass has put collectives inside fused ops, dtcompile owns the
    schedule and Inductor's pass is switched off for this compile: it would
    redo the placement without dtcompile's cost model, and it does not see a
    collective inside a fused op (a ``FallbackKernel``), so it could move
    another collective across it (pytorch/pytorch#189454).  Where neither
    changed the graph (disabled, or their rewrites did not pay under the
    profile), or the setting is given explicitly, Inductor's own choice stands.
    """
    if not inductor_reorders_collectives() or INDUCTOR_SIMPLE_OVERLAP in config.inductor_config:
        return {}
    scheduled = any(
        decision.action in (Action.MOVED, Action.FUSED)
        for record in passes
        if record.name in ("overlap", "async_tp")
        for decision in record.decisions
    )
    return {INDUCTOR_SIMPLE_OVERLAP: False} if scheduled else {}


# The packages whose own exceptions are deliberate errors (bad input, a region
# the user declared wrongly), never a reason to run eagerly.
_OWN_PACKAGES = ("dtcompile", "hops", "dynamo_vars")


def _raised_on_purpose(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is one of dtcompile's own."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__module__.partition(".")[0] in _OWN_PACKAGES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _devices(example_inputs: Sequence[Any]) -> frozenset[str]:
    return frozenset(x.device.type for x in example_inputs if isinstance(x, torch.Tensor))


class DTCompileBackend:
    """The compiler function ``torch.compile`` calls; made by :func:`backend`.

    ``records`` holds a :class:`~dtcompile.records.CompiledGraph` for each graph
    it compiled (bounded; the newest last), and ``fallbacks`` an
    :class:`~dtcompile.records.EagerFallback` for each graph it ran eagerly
    because torch could not trace it (``eager_fallback``), and ``cached`` a
    :class:`~dtcompile.records.CachedCompile` for each graph AOTAutograd's cache
    served (compiled by an earlier run with the same options; see
    :mod:`dtcompile.cache_keys`).  ``torch.compile``'s ``mode=`` and
    ``options=`` arrive as keyword arguments of the call (:func:`config_for`).
    """

    def __init__(self, config: DTCompileConfig) -> None:
        self.config = config
        self.records: collections.deque[CompiledGraph] = collections.deque(maxlen=_MAX_RECORDS)
        self.fallbacks: collections.deque[EagerFallback] = collections.deque(maxlen=_MAX_RECORDS)
        self.cached: collections.deque[CachedCompile] = collections.deque(maxlen=_MAX_RECORDS)
        self.checks: collections.deque[RankCheck] = collections.deque(maxlen=_MAX_RECORDS)
        # (rank, frame) -> schedules its ranks agreed on (rank: ranks as threads share a backend).
        self._agreed: dict[tuple[int, str], set[str]] = {}

    def __repr__(self) -> str:
        return f"dtcompile.backend({self.config})"

    def recording_into_this(self, **changes: Any) -> DTCompileBackend:
        """A backend with ``changes`` to this one's options whose records, fallbacks and
        cached graphs land in this backend's (``collective_schedule`` compiles so with
        ``aot_cache=False``: it reads what dtcompile compiles)."""
        other = DTCompileBackend(self.config.replace(**changes))
        other.records, other.fallbacks, other.cached = self.records, self.fallbacks, self.cached
        other.checks = self.checks
        return other

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        config = self.config
        if not dynamo_vars.is_installed():
            warnings.warn(f"dtcompile: this graph was traced with dynamo_vars uninstalled: {_STOCK_TRACING}", stacklevel=2)
        if mode is not None or options:
            config, ignored = config_for(config, mode, options, _devices(example_inputs))
            if ignored:
                warnings.warn(f"dtcompile: ignored {'; '.join(ignored)}", stacklevel=2)
        compile_id = torch._guards.CompileContext.current_compile_id()
        axes = mesh_axes(gm, example_inputs)
        # Priced for its devices and its meshes' groups (the default group's when it has none).
        priced = profile_for_groups(config.cost_profile, _devices(example_inputs), list(axes))
        info = describe_dynamo_graph(
            gm, str(compile_id) if compile_id is not None else "?", axes, priced.profile, priced.why
        )
        info.spmd_inputs = input_types(gm, example_inputs, axes)
        log.info("%s: cost profile %s", info.compile_id, priced)
        constants = split_constant_outputs(gm)
        views = split_input_views(gm)
        # Keyed on this rank's place in the graph's meshes: the trace bakes its coordinates in.
        key = compile_key(config, priced.profile, rank_position(gm, example_inputs))
        # Where a compile cache can serve this graph, what is kept beside it for the graph
        # (its artifacts, its schedule) is found again by this; None where none can.
        entry = f"{key}\n{gm.code}\n{inputs_text(example_inputs)}" if config.inductor and config.aot_cache else None
        progress = _Progress(kept_as=entry)
        checking = config.check_ranks and world_can_disagree()
        partitioner = Partitioner(
            bool(info.uneven),
            key,
            on_start=progress.trace_finished,
            params=param_names(gm, example_inputs),
            reshard=config.reshard_after_forward,
            keep_gathered=config.keep_gathered,
            memory_budget=config.memory_budget_bytes,
            name=f"compile {info.compile_id}",
        )
        try:
            with (
                _aot_settings(config, backward_now=checking),
                stable_mesh_keys(),
                fresh_sharding_caches(),
                keep_regions(),
                loss_parallel_backward(gm),
            ):
                if config.inductor:
                    from torch._inductor.compile_fx import compile_fx

                    patches = dict(config.inductor_config)
                    patches["custom_partitioner_fn"] = partitioner
                    compiled = compile_fx(
                        gm,
                        example_inputs,
                        inner_compile=functools.partial(self._inductor_inner_compile, info, config, progress, partitioner),
                        config_patches=patches,
                    )
                else:
                    compiled = self._aot_without_inductor(gm, example_inputs, info, config, progress, partitioner)
        except Exception as exc:
            if progress.traced or not config.eager_fallback or _raised_on_purpose(exc):
                raise
            fallback = self._fall_back_to_eager(gm, info, exc)
            compiled, how = gm.forward, f"run eagerly ({fallback.error})"
        else:
            how = "compiled here" if progress.traced else "served from the compile cache"
            if not progress.traced:
                self._loaded_from_cache(gm, info, entry)
        run = with_outputs_put_back(compiled, constants, views)
        if not checking:
            return run
        schedule = self._schedule(gm, example_inputs, info.compile_id, config, priced, key, entry, how, progress.graphs)
        groups = check_groups(gm, meshes_held(gm, example_inputs))
        if not groups or schedule.collectives == ():
            # Nothing to pair up: a graph some ranks run alone (rank 0's evaluation) must not wait.
            return run
        return CheckedOnFirstCall(
            run,
            with_outputs_put_back(gm.forward, constants, views),
            functools.partial(self._agree, schedule, groups, config.check_ranks_timeout_s, info.axes),
            functools.partial(self._run_eagerly_on_every_rank, gm, info),
        )

    def _schedule(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        compile_id: str,
        config: DTCompileConfig,
        priced: ProfileChoice,
        key: str,
        entry: str | None,
        how: str,
        graphs: Sequence[CompiledGraph],
    ) -> Schedule:
        """What this rank compiled for ``gm``, as its ranks' check compares it; a compiled
        schedule is saved beside the compile cache (as ``entry``), for a run the cache serves."""
        collectives: tuple[str, ...] | None = None
        if graphs:
            collectives = collective_lines((g.kind, g.collectives) for g in graphs)
            if entry is not None:
                save_schedule(entry, collectives)
        elif how.startswith("served") and entry is not None:
            collectives = load_schedule(entry)
        profile = f"{priced}, numbers {profile_text(priced.profile)}"
        decided = decided_from(key_fields(config), profile, source_digest(), gm, example_inputs)
        return Schedule(compile_id, how, collectives, decided, eager=how.startswith("run eagerly"))

    def _agree(self, schedule: Schedule, groups: Sequence[str], timeout_s: float, axes: Mapping[str, str]) -> bool:
        """The ranks' check of one graph (:func:`dtcompile.rank_check.agree`), recorded; a
        recompile whose schedule its frame already agreed on is not exchanged."""
        import torch.distributed as dist

        frame = (dist.get_rank(), schedule.compile_id.split("/")[0])

        def record(outcome: str, seconds: float = 0.0) -> None:
            check = RankCheck(schedule.compile_id, tuple(groups), outcome, seconds, bool(schedule.digest))
            self.checks.append(check)
            log.info("%s", check)

        if schedule.digest and schedule.digest in self._agreed.get(frame, ()):
            record("agreed on by an earlier graph")
            return False
        start = time.perf_counter()
        try:
            eager = agree(schedule, groups, timeout_s, axes)
        except RanksDisagree:
            record("ranks disagree", time.perf_counter() - start)
            raise
        record("every rank runs it eagerly" if eager else "agreed", time.perf_counter() - start)
        if not eager and schedule.digest:
            self._agreed.setdefault(frame, set()).add(schedule.digest)
        return eager

    def _run_eagerly_on_every_rank(self, gm: fx.GraphModule, info: DynamoGraphInfo) -> None:
        warnings.warn(
            f"dtcompile: graph {info.compile_id} runs eagerly on every rank of its groups: some rank could not "
            "compile it (its backend.fallbacks says why), and ranks must issue the same collectives",
            stacklevel=3,
        )

    def _loaded_from_cache(self, gm: fx.GraphModule, info: DynamoGraphInfo, entry: str | None) -> None:
        """Records a graph AOTAutograd's cache served (nothing traced here); says so in the log,
        and logs again the artifacts the run that compiled it kept beside the cache."""
        saved = load_beside_cache(Beside.REPORTS, entry) if entry is not None else None
        cached = CachedCompile(compile_id=info.compile_id, graph=gm, reported=bool(saved))
        self.cached.append(cached)
        log.info("%s", cached)
        emit_cached_artifact(cached)
        if saved:
            emit_saved_artifacts(saved)

    def _fall_back_to_eager(self, gm: fx.GraphModule, info: DynamoGraphInfo, exc: Exception) -> EagerFallback:
        """Records that the Dynamo graph runs as it is (DTensor's eager ops: eager's numbers
        and collectives), for a graph torch's AOTAutograd could not trace; says so
        (a warning, ``backend.fallbacks``, a ``dtcompile_eager_fallback`` artifact)."""
        fallback = EagerFallback(compile_id=info.compile_id, error=_one_line(exc), graph=gm)
        self.fallbacks.append(fallback)
        log.info("%s", fallback)
        emit_fallback_artifact(fallback)
        warnings.warn(f"dtcompile: {fallback}", stacklevel=2)
        return fallback

    def _inductor_inner_compile(
        self,
        info: DynamoGraphInfo,
        config: DTCompileConfig,
        progress: _Progress,
        partitioner: Partitioner,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        **kwargs: Any,
    ) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner

        if kwargs.get("is_backward"):
            kind = GraphKind.BACKWARD
        elif kwargs.get("is_inference"):
            kind = GraphKind.INFERENCE
        else:
            kind = GraphKind.FORWARD
        communicates = any(is_collective(node) for node in gm.graph.nodes)
        with contextlib.ExitStack() as stack:

            def lowering(passes: Sequence[PassRecord]) -> dict[str, Any]:
                """Patches Inductor for this graph (until it is compiled); what it will read."""
                stack.enter_context(inductor_config.patch(_schedule_owned_by_dtcompile(config, passes) if communicates else {}))
                current = inductor_config.get_config_copy()
                settings = {name: current[name] for name in config.inductor_config}
                if communicates and inductor_reorders_collectives():
                    settings[INDUCTOR_SIMPLE_OVERLAP] = current[INDUCTOR_SIMPLE_OVERLAP]
                return settings

            gm = self._run_passes(gm, example_inputs, kind, info, config, progress, lowering, partitioner)
            return compile_fx_inner(gm, example_inputs, **kwargs)

    def _aot_without_inductor(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        info: DynamoGraphInfo,
        config: DTCompileConfig,
        progress: _Progress,
        partitioner: Partitioner,
    ) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.compile_fx import select_decomp_table

        def compiler(kind: GraphKind) -> Callable[..., Any]:
            def compile_graph(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                from torch._functorch.aot_autograd import make_boxed_func

                passed = self._run_passes(graph, inputs, kind, info, config, progress, lambda _: {}, partitioner)
                return make_boxed_func(passed.forward)

            return compile_graph

        return aot_autograd(
            fw_compiler=compiler(GraphKind.FORWARD),
            bw_compiler=compiler(GraphKind.BACKWARD),
            inference_compiler=compiler(GraphKind.INFERENCE),
            decompositions=select_decomp_table(),
            partition_fn=partitioner,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _run_passes(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        kind: GraphKind,
        info: DynamoGraphInfo,
        config: DTCompileConfig,
        progress: _Progress,
        lowering: Callable[[Sequence[PassRecord]], Mapping[str, Any]],
        partitioner: Partitioner,
    ) -> fx.GraphModule:
        """Runs the passes on one AOT graph and records it (a forward's record starts with
        the partitioner's ``reshard_after_forward`` decisions); ``lowering`` is told what the
        passes did and returns the settings the graph will be lowered with."""
        progress.trace_finished()
        memory = MemoryPlan(
            held_bytes=partitioner.held_during_backward if kind == GraphKind.BACKWARD else 0,
            prefetch_bytes=prefetch_window(partitioner.resharding.gathered),
        )
        ctx = PassContext(kind=kind, config=config, info=info, memory=memory)
        gm, passes = run_passes(gm, example_inputs, ctx)
        if kind == GraphKind.FORWARD:
            passes[:0] = partitioner.records(gm)
        with_regions = format_with_regions(gm) if any(is_region(n) for n in gm.graph.nodes) else ""
        regions = inline_regions(gm, info, kind)
        gm.recompile()
        record = CompiledGraph(
            compile_id=info.compile_id,
            kind=kind,
            graph=gm,
            collectives=tuple(graph_collectives(gm.graph, info.axes)),
            passes=tuple(passes),
            info=info,
            regions=tuple(regions),
            with_regions=with_regions,
            memory=estimate_memory(gm, kind, memory.held_bytes),
            memory_traced=ctx.traced_memory,
            memory_budget=(ctx.budget_bytes, ctx.budget_why),
            timeline=simulate(gm.graph, info.profile),
            timeline_traced=ctx.traced_timeline,
            lowering=dict(lowering(passes)),
        )
        self.records.append(record)
        progress.compiled(record)
        log.info(
            "compile %s %s graph: %d nodes, %d collectives, %d local_map regions",
            record.compile_id,
            kind,
            len(gm.graph.nodes),
            len(record.collectives),
            len(regions),
        )
        for region in regions:
            log.info("compile %s %s graph: region %s", record.compile_id, kind, region)
        emit_artifacts(record)
        if config.report:
            print(format_compiled_graph(record), flush=True)
        return gm


_STOCK_TRACING = (
    "Dynamo traces DTensor code with stock support; where stock falls short you get stock errors "
    "(e.g. 'Failed to convert args/kwargs to proxy' for DTensor factories, or local_map inlined). "
    "dynamo_vars.install() (or making a backend with dtcompile.backend()) turns dtcompile's back on."
)
