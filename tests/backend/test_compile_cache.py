"""torch's compile caches serve dtcompile's graphs: across processes, keyed on dtcompile's options.

A restarted job (same ``TORCHINDUCTOR_CACHE_DIR``, or artifacts from
``torch.compiler.save_cache_artifacts()``) gets every graph from AOTAutograd's
cache and every lowered graph from Inductor's FX graph cache; an option that
changes the compiled graphs misses.  Each run here is a fresh process: the keys
must be equal across processes, not only within one (a ``DeviceMesh`` input
pickled its per-process ``hash()`` into them).
"""

from __future__ import annotations

import copyreg
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dtcompile
from dtcompile._testing.cases import CASES, StepResult, assert_steps_close, cache_counts, reference_step, run_step
from dtcompile.cache_keys import compile_key, rank_position, stable_mesh_keys
from dtcompile.config import DTCompileConfig
from dtcompile.cost import get_profile
from dtcompile.pipeline.partition import Partitioner
from dtcompile.testing import fake_world, run_gloo

TOL = dict(rtol=1e-5, atol=1e-5)

# One training step of the tensor + sequence parallel block on the fake process
# group (world 4), compiled with dtcompile(**options) and Inductor; prints the
# caches' counters and the backend's records as JSON.  argv: options as JSON,
# then "save PATH" / "load PATH" for torch's portable cache artifacts.
_FAKE_PG_STEP = textwrap.dedent(
    """
    import json, sys
    import torch

    options = json.loads(sys.argv[1])
    if "disable_passes" in options:
        options["disable_passes"] = set(options["disable_passes"])
    if sys.argv[2:3] == ["load"]:
        torch.compiler.load_cache_artifacts(open(sys.argv[3], "rb").read())

    import dtcompile
    from dtcompile._testing.cases import CASES, cache_counts, run_step
    from dtcompile.testing import fake_world

    with fake_world(4):
        case = CASES["tp_sp_block"]
        _, parallel, x = case.build(case.mesh(4))
        backend = dtcompile.backend(**options)
        run_step(torch.compile(parallel, backend=backend, fullgraph=True), parallel, x)
    if sys.argv[2:3] == ["save"]:
        data, _ = torch.compiler.save_cache_artifacts()
        open(sys.argv[3], "wb").write(data)
    print("COUNTERS " + json.dumps(cache_counts(backend)))
    """
)


