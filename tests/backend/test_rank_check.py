"""Ranks that compiled a graph differently end with dtcompile's error, never an abort or a hang.

Each cause that can be staged on one machine, on real gloo ranks (where a
mismatch in a collective's size kills both processes from C++) and on threaded
ranks: per-rank options, a calibrated profile on one rank only, a compile cache
warm on one rank and cold on the other, an eager fallback on one rank, a
recompile on one rank.  Each either agrees, and equals eager and the
single-process model, or ends on every rank with :class:`RanksDisagree` saying
what differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import dtcompile
from dtcompile._testing.cases import CASES, StepResult, assert_steps_close, reference_step, run_step
from dtcompile.base.channels import BesideCacheFolders
from dtcompile.cost import get_profile
from dtcompile.graph.collectives import CollectiveInfo
from dtcompile.ranks.check import RanksDisagree, disagreement_message
from dtcompile.ranks.schedule import Schedule, Scheduled, scheduled_collectives
from dtcompile.testing import run_gloo, run_threaded
from dtcompile.testing.worlds import wait_for_eager_on_every_rank

TOL = dict(rtol=1e-5, atol=1e-5)
CASE = "gathered_stack"  # 4 layers, Shard(0) weights gathered in the forward
NO_PASSES = {"bucketing", "overlap", "async_tp"}


@dataclasses.dataclass
class RankRun:
    """What one rank saw: its steps (eager, then compiled ones) or the error it ended with."""

    eager: StepResult
    compiled: list[StepResult]
    error: str
    checks: list[str]
    fallbacks: int
    cached: int
    known: list[bool] = dataclasses.field(default_factory=list)
    """Per check: whether this rank knew its graph's collectives."""


def _rank_steps(rank: int, world_size: int, options: list[dict[str, Any]], steps: int = 2, **env: str) -> RankRun:
    """One rank: an eager step, then ``steps`` steps compiled with ``options[rank]``."""
    for name, value in env.items():
        os.environ[name] = value.format(rank=rank)
    options = [{k: set(v) if k == "disable_passes" else v for k, v in o.items()} for o in options]
    case = CASES[CASE]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    eager = run_step(parallel, parallel, x)
    wait_for_eager_on_every_rank()
    backend = dtcompile.backend(**{"inductor": False, **options[rank]})
    compiled = torch.compile(parallel, backend=backend, fullgraph=True)
    results, error = [], ""
    try:
        for _ in range(steps):
            results.append(run_step(compiled, parallel, x))
    except RanksDisagree as exc:
        error = str(exc)
    checks = list(backend.checks)
    return RankRun(
        eager, results, error, [c.outcome for c in checks], len(backend.fallbacks), len(backend.cached), [c.known for c in checks]
    )


def _assert_equal_eager_and_one_process(runs: list[RankRun], steps: int = 2) -> None:
    reference = reference_step(CASE, len(runs))
    for rank, run in enumerate(runs):
        assert not run.error, f"rank {rank}: {run.error}"
        assert len(run.compiled) == steps, f"rank {rank} ran {len(run.compiled)} of {steps} steps"
        assert_steps_close(run.eager, reference, f"rank {rank} eager vs one process", **TOL)
        for i, step in enumerate(run.compiled):
            assert_steps_close(step, run.eager, f"rank {rank} compiled step {i} vs eager", **TOL)


def _assert_every_rank_stops(runs: list[RankRun], *, names: list[str]) -> None:
    """Every rank ended with the error, before running a compiled step, and it names ``names``."""
    for rank, run in enumerate(runs):
        assert run.error, f"rank {rank} did not stop: checks {run.checks}"
        assert run.compiled == [], f"rank {rank} ran a compiled step"
        assert run.checks == ["ranks disagree"], run.checks
        for name in names:
            assert name in run.error, f"rank {rank}'s error does not name {name!r}:\n{run.error}"


# ---------------------------------------------------------------------------
# Per-rank options: the two cases of issue #32, on gloo.


