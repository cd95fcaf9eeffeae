"""How a mesh is named in every message and report: the bottom of the house.

``describe_mesh`` gives ``DeviceMesh((dp=2, tp=4))``; ``real_object`` reaches the
real object behind the ``FakeScriptObject`` a trace sees.  hops, dynamo_vars
and the backend all print meshes this one way, so this module imports nothing
of theirs (and nothing heavy: torch is imported inside the functions).
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe_mesh", "real_object"]


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
