"""``local_map`` regions are constraints: the solution reads, makes and hands back gradients at a
region exactly in its declared placements, and the compiled program keeps the region whole."""

from __future__ import annotations

import pytest
from support.ap_cases import (
    KEEP_COLLECTIVES,
    compiled_collectives,
    compiled_records,
    plan_case,
    predicted_collectives,
    step_us,
)
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtcompile

HEADS = (Shard(1),)  # RegionAttention's q, k, v and output: sharded on heads


@pytest.mark.models
def test_the_solution_meets_the_region_at_its_declared_placements(tp_mesh):
    reference, hand, x, solution, _ = plan_case("tp_sp_block_local_map", tp_mesh)
    regions = [n for n in solution.problem.nodes.values() if n.kind == "region"]
    assert len(regions) == 1
    region = solution.choice(regions[0].name)
    assert region.inputs == (HEADS,) * 3
    assert region.outputs == (HEADS,)
    assert region.grads == (HEADS,) * 3  # in_grad_placements, as declared
    line = next(line for line in solution.explain().splitlines() if "local_map" in line)
    assert line.startswith(
        "causal_attention = local_map[causal_attention](transpose, transpose_1, transpose_2)  "
        "# placement=(S(1), S(1), S(1)) -> S(1), cost=["
    )

    model = dtcompile.auto_parallel.parallelize(reference, solution)
    auto_x = distribute_tensor(x, tp_mesh, (Replicate(),), src_data_rank=None)
    records = compiled_records(model, auto_x, disable_passes=KEEP_COLLECTIVES)
    specs = [str(r.spec) for record in records for r in record.regions]
    assert specs == [  # the forward region and its backward, as declared
        "causal_attention on (tp=4): [S(1), S(1), S(1)] -> [S(1)] | grads [S(1), S(1), S(1)] | saved 6",
        "causal_attention on (tp=4): [S(1)] -> [S(1), S(1), S(1)] | grads [S(1), S(1), S(1)] | saved 6 | backward",
    ]
    assert predicted_collectives(solution) == compiled_collectives(records)
    assert step_us(compiled_records(model, auto_x)) <= step_us(compiled_records(hand, x))
