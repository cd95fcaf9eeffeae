"""What ``dtcompile-report`` draws: inline SVG pictures of one graph (its memory curve, its
simulated timeline) and the events of a measured trace put beside the predicted ones."""

from __future__ import annotations

import html
import math
from typing import Any

from dtcompile.base.notation import BYTE_UNITS, format_bytes

__all__ = ["byte_ticks", "measured_events", "memory_svg", "ticks", "time_text", "timeline_svg"]


def byte_ticks(top: float, count: int = 4) -> list[tuple[float, str]]:
    """Round byte values from 0 to ``top`` in one unit, with their labels: ``0``, ``256 MiB``..."""
    unit, scale = next(((u, s) for u, s in BYTE_UNITS if top >= 2 * s), ("B", 1))
    return [(value * scale, f"{value:g} {unit}" if value else "0") for value in ticks(top / scale, count)]


def time_text(us: float) -> str:
    """A time on an axis or a label: ``0``, ``250 ns``, ``12 us``, ``1.5 ms``, ``2 s``."""
    size = abs(us)
    if size == 0:
        return "0"
    for unit, scale in (("s", 1e6), ("ms", 1e3), ("us", 1.0)):
        if size >= scale:
            return f"{us / scale:.3g} {unit}"
    return f"{us * 1e3:.3g} ns"


def ticks(end: float, count: int = 5) -> list[float]:
    """About ``count`` round values from 0 to ``end`` (steps of 1, 2 or 5 times a power of ten)."""
    if end <= 0:
        return [0.0]
    raw = end / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(end / step + 1e-9) + 1)]


def _legend(entries: list[tuple[str, str, str]], x: float, y: float) -> str:
    """``(kind, colour or dash pattern, text)`` entries in a row: a swatch and its words each."""
    items = []
    for kind, style, text in entries:
        if kind == "box":
            items.append(f'<rect x="{x:.0f}" y="{y - 9:.0f}" width="10" height="10" fill="{style}"/>')
        else:
            items.append(f'<line x1="{x:.0f}" x2="{x + 14:.0f}" y1="{y - 4:.0f}" y2="{y - 4:.0f}" stroke="{_INK}" '
                         f'stroke-width="1.5" stroke-dasharray="{style}"/>')
        items.append(f'<text x="{x + 16:.0f}" y="{y:.0f}" font-size="11">{html.escape(text)}</text>')
        x += 22 + 6.2 * len(text)
    return "".join(items)


def _time_axis(left: float, right: float, top: float, bottom: float, end: float) -> str:
    """Gridlines and labels of a time axis from 0 to ``end`` us across ``left``..``right``."""
    parts = []
    for value in ticks(end):
        x = left + (right - left) * value / end
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.0f}" y2="{bottom:.0f}" stroke="#d0d7de"/>')
        anchor = "start" if value == 0 else "middle"
        parts.append(f'<text x="{x:.1f}" y="{bottom + 12:.0f}" font-size="10" fill="{_GREY}" text-anchor="{anchor}">'
                     f"{time_text(value)}</text>")
    return "".join(parts)


_INK, _GREY = "#24292f", "#57606a"


