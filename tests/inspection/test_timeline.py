"""The simulated timeline of each compiled graph: its bars, the report's SVG, the Perfetto file."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import dtcompile
from dtcompile._testing.cases import CASES
from dtcompile.artifacts import collectives_json, format_compiled_graph
from dtcompile.cost.simulate import simulate
from dtcompile.graph.collectives import collective_info
from dtcompile_tools import report as report_tool


def _compiled(case: str, mesh) -> list:
    _, parallel, x = CASES[case].build(mesh)
    backend = dtcompile.backend(inductor=False)
    torch.compile(parallel, backend=backend)(x).sum().backward()
    return list(backend.records)


def _length(spans, lane: str) -> float:
    return sum(s.end_us - s.start_us for s in spans if s.lane == lane)


@pytest.mark.parametrize(("case", "mesh_shape", "names"), [
    ("tp_mlp", (4,), ("tp",)),
    ("tp_sp_block", (4,), ("tp",)),
    ("tp_sp_block_local_map", (4,), ("tp",)),
    ("fsdp_mlp", (4,), ("dp",)),
    ("block_2d", (2, 2), ("dp", "tp")),
])
@pytest.mark.slow
def test_the_bars_add_up_to_the_simulated_times(fake_world, case, mesh_shape, names):
    """Compute bars sum to the compute time, waiting bars to the exposed communication, every
    collective has its bar, and no two bars of one lane overlap."""
    records = _compiled(case, fake_world(4, mesh_shape, names))
    assert records
    for record in records:
        for graph, timeline in ((record.graph.graph, record.timeline), (None, record.timeline_traced)):
            spans = timeline.spans
            assert _length(spans, "compute") == pytest.approx(timeline.compute_us, rel=1e-9, abs=1e-9)
            assert _length(spans, "exposed") == pytest.approx(timeline.exposed_comm_us, rel=1e-9, abs=1e-9)
            assert all(0 <= s.start_us <= s.end_us <= timeline.total_us + 1e-9 for s in spans)
            # The compute stream (compute and waiting) and the communication stream each run one thing at a time.
            for lanes in (("compute", "exposed"), ("comm",)):
                bars = sorted((s.start_us, s.end_us) for s in spans if s.lane in lanes)
                assert all(a[1] <= b[0] + 1e-9 for a, b in zip(bars, bars[1:])), (case, record.kind, lanes)
            if graph is not None:
                issued = [n.name for n in graph.nodes if collective_info(n) is not None]
                assert sorted(s.name for s in spans if s.lane == "comm") == sorted(issued)
        # As lowered: the same as playing the graph again.
        again = simulate(record.graph.graph, record.info.profile)
        assert again == record.timeline and again.spans == record.timeline.spans


def test_the_passes_hide_what_the_timeline_shows(fake_world):
    """FSDP's gathers, bucketed and overlapped: less exposed after the passes than before, and
    the text report says both."""
    records = _compiled("fsdp_mlp", fake_world(4, (4,), ("dp",)))
    forward = next(r for r in records if r.kind == "forward")
    assert forward.timeline.exposed_comm_us < forward.timeline_traced.exposed_comm_us
    text = format_compiled_graph(forward)
    section = text.split("-- timeline (simulated on h100) --\n")[1].splitlines()[0]
    after, before = forward.timeline, forward.timeline_traced
    assert section.startswith(f"0/0 forward: {after.total_us:.4g} us (")
    assert f"before the passes {before.total_us:.4g} us" in section


def _trace_of(records) -> report_tool.Trace:
    """What dtcompile-report reads back from a TORCH_TRACE of these records, built in process."""
    trace = report_tool.Trace({0: report_tool.RankTrace(0)})
    for record in records:
        compile_record = trace.ranks[0].compiles[record.compile_id]
        compile_record.collectives[record.kind] = json.loads(json.dumps(collectives_json(record)))
    return trace


@pytest.mark.slow
def test_the_report_draws_a_timeline_per_graph(fake_world):
    records = _compiled("tp_sp_block", fake_world(4, (4,), ("tp",)))
    page = report_tool.render_html(_trace_of(records))
    svgs = re.findall(r'<svg class="timeline".*?</svg>', page, flags=re.S)
    in_page_order = sorted(records, key=lambda r: tuple(map(int, r.compile_id.split("/"))))
    assert len(svgs) == len(records) >= 2
    for svg, record in zip(svgs, in_page_order):
        bars = {lane: len(re.findall(rf'<rect class="{lane}"', svg)) for lane in ("compute", "comm", "exposed")}
        for lane, count in bars.items():
            assert count == sum(s.lane == lane for s in record.timeline.spans) + sum(
                s.lane == lane for s in record.timeline_traced.spans
            ), (record.kind, lane)
        assert (bars["comm"] >= 1) == bool(record.collectives), (record.kind, bars)
        assert "before the passes" in svg and "after the passes" in svg


_PHASES = {"X", "M", "B", "E", "i", "I", "C", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D", "R", "(", ")"}


def _check_trace_event_format(data) -> list[dict]:
    """The Chrome trace-event format (JSON object form), as Perfetto and chrome://tracing read it."""
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    for event in data["traceEvents"]:
        assert event["ph"] in _PHASES, event
        assert isinstance(event["pid"], int) and isinstance(event.get("tid", 0), (int, str)), event
        if event["ph"] == "X":
            assert isinstance(event["name"], str)
            assert isinstance(event["ts"], (int, float)) and math.isfinite(event["ts"]) and event["ts"] >= 0
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        if event["ph"] == "M" and event["name"] in ("process_name", "thread_name"):
            assert isinstance(event["args"]["name"], str)
    return data["traceEvents"]


