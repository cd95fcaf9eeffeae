"""The backend's names: ``dtcompile.backend(**options)``, and ``"dtcompile"`` in torch's registry.

``torch.compile(model, backend="dtcompile")`` finds the name through the
``torch_dynamo_backends`` entry point ``dtcompile.registry:dtcompile``: torch
loads it on its first lookup of the name, which makes one default backend per
process (:func:`named_backend`).  Making any backend installs :mod:`dynamo_vars`
into Dynamo; ``dynamo_vars.uninstall()`` makes torch forget the name (its next
lookup installs again) and says that the backends made before trace with stock
Dynamo.  Nothing happens at import.
"""

from __future__ import annotations

import warnings
from typing import Any

import dynamo_vars
from dtcompile.compiler import _STOCK_TRACING, DTCompileBackend
from dtcompile.config import DTCompileConfig

__all__ = ["backend", "named_backend"]


def backend(**options: Any) -> DTCompileBackend:
    """Returns the dtcompile compiler function, configured by ``options``.

    ``options`` are the fields of :class:`DTCompileConfig`; an unknown name is a
    ``ValueError`` that lists the valid ones::

        model = torch.compile(model, backend=dtcompile.backend(inductor=False))

    Making a backend installs :mod:`dynamo_vars` into Dynamo (once per process),
    so that Dynamo traces the DTensor code before the backend sees it.
    """
    config = DTCompileConfig.from_options(options)
    dynamo_vars.install()
    dynamo_vars.on_uninstall(_say_backends_trace_stock)
    return DTCompileBackend(config)


def _say_backends_trace_stock() -> None:
    warnings.warn(
        f"dynamo_vars.uninstall(): the dtcompile backends made before are on stock Dynamo now: {_STOCK_TRACING}",
        stacklevel=3,
    )


_named: DTCompileBackend | None = None
_entry_point: Any = None


def _forget_named() -> None:
    """After ``dynamo_vars.uninstall()``: torch forgets the name (and gets its entry point
    back, which its registry replaced by None), so its next lookup installs again."""
    from torch._dynamo.backends import registry

    if _named is not None and registry._COMPILER_FNS.get("dtcompile") is _named:
        del registry._COMPILER_FNS["dtcompile"]
        if _entry_point is not None:
            registry._BACKENDS["dtcompile"] = _entry_point


def named_backend() -> DTCompileBackend:
    """What ``torch.compile(backend="dtcompile")`` resolves to: one default backend per
    process, which installs :mod:`dynamo_vars` each time torch looks the name up."""
    global _named, _entry_point
    from torch._dynamo.backends import registry

    if _named is None:
        _named = DTCompileBackend(DTCompileConfig())
    # Called while torch loads the entry point, before its registry forgets it.
    _entry_point = registry._BACKENDS.get("dtcompile") or _entry_point
    dynamo_vars.install()
    dynamo_vars.on_uninstall(_forget_named)
    return _named


def __getattr__(name: str) -> Any:
    # The entry point ``dtcompile.registry:dtcompile``: loaded when torch looks the
    # name up, never at import.
    if name == "dtcompile":
        return named_backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
