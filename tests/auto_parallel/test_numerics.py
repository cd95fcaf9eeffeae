"""Auto-parallel models compiled with dtcompile equal the single-process model, forward and
parameter gradients: on 4 threaded ranks, and the MLP on 2 real gloo ranks."""

from __future__ import annotations

import pytest
from ap_cases import assert_matches_reference, rank_step
from torch.distributed.tensor import Replicate

from dtcompile.testing import run_gloo, run_threaded

R = (Replicate(),)


@pytest.mark.models
def test_tp_mlp_on_4_threaded_ranks():
    # 1/3 of the replicated parameters: the solver must shard.
    budget = (16 * 32 * 2 + 32 + 16) * 4 // 3
    results = run_threaded(4, rank_step, "mlp", (4,), ("tp",), [R], [R], budget)
    assert_matches_reference(results)
    assert results[0][5]["w1.weight"] != R


def test_tp_mlp_on_2_gloo_ranks():
    budget = (16 * 32 * 2 + 32 + 16) * 4 // 2
    assert_matches_reference(run_gloo(2, rank_step, "mlp", (2,), ("tp",), [R], [R], budget))
