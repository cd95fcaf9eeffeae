"""Passes that change collectives do not run where ranks' graphs can differ.

Each rank runs the passes on its own AOT graph.  With an uneven shard the
graphs differ between ranks (padding on one, an empty shard on another), so a
decision made from one rank's graph could make the ranks issue different
collectives: a hang (found by the fuzzer, ``tests/fuzz``).  Such graphs keep
the collectives DTensor chose, and every pass record says why.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import dtcompile
from dtcompile.base.torch_compat import dot_of_partials_reduce_scatters
from dtcompile.testing import fake_world


def _records(global_rows: int):
    backend = dtcompile.backend(inductor=False)
    with fake_world(2) as mesh:
        x = distribute_tensor(torch.randn(global_rows, 3), mesh, [Shard(0)], src_data_rank=None)
        torch._dynamo.reset()
        torch.compile(lambda t: torch.nn.functional.linear(t, t), backend=backend, fullgraph=True)(x)
    return backend.records


@pytest.mark.parametrize("rows", [1, 3])
def test_uneven_shards_keep_the_collectives_dtensor_chose(rows):
    (record,) = _records(rows)
    by_name = {p.name: p for p in record.passes}
    for name in ("async_tp", "bucketing", "overlap"):
        (decision,) = by_name[name].decisions
        assert decision.text.startswith(f"not run: sharded unevenly: l_t_ (dim 0 of size {rows} over 2 shards)")
        assert by_name[name].collectives_before == by_name[name].collectives_after
    assert all("not run" not in d.text for d in by_name["annotate"].decisions)


def test_even_shards_run_every_pass():
    (record,) = _records(4)
    assert [d.text for p in record.passes for d in p.decisions if "not run" in d.text] == []
    assert [d.text for p in record.passes if p.name == "async_tp" for d in p.decisions] == [
        "not fused: no matmul consumes the gathered tensor as its left operand"
    ]


def _collectives_per_rank(world: int, program, make_input) -> list[list[tuple[str, str]]]:
    """Each rank's compiled graphs' collectives (kind, op), played rank by rank on the fake PG."""
    found = []
    for rank in range(world):
        backend = dtcompile.backend(inductor=False)
        with fake_world(world, rank=rank) as mesh:
            torch._dynamo.reset()
            out = torch.compile(lambda t: program(t, mesh), backend=backend, fullgraph=True)(make_input(mesh))
            if isinstance(out, tuple):
                out[1].backward()
        found.append([(r.kind, c.op) for r in backend.records for c in r.collectives])
    return found


def _strided(mesh, rows: int, cols: int, dim: int):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [_StridedShard(dim, split_factor=2)]
    local, _ = compute_local_shape_and_global_offset((rows, cols), mesh, placements)
    x = DTensor.from_local(torch.randn(local), mesh, placements, run_check=False, shape=(rows, cols), stride=(cols, 1))
    return x.requires_grad_()


def test_a_rank_with_an_empty_share_issues_the_same_collectives():
    """A rank whose share of a gathered result is empty computes it as a constant; the
    partitioner's dead-code pass dropped its all-gather there, and the other ranks
    waited in theirs (a hang, found by the fuzzer)."""
    per_rank = _collectives_per_rank(4, lambda t, mesh: t.redistribute(mesh, [Shard(0)]), lambda m: _strided(m, 5, 3, 0))
    assert per_rank[3] == per_rank[0] == [("forward", "all_gather")]
    assert all(c == per_rank[0] for c in per_rank)


def test_a_collective_traced_in_the_backward_stays_there_on_every_rank():
    """With a backward, the empty-share rank's forward also held a copy of the backward's
    all-gather (dead there), which the other ranks issue in the backward."""

    def program(t, mesh):
        t0 = t.redistribute(mesh, [Shard(0)])
        return t0.detach(), t0.full_tensor().sum()

    per_rank = _collectives_per_rank(2, program, lambda m: _strided(m, 1, 4, 1))
    want = [("forward", "all_gather"), ("forward", "all_gather"), ("backward", "all_gather")]
    assert per_rank == [want, want]


def test_an_ops_own_uneven_redistribution_keeps_the_collectives_on_every_rank():
    """``x @ x`` of a Partial vector of 3 over 2 ranks: DTensor reduce-scatters each operand
    to an uneven Shard(0) inside the op, where the Dynamo graph shows no uneven DTensor.
    Bucketing merged the two reduce-scatters on rank 0 only (the graphs differ after the
    collectives), and rank 1 failed (found by the fuzzer); the AOT graph's padding says so."""
    from torch.distributed.tensor import DTensor, Partial

    decisions = []
    for rank in range(2):
        backend = dtcompile.backend(inductor=False)
        with fake_world(2, rank=rank) as mesh:
            torch._dynamo.reset()
            x = DTensor.from_local(torch.randn(3), mesh, [Partial()], run_check=False)
            torch.compile(lambda t: t @ t, backend=backend, fullgraph=True)(x)
        (record,) = backend.records
        decisions.append({p.name: [d.text for d in p.decisions] for p in record.passes})
        if not dot_of_partials_reduce_scatters():
            # torch >= 2.14 all-reduces the operand once: nothing uneven, and
            # every rank's passes decide alike.
            assert [c.op for c in record.collectives] == ["all_reduce"]
            continue
        assert [c.op for c in record.collectives] == ["reduce_scatter", "reduce_scatter"]
    if not dot_of_partials_reduce_scatters():
        assert decisions[0] == decisions[1]
        return
    for name in ("async_tp", "bucketing", "overlap"):
        for per_rank in decisions:
            (text,) = per_rank[name]
            assert text.startswith("not run: sharded unevenly: reduce_scatter_tensor (its input padded by ")


