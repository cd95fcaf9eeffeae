"""Communication passes: what they rewrite, what they leave and why, and that numbers do not change."""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

import dtcompile
from dtcompile._testing.cases import CASES
from dtcompile.testing import assert_matches_eager, collective_schedule, threaded_world


def _fsdp_schedule(fake_world, **options) -> tuple[str, list[str]]:
    case = CASES["fsdp_mlp"]
    mesh = fake_world(4, (4,), ("dp",))
    _, parallel, x = case.build(mesh)
    backend = dtcompile.backend(inductor=False, **options)
    schedule = collective_schedule(parallel, case.local_input(x, mesh), backend=backend)
    decisions = [f"{r.kind}: {d}" for r in backend.records for p in r.passes if p.name == "bucketing" for d in p.decisions]
    return str(schedule), decisions


def test_bucketing_fsdp_all_gathers_and_reduce_scatters(fake_world):
    schedule, decisions = _fsdp_schedule(fake_world)
    assert_expected_inline(
        schedule,
        """\
forward 0/0:
  all_gather      dp     x4    float32[1072]  4288 B
backward 0/0:
  reduce_scatter  dp     x4    float32[1072]  4288 B
forward total: 1 collectives, 4288 B per rank
backward total: 1 collectives, 4288 B per rank""",
    )
    assert decisions == [
        "forward: all_gather[4 -> 1]: all_gather_into_tensor, all_gather_into_tensor_1, all_gather_into_tensor_2, all_gather_into_tensor_3 (4288 B)",
        "backward: reduce_scatter[4 -> 1]: reduce_scatter_tensor, reduce_scatter_tensor_1, reduce_scatter_tensor_2, reduce_scatter_tensor_3 (4288 B)",
    ]


def test_bucketing_respects_the_cap_and_says_so(fake_world):
    schedule, decisions = _fsdp_schedule(fake_world, bucket_cap_bytes=2200)
    # Gathered sizes 2048, 128, 2048, 64 B: two buckets of 2176 and 2112 B.
    assert "forward total: 2 collectives, 4288 B per rank" in schedule
    assert "forward: all_gather_into_tensor_2: starts a new bucket: the bucket would pass bucket_cap_bytes" in decisions


def test_bucketing_switched_off_keeps_every_collective(fake_world):
    schedule, decisions = _fsdp_schedule(fake_world, disable_passes={"bucketing"})
    assert "forward total: 4 collectives, 4288 B per rank" in schedule
    assert "backward total: 4 collectives, 4288 B per rank" in schedule
    assert decisions == []


def test_bucketing_leaves_dependent_collectives_alone_and_says_why(fake_world):
    case = CASES["tp_sp_block"]
    mesh = fake_world(4, (4,), ("tp",))
    _, parallel, x = case.build(mesh)
    backend = dtcompile.backend(inductor=False)
    schedule = collective_schedule(parallel, x, backend=backend)
    assert "forward total: 5 collectives, 20480 B per rank" in str(schedule)
    decisions = {d for r in backend.records for p in r.passes if p.name == "bucketing" for d in p.decisions}
    assert "all_gather_into_tensor_1: starts a new bucket: its input is computed after a bucketed result is used (they depend on each other)" in decisions


@pytest.mark.parametrize("case_name", ["fsdp_mlp", "block_2d"])
@pytest.mark.parametrize("disabled", [frozenset(), frozenset({"bucketing"})], ids=["all_passes", "no_bucketing"])
def test_passes_keep_numerics(case_name, disabled):
    case = CASES[case_name]

    def build(mesh):
        _, parallel, x = case.build(mesh)
        return parallel, (case.local_input(x, mesh),)

    assert_matches_eager(
        build,
        world=threaded_world(4, case.mesh_shape(4), case.mesh_dim_names),
        backend=dtcompile.backend(inductor=False, disable_passes=disabled),
    )
