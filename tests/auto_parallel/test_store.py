"""Measurements kept on disk (``dtcompile.auto_parallel.store``): a later process plans the same model
without measuring again and reaches the same plan; another planner version, a switched-off store or an
unreadable file measures again."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import dtcompile
from dtcompile._testing.models import build_mlp
from dtcompile.auto_parallel import problem as problem_module
from dtcompile.auto_parallel import store


@pytest.fixture
def cold(monkeypatch, tmp_path):
    """A fresh process's tables, over an empty store in ``tmp_path``; calling it again starts
    another fresh process over the same store."""
    monkeypatch.setenv("DTCOMPILE_AUTO_PARALLEL_CACHE_DIR", str(tmp_path))

    def start():
        monkeypatch.setattr(problem_module, "_MEASURE_TABLES", collections.OrderedDict())

    start()
    return start


def _plan(mesh):
    reference, _, x = build_mlp(mesh)
    return dtcompile.auto_parallel.plan(reference, mesh, (x,))


def test_a_later_process_reads_the_measurements_and_makes_the_same_plan(tp_mesh, cold, tmp_path):
    first = _plan(tp_mesh)
    assert first.stats["measurements_made"] > 0 and list(tmp_path.glob("*.measures.pkl"))
    cold()
    again = _plan(tp_mesh)
    assert again.stats["measurements_made"] == 0 and again.stats["measurements_reused"] > 0
    assert again.cost_us == first.cost_us and again.param_placements == first.param_placements
    assert again.explain() == first.explain()


def test_another_planner_version_or_a_store_switched_off_measures_again(tp_mesh, cold, monkeypatch):
    _plan(tp_mesh)
    cold()
    monkeypatch.setattr(store, "_planner_version", lambda: "an edited cost model")
    assert _plan(tp_mesh).stats["measurements_made"] > 0
    cold()
    monkeypatch.setenv("DTCOMPILE_AUTO_PARALLEL_CACHE_DIR", "0")
    assert _plan(tp_mesh).stats["measurements_made"] > 0


def test_an_unreadable_file_is_measured_again_and_replaced(tp_mesh, cold, tmp_path, caplog):
    first = _plan(tp_mesh)
    for path in tmp_path.glob("*.pkl"):
        path.write_bytes(b"not a pickle")
    cold()
    with caplog.at_level("WARNING", logger="dtcompile.auto_parallel.store"):
        again = _plan(tp_mesh)
    assert "ignoring unreadable measurements" in caplog.text
    assert again.stats["measurements_made"] > 0 and again.cost_us == first.cost_us
    cold()
    assert _plan(tp_mesh).stats["measurements_made"] == 0


@pytest.mark.subprocess
def test_a_second_interpreter_plans_without_measuring(tmp_path):
    script = textwrap.dedent("""
        import json
        import dtcompile
        from dtcompile._testing.models import build_mlp
        from dtcompile.testing import fake_world

        with fake_world(4, (4,), ("tp",)) as mesh:
            reference, _, x = build_mlp(mesh)
            solution = dtcompile.auto_parallel.plan(reference, mesh, (x,))
        print(json.dumps({"made": solution.stats["measurements_made"], "cost": solution.cost_us,
                          "placements": {k: repr(v) for k, v in solution.param_placements.items()}}))
    """)
    env = {**os.environ, "DTCOMPILE_AUTO_PARALLEL_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["made"] > 0 and runs[1]["made"] == 0
    assert runs[1]["cost"] == runs[0]["cost"] and runs[1]["placements"] == runs[0]["placements"]


def test_only_values_that_pickle_back_equal_are_kept():
    """A value is written only if all it holds pickles back equal: DTensor's plain placements,
    numbers, strings, enums, tuples and the planner's dataclasses of them; not a placement
    subclass with state of its own (an embedding's ``_MaskPartial`` holds its mask), at any
    depth, nor an object of another kind."""
    import enum
    from dataclasses import dataclass

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

    from dtcompile.auto_parallel.graph import Candidate
    from dtcompile.auto_parallel.placements import PlannedCollective
    from dtcompile.base.channels import GraphKind

    @dataclass(frozen=True)
    class Holder:
        value: object

    layout = (Shard(0), Replicate())
    collective = PlannedCollective(GraphKind.BACKWARD, "all_reduce", "dp", 2, 64, 1)
    plain = Candidate((layout,), ((Partial(), _StridedShard(0, split_factor=2)),), (layout,), (None,),
                      1.5, 2.5, (collective,))
    assert store._plain(plain) and store._plain([1, 2.0, "x", None, True, GraphKind.FORWARD])
    assert store._plain(Holder(enum.Enum("E", "A").A)) and store._plain(Holder(()))
    masked = Candidate((layout,), ((_MaskPartial(), Replicate()),), (layout,), (None,), 1.5, 2.5)
    assert not store._plain(masked)
    assert not store._plain(Holder([(Shard(1), _MaskPartial())]))
    assert not store._plain(Holder(object())) and not store._plain({"a": 1})


def test_writing_removes_other_versions_files_not_written_for_30_days_and_nothing_else(tp_mesh, cold, tmp_path):
    month = store.KEEP_OTHER_VERSIONS_S + 3600
    files = {
        "old version, stale": "0123456789abcdef-" + "a" * 24 + ".measures.pkl",
        "old version, recent": "fedcba9876543210-" + "b" * 24 + ".measures.pkl",
        "before versioned names, stale": "c" * 24 + ".strategies.pkl",
        "a dead process's temporary, stale": "0123456789abcdef-" + "d" * 24 + ".transfers.4242.139.tmp",
        "not the store's, stale": "notes.pkl",
    }
    for name in files.values():
        (tmp_path / name).write_bytes(b"x")
    for what, name in files.items():
        if "stale" in what:
            os.utime(tmp_path / name, (time.time() - month, time.time() - month))
    _plan(tp_mesh)  # writes this version's tables
    left = {path.name for path in tmp_path.iterdir()}
    assert {what for what, name in files.items() if name in left} == {"old version, recent", "not the store's, stale"}
    mine = [name for name in left if name.startswith(store._planner_version() + "-")]
    assert any(name.endswith(".measures.pkl") for name in mine), left
    # This version's files, however old, stay: a later process reads them.
    for name in mine:
        os.utime(tmp_path / name, (time.time() - month, time.time() - month))
    cold()
    reference, _, x = build_mlp(tp_mesh, dim=8, hidden=24)
    other = dtcompile.auto_parallel.plan(reference, tp_mesh, (x,))  # measures, so writes (and prunes)
    assert other.stats["measurements_made"] > 0 and all((tmp_path / name).exists() for name in mine)
    cold()
    assert _plan(tp_mesh).stats["measurements_made"] == 0
