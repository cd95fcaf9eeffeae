"""``dtcompile-report TRACE_DIR -o OUT``: a self-contained HTML report from a ``TORCH_TRACE`` directory.

Reads the structured logs that ``TORCH_TRACE=TRACE_DIR`` writes (one file per
rank), keeps what dtcompile logged (``dtcompile_*`` artifacts, see
:mod:`dtcompile.artifacts`) and what Dynamo logged about graph breaks and
recompiles, and writes ``OUT/index.html``: the graphs run eagerly because
torch could not trace them (``eager_fallback``); the graphs AOTAutograd's
cache served (compiled by an earlier run, whose sections are logged again from
what it kept beside the cache); the ``dtcompile.auto_parallel``
solutions planned (each node's placements and cost); per compile id the DTensor
placements, the annotated forward and backward graphs and the collective
schedule; each graph's simulated timeline before and after the passes (a compute
and a communication lane, the compute stream's waits marked) and its estimated
memory over its schedule (the curve with its peak marked, the budget the passes
kept to, what is alive at the peak); communication bytes and estimated time per
step; a check that every rank issues the same collectives in the same order, by
the ranks' check's rule (:mod:`dtcompile.ranks.pairing`; a rank that differs would
hang a real job); per compile the seconds of each graph's compile per stage
(Dynamo, AOTAutograd, the passes, Inductor...: ``dtcompile_<kind>_compile_seconds``);
graph breaks and recompile reasons.  No scripts, no network: the file opens
anywhere.  ``--perfetto OUT.json`` also writes the timelines as a Chrome
trace-event file for Perfetto (:func:`perfetto_trace`), beside a torch.profiler
trace of the same step with ``--measured``.

The logs are read by :func:`read_trace` (:mod:`dtcompile_tools.trace_log`, which says
their format): a log whose program was killed ends mid-entry, and that last entry is
left out, with a warning naming file:line, and the rest is reported.  A trace with no
dtcompile artifacts (a program compiled with another backend) is refused: there would
be nothing to report.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from dtcompile.base.channels import Artifact, GraphKind
from dtcompile.base.notation import format_bytes
from dtcompile.ranks.pairing import Scheduled, scheduled_from_artifact
from dtcompile.records import Stage
from dtcompile_tools.pictures import measured_events, memory_svg, timeline_svg
from dtcompile_tools.trace_log import CompileRecord, Trace, TraceError, read_trace
from dtcompile_tools.trace_log import RankTrace as RankTrace  # what a Trace holds per rank, for those who build one

__all__ = ["Trace", "TraceError", "main", "perfetto_trace", "read_trace", "render_html"]


def _schedule_on_axes(record: CompileRecord) -> dict[str, tuple[Scheduled, ...]]:
    """A compile's collectives by mesh axis, as the ranks' check compares them (an all-to-all's
    and a data-dependent collective's sizes are each rank's own: :mod:`dtcompile.ranks.pairing`)."""
    on_axes: dict[str, tuple[Scheduled, ...]] = defaultdict(tuple)
    for kind, data in sorted(record.collectives.items()):
        for c in scheduled_from_artifact(kind, data["collectives"]):
            on_axes[c.axis] += (c,)
    return on_axes


def divergence(trace: Trace) -> list[str]:
    """Compile ids where some rank's collectives on a mesh axis differ from the lowest rank's."""
    problems, ranks = [], sorted(trace.ranks)
    first = trace.ranks[ranks[0]]
    for rank in ranks[1:]:
        other = trace.ranks[rank]
        for cid in sorted(set(first.compiles) | set(other.compiles)):
            ours, theirs = (_schedule_on_axes(r.compiles.get(cid, CompileRecord())) for r in (first, other))
            differ = sorted(axis for axis in set(ours) | set(theirs) if ours.get(axis) != theirs.get(axis))
            if differ:
                problems.append(f"compile {cid}: rank {rank}'s collectives on {', '.join(differ)} differ from rank {ranks[0]}'s")
    return problems


def _totals(record: CompileRecord) -> tuple[int, int, int, float]:
    """Collectives, their bytes, how many of them are data-dependent (bytes not counted), est. us."""
    count = sum(d["totals"]["count"] for d in record.collectives.values())
    num_bytes = sum(d["totals"]["bytes"] for d in record.collectives.values())
    # Traces written before dtcompile marked data-dependent collectives have no such key.
    data_dependent = sum(d["totals"].get("data_dependent", 0) for d in record.collectives.values())
    us = sum(d["totals"]["estimated_us"] for d in record.collectives.values())
    return count, num_bytes, data_dependent, us


def _shape_and_bytes(collective: dict[str, Any]) -> tuple[str, Any]:
    """A data-dependent collective's shape and bytes are estimates: no shape, bytes ``data-dependent``."""
    if collective.get("data_dependent"):
        return "", "data-dependent"
    return "x".join(map(str, collective["shape"])), collective["bytes"]


