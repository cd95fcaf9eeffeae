"""What the auto-parallel tests share: the step cost of a compiled program, and collectives as multisets.

The solution and the hand-written plans are compared the same way: each model is
compiled with dtcompile (``inductor=False``: the same AOT graphs and passes),
run forward and backward once, and every compiled graph is played by
:func:`dtcompile.simulate.simulate` under one hardware profile.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import dtcompile
from dtcompile.cost_model import get_profile
from dtcompile.report import backward_from_sum
from dtcompile.simulate import simulate

# Passes that merge collectives: off when the compiled collectives are compared one
# by one with the predicted ones (bucketing merges several into one).
KEEP_COLLECTIVES = frozenset({"bucketing"})


def compiled_records(model: Any, *args: Any, disable_passes: frozenset[str] = frozenset()) -> list[Any]:
    """Compile ``model`` with dtcompile, run one forward and backward, return the graphs' records."""
    torch._dynamo.reset()
    backend = dtcompile.backend(inductor=False, disable_passes=set(disable_passes))
    out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    backward_from_sum(out)
    return list(backend.records)


def step_us(records: list[Any], profile: str = "h100") -> float:
    """Estimated time of the compiled forward and backward graphs, end to end."""
    hw = get_profile(profile)
    return sum(simulate(r.graph.graph, hw).total_us for r in records)


def compiled_collectives(records: list[Any]) -> Counter:
    """``(direction, op, axis, bytes)`` of every collective the compiled graphs issue."""
    return Counter(
        ("backward" if r.kind == "backward" else "forward", c.op, c.axis, c.bytes) for r in records for c in r.collectives
    )


def predicted_collectives(solution: Any) -> Counter:
    return Counter(c.key() for c in solution.predicted_collectives())
