"""Compile seconds per stage: each graph's record, ``explain()``, the ``TORCH_TRACE`` artifact
and ``dtcompile-report``'s table (issue #70).

Each stage a compile goes through is timed where it runs and none it skipped is shown: no
Inductor without Inductor, no AOTAutograd for a backward compiled at its first call, no
Dynamo for a step graph; the passes' stage is their records' sum; the stages together
take no longer than the call that compiled them.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from expecttest import assert_expected_inline
from torch import nn

import dtcompile
from dtcompile._testing.cases import CASES
from dtcompile.base.channels import Artifact, GraphKind
from dtcompile.base.torch_compat import frame_compile_started_ns
from dtcompile.records import PassRecord, Stage, StageSeconds
from dtcompile.testing import run_threaded
from dtcompile_tools import report as report_tool

# ---- the record


def test_stage_seconds_keep_the_stages_order_and_read_the_passes_from_their_records():
    passes = [PassRecord("bucketing", True, 9, 7, 3, 1, seconds=0.3), PassRecord("annotate", True, 7, 7, 1, 1, seconds=0.22)]
    stages = StageSeconds({Stage.INDUCTOR: 2.5, Stage.DYNAMO: 1.2}, passes)
    stages.add(Stage.ARTIFACTS, 0.004)
    stages.add(Stage.ARTIFACTS, 0.0002)  # a stage that ends more than once adds up
    assert list(stages) == [Stage.DYNAMO, Stage.PASSES, Stage.ARTIFACTS, Stage.INDUCTOR]
    assert stages.get(Stage.PASSES) == pytest.approx(0.52) and stages.get(Stage.AOT_AUTOGRAD) is None
    assert stages.total == pytest.approx(1.2 + 0.52 + 0.0042 + 2.5)
    assert_expected_inline(str(stages), """Dynamo 1.20 s, passes 0.52 s, artifacts 4.2 ms, Inductor 2.50 s; total 4.22 s""")
    with pytest.raises(ValueError, match="the passes' seconds are their records'"):
        stages.add(Stage.PASSES, 1.0)
    with pytest.raises(ValueError, match="a stage's seconds are 0 or more"):
        stages.add(Stage.DYNAMO, -1.0)
    assert str(StageSeconds()) == "no stage timed" and StageSeconds().total == 0


def test_dynamos_start_is_read_inside_a_frames_compile_only_and_never_raises(monkeypatch):
    seen = []

    def backend(gm, example_inputs):
        seen.append((frame_compile_started_ns(), time.time_ns()))
        return gm.forward

    torch._dynamo.reset()
    before = time.time_ns()
    torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.randn(4))
    ((started, called),) = seen
    assert started is not None and before <= started <= called
    assert frame_compile_started_ns() is None  # no frame being compiled
    # A torch whose metrics context lacks what is read: the stage is not timed, nothing raises.
    monkeypatch.setattr(dynamo_utils, "get_metrics_context", lambda: object())
    assert frame_compile_started_ns() is None


def test_a_compiled_graphs_record_has_each_stage_it_went_through(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    _, parallel, x = CASES["tp_mlp"].build(mesh)
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(parallel, backend=backend)
    start = time.perf_counter()
    compiled(x).sum().backward()  # the backward is compiled here, at its first call
    wall = time.perf_counter() - start
    forward, backward = backend.records
    typed = {Stage.SPMD_TYPES} if forward.info.spmd_inputs else set()
    assert set(forward.stages) == {
        Stage.DYNAMO, Stage.AOT_AUTOGRAD, Stage.PARTITIONER, Stage.PASSES, Stage.SIMULATIONS, Stage.ARTIFACTS, *typed
    }
    # Compiled lazily, outside the trace: nothing of Dynamo's, AOTAutograd's or the partitioner's.
    assert set(backward.stages) == {Stage.PASSES, Stage.SIMULATIONS, Stage.ARTIFACTS, *typed}
    for record in (forward, backward):
        assert all(seconds > 0 for _, seconds in record.stages.items()), record.stages
        assert record.stages.get(Stage.PASSES) == pytest.approx(sum(p.seconds for p in record.passes))
        assert list(record.stages) == sorted(record.stages, key=list(Stage).index)
    assert forward.stages.total + backward.stages.total <= wall
    assert str(forward.stages).startswith("Dynamo ") and "; total " in str(forward.stages)


def test_a_recompile_is_timed_from_its_own_frames_compile(fake_world):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = fake_world(4, (4,), ("tp",))
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(lambda d: (d * 2).sum(), backend=backend)
    compiled(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
    time.sleep(0.5)  # between the compiles: in neither one's Dynamo stage
    start = time.perf_counter()
    compiled(distribute_tensor(torch.randn(8, 4), mesh, [Shard(1)], src_data_rank=None))
    wall = time.perf_counter() - start
    first, again = backend.records
    assert (first.compile_id, again.compile_id) == ("0/0", "0/1")
    assert first.stages.get(Stage.DYNAMO) > 0 and 0 < again.stages.get(Stage.DYNAMO) < wall
    assert again.stages.total <= wall


def test_a_frames_second_call_of_the_backend_charges_dynamo_only_since_the_first_returned(monkeypatch):
    from dtcompile import compiler

    started = time.time_ns() - 2_000_000_000  # Dynamo began this frame's compile 2 s ago
    monkeypatch.setattr(compiler, "frame_compile_started_ns", lambda: started)
    monkeypatch.setattr(compiler, "_returned", type(compiler._returned)())
    assert compiler._dynamo_seconds() == pytest.approx(2.0, abs=0.5)
    compiler._note_return()
    assert compiler._dynamo_seconds() < 0.5
    monkeypatch.setattr(compiler, "frame_compile_started_ns", lambda: started + 1)  # another frame's compile
    assert compiler._dynamo_seconds() == pytest.approx(2.0, abs=0.5)


def _rank_compiles(rank: int, world_size: int) -> dict:
    """One threaded rank's compile of the TP MLP, forward and backward, and its first call's wall time."""
    case = CASES["tp_mlp"]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(parallel, backend=backend, fullgraph=True)
    start = time.perf_counter()
    compiled(x).sum().backward()
    wall = time.perf_counter() - start
    return {
        "stages": [(r.kind, dict(r.stages.items())) for r in backend.records],
        "checks": [c.seconds for c in backend.checks],
        "wall": wall,
    }


def test_on_threaded_ranks_the_ranks_check_is_charged_to_the_compiles_last_graph():
    for rank, run in enumerate(run_threaded(2, _rank_compiles, 2)):
        (forward_kind, forward), (backward_kind, backward) = run["stages"]
        assert (forward_kind, backward_kind) == (GraphKind.FORWARD, GraphKind.BACKWARD)
        # Dynamo's start is the rank thread's own; the backward is compiled with the forward
        # (for the check), inside the trace: AOTAutograd's time after the forward is the backward's.
        assert forward[Stage.DYNAMO] > 0 and Stage.DYNAMO not in backward, rank
        assert forward[Stage.AOT_AUTOGRAD] > 0 and backward[Stage.AOT_AUTOGRAD] > 0, rank
        (check,) = run["checks"]
        assert check > 0 and backward[Stage.RANKS_CHECK] == check and Stage.RANKS_CHECK not in forward, rank
        assert sum(forward.values()) + sum(backward.values()) <= run["wall"], rank


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_a_step_graph_has_its_trace_and_no_dynamo():
    model = _mlp()
    step = dtcompile.compile_step(lambda x: model(x).pow(2).mean(), model=model, inductor=False)
    start = time.perf_counter()
    step(torch.randn(4, 16))
    wall = time.perf_counter() - start
    (record,) = step.records
    assert set(record.stages) == {Stage.AOT_AUTOGRAD, Stage.PASSES, Stage.SIMULATIONS, Stage.ARTIFACTS}
    assert all(seconds > 0 for _, seconds in record.stages.items()) and record.stages.total <= wall
    text = step.explain()
    table = text[text.index("== compile seconds ==") :].splitlines()
    assert table[1].split() == ["graph", "AOTAutograd", "passes", "simulations", "artifacts", "total"]
    assert table[2].startswith("step/0 step ") and len(table) == 3


@pytest.mark.inductor
def test_a_step_lowered_with_inductor_logs_its_compile_seconds_once_inductor_included(caplog):
    model = _mlp()
    step = dtcompile.compile_step(lambda x: model(x).pow(2).mean(), model=model)
    with caplog.at_level("INFO", logger="dtcompile.compiler"):
        step(torch.randn(4, 16))
    (record,) = step.records
    assert set(record.stages) == {Stage.AOT_AUTOGRAD, Stage.PASSES, Stage.SIMULATIONS, Stage.ARTIFACTS, Stage.INDUCTOR}
    logged = [r.getMessage() for r in caplog.records if "compile seconds" in r.getMessage()]
    assert logged == [f"compile step/0 step graph: compile seconds: {record.stages}"], logged


def test_graph_trainers_step_graph_has_no_trace_stage_of_ours():
    """graph_trainer traces the step itself, before its passes: that is not measured here."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dtcompile.pipeline.step_pass import StepPass

    inputs = [torch.randn(8, 4), torch.randn(2, 8)]
    gm = make_fx(lambda w, x: (x @ w).relu().sum(), tracing_mode="fake")(*inputs)
    step_pass = StepPass({"inductor": False})
    step_pass(gm, inputs)
    (record,) = step_pass.records
    assert set(record.stages) == {Stage.PASSES, Stage.SIMULATIONS, Stage.ARTIFACTS}


