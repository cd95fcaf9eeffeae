"""Auto-parallel: dtcompile chooses the placements.

``dtcompile.auto_parallel(model, mesh, example_inputs, ...)`` returns
``(parallel_model, solution)``: the model with DTensor parameters in the
placements a cost-driven solver chose over DTensor's own op strategies, and
what it chose and why (:class:`Solution`: ``explain()``,
``predicted_collectives()``).  ``plan(...)`` only solves; ``parallelize(model,
solution, mesh)`` applies a solution, also on another mesh of the same shape
(plan once on a fake process group, apply on every rank).

The modules, in the order the work flows:

- :mod:`~dtcompile.auto_parallel.trace` -- the forward as aten ops on fake tensors;
- :mod:`~dtcompile.auto_parallel.strategies` -- DTensor's candidate strategies per op;
- :mod:`~dtcompile.auto_parallel.local_ops` -- ops DTensor has no strategy for, run on local shards;
- :mod:`~dtcompile.auto_parallel.measure` -- an op's forward and backward, and a
  redistribution, priced with dtcompile's cost model;
- :mod:`~dtcompile.auto_parallel.transfer` -- an edge's redistributions, bucketed parameter collectives;
- :mod:`~dtcompile.auto_parallel.graph` -- the problem as data: nodes, candidates, edges, fan-out rules;
- :mod:`~dtcompile.auto_parallel.problem` -- each node's candidates, priced;
- :mod:`~dtcompile.auto_parallel.edges` -- the edges between them, fan-outs, parameters gathered again;
- :mod:`~dtcompile.auto_parallel.tying` -- repeated layers share one choice;
- :mod:`~dtcompile.auto_parallel.peak` -- the training step's peak memory per rank, as linear terms;
- :mod:`~dtcompile.auto_parallel.solver` -- the integer program (HiGHS), its named constraints;
- :mod:`~dtcompile.auto_parallel.solution` -- the choice, explained;
- :mod:`~dtcompile.auto_parallel.agreement` -- on real ranks, the mesh's ranks compare the plans they apply;
- :mod:`~dtcompile.auto_parallel.apply` -- the parallel model;
- :mod:`~dtcompile.auto_parallel.api` -- the entry points, arguments checked.

This package module is itself callable, ``dtcompile.auto_parallel(...)`` being
:func:`~dtcompile.auto_parallel.api.auto_parallel`: the name is both the
subpackage and the function, and a module attribute set to the function would
be replaced by the subpackage the first time any of its modules is imported.
Importing it imports nothing heavy and changes nothing outside this module.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtcompile.auto_parallel.api import auto_parallel, plan
    from dtcompile.auto_parallel.apply import AutoParallelModule, parallelize
    from dtcompile.auto_parallel.solution import Solution
    from dtcompile.auto_parallel.solver import Infeasible

__all__ = ["AutoParallelModule", "Infeasible", "Solution", "auto_parallel", "parallelize", "plan"]

_WHERE = {
    "AutoParallelModule": "dtcompile.auto_parallel.apply",
    "Infeasible": "dtcompile.auto_parallel.solver",
    "Solution": "dtcompile.auto_parallel.solution",
    "auto_parallel": "dtcompile.auto_parallel.api",
    "parallelize": "dtcompile.auto_parallel.apply",
    "plan": "dtcompile.auto_parallel.api",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dtcompile.auto_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return __getattr__("auto_parallel")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
