"""dtcompile: a ``torch.compile`` backend for DTensor programs.

``torch.compile(model, backend="dtcompile")`` works once the package is
installed; ``dtcompile.backend(**options)`` makes a configured one.
``dtcompile.local_map`` is :func:`dtcompile.hops.local_map`: torch's ``local_map`` as one
op that keeps its placements through to the backend.  ``dtcompile.auto_parallel``
(a callable subpackage) chooses a model's placements.
``dtcompile.compile_step`` compiles a whole training step (forward, loss,
backward, optionally the optimizer) as one graph.

Importing ``dtcompile`` has no side effects and imports nothing heavy: each name
below is loaded on first use, and Dynamo is changed only when a backend is
made (:func:`backend`, or torch looking the name ``"dtcompile"`` up).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are; loaded lazily by __getattr__
    from dtcompile.compiler import DTCompileBackend
    from dtcompile.config import DTCompileConfig
    from dtcompile.cost.calibrate import calibrate
    from dtcompile.graph.collectives import CollectiveInfo
    from dtcompile.hops.local_map import local_map
    from dtcompile.ranks.check import RanksDisagree
    from dtcompile.records import CompiledGraph
    from dtcompile.registry import backend
    from dtcompile.report import Report, explain
    from dtcompile.step import CompiledStep, compile_step

__all__ = [
    "CollectiveInfo",
    "CompiledGraph",
    "CompiledStep",
    "DTCompileBackend",
    "DTCompileConfig",
    "RanksDisagree",
    "Report",
    "auto_parallel",
    "backend",
    "calibrate",
    "compile_step",
    "explain",
    "local_map",
]

_WHERE = {
    "CollectiveInfo": "dtcompile.graph.collectives",
    "CompiledGraph": "dtcompile.records",
    "CompiledStep": "dtcompile.step",
    "DTCompileBackend": "dtcompile.compiler",
    "DTCompileConfig": "dtcompile.config",
    "RanksDisagree": "dtcompile.ranks.check",
    "Report": "dtcompile.report",
    "auto_parallel": "dtcompile.auto_parallel",
    "backend": "dtcompile.registry",
    "calibrate": "dtcompile.cost.calibrate",
    "compile_step": "dtcompile.step",
    "explain": "dtcompile.report",
    "local_map": "dtcompile.hops.local_map",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dtcompile' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    # `auto_parallel` is a callable subpackage: the module is the value.
    value = module if module.__name__ == f"dtcompile.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