def _fake_pg_step(cache_dir: Path, *args: str, **options) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    out = subprocess.run(
        [sys.executable, "-c", _FAKE_PG_STEP, json.dumps(options), *args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Failed to pickle" not in text and "Traceback" not in text, text[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("COUNTERS ")]
    return json.loads(line.removeprefix("COUNTERS "))


def _cold(counts: dict[str, int]) -> None:
    assert counts.get("autograd_cache_hit", 0) == 0 and counts.get("fxgraph_cache_hit", 0) == 0, counts
    assert counts["compiled"] >= 4 and counts["cached"] == 0 and counts["fallbacks"] == 0, counts


def _warm(counts: dict[str, int], cold: dict[str, int]) -> None:
    """Every Dynamo graph from AOTAutograd's cache, every lowered graph from Inductor's."""
    assert counts.get("autograd_cache_hit", 0) == cold["autograd_cache_miss"] >= 3, counts
    assert counts.get("autograd_cache_miss", 0) == 0 and counts.get("fxgraph_cache_miss", 0) == 0, counts
    assert counts.get("fxgraph_cache_bypass", 0) == 0, counts
    assert counts.get("fxgraph_cache_hit", 0) == cold["fxgraph_cache_miss"], counts
    assert counts["compiled"] == 0 and counts["cached"] == cold["autograd_cache_miss"], counts


@pytest.mark.subprocess
@pytest.mark.inductor
def test_a_second_process_hits_both_caches_and_a_changed_option_misses(tmp_path):
    cold = _fake_pg_step(tmp_path)
    _cold(cold)
    _warm(_fake_pg_step(tmp_path), cold)
    # An option that changes the compiled graphs misses, in the same cache folder (that
    # every option is in the key: test_the_key_covers_the_options_that_change_graphs_and_no_others).
    for changed in ({"bucket_cap_bytes": 1024},):
        counts = _fake_pg_step(tmp_path, **changed)
        assert counts.get("autograd_cache_hit", 0) == 0, (changed, counts)
        assert counts["compiled"] >= 4 and counts["cached"] == 0, (changed, counts)
    # aot_cache=False compiles every graph here (to inspect it).
    counts = _fake_pg_step(tmp_path, aot_cache=False)
    assert counts["compiled"] == cold["compiled"] and counts["cached"] == 0, counts
    assert "autograd_cache_hit" not in counts and "autograd_cache_miss" not in counts, counts


@pytest.mark.subprocess
@pytest.mark.inductor
def test_portable_cache_artifacts_load_in_a_fresh_process_with_another_cache_dir(tmp_path):
    artifacts = tmp_path / "artifacts.bin"
    cold = _fake_pg_step(tmp_path / "first", "save", str(artifacts))
    _cold(cold)
    assert artifacts.stat().st_size > 0
    _warm(_fake_pg_step(tmp_path / "second", "load", str(artifacts)), cold)


def _gloo_cached_step(rank: int, world_size: int, cache_dir: str) -> tuple[StepResult, StepResult, dict[str, int]]:
    """On one gloo rank: an eager step, then a step compiled with dtcompile (Inductor)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    case = CASES["tp_sp_block"]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    local_x = case.local_input(x, mesh)
    eager = run_step(parallel, parallel, local_x)
    backend = dtcompile.backend()
    compiled = run_step(torch.compile(parallel, backend=backend, fullgraph=True), parallel, local_x)
    return eager, compiled, cache_counts(backend)


# Soak: tests/warm's shared-models test restarts gloo ranks from the cache on every shared
# case, this one's tp_sp_block among them, against eager and one process.
@pytest.mark.soak
@pytest.mark.inductor
@pytest.mark.gloo
def test_gloo_ranks_restarted_from_the_cache_equal_eager_and_one_process(tmp_path):
    """Real collectives: each rank's second process gets every graph from the caches,
    and its output and gradients equal eager's and the single-process model's."""
    world_size = 2
    reference = reference_step("tp_sp_block", world_size)
    runs = [run_gloo(world_size, _gloo_cached_step, world_size, str(tmp_path), timeout=600) for _ in range(2)]
    for rank in range(world_size):
        (eager, compiled, cold), (warm_eager, warm_compiled, warm) = runs[0][rank], runs[1][rank]
        _cold(cold)
        _warm(warm, cold)
        assert_steps_close(eager, reference, f"rank {rank} eager vs one process", **TOL)
        assert_steps_close(compiled, eager, f"rank {rank} cold compiled vs eager", **TOL)
        assert_steps_close(warm_compiled, warm_eager, f"rank {rank} compiled from the cache vs eager", **TOL)


def test_the_key_covers_the_options_that_change_graphs_and_no_others():
    base = DTCompileConfig()
    h100 = get_profile("h100")
    key = compile_key(base, h100)
    for changed in (
        base.replace(bucket_cap_bytes=1024),
        base.replace(disable_passes=frozenset({"bucketing"})),
        base.replace(overlap_memory_budget_bytes=0),
        base.replace(cost_profile="cpu_gloo"),
        base.replace(inductor=False),
        base.replace(inductor_config={"max_autotune": True}),
    ):
        assert compile_key(changed, h100) != key, changed
    for same in (base.replace(report=True), base.replace(trace_pass_graphs=True), base.replace(eager_fallback=False)):
        assert compile_key(same, h100) == key, same
    # The profile a graph is priced with (what "auto" picked for it) is in the key by its numbers.
    assert compile_key(base, get_profile("cpu_gloo")) != key
    assert compile_key(base, dataclasses.replace(h100, overlap=0.5)) != key
    # The inputs' spmd_types types: the same graph typed otherwise is compiled and checked again.
    assert compile_key(base, h100, input_types=(None, None)) == key
    row = compile_key(base, h100, input_types=({"tp": "S(0)"}, None))
    assert row != key and "spmd_types=(tp:S(0); -)" in row
    assert compile_key(base, h100, input_types=({"tp": "R"}, None)) not in (row, key)
    # Sets are keyed in a fixed order, whatever the process's string hashing.
    two = base.replace(disable_passes=frozenset({"bucketing", "overlap"}))
    assert "disable_passes={'bucketing', 'overlap'}" in compile_key(two, h100)
    # The partitioner carries it into both caches' keys.
    assert Partitioner((), key).uuid() != Partitioner((), compile_key(two, h100)).uuid()
    uneven = ("x (dim 0 of size 3 over 2 shards)",)
    assert pickle.loads(pickle.dumps(Partitioner(uneven, key))).uuid() == Partitioner(uneven, key).uuid()


def test_a_mesh_pickles_without_its_hash_only_while_dtcompile_compiles():
    from torch.distributed.device_mesh import DeviceMesh

    with fake_world(4) as mesh:
        hash(mesh)  # computes and caches _hash
        assert "_hash" in mesh.__getstate__()
        with stable_mesh_keys():
            restored = pickle.loads(pickle.dumps(mesh))
            assert "_hash" not in restored.__dict__
        assert DeviceMesh not in copyreg.dispatch_table
        # The mesh it loads as is the same mesh, its hash recomputed on first use.
        assert restored == mesh and hash(restored) == hash(mesh)


@pytest.mark.inductor
def test_collective_schedule_compiles_every_graph_even_where_the_cache_could_serve_it(tp_mesh):
    """A schedule is read from what dtcompile compiles; a graph AOTAutograd's cache
    served would leave nothing to read (an earlier run compiled it)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtcompile.testing import collective_schedule

    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])

    def gather(t):
        return t.redistribute(placements=[Replicate()]).sin()

    # The cache holds the graph now: a plain compile is served from it.
    torch.compile(gather, backend=dtcompile.backend(), fullgraph=True)(x)
    torch._dynamo.reset()
    served = dtcompile.backend()
    torch.compile(gather, backend=served, fullgraph=True)(x)
    assert (len(served.records), len(served.cached)) == (0, 1)
    torch._dynamo.reset()
    backend = dtcompile.backend()
    schedule = collective_schedule(gather, x, backend=backend, backward=False)
    assert [c.op for c in schedule.forward] == ["all_gather"]
    assert (len(backend.records), len(backend.cached)) == (1, 0)