@pytest.mark.gloo
def test_gloo_ranks_with_other_bucket_caps_stop_naming_the_option():
    """Without the check gloo kills both processes ('Received data size doesn't match')."""
    options = [{"bucket_cap_bytes": 1 << 30}, {"bucket_cap_bytes": 64}]
    runs = run_gloo(2, _rank_steps, 2, options, timeout=120)
    _assert_every_rank_stops(runs, names=["bucket_cap_bytes: 1073741824 on rank 0, 64 on rank 1", "first difference: forward collective 0"])
    # Both ranks say the same thing, naming both sides.
    assert runs[0].error == runs[1].error
    assert "ranks [0]" in runs[0].error and "ranks [1]" in runs[0].error


@pytest.mark.gloo
def test_gloo_ranks_with_passes_off_on_one_rank_stop_naming_the_option():
    options = [{}, {"disable_passes": sorted(NO_PASSES)}]
    runs = run_gloo(2, _rank_steps, 2, options, timeout=120)
    _assert_every_rank_stops(runs, names=["disable_passes: {} on rank 0, {'async_tp', 'bucketing', 'overlap'} on rank 1"])


@pytest.mark.gloo
def test_gloo_ranks_with_equal_options_equal_eager_and_check_once():
    runs = run_gloo(2, _rank_steps, 2, [{"bucket_cap_bytes": 64}] * 2, timeout=120)
    _assert_equal_eager_and_one_process(runs)
    for run in runs:
        assert run.checks == ["agreed"], "one check, at the first call; none after"


@pytest.mark.gloo
def test_gloo_ranks_whose_options_differ_where_it_changes_nothing_agree():
    """What is compared is the collectives, not the options: an overlap budget that moves
    nothing here differs harmlessly."""
    options = [{"overlap_memory_budget_bytes": 0}, {"overlap_memory_budget_bytes": 1 << 30}]
    runs = run_gloo(2, _rank_steps, 2, options, timeout=120)
    _assert_equal_eager_and_one_process(runs)


# ---------------------------------------------------------------------------
# A calibrated profile on one rank only.


def _profile_dirs(tmp_path: Path) -> str:
    """Rank 1's profile folder holds a ``cpu_gloo.json`` calibrated as a machine whose
    collectives cost nothing to issue (no latency): bucketing them does not pay there."""
    for rank in (0, 1):
        (tmp_path / f"profiles{rank}").mkdir()
    fast = get_profile("cpu_gloo")
    link = dataclasses.replace(fast.intra_node, hop_latency_us=0.0, base_latency_us=0.0, bandwidth_gbps=1000.0)
    fast = dataclasses.replace(fast, intra_node=link, inter_node=link)
    (tmp_path / "profiles1" / "cpu_gloo.json").write_text(json.dumps(fast.to_json()))
    return str(tmp_path / "profiles{rank}")


@pytest.mark.gloo
def test_gloo_profile_calibrated_on_one_rank_only_stops_naming_the_profile(tmp_path):
    profiles = _profile_dirs(tmp_path)
    runs = run_gloo(2, _rank_env_steps, 2, [{}, {}], {"DTCOMPILE_PROFILE_DIR": profiles}, timeout=120)
    _assert_every_rank_stops(runs, names=["cost profile: cpu_gloo (auto: cpu tensors on gloo)", "calibrated on this machine"])


def _rank_env_steps(rank: int, world_size: int, options: list[dict[str, Any]], env: dict[str, str]) -> RankRun:
    return _rank_steps(rank, world_size, options, **env)


# ---------------------------------------------------------------------------
# A compile cache warm on one rank and cold on the other.


def _rank_cached_steps(rank: int, world_size: int, cache_dirs: str, forget_schedules: bool, caps: list[int]) -> RankRun:
    cache = cache_dirs.format(rank=rank)
    if forget_schedules:
        shutil.rmtree(Path(cache) / BesideCacheFolders.SCHEDULES, ignore_errors=True)
    options = [{"inductor": True, "bucket_cap_bytes": cap} for cap in caps]
    return _rank_steps(rank, world_size, options, TORCHINDUCTOR_CACHE_DIR=cache)


