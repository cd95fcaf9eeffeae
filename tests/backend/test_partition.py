"""The partitioner: a module-level object torch's compile caches can key on, and no lasting patch of torch."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import dtcompile
from dtcompile.pipeline.partition import Partitioner
from dtcompile.testing import fake_world


def test_a_partitioner_pickles_as_its_setting_alone():
    """Inductor pickles its config, the partitioner with it, into the FX graph cache key:
    the key must not see this compile's callback (a closure: unpicklable, and new each time)."""
    called = []
    uneven = ("x (dim 0 of size 3 over 2 shards)",)
    first, second = Partitioner(uneven, on_start=lambda: called.append(1)), Partitioner(uneven, on_start=print)
    assert pickle.dumps(first) == pickle.dumps(second)
    assert pickle.dumps(first) != pickle.dumps(Partitioner(()))
    restored = pickle.loads(pickle.dumps(first))
    assert (restored.uneven, restored.on_start) == (uneven, None)
    assert first.uuid() == second.uuid() != Partitioner(()).uuid()


def test_keeping_collectives_leaves_torchs_partitioner_module_as_it_was():
    """The rules that keep collectives in their phase replace two functions of
    torch._functorch.partitioners only while such a partition runs."""
    from torch._functorch import partitioners

    before = (partitioners.is_not_collective, partitioners._must_be_in_forward)
    backend = dtcompile.backend(inductor=False)
    with fake_world(2) as mesh:
        # 3 rows over 2 ranks: uneven, so the partition keeps collectives.
        x = distribute_tensor(torch.randn(3, 4), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        out = torch.compile(lambda t: t.full_tensor().sin().sum(), backend=backend, fullgraph=True)(x)
        out.backward()
    (record,) = [r for r in backend.records if r.kind == "forward"]
    assert record.info.uneven
    assert (partitioners.is_not_collective, partitioners._must_be_in_forward) == before


@pytest.mark.subprocess
@pytest.mark.inductor
def test_the_demo_prints_no_cache_tracebacks(tmp_path):
    """Inductor's FX graph cache pickles the partitioner; a local class made it print
    'Failed to pickle cache key' with a traceback per graph and rank, and bypass the cache.

    Run under ``TORCH_TRACE`` too: its 4 ranks are threads writing one log, which
    ``dtcompile-report`` read as one rank with 12 compile ids, 18 recompiles and 4 times the
    per-rank collectives; it reads 4 ranks now, each with the 9 collectives the demo's
    ``explain()`` prints, no recompile, and the ranks agreeing."""
    import os

    from dtcompile_tools.report import divergence, read_trace

    env = {**os.environ, "TORCH_TRACE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "dtcompile.demo"], capture_output=True, text=True, timeout=600, check=False, env=env
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "OK: compiled matches eager and the reference" in text
    assert "Failed to pickle" not in text
    assert "Traceback" not in text
    # A quiet demo: no warning of ours or of torch's (numpy is a dependency: torch warns without it).
    assert "Warning" not in out.stderr and "warn" not in out.stderr.lower(), out.stderr[-3000:]
    trace = read_trace(tmp_path)
    assert sorted(trace.ranks) == [0, 1, 2, 3], sorted(trace.ranks)
    for rank, ranked in trace.ranks.items():
        counts = sum(d["totals"]["count"] for c in ranked.compiles.values() for d in c.collectives.values())
        assert (counts, ranked.recompiles) == (9, []), f"rank {rank}: {counts} collectives, {ranked.recompiles}"
        assert sorted(ranked.compiles) == ["0/0", "1/0", "2/0"], f"rank {rank}: {sorted(ranked.compiles)}"
    assert divergence(trace) == []
    assert any("ran as threads of one process" in w for w in trace.warnings), trace.warnings
