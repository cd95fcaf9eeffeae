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

The pipeline for one Dynamo graph, one :class:`~dtcompile.pipeline.graph_compile.GraphCompile` per
backend call (a method per stage):

1. AOTAutograd traces the joint forward/backward graph with Inductor's
   decomposition table, DTensor desugars to local ops plus functional
   collectives, and :class:`dtcompile.pipeline.partition.Partitioner` (the min-cut
   partitioner, or one that keeps collectives under uneven shards) splits it
   into a forward and a backward graph (exactly the graphs Inductor would get).
   ``local_map`` regions stay one ``local_map_region`` node each, forward and
   backward (:func:`dtcompile.hops.keep_regions` is on while AOTAutograd traces).
2. :func:`dtcompile.passes.run_passes` runs the ordered pass list on each.
3. Lowering: the regions are inlined (:func:`dtcompile.pipeline.lowering.inline_regions`),
   then Inductor's ``compile_fx_inner`` (``inductor=True``), or the graph as
   it is (``inductor=False``).
4. Where ranks can compile differently (a real process group; ``check_ranks``),
   the compiled graph's first call first checks that every rank of its groups
   compiled the same collectives (:mod:`dtcompile.ranks.check`); the backward is
   then compiled with the forward, not at its first call, so that the check
   covers both.

Each AOT graph's record says how long each stage of its compile took
(:class:`~dtcompile.records.StageSeconds`), from Dynamo's tracing of the frame,
which the backend reads when Dynamo calls it (:func:`_dynamo_seconds`), to the
ranks' check, charged to the compile's last graph.

Where step 1 fails in torch on a program eager DTensor runs (stock AOTAutograd
refuses some DTensor programs), the Dynamo graph runs eagerly instead, with a
warning and a ``backend.fallbacks`` record (``eager_fallback``, see
:class:`~dtcompile.records.EagerFallback`); a failure in dtcompile's own code,
or after the trace, raises.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

import dynamo_vars
from dtcompile.annotations import DynamoGraphInfo
from dtcompile.base.torch_compat import frame_compile_started_ns
from dtcompile.cache_keys import meshes_held
from dtcompile.config import DTCompileConfig, config_for
from dtcompile.cost.auto import devices_of
from dtcompile.pipeline.compile_log import CompileLog
from dtcompile.pipeline.dynamo_output import with_outputs_put_back
from dtcompile.pipeline.graph_compile import GraphCompile
from dtcompile.ranks.check import CheckedOnFirstCall, check_groups
from dtcompile.records import CachedCompile, CompiledGraph, EagerFallback, RankCheck
from dtcompile.spmd.carry import carry_spmd_types

__all__ = ["DTCompileBackend"]

log = logging.getLogger(__name__)

# How many compiled graphs a backend keeps for inspection; older ones are dropped.
_MAX_RECORDS = 256


# The packages whose own exceptions are deliberate errors (bad input, a region
# the user declared wrongly), never a reason to run eagerly.
_OWN_PACKAGES = ("dtcompile", "dynamo_vars")


_returned = threading.local()
"""Per thread (a rank run as a thread compiles on its own): ``(the start of the frame's
compile, when the backend last returned in it)``, read by :func:`_dynamo_seconds`."""


def _dynamo_seconds() -> float | None:
    """How long Dynamo traced before this call of the backend: since it began compiling the
    frame (:func:`~dtcompile.base.torch_compat.frame_compile_started_ns`), or since the
    backend's last return where this frame's compile called it before; ``None`` outside a
    frame's compile, or where torch does not say when it began."""
    started = frame_compile_started_ns()
    if started is None:
        return None
    last = getattr(_returned, "at", None)
    since = last[1] if last is not None and last[0] == started else started
    return max(0.0, (time.time_ns() - since) / 1e9)


def _note_return() -> None:
    """Marks the backend's return in the frame's compile (:data:`_returned`)."""
    started = frame_compile_started_ns()
    _returned.at = (started, time.time_ns()) if started is not None else None


