"""What ``dtcompile-report`` draws: inline SVG pictures of one graph (its memory curve, its
simulated timeline) and the events of a measured trace put beside the predicted ones."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["measured_events", "memory_svg", "mib", "timeline_svg"]


def mib(num: float) -> str:
    return f"{num / (1 << 20):.3g} MiB" if num >= 1 << 20 else f"{num / 1024:.3g} KiB" if num >= 1024 else f"{num:.0f} B"


def memory_svg(kind: str, memory: dict[str, Any], width: int = 640, height: int = 160) -> str:
    """One graph's estimated live bytes over its estimated compute time, as an inline SVG:
    the curve, its peak marked and named, the peak before the passes (dotted) and the
    budget the passes kept to (dashed)."""
    curve = memory.get("curve") or []
    if not curve:
        return ""
    top = max([b for _, b in curve] + [memory.get("budget_bytes") or 0, memory.get("traced_peak_bytes") or 0]) or 1
    end = curve[-1][0] or 1
    pad = 4

    def x(us: float) -> float:
        return pad + (width - 2 * pad) * us / end

    def y(num: float) -> float:
        return height - pad - (height - 2 * pad) * num / top

    points = " ".join(f"{x(us):.1f},{y(b):.1f}" for us, b in curve)
    lines = [f'<polyline fill="none" stroke="#0969da" stroke-width="1.5" points="{points}"/>']
    for value, style, label in (
        (memory.get("budget_bytes"), "6,3", "budget"),
        (memory.get("traced_peak_bytes"), "2,2", "before the passes"),
    ):
        if value:
            lines.append(
                f'<line x1="{pad}" x2="{width - pad}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#888" '
                f'stroke-dasharray="{style}"><title>{label}: {mib(value)}</title></line>'
            )
    px, py = x(memory["peak_us"]), y(memory["peak_bytes"])
    peak = f"peak {mib(memory['peak_bytes'])} at {memory['peak_node']}"
    lines.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#cf222e"><title>{html.escape(peak)}</title></circle>')
    anchor = "end" if px > width / 2 else "start"
    lines.append(f'<text x="{px:.1f}" y="{max(py - 6, 12):.1f}" font-size="11" text-anchor="{anchor}">{html.escape(peak)}</text>')
    return (
        f'<figure><svg class="memory" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(kind)} memory">{"".join(lines)}</svg>'
        f"<figcaption>{html.escape(kind)}: live bytes (estimated) over estimated compute time, "
        f"0 to {end:.0f} us; dashed: budget, dotted: peak before the passes</figcaption></figure>"
    )


_LANE_COLOURS = {"compute": "#2da44e", "comm": "#0969da", "exposed": "#cf222e"}


def timeline_svg(kind: str, timeline: dict[str, Any], width: int = 640) -> str:
    """One graph's simulated run as an inline SVG, before the passes (when logged) above after
    them, on one time scale: per run a compute lane (compute green, the compute stream
    waiting for communication red) and a communication lane (each collective a blue bar)."""
    runs = [(when, timeline[when]) for when in ("before", "after") if when in timeline]
    if not runs:
        return ""
    end = max(run["total_us"] for _, run in runs) or 1.0
    label, lane_h, gap, pad = 150, 14, 4, 4
    run_h = 2 * (lane_h + gap) + 10
    height = len(runs) * run_h + 16

    def x(us: float) -> float:
        return label + (width - label - pad) * us / end

    items = []
    for i, (when, run) in enumerate(runs):
        top = i * run_h + 4
        title = f"{when} the passes: {run['total_us']:.1f} us, {run['exposed_us']:.1f} exposed"
        items.append(f'<text x="0" y="{top + lane_h - 3}" font-size="11">{html.escape(when)} the passes</text>')
        items.append(f'<text x="0" y="{top + 2 * lane_h + gap - 3}" font-size="10" fill="#555">{run["total_us"]:.3g} us, {run["exposed_us"]:.3g} exposed</text>')
        for lane, name, start, stop, nodes in run["spans"]:
            row = top if lane != "comm" else top + lane_h + gap
            w = max(x(stop) - x(start), 0.5)
            what = {"compute": f"compute, {nodes} node(s)", "comm": "collective", "exposed": "waiting for communication"}[lane]
            tip = f"{name}: {what}, {start:.1f} to {stop:.1f} us"
            items.append(
                f'<rect class="{lane}" x="{x(start):.1f}" y="{row}" width="{w:.1f}" height="{lane_h}" '
                f'fill="{_LANE_COLOURS[lane]}"><title>{html.escape(tip)}</title></rect>'
            )
        items.append(f"<title>{html.escape(title)}</title>")
    axis_y = len(runs) * run_h + 12
    items.append(f'<text x="{label}" y="{axis_y}" font-size="10" fill="#555">0 us</text>')
    items.append(f'<text x="{width - pad}" y="{axis_y}" font-size="10" fill="#555" text-anchor="end">{end:.3g} us</text>')
    return (
        f'<figure><svg class="timeline" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(kind)} timeline">{"".join(items)}</svg>'
        f"<figcaption>{html.escape(kind)}: simulated on the graph's cost profile; per run, top lane compute "
        "(green; red where it waits for communication), bottom lane the collectives (blue)</figcaption></figure>"
    )


def measured_events(measured: dict[str, Any] | list[Any], first_pid: int) -> list[dict[str, Any]]:
    """A torch.profiler Chrome trace's events, its processes renumbered after ours and named
    ``measured: ...``; a file that is not a trace-event file is a ValueError."""
    raw = measured.get("traceEvents") if isinstance(measured, dict) else measured
    if not isinstance(raw, list):
        raise ValueError("--measured: not a Chrome trace-event file (no traceEvents list); write one with prof.export_chrome_trace(PATH)")
    pids: dict[Any, int] = {}
    named: set[int] = set()
    out = []
    for event in raw:
        if not isinstance(event, dict) or "ph" not in event:
            continue
        event = dict(event)
        pid = pids.setdefault(event.get("pid", 0), first_pid + len(pids))
        original = event.get("pid", 0)
        event["pid"] = pid
        if event.get("ph") == "M" and event.get("name") == "process_name":
            event["args"] = {"name": f"measured: {event.get('args', {}).get('name', original)}"}
            named.add(pid)
        out.append(event)
    for original, pid in pids.items():
        if pid not in named:
            out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"measured: process {original}"}})
    return out