def _positions(build, world_size: int = 2) -> list[str]:
    """What :func:`rank_position` says of the Dynamo graph of ``build(mesh) -> (fn, args)`` on each rank."""
    positions = []
    for rank in range(world_size):
        with fake_world(world_size, rank=rank) as mesh:
            fn, args = build(mesh)
            seen = []

            def capture(gm, example_inputs):
                seen.append(rank_position(gm, example_inputs))
                return gm.forward

            torch._dynamo.reset()
            torch.compile(fn, backend=capture, fullgraph=True)(*args)
            (position,) = seen
            positions.append(position)
    return positions


def _gathered_stack(mesh):
    _, parallel, x = CASES["gathered_stack"].build(mesh)
    return parallel, (x,)


def _plain_all_reduce(mesh):
    from torch.distributed import _functional_collectives as funcol

    return (lambda x: funcol.all_reduce(x * 2, "sum", mesh.get_group()).sin()), (torch.ones(4),)


def test_a_graph_holding_a_mesh_keys_on_the_rank_and_a_plain_one_does_not():
    # Issue #37: the backward of to_local() slices this rank's chunk, baked into the graph;
    # the key must tell the ranks apart, or a shared cache folder serves one rank's graph to all.
    positions = _positions(_gathered_stack)
    assert positions == ["0 of 2: DeviceMesh((dim0=2)) at (0,)", "1 of 2: DeviceMesh((dim0=2)) at (1,)"], positions
    keys = {compile_key(DTCompileConfig(), get_profile("h100"), p) for p in positions}
    assert len(keys) == 2 and all(f"rank={p})" in k for p, k in zip(positions, sorted(keys))), keys
    # Plain tensors and functional collectives: the trace reads no rank; one entry serves all.
    assert _positions(_plain_all_reduce) == ["", ""]
    assert compile_key(DTCompileConfig(), get_profile("h100"), "") == compile_key(DTCompileConfig(), get_profile("h100"))


def _untraced(job):
    """AOTAutograd returning the graph without tracing it (as its cache does on a hit)."""
    return job.gm.forward


@pytest.mark.parametrize("hit_counted", [True, False], ids=["cache-hit-counted", "no-hit-counted"])
def test_a_graph_is_recorded_as_served_only_where_aot_autograd_counted_a_hit(monkeypatch, hit_counted):
    """The cache hit is AOTAutograd's own count, not the absence of a trace: a graph
    neither traced nor counted is an error, never recorded as served from the cache."""
    from torch._dynamo.utils import counters

    from dtcompile.pipeline.graph_compile import GraphCompile

    def served(job):
        if hit_counted:
            counters["aot_autograd"]["autograd_cache_hit"] += 1
        return _untraced(job)

    monkeypatch.setattr(GraphCompile, "_aot_only", served)
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(lambda t: t * 2, backend=backend)
    if hit_counted:
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
        assert [c.compile_id for c in backend.cached] == ["0/0"] and not backend.records
    else:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="without tracing it here and without a cache hit"):
            compiled(torch.ones(3))
        assert not backend.cached
