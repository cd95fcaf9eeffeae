"""dtcompile: a ``torch.compile`` backend for DTensor programs.

``torch.compile(model, backend="dtcompile")`` works once the package is
installed; ``dtcompile.backend(**options)`` makes a configured one.
"""

from dtcompile.collectives import CollectiveInfo
from dtcompile.compiler import CompiledGraph, DTCompileBackend, backend
from dtcompile.config import DTCompileConfig
from dtcompile.report import Report, explain

__all__ = ["CollectiveInfo", "CompiledGraph", "DTCompileBackend", "DTCompileConfig", "Report", "backend", "explain"]
