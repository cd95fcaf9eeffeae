"""The passes' rewrites are priced under the profile of the machine the graph runs on.

Which profile ``auto`` picks (device and process-group backend), that each
pass skips a rewrite that does not pay and records both numbers, and that
``dtcompile.calibrate()`` writes a profile a backend loads by name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import fx

import dtcompile
from dtcompile._testing import models
from dtcompile._testing.cases import CASES, pass_context
from dtcompile.base.notation import format_bytes
from dtcompile.cost import AUTO, choose_profile, get_profile, load_profile, save_profile
from dtcompile.pass_names import COMMUNICATION_PASSES
from dtcompile.passes.bucketing import bucket_collectives
from dtcompile.passes.overlap import reorder_for_overlap
from dtcompile.records import Action
from dtcompile.testing import collective_schedule, run_gloo

c10d = torch.ops._c10d_functional


@pytest.mark.parametrize(
    ("devices", "backends", "gpu", "name", "why"),
    [
        ({"cpu"}, {"gloo"}, None, "cpu_gloo", "auto: cpu tensors on gloo"),
        ({"cpu"}, set(), None, "cpu_gloo", "auto: cpu tensors on no process group"),
        ({"cpu"}, {"fake"}, None, "h100", "a test world standing in for a job"),
        ({"cpu"}, {"threaded"}, None, "h100", "a test world standing in for a job"),
        ({"cuda"}, {"nccl"}, "NVIDIA A100-SXM4-80GB", "a100", "NVIDIA A100-SXM4-80GB"),
        ({"cuda"}, {"nccl"}, "NVIDIA H100 80GB HBM3", "h100", "NVIDIA H100 80GB HBM3"),
        ({"cuda"}, {"nccl"}, "NVIDIA L4", "h100", "no profile of its own: h100's; run dtcompile.calibrate()"),
        ({"cpu"}, {"mpi"}, None, "h100", "no profile for them"),
    ],
)
def test_auto_picks_the_profile_of_the_device_and_backend(devices, backends, gpu, name, why):
    chosen = choose_profile(AUTO, devices, backends, gpu)
    assert chosen.profile.name == name
    assert why in chosen.why
    assert choose_profile("a100", devices, backends, gpu).profile.name == "a100"  # a name given wins


def test_a_profile_is_given_by_name_or_object_and_checked():
    mine = dataclasses.replace(get_profile("cpu_gloo"), name="mine", overlap=0.5)
    backend = dtcompile.backend(cost_profile=mine)
    assert backend.config.cost_profile is mine
    assert choose_profile(mine).profile is mine
    with pytest.raises(ValueError, match=r"unknown cost profile 'nope'.*dtcompile.calibrate\(name='nope'\)"):
        dtcompile.backend(cost_profile="nope")
    with pytest.raises(ValueError, match=r"overlap must be within \[0, 1\], got 2"):
        dataclasses.replace(mine, overlap=2)


def _rank_profile(rank: int) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    _, parallel, x = models.build_mlp(mesh)
    backend = dtcompile.backend(inductor=False)
    torch.compile(parallel, backend=backend)(x)
    return backend.records[0].info.profile.name, backend.records[0].info.profile_why


@pytest.mark.gloo
def test_a_gloo_graph_is_priced_with_the_cpu_gloo_profile(fake_world, monkeypatch, tmp_path):
    monkeypatch.setenv("DTCOMPILE_PROFILE_DIR", str(tmp_path))  # nothing calibrated here
    assert run_gloo(2, _rank_profile) == [("cpu_gloo", "auto: cpu tensors on gloo")] * 2
    # The same program in the fake world is priced for the job it stands in for.
    mesh = fake_world(2, (2,), ("tp",))
    _, parallel, x = models.build_mlp(mesh)
    report = dtcompile.explain(parallel)(x)
    assert report.graphs[0].info.profile.name == "h100"
    assert "cost profile h100 (auto: cpu tensors on fake" in report.text(aot_graphs=False)


def _two_all_reduces(numel: int, group: str) -> fx.GraphModule:
    """x and y, ``numel`` floats each, all-reduced independently; the sum of both results."""
    graph = fx.Graph()
    waits = [
        graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default, (t, "sum", group)),))
        for t in (graph.placeholder("x"), graph.placeholder("y"))
    ]
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, tuple(waits)))
    with torch._subclasses.FakeTensorMode():
        for node in graph.nodes:
            if node.op == "placeholder":
                node.meta["val"] = torch.empty(numel)
            elif node.op == "call_function":
                node.meta["val"] = node.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args])
    return fx.GraphModule(torch.nn.Module(), graph)


# By hand, from cpu_gloo's numbers (380 us per launch, 72 us per ring step, 0.9 GB/s on the
# wire, 11 GB/s of copies): merging two all-reduces of 2 ranks saves one launch whatever
# their size, 380 + 2 x 72 = 524 us; it costs both inputs copied into the bucket and back
# out, 2 x 2 x 4 x numel bytes at 11 GB/s: 0.37 us for 256 floats, 1525 us for 1 Mi.
@pytest.mark.parametrize(("numel", "costs", "bucketed"), [(256, 0.3724, True), (1 << 20, 1525.20, False)])
def test_bucketing_applies_only_what_pays_and_records_both_numbers(fake_world, numel, costs, bucketed):
    mesh = fake_world(2, (2,), ("dp",))
    group = mesh.get_group().group_name
    # Memory out of the way (its pricing is tests/passes/test_memory.py's).
    ctx = pass_context(dtcompile.DTCompileConfig(inductor=False, memory_budget_bytes=1 << 40), "backward", profile="cpu_gloo")
    gm = bucket_collectives(_two_all_reduces(numel, group), [], ctx)
    saves = 524.0
    (outcome,) = ctx.outcomes
    assert outcome.price.saves_us == pytest.approx(saves)
    assert outcome.price.costs_us == pytest.approx(costs, rel=1e-4)
    reduces = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    if bucketed:
        assert outcome.action is Action.BUCKETED and len(reduces) == 1
    else:
        assert outcome.action is Action.SKIPPED and len(reduces) == 2
        assert str(outcome) == (
            f"all_reduce_default_1: starts a new bucket: joining all_reduce_default's does not pay: "
            f"saves 524 us, costs 1.53 ms of copies, adds {format_bytes(outcome.price.adds_bytes)} to the peak (cpu_gloo)"
        )


def test_overlap_is_undone_where_communication_cannot_run_beside_compute(fake_world):
    from test_passes import _hand_built_graph as build  # the graph test_passes moves under h100

    fake_world(2)
    original = [n.name for n in build().graph.nodes]
    ctx = pass_context(dtcompile.DTCompileConfig(inductor=False), profile="cpu_gloo")
    gm = reorder_for_overlap(build(), [], ctx)
    assert [n.name for n in gm.graph.nodes] == original
    (outcome,) = ctx.outcomes
    assert outcome.action is Action.SKIPPED
    assert outcome.price.saves_us == 0 and outcome.price.costs_us == 0
    assert "not reordered: 2 move(s) would hide no communication (the profile overlaps 0% of a collective" in str(outcome)
    # Under h100 the same graph is reordered, and the gain recorded.
    ctx = pass_context(dtcompile.DTCompileConfig(inductor=False), profile="h100")
    gm = reorder_for_overlap(build(), [], ctx)
    assert [n.name for n in gm.graph.nodes] != original
    assert ctx.outcomes[0].action is Action.MOVED and ctx.outcomes[0].price.saves_us > 0


@pytest.mark.models
def test_async_tp_is_not_fused_on_a_profile_without_fused_kernels(fake_world):
    case = CASES["tp_sp_block"]
    mesh = fake_world(2, (2,), ("tp",))
    _, parallel, x = case.build(mesh)
    schedules = {}
    for name, options in {
        "cpu_gloo": {"cost_profile": "cpu_gloo"},
        "h100": {"cost_profile": "h100"},
        "no passes": {"disable_passes": COMMUNICATION_PASSES},
    }.items():
        backend = dtcompile.backend(inductor=False, **options)
        schedules[name] = str(collective_schedule(parallel, case.local_input(x, mesh), backend=backend))
        decisions = [d for r in backend.records for p in r.passes if p.name == "async_tp" for d in p.decisions]
        if name == "cpu_gloo":
            assert decisions and all(d.action is Action.SKIPPED for d in decisions)
            assert any("cpu_gloo has no fused collective-matmul kernel" in str(d) and d.price is not None for d in decisions)
        if name == "h100":
            assert any(d.action is Action.FUSED and d.price.pays for d in decisions)
    assert schedules["cpu_gloo"] == schedules["no passes"]
    assert schedules["h100"] != schedules["no passes"]


def _rank_calibrate(rank: int, name: str) -> dict:
    return dtcompile.calibrate(name, iters=2).to_json()


@pytest.mark.models
def test_calibrate_writes_a_profile_a_backend_loads_by_name(fake_world, monkeypatch, tmp_path):
    monkeypatch.setenv("DTCOMPILE_PROFILE_DIR", str(tmp_path))
    measured = run_gloo(2, _rank_calibrate, "this_box_gloo")
    assert measured[0] == measured[1]  # rank 0's numbers on every rank
    saved = tmp_path / "this_box_gloo.json"
    assert json.loads(saved.read_text()) == measured[0]
    profile = load_profile(saved)
    assert profile.to_json() == measured[0]
    assert 0.0 <= profile.overlap <= 1.0 and not profile.fused_collective_matmul
    assert profile.intra_node.bandwidth_gbps > 0 and profile.memory_gbps > 0 and profile.matmul_tflops > 0
    # A fresh backend in this process finds it by name and prices with it.
    mesh = fake_world(2, (2,), ("tp",))
    _, parallel, x = models.build_mlp(mesh)
    backend = dtcompile.backend(inductor=False, cost_profile="this_box_gloo")
    torch.compile(parallel, backend=backend)(x)
    assert backend.records[0].info.profile == profile
    # Saved under the name auto picks, it replaces the built-in one on this machine.
    save_profile(dataclasses.replace(profile, name="cpu_gloo"))
    chosen = choose_profile(AUTO, {"cpu"}, {"gloo"})
    assert chosen.profile == dataclasses.replace(profile, name="cpu_gloo")
    assert f"calibrated on this machine ({tmp_path / 'cpu_gloo.json'})" in chosen.why


def test_a_file_that_is_not_a_profile_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"name": "broken"}')
    with pytest.raises(ValueError, match=r"broken.json is not a saved cost profile \(KeyError"):
        load_profile(bad)


def test_calibrate_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"calibrate: no process group; call torch.distributed.init_process_group"):
        dtcompile.calibrate()
