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