def _raised_on_purpose(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is one of dtcompile's own."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__module__.partition(".")[0] in _OWN_PACKAGES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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

    def __init__(self, config: DTCompileConfig, log: CompileLog | None = None) -> None:
        self.config = config
        self.log = log if log is not None else CompileLog(maxlen=_MAX_RECORDS)
        """Where this backend's compiles land (:class:`~dtcompile.pipeline.compile_log.CompileLog`)."""

    @property
    def records(self) -> collections.deque[CompiledGraph]:
        return self.log.records

    @property
    def fallbacks(self) -> collections.deque[EagerFallback]:
        return self.log.fallbacks

    @property
    def cached(self) -> collections.deque[CachedCompile]:
        return self.log.cached

    @property
    def checks(self) -> collections.deque[RankCheck]:
        return self.log.checks

    def __repr__(self) -> str:
        return f"dtcompile.backend({self.config})"

    def sharing_records(self, **changes: Any) -> DTCompileBackend:
        """A backend with ``changes`` to this one's options whose records, fallbacks and
        cached graphs land in this backend's (``collective_schedule`` compiles so with
        ``aot_cache=False``: it reads what dtcompile compiles)."""
        return DTCompileBackend(self.config.replace(**changes), self.log.sharing())

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        dynamo_seconds = _dynamo_seconds()
        try:
            return self._compile(gm, example_inputs, mode, options, dynamo_seconds)
        finally:
            _note_return()

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None,
        options: Mapping[str, Any] | None,
        dynamo_seconds: float | None,
    ) -> Callable[..., Any]:
        """The compiled function for Dynamo graph ``gm`` (see the module doc)."""
        config = self.config
        if not dynamo_vars.is_installed():
            warnings.warn(f"dtcompile: this graph was traced with dynamo_vars uninstalled: {_STOCK_TRACING}", stacklevel=2)
        if mode is not None or options:
            config, ignored = config_for(config, mode, options, devices_of(example_inputs))
            if ignored:
                warnings.warn(f"dtcompile: ignored {'; '.join(ignored)}", stacklevel=2)
        job = GraphCompile(self.log, gm, example_inputs, config, dynamo_seconds)
        try:
            compiled = job.trace()
        except Exception as exc:
            if job.traced or not config.eager_fallback or _raised_on_purpose(exc):
                raise
            compiled = job.fall_back_to_eager(exc)
        else:
            if job.served_from_cache():
                job.record_cache_hit()
        run = with_outputs_put_back(compiled, job.constants, job.views)
        if job.spmd_carry is not None:
            run = carry_spmd_types(run, job.spmd_carry)
        if not job.checking:
            return run
        schedule = job.schedule()
        groups = check_groups(gm, meshes_held(gm, example_inputs))
        if not groups or schedule.collectives == ():
            # Nothing to pair up: a graph some ranks run alone (rank 0's evaluation) must not wait.
            return run
        return CheckedOnFirstCall(
            run,
            with_outputs_put_back(gm.forward, job.constants, job.views),
            functools.partial(
                self.log.checker.check, schedule, groups, config.check_ranks_timeout_s, job.info.axes,
                # The check is one for every graph of the compile: charged to its last.
                charge=functools.partial(self.log.checked, job.graphs[-1]) if job.graphs else None,
            ),
            functools.partial(self._run_eagerly_on_every_rank, gm, job.info),
        )

    def _run_eagerly_on_every_rank(self, gm: fx.GraphModule, info: DynamoGraphInfo) -> None:
        warnings.warn(
            f"dtcompile: graph {info.compile_id} runs eagerly on every rank of its groups: some rank could not "
            "compile it (its backend.fallbacks says why), and ranks must issue the same collectives",
            stacklevel=3,
        )


_STOCK_TRACING = (
    "Dynamo traces DTensor code with stock support; where stock falls short you get stock errors "
    "(e.g. 'Failed to convert args/kwargs to proxy' for DTensor factories, or local_map inlined). "
    "dynamo_vars.install() (or making a backend with dtcompile.backend()) turns dtcompile's back on."
)