@pytest.mark.inductor
@pytest.mark.gloo
def test_gloo_cache_warm_on_one_rank_and_cold_on_the_other(tmp_path):
    """Rank 0's folder is warmed by an earlier run; rank 1's is empty.  Rank 0 is served
    from the cache (nothing traced) and reads back the collectives the earlier run saved:
    with equal options both agree and equal eager.  Where those saved collectives are
    gone, what the graphs were decided from is compared: rank 1 with another bucket cap
    stops both, naming it."""
    default = dtcompile.backend().config.bucket_cap_bytes
    run_gloo(2, _rank_cached_steps, 2, str(tmp_path / "warm{rank}"), False, [default] * 2, timeout=600)
    shutil.copytree(tmp_path / "warm0", tmp_path / "0")
    cache_dirs = str(tmp_path) + "/{rank}"

    runs = run_gloo(2, _rank_cached_steps, 2, cache_dirs, False, [default] * 2, timeout=600)
    _assert_equal_eager_and_one_process(runs)
    assert (runs[0].cached, runs[1].cached) == (1, 0), "rank 0 warm, rank 1 cold"
    assert [run.checks for run in runs] == [["agreed"], ["agreed"]]
    assert [run.known for run in runs] == [[True], [True]], "rank 0 read its collectives back"

    shutil.rmtree(tmp_path / "1")
    runs = run_gloo(2, _rank_cached_steps, 2, cache_dirs, True, [default, 64], timeout=600)
    assert [run.known for run in runs] == [[False], [True]]
    _assert_every_rank_stops(runs, names=[f"bucket_cap_bytes: {default} on rank 0, 64 on rank 1", "schedule is unknown"])
    assert "rank 0's graph was served from the compile cache, rank 1's compiled here" in runs[0].error


# ---------------------------------------------------------------------------
# An eager fallback on one rank.


def _rank_falls_back(rank: int, world_size: int) -> RankRun:
    """Rank 1's AOTAutograd 'cannot trace' the graph (staged: torch raising while it traces)."""
    if rank == 1:
        import dtcompile.pipeline.graph_compile

        def cannot_trace(gm):
            raise RuntimeError("staged: AOTAutograd cannot trace this graph on this rank")

        dtcompile.pipeline.graph_compile.loss_parallel_backward = cannot_trace
    with pytest.warns(UserWarning, match="eager"):
        return _rank_steps(rank, world_size, [{}, {}])


@pytest.mark.gloo
def test_gloo_eager_fallback_on_one_rank_runs_eagerly_on_every_rank():
    runs = run_gloo(2, _rank_falls_back, 2, timeout=120)
    _assert_equal_eager_and_one_process(runs)
    assert [run.fallbacks for run in runs] == [0, 1]
    assert [run.checks for run in runs] == [["every rank runs it eagerly"]] * 2


# ---------------------------------------------------------------------------
# A recompile on one rank.


class _Scaled(nn.Module):
    """The stack times a Python float that Dynamo guards on: changing it on one rank
    recompiles on that rank only.  With ``gather_more`` it also gathers a small tensor
    (a collective the graph had not)."""

    def __init__(self, inner: nn.Module, mesh: Any) -> None:
        super().__init__()
        self.inner = inner
        self.mesh = mesh
        self.scale = 1.0
        self.gather_more = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x) * self.scale
        if self.gather_more:
            y = y + DTensor.from_local(torch.zeros(1), self.mesh, [Shard(0)]).full_tensor().sum()
        return y


