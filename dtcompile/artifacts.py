"""Per-graph output of the backend: the text section of one compiled graph, and its TORCH_TRACE artifacts.

Every compile logs, through ``torch._logging.trace_structured``, the artifacts
``dtcompile_placements``, ``dtcompile_<kind>_graph``,
``dtcompile_<kind>_collectives`` (JSON) and ``dtcompile_<kind>_regions``,
which ``tlparse`` shows under the compile id and ``dtcompile-report``
(:mod:`dtcompile_tools.report`) turns into HTML, then, once the graph's stages are
done, ``dtcompile_<kind>_compile_seconds`` (JSON: :func:`compile_seconds_json`);
``report=True`` prints :func:`format_compiled_graph` as each graph compiles.
:mod:`dtcompile.report` builds the whole-program report on the same pieces.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtcompile.base.channels import Artifact, GraphKind, Meta
from dtcompile.base.notation import format_bytes
from dtcompile.records import CachedCompile, CompiledGraph, EagerFallback, Stage

__all__ = [
    "collective_table",
    "collectives_json",
    "compile_seconds_json",
    "compile_seconds_table",
    "emit_artifacts",
    "emit_cached_artifact",
    "emit_compile_seconds",
    "emit_fallback_artifact",
    "emit_saved_artifacts",
    "format_compiled_graph",
    "keep_artifacts",
    "memory_json",
    "memory_lines",
    "pass_lines",
    "region_lines",
    "timeline_json",
    "timeline_lines",
]


def collectives_json(record: CompiledGraph) -> dict[str, Any]:
    """The collectives of one AOT graph with their estimated times, and totals, and its
    ``local_map`` regions (as the passes saw them, before lowering inlined them), as JSON data.

    A data-dependent collective has ``"data_dependent": true``, and its ``shape``
    and ``bytes`` are the estimates its time was costed from; the totals' ``bytes``
    leave it out and their ``data_dependent`` counts it."""
    items = []
    for node in record.graph.graph.nodes:
        info = node.meta.get(Meta.COLLECTIVE)
        if info is None:
            continue
        items.append(
            {
                "node": info.node,
                "op": info.op,
                "label": info.label,
                "axis": info.axis,
                "group_size": info.group_size,
                "shape": list(info.shape),
                "dtype": str(info.dtype).removeprefix("torch."),
                "bytes": info.bytes,
                "data_dependent": info.data_dependent,
                "estimated_us": round(node.meta.get(Meta.COST_US, 0.0), 3),
            }
        )
    return {
        "compile_id": record.compile_id,
        "kind": record.kind,
        "cost_profile": record.info.profile.name,
        "cost_profile_why": record.info.profile_why,
        "passes": [
            {
                "name": p.name,
                "ran": p.ran,
                "nodes": [p.nodes_before, p.nodes_after],
                "collectives": [p.collectives_before, p.collectives_after],
                "decisions": [str(d) for d in p.decisions],
                "outcomes": [{"action": d.action.value, "node": d.node, "text": d.text} for d in p.decisions],
                "seconds": p.seconds,
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
        "memory": memory_json(record),
        "timeline": timeline_json(record),
        "collectives": items,
        "totals": {
            "count": len(items),
            "bytes": sum(c["bytes"] for c in items if not c["data_dependent"]),
            "data_dependent": sum(c["data_dependent"] for c in items),
            "estimated_us": round(sum(c["estimated_us"] for c in items), 3),
        },
    }


# Points of a memory curve kept in the JSON (a long graph's curve is thinned, its peak kept).
_CURVE_POINTS = 400


def memory_json(record: CompiledGraph) -> dict[str, Any] | None:
    """One graph's estimated memory (:mod:`dtcompile.graph.memory`) as JSON data: its peak, what is
    alive there, the peak before the passes, the budget they kept to, and the curve of
    live bytes over the schedule's estimated compute time (``[us, bytes]`` points)."""
    from dtcompile.cost.simulate import node_time_us

    estimate = record.memory
    if estimate is None:
        return None
    times, clock = [], 0.0
    for node in record.graph.graph.nodes:
        times.append(round(clock, 3))
        clock += node_time_us(node, record.info.profile)
    points = list(zip(times, estimate.curve))
    peak_index = estimate.nodes.index(estimate.peak_node) if estimate.peak_node in estimate.nodes else 0
    step = max(1, len(points) // _CURVE_POINTS)
    kept = sorted(set(range(0, len(points), step)) | {peak_index, len(points) - 1} if points else set())
    traced = record.memory_traced
    budget, why = record.memory_budget.num_bytes, record.memory_budget.why
    return {
        "peak_bytes": estimate.peak_bytes,
        "peak_node": estimate.peak_node,
        "peak_us": times[peak_index] if times else 0.0,
        "held_bytes": estimate.held_bytes,
        "by_kind": dict(estimate.by_kind),
        "at_peak": [{"name": t.name, "bytes": t.bytes, "kind": t.kind} for t in estimate.at_peak[:10]],
        "traced_peak_bytes": traced.peak_bytes if traced is not None else None,
        "budget_bytes": budget,
        "budget_why": why,
        "curve": [list(points[i]) for i in kept],
    }


def timeline_json(record: CompiledGraph) -> dict[str, Any] | None:
    """One graph's simulated run (:func:`dtcompile.cost.simulate.simulate`) as JSON data, after the
    passes and before them: per run its total, compute and exposed communication time, and
    its bars as ``[lane, name, start_us, end_us, nodes]`` (lanes ``compute``, ``comm``,
    ``exposed``; back-to-back compute is one bar)."""
    if record.timeline is None:
        return None
    runs = {"after": record.timeline, "before": record.timeline_traced}
    return {
        when: {
            "total_us": round(run.total_us, 3),
            "compute_us": round(run.compute_us, 3),
            "comm_us": round(run.comm_us, 3),
            "exposed_us": round(run.exposed_comm_us, 3),
            "spans": [[s.lane, s.name, round(s.start_us, 3), round(s.end_us, 3), s.nodes] for s in run.spans],
        }
        for when, run in runs.items()
        if run is not None
    }


def timeline_lines(record: CompiledGraph) -> list[str]:
    """The text report's timeline line of one graph: its simulated time, before the passes too."""
    data = timeline_json(record)
    if not data:
        return []

    def run(r: dict[str, Any]) -> str:
        return f"{r['total_us']:.4g} us ({r['compute_us']:.3g} compute, {r['exposed_us']:.3g} communication exposed)"

    before = f"; before the passes {run(data['before'])}" if "before" in data else ""
    return [f"{record.compile_id} {record.kind}: {run(data['after'])}{before}"]


def memory_lines(record: CompiledGraph) -> list[str]:
    """The text report's memory lines of one graph: its peak, before the passes, the budget."""
    estimate, traced = record.memory, record.memory_traced
    if estimate is None:
        return []
    budget, why = record.memory_budget.num_bytes, record.memory_budget.why
    before = f"; {format_bytes(traced.peak_bytes)} before the passes" if traced is not None else ""
    kept = f"; budget {format_bytes(budget)} ({why})" if budget else ""
    return [
        f"{record.compile_id} {record.kind}: {estimate}{before}{kept}",
        f"  alive at the peak: {estimate.largest()}",
    ]


def _artifact(name: str, encoding: str, payload: Callable[[], str]) -> None:
    # The rank that logs it: ranks run as threads of one process share one log, which
    # torch names for one of them; dtcompile-report splits the log by this.
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding, **_rank()}, payload_fn=payload
    )