def _dynamic_records(make_input, program=lambda t, mesh: torch.nn.functional.linear(t, t)):
    """The records of ``program(make_input(mesh), mesh)`` compiled on 2 simulated ranks."""
    backend = dtcompile.backend(inductor=False)
    with fake_world(2) as mesh:
        torch._dynamo.reset()
        x = make_input(mesh)
        torch.compile(lambda t: program(t, mesh), backend=backend, fullgraph=True)(x)
    return backend.records


def _not_run(records) -> list[str]:
    return [d.text for r in records for p in r.passes for d in p.decisions if "not run" in d.text]


def test_a_symbolic_size_known_to_divide_is_even():
    """A shard of global rows ``2 * s0`` (Dynamo's for a DTensor marked dynamic) is even
    whatever ``s0``: the passes run (the fuzzer's FSDP x TP, recompiled on one dp coordinate,
    stopped bucketing its dp gathers where its peers bucketed theirs)."""
    def make(mesh):
        x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)], src_data_rank=None)
        torch._dynamo.mark_dynamic(x, 0)  # Dynamo makes the local rows s0, the global 2 * s0
        return x

    records = _dynamic_records(make)
    assert records and _not_run(records) == []
    texts = [d.text for r in records for p in r.passes for d in p.decisions]
    assert "not bucketed: its shape is symbolic (dynamic shapes); a bucket is built for one shape" in texts, texts


def test_a_symbolic_size_that_may_not_divide_is_uneven():
    """Global rows ``2 * s0 - 1`` over 2 ranks: uneven for every ``s0``, and the passes say so."""
    from torch.distributed.tensor import DTensor

    def make(mesh):
        local = torch.randn(3, 3)
        torch._dynamo.mark_dynamic(local, 0)
        return local

    def program(local, mesh):
        rows = 2 * local.shape[0] - 1
        x = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, 3), stride=(3, 1))
        return torch.nn.functional.linear(x, x)

    texts = _not_run(_dynamic_records(make, program))
    assert texts and all("symbolic size over 2 shards" in t for t in texts), texts
