"""Where a front door's compiles land: the one sink of records, fallbacks, cache hits and ranks' checks.

A :class:`CompileLog` belongs to a front door (the ``torch.compile`` backend, a
:class:`~dtcompile.pipeline.step_pass.StepPass`); the stages hand it what they made and
never reach back into the front door.  Each thing it is handed is kept, logged
(INFO, logger ``dtcompile.compiler``, the one users configure for every compile) and
emitted as a ``TORCH_TRACE`` artifact, in one way for every entry:

- :meth:`CompileLog.compiled`: a :class:`~dtcompile.records.CompiledGraph` (a Dynamo
  graph's forward, backward or inference graph, or a whole-step graph), printed too
  where the options ask for the ``report``; :meth:`CompileLog.finished`: its compile
  seconds per stage once its stages are done (:class:`~dtcompile.records.StageSeconds`),
  and :meth:`CompileLog.checked` again with its compile's ranks' check added;
- :meth:`CompileLog.served`: a :class:`~dtcompile.records.CachedCompile`, a graph the
  compile cache served;
- :meth:`CompileLog.fell_back`: an :class:`~dtcompile.records.EagerFallback`, a graph
  that runs eagerly because torch could not trace it;
- :attr:`CompileLog.checker`: the ranks' check (:class:`~dtcompile.ranks.check.RankChecker`),
  whose :class:`~dtcompile.records.RankCheck` records land in :attr:`CompileLog.checks`.
"""

from __future__ import annotations

import collections
import logging
import time

from dtcompile.artifacts import (
    emit_artifacts,
    emit_cached_artifact,
    emit_compile_seconds,
    emit_fallback_artifact,
    format_compiled_graph,
)
from dtcompile.ranks.check import RankChecker
from dtcompile.records import CachedCompile, CompiledGraph, EagerFallback, RankCheck, Stage

__all__ = ["CompileLog"]

log = logging.getLogger("dtcompile.compiler")  # the backend's logger, as users configure it


class CompileLog:
    """The records of one front door's compiles (see the module doc); ``maxlen`` bounds each
    kind of record (the oldest is dropped), ``None`` keeps them all."""

    def __init__(self, maxlen: int | None = None) -> None:
        self.records: collections.deque[CompiledGraph] = collections.deque(maxlen=maxlen)
        self.fallbacks: collections.deque[EagerFallback] = collections.deque(maxlen=maxlen)
        self.cached: collections.deque[CachedCompile] = collections.deque(maxlen=maxlen)
        self.checks: collections.deque[RankCheck] = collections.deque(maxlen=maxlen)
        self.checker = RankChecker(self.checks)
        """The ranks' check of the graphs this front door compiles (its records land in :attr:`checks`)."""

    def sharing(self) -> CompileLog:
        """A log whose records land in this one's, with a ranks' check of its own (what one
        front door has agreed with its peers is not another's)."""
        other = CompileLog.__new__(CompileLog)
        other.records, other.fallbacks, other.cached, other.checks = self.records, self.fallbacks, self.cached, self.checks
        other.checker = RankChecker(other.checks)
        return other

    def compiled(self, record: CompiledGraph, *, report: bool = False, profile: object = None) -> None:
        """Keeps ``record``, logs it (``profile``: the cost profile it was priced with, where the
        log has not said it yet), emits its artifacts, and prints it with ``report``; the
        time that takes is its :attr:`~dtcompile.records.Stage.ARTIFACTS` stage."""
        start = time.perf_counter()
        self.records.append(record)
        priced = f", cost profile {profile}" if profile is not None else ""
        log.info(
            "compile %s %s graph: %d nodes, %d collectives, %d local_map regions%s",
            record.compile_id, record.kind, len(record.graph.graph.nodes), len(record.collectives),
            len(record.regions), priced,
        )
        for region in record.regions:
            log.info("compile %s %s graph: region %s", record.compile_id, record.kind, region)
        emit_artifacts(record)
        if report:
            print(format_compiled_graph(record), flush=True)
        record.stages.add(Stage.ARTIFACTS, time.perf_counter() - start)

    def finished(self, record: CompiledGraph) -> None:
        """Logs (INFO) and emits ``record``'s compile seconds per stage, once its stages are done."""
        log.info("compile %s %s graph: compile seconds: %s", record.compile_id, record.kind, record.stages)
        emit_compile_seconds(record)

    def checked(self, record: CompiledGraph, check: RankCheck) -> None:
        """Charges the ranks' check ``check`` to ``record``, its compile's last graph, whose
        compile seconds were emitted already, and emits them again where it adds to them."""
        if check.seconds > 0:
            record.stages.add_check(check)
            self.finished(record)

    def served(self, cached: CachedCompile) -> None:
        """Keeps, logs and emits ``cached``."""
        self.cached.append(cached)
        log.info("%s", cached)
        emit_cached_artifact(cached)

    def fell_back(self, fallback: EagerFallback) -> None:
        """Keeps, logs and emits ``fallback``."""
        self.fallbacks.append(fallback)
        log.info("%s", fallback)
        emit_fallback_artifact(fallback)
