"""dtcompile: a ``torch.compile`` backend for DTensor programs.

``torch.compile(model, backend="dtcompile")`` works once the package is
installed; ``dtcompile.backend(**options)`` makes a configured one.
``dtcompile.local_map`` is :func:`hops.local_map`: torch's ``local_map`` as one
op that keeps its placements through to the backend.
"""

from dtcompile.collectives import CollectiveInfo
from dtcompile.compiler import CompiledGraph, DTCompileBackend, backend
from dtcompile.config import DTCompileConfig
from dtcompile.report import Report, explain
from hops.local_map import local_map

__all__ = [
    "CollectiveInfo",
    "CompiledGraph",
    "DTCompileBackend",
    "DTCompileConfig",
    "Report",
    "backend",
    "explain",
    "local_map",
]