def _rank_recompiles(rank: int, world_size: int, extra_collective_on_rank0: bool, timeout_s: float) -> RankRun:
    case = CASES[CASE]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    model = _Scaled(parallel, mesh)
    eager = run_step(model, parallel, x)
    wait_for_eager_on_every_rank()
    backend = dtcompile.backend(inductor=False, check_ranks_timeout_s=timeout_s)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    results, error = [run_step(compiled, parallel, x)], ""
    if rank == 0:
        model.scale = 1.0 + 1e-9
        model.gather_more = extra_collective_on_rank0
    try:
        results.append(run_step(compiled, parallel, x))
    except RanksDisagree as exc:
        error = str(exc)
    return RankRun(eager, results, error, [c.outcome for c in backend.checks], 0, 0)


@pytest.mark.slow
def test_threaded_recompile_on_one_rank_with_the_same_collectives_agrees():
    """Rank 0 recompiles (its guard on ``scale`` fails), rank 1 does not: the new graph's
    collectives are the ones its frame agreed on, so nothing is exchanged, and the ranks'
    collectives pair up as before."""
    runs = run_threaded(2, _rank_recompiles, 2, False, 60.0)
    assert runs[0].checks == ["agreed", "agreed on by an earlier graph"]
    assert runs[1].checks == ["agreed"]
    for run in runs:
        assert not run.error, run.error
        for step in run.compiled:
            torch.testing.assert_close(step.output, run.eager.output, **TOL)


@pytest.mark.slow
def test_threaded_recompile_on_one_rank_with_new_collectives_ends_with_the_error():
    """Rank 0's new graph has a collective rank 1's has not, and rank 1 never comes to the
    check: rank 0 ends with the error naming it; rank 1, waiting in its collective for
    rank 0, is released when rank 0 fails (on gloo: by the connection closing)."""
    # The timeout also bounds the first check, where one rank may wait for the other's compile.
    with pytest.raises(Exception, match=r"rank\(s\) \[1\] of the dp group \[0, 1\] did not come to compare graph"):
        run_threaded(2, _rank_recompiles_and_raises, 2, True, 15.0, timeout=180)


def _rank_recompiles_and_raises(rank: int, world_size: int, extra: bool, timeout_s: float) -> RankRun:
    run = _rank_recompiles(rank, world_size, extra, timeout_s)
    if run.error:
        raise RanksDisagree(run.error)
    return run


# ---------------------------------------------------------------------------
# Threaded ranks get the same check; a 2-D mesh learns of a disagreement everywhere.


def test_threaded_ranks_with_other_bucket_caps_stop_naming_the_option():
    options = [{"bucket_cap_bytes": 1 << 30}, {"bucket_cap_bytes": 64}]
    runs = run_threaded(2, _rank_steps, 2, options)
    _assert_every_rank_stops(runs, names=["bucket_cap_bytes", "on the dp group"])


def _rank_2d(rank: int, world_size: int, odd_rank: int) -> str:
    case = CASES["block_2d"]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    options = {"disable_passes": NO_PASSES} if rank == odd_rank else {}
    compiled = torch.compile(parallel, backend=dtcompile.backend(inductor=False, **options), fullgraph=True)
    try:
        run_step(compiled, parallel, case.local_input(x, mesh))
    except RanksDisagree as exc:
        return str(exc)
    return ""


@pytest.mark.models
def test_threaded_2d_mesh_every_rank_stops_when_one_rank_differs():
    """On dp x tp = 2 x 2, rank 3 compiled without passes.  Rank 0 shares no group with
    rank 3, yet stops too: each rank's check goes over tp, then dp, and says what it saw."""
    errors = run_threaded(4, _rank_2d, 4, 3)
    assert all(errors), errors
    assert "disable_passes" in errors[2] or "disable_passes" in errors[1]


# ---------------------------------------------------------------------------
# Where the check does not run, and its parts.


def test_no_check_without_ranks_that_can_differ(fake_world):
    """The fake process group simulates every rank in one process: nothing to compare,
    and the backward stays compiled at its first call, as stock."""
    fake_world(2)
    case = CASES[CASE]
    _, parallel, x = case.build(case.mesh(2))
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(parallel, backend=backend, fullgraph=True)
    out = compiled(x)
    assert [r.kind for r in backend.records] == ["forward"]
    out.sum().backward()
    assert [r.kind for r in backend.records] == ["forward", "backward"]
    assert list(backend.checks) == []