# ---- explain()


def test_explain_has_a_row_of_compile_seconds_per_graph(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    _, parallel, x = CASES["tp_mlp"].build(mesh)
    report = dtcompile.explain(parallel)(x)
    text = report.text(aot_graphs=False)
    lines = text.splitlines()
    at = lines.index("== compile seconds ==")
    header, forward_row, backward_row, *after = lines[at + 1 :]
    assert after == [], "the report ends with its compile seconds"
    assert lines.index("== recompiles ==") < at
    columns = header.split()
    assert columns == ["graph", "Dynamo", "AOTAutograd", "partitioner", "passes", "simulations", "artifacts", "total"]
    forward, backward = report.graphs
    for row, record in ((forward_row, forward), (backward_row, backward)):
        cells = row.split()
        assert cells[:2] == [record.compile_id, str(record.kind)]
        stages = [Stage(name) for name in columns[1:-1]]
        want = ["-" if record.stages.get(s) is None else f"{record.stages.get(s):.3f}" for s in stages]
        assert cells[2:] == [*want, f"{record.stages.total:.3f}"]
    assert backward_row.split()[2:5] == ["-", "-", "-"]
    # Each pass that ran says how long it took.
    assert any(line.startswith("annotate: nodes ") and line.endswith(" ms") for line in lines)


# ---- the artifact and dtcompile-report


def _log_line(meta: dict, payload: str) -> list[str]:
    """One TORCH_TRACE entry as torch writes it: the metadata line, then the payload's tab-led lines."""
    digest = hashlib.md5(payload.encode(), usedforsecurity=False).hexdigest()
    return [f"V0101 00:00:00.000000 1 trace.py:1] {json.dumps({**meta, 'has_payload': digest})}", *("\t" + p for p in payload.split("\n"))]


def test_the_report_keeps_a_graphs_last_compile_seconds_logged_again_at_the_first_call(tmp_path):
    """The ranks' check adds to the compile's last graph at its first call, outside torch's
    compile (no compile id of torch's): that artifact goes to the compile whose graphs it names."""
    compile_id = {"frame_id": 0, "frame_compile_id": 0}

    def seconds(stages):
        return json.dumps({"compile_id": "0/0", "kind": "backward", "stages": stages, "total": sum(stages.values())})

    collectives = json.dumps({"compile_id": "0/0", "kind": "backward", "collectives": [], "totals": {}})
    lines = [
        *_log_line({"artifact": {"name": Artifact.collectives(GraphKind.BACKWARD), "encoding": "json"}, **compile_id}, collectives),
        *_log_line({"artifact": {"name": Artifact.compile_seconds(GraphKind.BACKWARD), "encoding": "json"}, **compile_id},
                   seconds({"passes": 0.5})),
        *_log_line({"artifact": {"name": Artifact.compile_seconds(GraphKind.BACKWARD), "encoding": "json"}},
                   seconds({"passes": 0.5, "ranks' check": 0.25})),
    ]
    (tmp_path / "dedicated_log_torch_trace_rank_0_x.log").write_text("\n".join(lines) + "\n")
    trace = report_tool.read_trace(tmp_path)
    assert list(trace.ranks[0].compiles) == ["0/0"]
    assert trace.ranks[0].compiles["0/0"].seconds["backward"]["stages"] == {"passes": 0.5, "ranks' check": 0.25}