def _rank() -> dict[str, Any]:
    """``{"rank": r, "world": backend}``: this rank (this thread's, for ranks run as threads)
    and its process group's backend (``threaded``, ``fake``, ``gloo``...); nothing outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world": str(dist.get_backend())}
    return {}


def _artifacts(record: CompiledGraph) -> list[tuple[str, str, Callable[[], str]]]:
    """One AOT graph's artifacts as ``(name, encoding, payload)``, the payload made when asked."""
    artifacts = [
        (Artifact.PLACEMENTS, "string", record.info.format),
        (Artifact.graph(record.kind), "string", record.annotated),
        (Artifact.collectives(record.kind), "json", lambda: json.dumps(collectives_json(record))),
    ]
    if record.regions:
        artifacts.append((Artifact.regions(record.kind), "string", lambda: record.with_regions))
    return artifacts


def emit_artifacts(record: CompiledGraph) -> None:
    """Log one AOT graph's annotations as ``TORCH_TRACE`` artifacts (no-ops without TORCH_TRACE)."""
    for name, encoding, payload in _artifacts(record):
        _artifact(name, encoding, payload)


def keep_artifacts(record: CompiledGraph, kept: dict[str, list[str]]) -> None:
    """Adds one AOT graph's artifacts, made now, to ``kept`` (name -> ``[name, encoding, payload]``),
    what a Dynamo graph keeps beside the compile cache (:mod:`dtcompile.base.beside_cache`) for
    :func:`emit_saved_artifacts`; the placements, the same for each of its AOT graphs, once."""
    for name, encoding, payload in _artifacts(record):
        if name not in kept:
            kept[name] = [name, encoding, payload()]


def compile_seconds_json(record: CompiledGraph) -> dict[str, Any]:
    """One graph's compile seconds per stage (:attr:`~dtcompile.records.CompiledGraph.stages`)
    as JSON data: ``{"compile_id", "kind", "stages": {stage: seconds}, "total"}``, the
    stages in their order, those it did not go through left out."""
    return {
        "compile_id": record.compile_id,
        "kind": record.kind,
        "stages": {stage.value: round(seconds, 6) for stage, seconds in record.stages.items()},
        "total": round(record.stages.total, 6),
    }


def emit_compile_seconds(record: CompiledGraph) -> None:
    """Log one graph's compile seconds as they stand (``dtcompile_<kind>_compile_seconds``)."""
    _artifact(Artifact.compile_seconds(record.kind), "json", lambda: json.dumps(compile_seconds_json(record)))


