"""The plan's memory as the training step's peak (``memory_budget_bytes``, ``dtcompile.auto_parallel.peak``):
a budget only the peak model can see (activations dominate, the parameters are small) changes the
plan, and the compiled step's measured peak is within 10% of the plan's estimate and under the budget;
a budget below the least peak is an error naming that peak; the options are checked."""

from __future__ import annotations

import pytest
import torch
from support.peak_models import Stack, measured_peak
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile.auto_parallel import Infeasible
from dtcompile.testing import fake_world


@pytest.fixture
def stack():
    torch.manual_seed(0)
    return Stack(), torch.randn(512, 32)


@pytest.mark.inductor
def test_a_budget_only_the_step_peak_sees_is_kept_by_the_compiled_step(stack):
    model, x = stack
    with fake_world(4, (4,), ("dp",)) as mesh:
        free = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adam")
        # No collective at all is cheapest: everything replicated, every rank holding every activation.
        assert set(free.param_placements.values()) | set(free.input_placements) == {(Replicate(),)}
        budget = free.peak_memory().total // 2
        # A budget on parameter bytes does not see it: the same plan, over the budget when run.
        blind = dtcompile.auto_parallel.plan(model, mesh, (x,), param_memory_budget_bytes=budget)
        assert blind.param_placements == free.param_placements and blind.input_placements == free.input_placements
        # One budget serves the plan and the compile: the plan reads the compile config's.
        backend = dtcompile.backend(memory_budget_bytes=budget)
        planned = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adam", config=backend)
        assert planned.memory_budget_bytes == budget
        estimate = planned.peak_memory()
        assert estimate.total <= budget < free.peak_memory().total
        assert planned.cost_us > free.cost_us  # memory bought with time
        assert f"budget {dtcompile.base.notation.format_bytes(budget)}" in planned.explain().splitlines()[-1]

        measured = measured_peak(model, x, planned, backend)
        assert measured == pytest.approx(estimate.total, rel=0.10), (measured, estimate)
        assert measured <= budget, (measured, budget)
        torch._dynamo.reset()
        over = measured_peak(model, x, blind, dtcompile.backend())
        assert over > budget, (over, budget)
        assert over == pytest.approx(free.peak_memory().total, rel=0.10)


def test_a_budget_below_the_least_peak_is_an_error_naming_it(stack):
    model, x = stack
    with fake_world(4, (4,), ("dp",)) as mesh:
        with pytest.raises(Infeasible) as caught:
            dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adamw", memory_budget_bytes=100_000)
        least = caught.value.least_peak_bytes
        assert least is not None and least > 100_000
        assert "memory_budget_bytes=100000" in str(caught.value) and f"{least} B" in str(caught.value)
        # The least peak is one a plan reaches: at exactly that budget it plans, and a byte less it cannot.
        tight = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adamw", memory_budget_bytes=least)
        assert tight.peak_memory().total == least
        with pytest.raises(Infeasible):
            dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adamw", memory_budget_bytes=least - 1)


def test_the_optimizer_state_counts_per_parameter_shard(stack):
    model, x = stack
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with fake_world(4, (4,), ("dp",)) as mesh:
        sgd = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer=torch.optim.SGD).peak_memory()
        adam = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="Adam").peak_memory()
    assert sgd.kinds["parameters"] == adam.kinds["parameters"] == params  # replicated: each rank holds them whole
    assert (sgd.kinds["optimizer state"], adam.kinds["optimizer state"]) == (0, 2 * params)
    assert adam.total - sgd.total == 2 * params


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"memory_budget_bytes": "1GB"}, "memory_budget_bytes must be an int >= 1 or None, got '1GB'"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes must be an int >= 1 or None, got 0"),
        ({"memory_budget_bytes": 10**6, "config": dtcompile.backend(memory_budget_bytes=10**7)},
         "memory_budget_bytes=1000000 but the compile config's memory_budget_bytes is 10000000"),
        ({"optimizer": "lamb"}, "optimizer='lamb' is not one the peak memory model knows"),
        ({"optimizer": torch.optim.LBFGS}, "is not one the peak memory model knows"),
    ],
)
def test_bad_memory_options_name_what_is_wrong(stack, options, message):
    model, x = stack
    with fake_world(4, (4,), ("dp",)) as mesh, pytest.raises(ValueError, match="auto_parallel: ") as caught:
        dtcompile.auto_parallel.plan(model, mesh, (x,), **options)
    assert message in str(caught.value)