def test_the_perfetto_file_holds_every_bar(fake_world, tmp_path):
    records = _compiled("fsdp_mlp", fake_world(4, (4,), ("dp",)))
    trace = _trace_of(records)
    events = _check_trace_event_format(json.loads(json.dumps(report_tool.perfetto_trace(trace))))
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == sorted(
        f"rank 0 compile 0/0 {r.kind} ({when} the passes, predicted)" for r in records for when in ("before", "after")
    )
    for record in records:
        (pid,) = [p for p, name in processes.items() if name == f"rank 0 compile 0/0 {record.kind} (after the passes, predicted)"]
        comm = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "comm"]
        assert [e["name"] for e in comm] == [s.name for s in record.timeline.spans if s.lane == "comm"]
        ends = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["pid"] == pid)
        assert ends == pytest.approx(record.timeline.total_us, abs=1e-2)


def test_a_profiler_trace_goes_beside_the_prediction(fake_world, tmp_path):
    """``--measured``: a torch.profiler trace of a step, in the same file under its own processes."""
    records = _compiled("tp_mlp", fake_world(4, (4,), ("tp",)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    measured_file = tmp_path / "measured.json"
    prof.export_chrome_trace(str(measured_file))
    measured = json.loads(measured_file.read_text())
    merged = report_tool.perfetto_trace(_trace_of(records), measured)
    events = _check_trace_event_format(json.loads(json.dumps(merged)))
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    ours = {pid for pid, name in names.items() if name.endswith("predicted)")}
    theirs = {pid for pid, name in names.items() if name.startswith("measured: ")}
    assert len(ours) == 2 * len(records) and theirs and not ours & theirs
    # Every measured event kept, on a measured process.
    kept = [e for e in events if e["pid"] in theirs and e["ph"] == "X"]
    assert len(kept) == sum(e.get("ph") == "X" for e in measured["traceEvents"]) > 0
    assert any("mm" in e["name"] for e in kept)


def test_the_perfetto_options_are_checked(fake_world, tmp_path, capsys):
    with pytest.raises(SystemExit):
        report_tool.main([str(tmp_path), "--measured", str(tmp_path / "p.json")])
    assert "--measured goes beside the predicted timelines of --perfetto" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a trace"}')
    with pytest.raises(report_tool.TraceError, match="not a Chrome trace-event file"):
        report_tool.perfetto_trace(report_tool.Trace({}), json.loads(bad.read_text()))
