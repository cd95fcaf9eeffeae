"""An ``as_strided_`` that changes only the strides of size-1 dims (ATen's adaptive average pool to
one element gives its mean channels-last strides so) is no op to place: the planner drops it, and a
model pooled by ``AdaptiveAvgPool1d(1)`` over a transposed input (Swin's pooler) plans and computes
as the single-process model.  One that changes a layout stays, and is refused as before."""

from __future__ import annotations

import pytest
import torch
from support.ap_cases import apply_and_step, assert_matches_reference
from torch import nn

import dtcompile
from dtcompile.auto_parallel.trace import trace_forward
from dtcompile.testing import fake_world, run_threaded


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.proj(x).transpose(1, 2)).flatten(1))


class Restrided(nn.Module):
    """Writes new strides over a size-8 dim: a layout change, not a no-op."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) * 2
        return y.as_strided_((8, 8), (1, 8))


def _ops(model: nn.Module, x: torch.Tensor) -> list[str]:
    traced = trace_forward(model, (x,), "cpu")
    return [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]


def test_a_restride_of_size_1_dims_is_dropped_and_one_of_a_layout_is_kept():
    pooled = _ops(Pooled(), torch.randn(4, 8, 16))
    assert "aten.mean.dim" in pooled and "aten.as_strided_.default" not in pooled
    assert "aten.as_strided_.default" in _ops(Restrided(), torch.randn(8, 8))


def test_a_layout_changing_restride_is_still_refused_with_the_models_line():
    with fake_world(4, (4,), ("tp",)) as mesh, pytest.raises(ValueError, match=r"node as_strided_ \(aten.as_strided_"):
        dtcompile.auto_parallel.plan(Restrided(), mesh, (torch.randn(8, 8),))


@pytest.mark.models
def test_a_model_pooled_by_adaptive_avg_pool_plans_and_equals_the_single_process_model():
    torch.manual_seed(0)
    model, args = Pooled(), (torch.randn(4, 8, 16),)
    with fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        solution = dtcompile.auto_parallel.plan(model, mesh, args, param_memory_budget_bytes=(16 * 32 + 32 + 32 * 8 + 8) * 4 // 2)
    results = run_threaded(4, apply_and_step, model, args, (2, 2), ("dp", "tp"), solution)
    assert_matches_reference(results)
