"""Guards on meshes and placements whose failures read as mesh and placement differences.

Stock Dynamo guards a DTensor input with a lambda named ``__dtensor_spec_<id>``
and a mesh with ``___check_opaque_guard_fn_<id>``; a recompile then reports that
name.  The guards installed here check the same facts (stock's check functions
are reused, so what recompiles does not change) and describe a failure in words::

    placements of d changed: (Shard(dim=0),) -> (Replicate(),)
    mesh of d changed: DeviceMesh((tp=4)) -> DeviceMesh((dp=2, tp=2))

How: a lambda guard carries several ``verbose_code_parts`` (at least two: with
one, Dynamo reports its text instead of evaluating it); on a guard failure
Dynamo evaluates each part with the frame's locals and reports the first that
returns a string.  Every part here is a call
``__load_module('dynamo_vars.guards').explain(<key>, <part>, <source>)`` into
:func:`explain`, which compares the current value with the one recorded under
``key`` when the guard was built.  ``__load_module`` is in Dynamo's guard scope.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

from dtcompile.base.notation import describe_mesh, real_object

__all__ = ["describe_mesh", "describe_placements", "explain", "real_object", "source_label"]

# key -> (part -> function(old value, new value) -> str | None).  Entries live as
# long as the process: one small record per guard built.
_EXPECTED: dict[int, tuple[Any, dict[str, Callable[[Any, Any], str | None]]]] = {}
_KEYS = itertools.count()


def describe_mesh_change(old: Any, new: Any) -> str:
    """The difference of two meshes; when shape and names agree, the ranks or device that differ."""
    before, after = describe_mesh(old), describe_mesh(new)
    if before != after:
        return f"{before} -> {after}"
    old_real, new_real = real_object(old), real_object(new)
    if old_real.device_type != new_real.device_type:
        return f"{before} on {old_real.device_type} -> on {new_real.device_type}"
    old_ranks, new_ranks = old_real.mesh.flatten().tolist(), new_real.mesh.flatten().tolist()
    if old_ranks != new_ranks:
        return f"{before} over ranks {old_ranks} -> ranks {new_ranks}"
    old_thread, new_thread = getattr(old_real, "_thread_id", None), getattr(new_real, "_thread_id", None)
    if old_thread != new_thread:
        # DeviceMesh.__eq__ tells apart the meshes of the threaded process group's rank threads.
        old_rank, new_rank = getattr(old_real, "_rank", "?"), getattr(new_real, "_rank", "?")
        return f"{before} of rank {old_rank}'s thread -> of rank {new_rank}'s thread (threaded process group)"
    return f"{before} -> another {before} that DeviceMesh.__eq__ tells apart (its layout differs)"


def describe_placements(placements: Any) -> str:
    """``(Shard(dim=0), Replicate())``; a user subclass shows as its own repr."""
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


def source_label(source_name: str) -> str:
    """``L['x']`` -> ``arg x``; ``L['self']._modules['fc'].weight`` -> ``self.fc.weight``; globals kept."""
    match = re.fullmatch(r"L\['([^']+)'\]", source_name)
    if match:
        return f"arg {match.group(1)}"
    name = re.sub(r"\._modules\['([^']+)'\]", r".\1", source_name)
    name = re.sub(r"\._(parameters|buffers)\['([^']+)'\]", r".\2", name)
    name = re.sub(r"^L\['([^']+)'\]", r"\1", name)
    name = re.sub(r"^G\['([^']+)'\]", r"global \1", name)
    return name


def record(expected: Any, parts: dict[str, Callable[[Any, Any], str | None]]) -> int:
    """Remember what a guard expects; returns the key its code parts name."""
    key = next(_KEYS)
    _EXPECTED[key] = (expected, parts)
    return key


def code_parts(key: int, source_name: str, label: str | None = None) -> list[str]:
    """One verbose code part per explained aspect, in the order they are checked.

    Each evaluates ``source_name``; the message names ``label`` (default: the source).
    """
    _, parts = _EXPECTED[key]
    label = source_name if label is None else label
    return [
        f"__load_module('dynamo_vars.guards').explain({key}, {part!r}, {source_name}, {label!r})"
        for part in parts
    ]


def explain(key: int, part: str, value: Any, source_name: str) -> str | bool:
    """A failure description for aspect ``part`` of the guard ``key``, or ``True`` if it holds."""
    expected, parts = _EXPECTED[key]
    message = parts[part](expected, value)
    if message is None:
        return True
    return message.replace("{what}", source_label(source_name))