def test_check_ranks_false_skips_it():
    runs = run_threaded(2, _rank_steps, 2, [{"check_ranks": False}] * 2)
    assert [run.checks for run in runs] == [[], []]
    _assert_equal_eager_and_one_process(runs)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"check_ranks": 1}, TypeError, "check_ranks must be True or False"),
        ({"check_ranks_timeout_s": 0}, ValueError, "check_ranks_timeout_s must be > 0"),
        ({"check_ranks_timeout_s": float("inf")}, ValueError, "finite"),
        ({"check_ranks_timeout_s": "60"}, TypeError, "number of seconds"),
    ],
)
def test_check_options_are_validated(options, error, match):
    with pytest.raises(error, match=match):
        dtcompile.backend(**options)


def _info(op: str, shape: tuple[int, ...], **kw: Any) -> CollectiveInfo:
    return CollectiveInfo(node="n", op=op, axis="dp", group_size=2, shape=shape, dtype=torch.float32, bytes=4, **kw)


def test_scheduled_collectives_leave_out_shapes_ranks_may_not_share():
    scheduled = scheduled_collectives(
        [("forward", [_info("all_gather", (4, 2)), _info("all_to_all", (9,))]), ("backward", [_info("all_reduce", (3,), data_dependent=True)])]
    )
    assert [str(c) for c in scheduled] == [
        "forward collective 0: all_gather[dp] x2 float32[4, 2]",
        "forward collective 1: all_to_all[dp] x2 float32",
        "backward collective 0: all_reduce[dp] x2 float32",
    ]


_GATHER_8 = (Scheduled("forward", 0, "all_gather", "dp", 2, "float32", (8,)),)


def test_the_message_names_sides_first_difference_and_what_differs():
    a = Schedule("0/0", "compiled here", _GATHER_8, {"bucket_cap_bytes": "64", "torch": "x"})
    b = Schedule("0/0", "served from the compile cache", (), {"bucket_cap_bytes": "128", "torch": "x"})
    text = disagreement_message("0/0", "dp", [([0, 2], a), ([1], b)], compared_schedules=True)
    assert "ranks [0, 2]: graph 0/0, compiled here, 1 collectives on dp" in text
    assert "forward collective 0: all_gather[dp] x2 float32[8] on rank 0 only" in text
    assert "bucket_cap_bytes: 64 on rank 0, 128 on rank 1" in text
    assert "rank 0's graph was compiled here, rank 1's served from the compile cache" in text
    assert "torch:" not in text
    assert Schedule.from_json(a.to_json()) == a


def test_a_warm_rank_and_a_cold_one_compare_what_they_were_decided_from():
    """Where one rank's collectives are unknown (served from the cache without them), the
    ranks compare what their graphs were decided from; how each got it is not part of it."""
    import torch.distributed as dist

    from dtcompile.ranks.check import _compare

    decided = {"bucket_cap_bytes": "64", "torch": torch.__version__}
    warm = Schedule("0/0", "served from the compile cache", None, decided)
    cold = Schedule("0/0", "compiled here", _GATHER_8, decided)
    other = dataclasses.replace(cold, decided_by={**decided, "bucket_cap_bytes": "128"})
    store = dist.HashStore()

    def peers(*schedules: Schedule) -> list[dict[str, Any]]:
        for rank, s in enumerate(schedules):
            store.set(f"detail/{rank}", s.to_json())
        return [{"rank": r, "digest": s.digest, "decided": s.decided_by_digest, "detail": f"detail/{r}"} for r, s in enumerate(schedules)]

    assert _compare(store, "0/0", "dp", peers(warm, cold)) == ""
    text = _compare(store, "0/0", "dp", peers(warm, other))
    assert "bucket_cap_bytes: 64 on rank 0, 128 on rank 1" in text and "schedule is unknown" in text
