"""The text report of what dtcompile compiled: :func:`explain` and :class:`Report`.

``dtcompile.explain(fn)(*args)`` compiles ``fn`` with dtcompile, runs it (and a
backward), and returns a :class:`Report`; ``str(report)`` is, per compile id:

- the Dynamo graph's DTensor nodes in op-schema notation, each with the
  collectives it causes in forward and backward and their estimated time;
- the forward and backward AOT graphs, one annotated line per call node;
- a collective table (graph, op, axis, group, bytes, estimated us) and totals;

then the graph breaks and the recompile reasons (in placement and mesh words,
see :mod:`dynamo_vars.guards`), and last the compile seconds: one row per graph, its
seconds in each stage of its compile (Dynamo, AOTAutograd, the partitioner, the SPMD
types' check, the passes, the simulations, the artifacts, Inductor, the ranks' check:
:class:`~dtcompile.records.Stage`) and their total.  For a model made by ``dtcompile.auto_parallel``
the report starts with its solution (``solution.explain()``: every node's
placements and cost).  It sits above the backend: it builds one.
The per-graph pieces and the ``TORCH_TRACE`` artifacts are in
:mod:`dtcompile.artifacts`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dtcompile.artifacts import collective_table, compile_seconds_table, memory_lines, pass_lines, region_lines
from dtcompile.ranks.check import ranks_are_threads, reset_dynamo_of_this_rank
from dtcompile.records import CompiledGraph
from dtcompile.registry import backend as make_backend

__all__ = ["Report", "backward_from_sum", "explain"]


def backward_from_sum(out: Any) -> None:
    """Backward from the sum of every output that requires grad (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        sum((t.to_local() if isinstance(t, DTensor) else t).float().sum() for t in leaves).backward()


@dataclass(frozen=True)
class Report:
    """What :func:`explain` saw: the compiled graphs, graph breaks and recompiles."""

    graphs: tuple[CompiledGraph, ...]
    graph_breaks: tuple[str, ...]
    recompiles: tuple[str, ...]
    solution: str = ""
    """For a model made by ``dtcompile.auto_parallel``: its solution's ``explain()``."""

    def __str__(self) -> str:
        return self.text()

    def text(self, aot_graphs: bool = True) -> str:
        """The report; ``aot_graphs=False`` leaves out the annotated forward/backward graphs."""
        lines = []
        info = self.graphs[0].info if self.graphs else None
        if info is not None:
            lines.append(
                f"dtcompile report; cost profile {info.profile.name} ({info.profile_why}): {info.profile.description}"
            )
        if self.solution:
            lines += ["== auto-parallel solution ==", self.solution]
        by_id: dict[str, list[CompiledGraph]] = {}
        for record in self.graphs:
            by_id.setdefault(record.compile_id, []).append(record)
        for compile_id, records in by_id.items():
            lines += [f"== compile {compile_id} ==", "-- DTensor placements (Dynamo graph) --", records[0].info.format()]
            for record in records:
                if aot_graphs:
                    lines += [f"-- {record.kind} graph --", record.annotated()]
                lines += region_lines(record, f"-- local_map regions of the {record.kind} graph (one op each until lowering) --")
                lines += [f"-- passes on the {record.kind} graph --", *pass_lines(record)]
        lines += ["== memory (estimated, per rank) ==", *[line for r in self.graphs for line in memory_lines(r)]]
        lines += ["== collectives ==", *collective_table(list(self.graphs))]
        lines.append("== graph breaks ==")
        lines += [f"- {reason}" for reason in self.graph_breaks] or ["none"]
        lines.append("== recompiles ==")
        lines += [f"- {reason}" for reason in self.recompiles] or ["none"]
        lines += ["== compile seconds ==", *compile_seconds_table(self.graphs)]
        return "\n".join(lines)


def _solution_of(fn: Any) -> str:
    """The solution's ``explain()`` where ``fn`` is a model ``dtcompile.auto_parallel`` made."""
    from dtcompile.auto_parallel.apply import AutoParallelModule

    return fn.solution.explain() if isinstance(fn, AutoParallelModule) else ""


def _depyf(dump_dir: str | None) -> Any:
    if dump_dir is None:
        return contextlib.nullcontext()
    import depyf

    return depyf.prepare_debug(dump_dir)


_NOT_PER_RANK = "not counted: the ranks are threads of one process, and Dynamo counts for all of them at once"


def explain(
    fn: Callable[..., Any], *, backward: bool = True, depyf_dir: str | None = None, **options: Any
) -> Callable[..., Report]:
    """``explain(fn, **backend_options)(*args)``: compile ``fn`` with dtcompile (by default
    without Inductor lowering), call it on ``args`` (and run a backward from the sum of its
    outputs), and report what was compiled (``aot_cache=False``: every graph is
    compiled, none served by a cache).  Calling the result again with other args
    reports the recompiles they cause.  Resets Dynamo's caches first, but where ranks are
    threads of one process (they share them: :func:`dtcompile.ranks.check.ranks_are_threads`).

    ``depyf_dir``: also dump Dynamo's transformed bytecode, decompiled by depyf, and
    the graphs' code there (``dtcompile-report --depyf DIR`` puts it beside the HTML)."""
    options.setdefault("inductor", False)
    # Every graph compiled here, to be reported: none served by AOTAutograd's cache.
    options.setdefault("aot_cache", False)
    backend = make_backend(**options)
    compiled = torch.compile(fn, backend=backend)
    # Ranks as threads share Dynamo (no reset: it compiles ``fn`` again for the new backend),
    # and its counters are the whole process's: one rank's graph breaks and recompiles are
    # not counted.
    reset_dynamo_of_this_rank()
    threads = ranks_are_threads()

    def run(*args: Any, **kwargs: Any) -> Report:
        from torch._dynamo.utils import counters, guard_failures

        breaks_before = dict(counters["graph_break"])
        failures_before = {code: len(r) for code, r in guard_failures.items()}
        with _depyf(depyf_dir):
            out = compiled(*args, **kwargs)
            if backward:
                backward_from_sum(out)
        breaks = tuple(
            f"{reason} (x{n - breaks_before.get(reason, 0)})"
            for reason, n in counters["graph_break"].items()
            if n > breaks_before.get(reason, 0)
        )
        recompiles = tuple(
            f"{code.co_name}: {reason}"
            for code, reasons in guard_failures.items()
            for reason in reasons[failures_before.get(code, 0) :]
        )
        if threads:  # Dynamo's counters are the process's: every rank thread's at once
            breaks = recompiles = (_NOT_PER_RANK,)
        return Report(tuple(backend.records), breaks, recompiles, _solution_of(fn))

    return run
