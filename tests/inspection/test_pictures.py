"""The report's pictures keep a readable scale at any size: round ticks in the unit the numbers
need, a legend, the op's name on a bar wide enough; decisions say times and memory in sensible
units and signs; and the demo's ``--trace`` case shows the passes changing the timeline."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dtcompile.base.notation import format_bytes
from dtcompile.records import Price
from dtcompile_tools.pictures import byte_ticks, memory_svg, ticks, time_text, timeline_svg
from dtcompile_tools.report import read_trace, render_html


def test_ticks_are_round_and_cover_the_range():
    assert ticks(33.7) == [0, 10, 20, 30]
    assert ticks(4300) == [0, 1000, 2000, 3000, 4000]
    assert [round(t, 6) for t in ticks(0.00041)] == [0.0, 0.0001, 0.0002, 0.0003, 0.0004]
    assert ticks(0) == [0.0]


def test_times_and_bytes_read_in_the_unit_they_need():
    assert [time_text(v) for v in (0, 0.00025, 0.5, 12, 1500, 2.5e6)] == ["0", "0.25 ns", "500 ns", "12 us", "1.5 ms", "2.5 s"]
    assert [format_bytes(v) for v in (0, 512, 3000, 1.25e9)] == ["0 B", "512 B", "2.93 KiB", "1.16 GiB"]
    assert byte_ticks(1.43e9) == [(0, "0"), (500 << 20, "500 MiB"), (1000 << 20, "1000 MiB")]
    assert byte_ticks(5000) == [(0, "0"), (2048, "2 KiB"), (4096, "4 KiB")]


def test_decisions_say_times_and_the_peak_in_sensible_units_and_signs():
    assert str(Price(0.000123, 0.0, profile="h100")) == "saves 0.123 ns, costs 0 us (h100)"
    assert str(Price(1525.2, 0.37, "of copies", adds_bytes=-9 * 1024)) == (
        "saves 1.53 ms, costs 370 ns of copies, lowers the peak by 9 KiB"
    )
    assert str(Price(12.0, 150.0, adds_bytes=0)) == "saves 12.0 us, costs 150 us, leaves the peak as it is"


def _run(total: float, spans: list[list]) -> dict:
    return {"total_us": total, "compute_us": total, "comm_us": 0.0, "exposed_us": 0.0, "spans": spans}


def test_a_timeline_of_nanoseconds_and_one_of_milliseconds_both_have_a_scale():
    for total, unit in ((0.0004, "ns"), (4300.0, "ms")):
        svg = timeline_svg("forward", {"after": _run(total, [["compute", "mm", 0.0, total * 0.9, 3]])})
        labels = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
        assert [label for label in labels if label.endswith(unit)], (unit, labels)
        assert {"compute", "compute waits for communication", "collective"} <= set(labels)
    wide = timeline_svg("forward", {"after": _run(10.0, [["compute", "mm_1", 0.0, 9.0, 1], ["comm", "all_gather", 9.0, 9.01, 1]])})
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", wide)
    assert "mm_1" in texts and "all_gather" not in texts  # named where it fits, not on a sliver


def test_the_memory_picture_has_a_byte_axis_and_says_what_its_lines_are():
    memory = {"curve": [[0.0, 0], [1000.0, 600 << 20], [3000.0, 100 << 20]], "peak_us": 1000.0, "peak_bytes": 600 << 20,
              "peak_node": "mm", "budget_bytes": 700 << 20, "traced_peak_bytes": 650 << 20}
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", memory_svg("forward", memory))
    assert "200 MiB" in labels and "1 ms" in labels and "peak 600 MiB at mm" in labels
    assert "budget 700 MiB" in labels and "peak before the passes 650 MiB" in labels


@pytest.mark.subprocess
def test_the_demo_trace_shows_the_passes_cutting_exposed_communication(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtcompile.demo", "--trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    page = render_html(read_trace(tmp_path))
    timelines = re.findall(r'<svg class="timeline".*?</svg>', page, flags=re.DOTALL)
    exposed = [re.findall(r"([\d.]+(?: \w+)?) exposed", svg) for svg in timelines]
    changed = [svg for svg, found in zip(timelines, exposed) if len(found) == 2 and found[0] != found[1]]
    assert len(changed) >= 2, "the forward and the backward timelines change under the passes"
    assert "696 us exposed" in changed[0] and "191 us exposed" in changed[0], re.findall(r"[\d.]+ \w+ exposed", changed[0])
