"""The text report and the ``TORCH_TRACE`` artifacts of what dtcompile compiled.

``dtcompile.explain(fn)(*args)`` compiles ``fn`` with dtcompile, runs it (and a
backward), and returns a :class:`Report`; ``str(report)`` is, per compile id:

- the Dynamo graph's DTensor nodes in op-schema notation, each with the
  collectives it causes in forward and backward and their estimated time;
- the forward and backward AOT graphs, one annotated line per call node;
- a collective table (graph, op, axis, group, bytes, estimated us) and totals;

then the graph breaks and the recompile reasons (in placement and mesh words,
see :mod:`dynamo_vars.guards`).

Every compile also logs, through ``torch._logging.trace_structured``, the
artifacts ``dtcompile_placements``, ``dtcompile_<kind>_graph`` and
``dtcompile_<kind>_collectives`` (JSON), which ``tlparse`` shows under the
compile id, and which ``dtcompile-report`` (``tools/report.py``) turns into HTML.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dtcompile.compiler import CompiledGraph

__all__ = ["Report", "collectives_json", "emit_artifacts", "explain", "format_compiled_graph"]


def collectives_json(record: CompiledGraph) -> dict[str, Any]:
    """The collectives of one AOT graph with their estimated times, and totals, and its
    ``local_map`` regions (as the passes saw them, before lowering inlined them), as JSON data."""
    items = []
    for node in record.graph.graph.nodes:
        info = node.meta.get("dtcompile_collective")
        if info is None:
            continue
        items.append(
            {
                "node": info.node,
                "op": info.op,
                "axis": info.axis,
                "group_size": info.group_size,
                "shape": list(info.shape),
                "dtype": str(info.dtype).removeprefix("torch."),
                "bytes": info.bytes,
                "estimated_us": round(node.meta.get("dtcompile_cost_us", 0.0), 3),
            }
        )
    return {
        "compile_id": record.compile_id,
        "kind": record.kind,
        "cost_profile": record.info.profile.name,
        "passes": [
            {
                "name": p.name,
                "ran": p.ran,
                "nodes": [p.nodes_before, p.nodes_after],
                "collectives": [p.collectives_before, p.collectives_after],
                "decisions": list(p.decisions),
            }
            for p in record.passes
        ],
        "regions": [
            {
                "node": r.node,
                "name": r.spec.name,
                "spec": str(r.spec),
                "ops": r.ops,
                "collectives": list(r.collectives),
            }
            for r in record.regions
        ],
        "collectives": items,
        "totals": {
            "count": len(items),
            "bytes": sum(c["bytes"] for c in items),
            "estimated_us": round(sum(c["estimated_us"] for c in items), 3),
        },
    }


def emit_artifacts(record: CompiledGraph) -> None:
    """Log one AOT graph's annotations as ``TORCH_TRACE`` artifacts (no-ops without TORCH_TRACE)."""
    trace = torch._logging.trace_structured

    def artifact(name: str, encoding: str, payload: Callable[[], str]) -> None:
        trace("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload)

    artifact("dtcompile_placements", "string", record.info.format)
    artifact(f"dtcompile_{record.kind}_graph", "string", record.annotated)
    artifact(f"dtcompile_{record.kind}_collectives", "json", lambda: json.dumps(collectives_json(record)))
    if record.regions:
        artifact(f"dtcompile_{record.kind}_regions", "string", lambda: record.with_regions)


def _collective_table(records: list[CompiledGraph]) -> list[str]:
    lines = [f"{'graph':<14} {'op':<15} {'axis':<6} {'group':>5} {'bytes':>10} {'est. us':>9}"]
    totals: dict[str, list[float]] = {}
    for record in records:
        data = collectives_json(record)
        for c in data["collectives"]:
            graph = f"{record.compile_id} {record.kind}"
            lines.append(f"{graph:<14} {c['op']:<15} {c['axis']:<6} {c['group_size']:>5} {c['bytes']:>10} {c['estimated_us']:>9.1f}")
        total = totals.setdefault(record.kind, [0, 0, 0.0])
        total[0] += data["totals"]["count"]
        total[1] += data["totals"]["bytes"]
        total[2] += data["totals"]["estimated_us"]
    for kind, (count, num_bytes, us) in totals.items():
        lines.append(f"total {kind}: {count} collectives, {num_bytes} B per rank, ~{us:.1f} us")
    return lines


def format_compiled_graph(record: CompiledGraph) -> str:
    """The report section of one AOT graph (used by the ``report=True`` option)."""
    profile = record.info.profile
    return "\n".join(
        [
            f"== dtcompile {record.compile_id} {record.kind} (cost profile {profile.name}) ==",
            "-- DTensor placements (Dynamo graph) --",
            record.info.format(),
            f"-- {record.kind} graph --",
            record.annotated(),
            *_region_lines(record, "-- local_map regions (one op each until lowering) --"),
            "-- passes --",
            *_pass_lines(record),
            "-- collectives --",
            *_collective_table([record]),
        ]
    )


def _region_lines(record: CompiledGraph, title: str) -> list[str]:
    return [title, *map(str, record.regions)] if record.regions else []


def _pass_lines(record: CompiledGraph) -> list[str]:
    lines = []
    for p in record.passes:
        summary = f"nodes {p.nodes_before} -> {p.nodes_after}, collectives {p.collectives_before} -> {p.collectives_after}"
        lines.append(f"{p.name}: " + (summary if p.ran else "switched off"))
        lines += [f"  {decision}" for decision in p.decisions]
    return lines


@dataclass(frozen=True)
class Report:
    """What :func:`explain` saw: the compiled graphs, graph breaks and recompiles."""

    graphs: tuple[CompiledGraph, ...]
    graph_breaks: tuple[str, ...]
    recompiles: tuple[str, ...]

    def __str__(self) -> str:
        return self.text()

    def text(self, aot_graphs: bool = True) -> str:
        """The report; ``aot_graphs=False`` leaves out the annotated forward/backward graphs."""
        lines = []
        profile = self.graphs[0].info.profile if self.graphs else None
        if profile is not None:
            lines.append(f"dtcompile report; cost profile {profile.name}: {profile.description}")
        by_id: dict[str, list[CompiledGraph]] = {}
        for record in self.graphs:
            by_id.setdefault(record.compile_id, []).append(record)
        for compile_id, records in by_id.items():
            lines += [f"== compile {compile_id} ==", "-- DTensor placements (Dynamo graph) --", records[0].info.format()]
            for record in records:
                if aot_graphs:
                    lines += [f"-- {record.kind} graph --", record.annotated()]
                lines += _region_lines(record, f"-- local_map regions of the {record.kind} graph (one op each until lowering) --")
                lines += [f"-- passes on the {record.kind} graph --", *_pass_lines(record)]
        lines += ["== collectives ==", *_collective_table(list(self.graphs))]
        lines.append("== graph breaks ==")
        lines += [f"- {reason}" for reason in self.graph_breaks] or ["none"]
        lines.append("== recompiles ==")
        lines += [f"- {reason}" for reason in self.recompiles] or ["none"]
        return "\n".join(lines)


def _depyf(dump_dir: str | None) -> Any:
    if dump_dir is None:
        return contextlib.nullcontext()
    import depyf

    return depyf.prepare_debug(dump_dir)


def explain(
    fn: Callable[..., Any], *, backward: bool = True, depyf_dir: str | None = None, **options: Any
) -> Callable[..., Report]:
    """``explain(fn, **backend_options)(*args)``: compile ``fn`` with dtcompile (by default
    without Inductor lowering), call it on ``args`` (and run a backward from the sum of its
    outputs), and report what was compiled.  Calling the result again with other args
    reports the recompiles they cause.  Resets Dynamo's caches first.

    ``depyf_dir``: also dump Dynamo's transformed bytecode, decompiled by depyf, and
    the graphs' code there (``dtcompile-report --depyf DIR`` puts it beside the HTML)."""
    import dtcompile
    from dtcompile.testing.asserts import backward_from_sum

    options.setdefault("inductor", False)
    backend = dtcompile.backend(**options)
    compiled = torch.compile(fn, backend=backend)
    torch._dynamo.reset()

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
        return Report(tuple(backend.records), breaks, recompiles)

    return run
