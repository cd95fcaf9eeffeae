"""How a mesh, a traced node's place in the model's code, and a number of bytes are named in
every message and report: the bottom of the house.

``describe_mesh`` gives ``DeviceMesh((dp=2, tp=4))``; ``real_object`` reaches the
real object behind the ``FakeScriptObject`` a trace sees; ``source_of`` gives the
model's line a traced node came from; ``format_bytes`` gives ``8.42 MiB`` (the
backend's records and the report tool's pages alike).  hops, dynamo_vars and the backend all
print these one way, so this module imports nothing of theirs (and nothing heavy:
torch is imported inside the functions).
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig
from pathlib import Path
from typing import Any

__all__ = ["BYTE_UNITS", "describe_mesh", "format_bytes", "is_library_file", "real_object", "source_of", "source_of_traceback"]

BYTE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
"""The units bytes are named in, largest first (below a KiB: ``B``)."""


def format_bytes(num: float) -> str:
    """Bytes as a reader wants them: ``512 B``, ``3.2 KiB``, ``8.42 MiB``, ``1.5 GiB``."""
    for unit, scale in BYTE_UNITS:
        if abs(num) >= scale:
            return f"{num / scale:.3g} {unit}"
    return f"{num:.0f} B"

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>[^\n]*)')
_DTCOMPILE = str(Path(__file__).resolve().parents[1]) + os.sep  # the dtcompile package
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def source_of(node: Any) -> str:
    """Where fx node ``node`` came from in the model's code, to follow its op in a message:
    ``", at FILE:LINE in FN: `CODE`"`` (the innermost frame of the model's code, not a
    :func:`library file <is_library_file>`, from the trace's stack traces:
    ``make_fx(record_stack_traces=True)``, or Dynamo's), or ``""`` when unknown (or no node)."""
    trace = node.meta.get("stack_trace") if node is not None else None
    frames = [(m["file"], m["line"], m["fn"], m["code"]) for m in _FRAME.finditer(trace or "")]
    return _innermost_user_frame(frames)


def source_of_traceback(tb: Any) -> str:
    """:func:`source_of` for a traceback (an exception's ``__traceback__``): its innermost frame of
    the model's code, in the same words."""
    import traceback

    return _innermost_user_frame([(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(tb)])


def is_library_file(path: str) -> bool:
    """Whether a frame in file ``path`` is not the model's code: torch's, dtcompile's, or Python's
    own (``<frozen importlib._bootstrap>`` too, but not the packages installed beside it).  Code
    run from a string (``<string>``: ``exec``, ``python -c``) is the user's."""
    return path.startswith(_libraries()) or path.startswith("<frozen ") or (
        path.startswith(_STDLIB) and not any(part in path for part in ("site-packages", "dist-packages"))
    )


@functools.cache
def _libraries() -> tuple[str, str]:
    import torch

    return (os.path.dirname(torch.__file__) + os.sep, _DTCOMPILE)


def _innermost_user_frame(frames: list[tuple[str, Any, str, str]]) -> str:
    kept = [f for f in frames if not is_library_file(f[0])]
    if not kept:
        return ""
    file, line, fn, code = kept[-1]
    return f", at {file}:{line} in {fn}: `{code.strip()}`"


def real_object(obj: Any) -> Any:
    """The real object behind a ``FakeScriptObject`` (what a trace sees), else ``obj``."""
    from torch._library.fake_class_registry import FakeScriptObject

    return obj.real_obj if isinstance(obj, FakeScriptObject) else obj


def describe_mesh(mesh: Any) -> str:
    """``DeviceMesh((dp=2, tp=4))``: shape and axis names, the short form of ``repr``."""
    mesh = real_object(mesh)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    axes = ", ".join(f"{name}={size}" for name, size in zip(names, mesh.shape))
    return f"DeviceMesh(({axes}))"