def compile_seconds_table(records: Sequence[CompiledGraph]) -> list[str]:
    """The text report's compile seconds: one row per graph (its compile id and kind, the
    seconds of each stage, ``-`` where it did not go through it, and their total), a
    column per stage some graph went through, in the stages' order."""
    stages = [stage for stage in Stage if any(stage in record.stages for record in records)]
    columns = [(str(stage), max(len(str(stage)), 7)) for stage in stages] + [("total", 7)]
    lines = [f"{'graph':<14} " + " ".join(f"{name:>{width}}" for name, width in columns)]
    for record in records:
        seconds = [record.stages.get(stage) for stage in stages] + [record.stages.total]
        cells = ["-" if s is None else f"{s:.3f}" for s in seconds]
        lines.append(f"{f'{record.compile_id} {record.kind}':<14} " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, columns)))
    return lines


def emit_saved_artifacts(saved: Sequence[Sequence[str]]) -> None:
    """Log again what :func:`keep_artifacts` kept, for a graph the compile cache served."""
    for name, encoding, payload in saved:
        _artifact(name, encoding, functools.partial(str, payload))


def emit_fallback_artifact(fallback: EagerFallback) -> None:
    """Log a graph run eagerly (``dtcompile_eager_fallback``: why, and the Dynamo graph)."""
    _with_dynamo_graph(Artifact.EAGER_FALLBACK, fallback)


def emit_cached_artifact(cached: CachedCompile) -> None:
    """Log a graph AOTAutograd's cache served (``dtcompile_cached_compile``: that, and the Dynamo graph)."""
    _with_dynamo_graph(Artifact.CACHED_COMPILE, cached)


def _with_dynamo_graph(name: str, note: EagerFallback | CachedCompile) -> None:
    """An artifact of what happened to a Dynamo graph that was not compiled here, then the graph."""
    _artifact(name, "string", lambda: f"{note}\n\n{note.graph.print_readable(print_output=False)}")


def collective_table(records: list[CompiledGraph]) -> list[str]:
    """One line per collective and a total per graph kind; a data-dependent one's bytes
    read ``data-dependent`` (see :func:`collectives_json`)."""
    lines = [f"{'graph':<14} {'op':<15} {'axis':<6} {'group':>5} {'bytes':>14} {'est. us':>9}"]
    totals: dict[str, list[float]] = {}
    for record in records:
        data = collectives_json(record)
        for c in data["collectives"]:
            graph = f"{record.compile_id} {record.kind}"
            num_bytes = "data-dependent" if c["data_dependent"] else c["bytes"]
            lines.append(f"{graph:<14} {c['op']:<15} {c['axis']:<6} {c['group_size']:>5} {num_bytes:>14} {c['estimated_us']:>9.1f}")
        total = totals.setdefault(record.kind, [0, 0, 0, 0.0])
        total[0] += data["totals"]["count"]
        total[1] += data["totals"]["bytes"]
        total[2] += data["totals"]["data_dependent"]
        total[3] += data["totals"]["estimated_us"]
    for kind, (count, num_bytes, data_dependent, us) in totals.items():
        unknown = f" and {data_dependent} data-dependent" if data_dependent else ""
        lines.append(f"total {kind}: {count} collectives, {num_bytes} B per rank{unknown}, ~{us:.1f} us")
    return lines


def format_compiled_graph(record: CompiledGraph) -> str:
    """The report section of one AOT graph (used by the ``report=True`` option)."""
    profile = record.info.profile
    return "\n".join(
        [
            f"== dtcompile {record.compile_id} {record.kind} (cost profile {profile.name}: {record.info.profile_why}) ==",
            # A whole-step graph has no Dynamo graph: its nodes say which part of the step they are.
            *(["-- DTensor placements (Dynamo graph) --", record.info.format()] if record.kind != GraphKind.STEP else []),
            f"-- {record.kind} graph --",
            record.annotated(),
            *region_lines(record, "-- local_map regions (one op each until lowering) --"),
            "-- passes --",
            *pass_lines(record),
            "-- memory (estimated, per rank) --",
            *memory_lines(record),
            f"-- timeline (simulated on {profile.name}) --",
            *timeline_lines(record),
            "-- collectives --",
            *collective_table([record]),
        ]
    )


def region_lines(record: CompiledGraph, title: str) -> list[str]:
    return [title, *map(str, record.regions)] if record.regions else []


def pass_lines(record: CompiledGraph) -> list[str]:
    """The text report's lines of one graph's passes: per pass what it did to the nodes and
    collectives and how long it took, then its decisions."""
    lines = []
    for p in record.passes:
        summary = f"nodes {p.nodes_before} -> {p.nodes_after}, collectives {p.collectives_before} -> {p.collectives_after}"
        took = f", {p.seconds * 1e3:.2f} ms" if p.seconds else ""
        lines.append(f"{p.name}: " + (summary + took if p.ran else "switched off"))
        lines += [f"  {decision}" for decision in p.decisions]
    return lines