def memory_svg(kind: str, memory: dict[str, Any], width: int = 720, height: int = 200) -> str:
    """One graph's estimated live bytes over its estimated compute time, as an inline SVG:
    byte and time axes with round ticks, the curve, its peak marked and named, the peak
    before the passes (dotted) and the budget the passes kept to (dashed), and a legend."""
    curve = memory.get("curve") or []
    if not curve:
        return ""
    top = max([b for _, b in curve] + [memory.get("budget_bytes") or 0, memory.get("traced_peak_bytes") or 0]) or 1
    top *= 1.1  # room above the highest line for the peak's words
    end = curve[-1][0] or 1
    left, right, upper, lower = 72, width - 8, 22, height - 18

    def x(us: float) -> float:
        return left + (right - left) * us / end

    def y(num: float) -> float:
        return lower - (lower - upper) * num / top

    parts = [_time_axis(left, right, upper, lower, end)]
    for value, text in byte_ticks(top):
        parts.append(f'<line x1="{left}" x2="{right}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#eaeef2"/>')
        parts.append(f'<text x="{left - 4}" y="{y(value) + 3:.1f}" font-size="10" fill="{_GREY}" text-anchor="end">'
                     f"{text}</text>")
    points = " ".join(f"{x(us):.1f},{y(b):.1f}" for us, b in curve)
    parts.append(f'<polyline fill="none" stroke="#0969da" stroke-width="1.5" points="{points}"/>')
    legend = [("box", "#0969da", "live bytes")]
    for value, style, label in (
        (memory.get("budget_bytes"), "6,3", "budget"),
        (memory.get("traced_peak_bytes"), "2,2", "peak before the passes"),
    ):
        if value:
            parts.append(
                f'<line x1="{left}" x2="{right}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="{_INK}" '
                f'stroke-dasharray="{style}"><title>{label}: {format_bytes(value)}</title></line>'
            )
            legend.append(("line", style, f"{label} {format_bytes(value)}"))
    px, py = x(memory["peak_us"]), y(memory["peak_bytes"])
    peak = f"peak {format_bytes(memory['peak_bytes'])} at {memory['peak_node']}"
    parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#cf222e"><title>{html.escape(peak)}</title></circle>')
    anchor = "end" if px > (left + right) / 2 else "start"
    parts.append(f'<text x="{px + (-6 if anchor == "end" else 6):.1f}" y="{max(py - 6, upper + 10):.1f}" font-size="11" '
                 f'text-anchor="{anchor}">{html.escape(peak)}</text>')
    parts.append(_legend(legend, left, 13))
    return (
        f'<figure><svg class="memory" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'style="max-width:100%;height:auto" role="img" aria-label="{html.escape(kind)} memory">{"".join(parts)}</svg>'
        f"<figcaption>{html.escape(kind)}: live bytes per rank (estimated) over the estimated compute time, "
        f"0 to {time_text(end)}</figcaption></figure>"
    )


_LANE_COLOURS = {"compute": "#2da44e", "comm": "#0969da", "exposed": "#cf222e"}
_LANE_WORDS = {"compute": "compute", "exposed": "compute waits for communication", "comm": "collective"}


def timeline_svg(kind: str, timeline: dict[str, Any], width: int = 720) -> str:
    """One graph's simulated run as an inline SVG, before the passes (when logged) above after
    them, on one time axis with round ticks: per run a compute lane (compute green, the
    compute stream waiting for communication red) and a communication lane (each collective
    a blue bar); a bar wide enough carries its op's name, every bar a tooltip; a legend."""
    runs = [(when, timeline[when]) for when in ("before", "after") if when in timeline]
    if not runs:
        return ""
    end = max(run["total_us"] for _, run in runs) or 1.0
    label, lane_h, gap, right = 150, 16, 4, width - 8
    run_h = 2 * (lane_h + gap) + 12
    first = 22
    height = first + len(runs) * run_h + 18

    def x(us: float) -> float:
        return label + (right - label) * us / end

    items = [_time_axis(label, right, first - 4, first + len(runs) * run_h - 8, end)]
    for i, (when, run) in enumerate(runs):
        top = first + i * run_h
        items.append(f'<text x="0" y="{top + lane_h - 4}" font-size="11">{html.escape(when)} the passes</text>')
        items.append(f'<text x="0" y="{top + 2 * lane_h + gap - 4}" font-size="10" fill="{_GREY}">'
                     f'{time_text(run["total_us"])}, {time_text(run["exposed_us"])} exposed</text>')
        for lane, name, start, stop, nodes in run["spans"]:
            row = top if lane != "comm" else top + lane_h + gap
            w = max(x(stop) - x(start), 0.5)
            what = {"compute": f"compute, {nodes} node(s)", "comm": "collective", "exposed": "waiting for communication"}[lane]
            tip = f"{name}: {what}, {time_text(start)} to {time_text(stop)} ({time_text(stop - start)})"
            items.append(
                f'<rect class="{lane}" x="{x(start):.1f}" y="{row}" width="{w:.1f}" height="{lane_h}" '
                f'fill="{_LANE_COLOURS[lane]}"><title>{html.escape(tip)}</title></rect>'
            )
            if w >= 7 * len(name) + 6:  # the op's name fits inside the bar
                items.append(f'<text x="{x(start) + 3:.1f}" y="{row + lane_h - 4}" font-size="10" fill="#ffffff" '
                             f'pointer-events="none">{html.escape(name)}</text>')
    items.append(_legend([("box", _LANE_COLOURS[lane], words) for lane, words in _LANE_WORDS.items()], label, 13))
    return (
        f'<figure><svg class="timeline" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'style="max-width:100%;height:auto" role="img" aria-label="{html.escape(kind)} timeline">{"".join(items)}</svg>'
        f"<figcaption>{html.escape(kind)}: simulated on the graph's cost profile; per run the compute "
        "lane above the collectives' lane</figcaption></figure>"
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