def _compile_seconds_table(record: CompileRecord) -> str:
    """A compile's graphs' seconds per stage, a column per stage one of them went through,
    in the stages' order, and their total (the text report's ``== compile seconds ==``)."""
    order = [stage.value for stage in Stage]
    logged = {name for data in record.seconds.values() for name in data["stages"]}
    # A stage this dtcompile does not know (a newer one's trace) goes last.
    stages = [name for name in order if name in logged] + sorted(logged - set(order))
    rows = [
        [kind, *(f"{data['stages'][name]:.3f}" if name in data["stages"] else "" for name in stages), f"{data['total']:.3f}"]
        for kind, data in record.seconds.items()
    ]
    return _table(["graph", *stages, "total"], rows)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
th { background: #eee; } td.n, th.n { text-align: right; white-space: nowrap; } td { white-space: pre-line; }
figcaption { font-size: 0.85em; color: #57606a; }
.ok { color: #1a7f37; } .bad { color: #cf222e; font-weight: bold; }
"""


_NUMBER = re.compile(r"[-+~]?[\d.,]+(?:e[-+]?\d+)?(?: ?[A-Za-z]{1,3})?(?: -> [\d.,]+)?")


def _table(header: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """Prose left-aligned, numbers (a count, ``512 B``, ``10.2``) right-aligned; the first ``left``
    columns name the row, left-aligned whatever they hold."""
    numeric = [i >= left and rows and all(_NUMBER.fullmatch(str(row[i])) for row in rows if str(row[i]))
               for i in range(len(header))]

    def cell(tag: str, i: int, value: Any) -> str:
        cls = ' class="n"' if numeric[i] else ""
        return f"<{tag}{cls}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(trace: Trace, title: str = "dtcompile report", depyf_files: list[str] | None = None) -> str:
    """The report as one HTML document (rank 0's graphs; every rank in the checks and totals)."""
    ranks = sorted(trace.ranks)
    lead = trace.ranks[ranks[0]]
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>{html.escape(title)}</h1><p>ranks: {', '.join(map(str, ranks))}; compile ids: {len(lead.compiles)}</p>")
    if trace.warnings:
        parts.append('<section id="warnings"><h2>Left out of this report</h2><ul>')
        parts += [f'<li class="bad">{html.escape(w)}</li>' for w in trace.warnings]
        parts.append("</ul></section>")

    parts.append('<section id="summary"><h2>Communication per step</h2>')
    rows = []
    for rank in ranks:
        records = trace.ranks[rank].compiles.values()
        totals = [_totals(r) for r in records]
        count = sum(t[0] for t in totals)
        num_bytes: Any = sum(t[1] for t in totals)
        data_dependent = sum(t[2] for t in totals)
        us = sum(t[3] for t in totals)
        if data_dependent:
            num_bytes = f"{num_bytes} and {data_dependent} data-dependent"
        rows.append([f"rank {rank}", count, num_bytes, f"{us:.1f}"])
    parts.append(_table(["rank", "collectives", "bytes per rank", "estimated us"], rows))
    parts.append("</section>")

    parts.append('<section id="memory-summary"><h2>Memory per step (estimated peak per graph)</h2>')
    rows = [
        [f"rank {rank}", f"{cid} {kind}", format_bytes(data["memory"]["peak_bytes"]), data["memory"]["peak_node"],
         format_bytes(data["memory"]["traced_peak_bytes"] or 0), format_bytes(data["memory"]["budget_bytes"] or 0)]
        for rank in ranks
        for cid, record in sorted(trace.ranks[rank].compiles.items())
        for kind, data in record.collectives.items()
        if data.get("memory")
    ]
    parts.append(_table(["rank", "graph", "peak", "at", "before the passes", "budget"], rows, left=2) if rows else "<p>none</p>")
    parts.append("</section>")

    problems = divergence(trace)
    parts.append('<section id="divergence"><h2>Collective schedule across ranks</h2>')
    if len(ranks) == 1:
        parts.append("<p>one rank in the trace: nothing to compare</p>")
    elif problems:
        parts.append("<ul>" + "".join(f'<li class="bad">{html.escape(p)}</li>' for p in problems) + "</ul>")
    else:
        parts.append(f'<p class="ok">all {len(ranks)} ranks issue the same collectives in the same order</p>')
    parts.append("</section>")

    if lead.fallbacks:
        parts.append('<section id="eager-fallbacks"><h2>Graphs run eagerly (not compiled)</h2>')
        parts += [f'<pre class="bad">{html.escape(text)}</pre>' for text in lead.fallbacks]
        parts.append("</section>")

    if lead.cached:
        parts.append('<section id="cached-compiles"><h2>Graphs served by the compile cache (compiled by an earlier run)</h2>')
        parts.append(
            "<p>AOTAutograd's cache served these graphs: dtcompile compiled them in an earlier run with the same "
            "source and options. Their sections below were logged again from what that run kept beside the cache; "
            "where a graph says that is gone, trace a run with an empty TORCHINDUCTOR_CACHE_DIR, or compile with "
            "dtcompile.backend(aot_cache=False), to see it.</p>"
        )
        parts += [f"<pre>{html.escape(text)}</pre>" for text in lead.cached]
        parts.append("</section>")

    if lead.plans:
        parts.append('<section id="auto-parallel"><h2>Auto-parallel plans</h2>')
        parts += [f"<pre>{html.escape(plan)}</pre>" for plan in lead.plans]
        parts.append("</section>")

    for cid, record in sorted(lead.compiles.items()):
        anchor = re.sub(r"[^0-9A-Za-z]", "_", cid)
        parts.append(f'<section class="compile" id="compile-{anchor}"><h2>Compile {html.escape(cid)}</h2>')
        parts.append(f"<h3>DTensor placements</h3><pre>{html.escape(record.placements)}</pre>")
        for kind, text in record.graphs.items():
            parts.append(f"<h3>{html.escape(kind)} graph</h3><pre>{html.escape(text)}</pre>")
        rows = [
            [kind, c["op"], c["axis"], c["group_size"], *_shape_and_bytes(c), f"{c['estimated_us']:.1f}"]
            for kind, data in record.collectives.items()
            for c in data["collectives"]
        ]
        profiles = sorted({(d["cost_profile"], d.get("cost_profile_why", "")) for d in record.collectives.values() if "cost_profile" in d})
        for name, why in profiles:
            parts.append(f'<p class="profile">Priced with cost profile <b>{html.escape(name)}</b> ({html.escape(why)})</p>')
        parts.append("<h3>Collectives</h3>" + (_table(["graph", "op", "axis", "group", "shape", "bytes", "est. us"], rows, left=3) if rows else "<p>none</p>"))
        passes = [
            [
                kind,
                p["name"],
                "yes" if p["ran"] else "switched off",
                "{} -> {}".format(*p["nodes"]),
                "{} -> {}".format(*p["collectives"]),
                f"{p['seconds'] * 1e3:.2f}" if p.get("seconds") else "",
                "\n".join(p.get("decisions", [])),
            ]
            for kind, data in record.collectives.items()
            for p in data.get("passes", [])
        ]
        if passes:
            header = ["graph", "pass", "ran", "nodes", "collectives", "ms", "decisions"]
            parts.append("<h3>Passes</h3>" + _table(header, passes, left=2))
        if record.seconds:
            parts.append("<h3>Compile seconds</h3>" + _compile_seconds_table(record))
        timelines = [(kind, data["timeline"]) for kind, data in record.collectives.items() if data.get("timeline")]
        if timelines:
            parts.append("<h3>Timeline (simulated)</h3>")
            parts += [timeline_svg(kind, timeline) for kind, timeline in timelines]
        memories = [(kind, data["memory"]) for kind, data in record.collectives.items() if data.get("memory")]
        if memories:
            parts.append("<h3>Memory</h3>")
            for kind, memory in memories:
                parts.append(memory_svg(kind, memory))
                alive = [[a["name"], a["kind"], format_bytes(a["bytes"])] for a in memory.get("at_peak", [])]
                parts.append(f"<p>{html.escape(kind)}: alive at the peak (largest first)</p>" + _table(["tensor", "kind", "bytes"], alive, left=2))
        parts.append("</section>")

    for section, title_text, items in (
        ("graph-breaks", "Graph breaks", [b for r in ranks for b in trace.ranks[r].graph_breaks]),
        ("recompiles", "Recompiles", [b for r in ranks for b in trace.ranks[r].recompiles]),
    ):
        parts.append(f'<section id="{section}"><h2>{title_text}</h2>')
        parts.append("<ul>" + "".join(f"<li><pre>{html.escape(i)}</pre></li>" for i in items) + "</ul>" if items else "<p>none</p>")
        parts.append("</section>")
    if depyf_files is not None:
        parts.append('<section id="depyf"><h2>Decompiled Dynamo bytecode (depyf)</h2><ul>')
        parts += [f'<li><a href="depyf/{html.escape(name)}">{html.escape(name)}</a></li>' for name in depyf_files]
        parts.append("</ul></section>")
    parts.append("</body></html>")
    return "\n".join(parts)


_TIDS = {"compute": 1, "exposed": 1, "comm": 2}


def perfetto_trace(trace: Trace, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The simulated timelines as a Chrome trace-event file, which Perfetto (ui.perfetto.dev)
    and chrome://tracing open: per rank, graph and run (before or after the passes) one
    process, with a compute thread (waits for communication named ``exposed: <node>``) and a
    communication thread, each bar a complete (``X``) event in microseconds.  ``measured``, a
    torch.profiler Chrome trace of the same step (``prof.export_chrome_trace``), is put beside
    them, its processes renamed ``measured: ...``: predicted against measured."""
    events: list[dict[str, Any]] = []

    def name(pid: int, what: str, text: str, tid: int = 0) -> None:
        events.append({"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {"name": text}})

    pid = 0
    for rank in sorted(trace.ranks):
        for cid, record in sorted(trace.ranks[rank].compiles.items()):
            for kind, data in record.collectives.items():
                for when, run in (data.get("timeline") or {}).items():
                    pid += 1
                    name(pid, "process_name", f"rank {rank} compile {cid} {kind} ({when} the passes, predicted)")
                    events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
                    name(pid, "thread_name", "compute", _TIDS["compute"])
                    name(pid, "thread_name", "communication", _TIDS["comm"])
                    for lane, node, start, stop, nodes in run["spans"]:
                        events.append({
                            "name": f"exposed: {node}" if lane == "exposed" else node,
                            "cat": lane,
                            "ph": "X",
                            "ts": start,
                            "dur": round(stop - start, 3),
                            "pid": pid,
                            "tid": _TIDS[lane],
                            "args": {"nodes": nodes},
                        })
    if measured is not None:
        try:
            events += measured_events(measured, first_pid=pid + 1)
        except ValueError as err:
            raise TraceError(str(err)) from None
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"source": "dtcompile-report"}}


def _depyf_files(dump_dir: str) -> list[str]:
    path = Path(dump_dir)
    files = sorted(p.name for p in path.glob("*.py")) if path.is_dir() else []
    if not files:
        raise TraceError(f"{path}: no depyf dump (*.py files); make one with dtcompile.explain(..., depyf_dir={str(path)!r})")
    return files


def _read_measured(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as err:
        raise TraceError(f"--measured {path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise TraceError(f"--measured {path}: not JSON ({err.msg}); pass a torch.profiler Chrome trace") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtcompile-report", description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", help="the directory TORCH_TRACE pointed at (one log per rank)")
    parser.add_argument("-o", "--out", default="dtcompile_report", help="output directory (index.html is written there)")
    parser.add_argument(
        "--depyf",
        metavar="DUMP_DIR",
        help="a depyf dump of the same run (dtcompile.explain(..., depyf_dir=DUMP_DIR)); "
        "its decompiled code is copied to OUT/depyf and listed in the report",
    )
    parser.add_argument(
        "--perfetto",
        metavar="OUT_JSON",
        help="also write the simulated timelines as a Chrome trace-event file (open it in ui.perfetto.dev)",
    )
    parser.add_argument(
        "--measured",
        metavar="PROFILER_JSON",
        help="with --perfetto: a torch.profiler Chrome trace of the same step (prof.export_chrome_trace), "
        "put beside the predicted timelines",
    )
    args = parser.parse_args(argv)
    if args.measured and not args.perfetto:
        parser.error("--measured goes beside the predicted timelines of --perfetto: pass --perfetto OUT_JSON too")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(
            f"-o {out}: is a file; -o names the directory that index.html is written into: "
            "pass a directory (it is created if missing)"
        )
    try:
        trace = read_trace(args.trace_dir)
        depyf_files = _depyf_files(args.depyf) if args.depyf else None
        measured = _read_measured(args.measured) if args.measured else None
        timelines = perfetto_trace(trace, measured) if args.perfetto else None
    except TraceError as err:
        print(f"dtcompile-report: {err}", file=sys.stderr)
        return 2
    for warning in trace.warnings:
        print(f"dtcompile-report: warning: {warning}", file=sys.stderr)
    if not any(rank.compiles or rank.plans or rank.fallbacks or rank.cached for rank in trace.ranks.values()):
        print(
            f"dtcompile-report: {args.trace_dir}: no dtcompile artifacts ({Artifact.PLACEMENTS}, "
            f"{Artifact.graph(GraphKind.FORWARD)}, {Artifact.collectives(GraphKind.FORWARD)}, "
            f"{Artifact.AUTO_PARALLEL_SOLUTION}, {Artifact.EAGER_FALLBACK}, {Artifact.CACHED_COMPILE}...) "
            "in the trace: the program was not "
            'compiled with dtcompile; compile it with torch.compile(..., backend="dtcompile") '
            "and run it again with TORCH_TRACE set",
            file=sys.stderr,
        )
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"-o {out}: cannot create the directory ({err.strerror or err}); pass a directory that can be created")
    if depyf_files is not None:
        (out / "depyf").mkdir(exist_ok=True)
        for name in depyf_files:
            shutil.copy(Path(args.depyf) / name, out / "depyf" / name)
    (out / "index.html").write_text(render_html(trace, depyf_files=depyf_files))
    print(f"dtcompile-report: wrote {out / 'index.html'} ({len(trace.ranks)} rank(s))")
    if timelines is not None:
        Path(args.perfetto).write_text(json.dumps(timelines))
        print(f"dtcompile-report: wrote {args.perfetto} ({len(timelines['traceEvents'])} trace events)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
