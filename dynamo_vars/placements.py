"""Placements (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``, user subclasses) in compiled code.

Stock torch registers the placement classes as opaque *value* types: they are
constants in the graph, their methods run at trace time, and a placement
argument is guarded by ``==``.  Two gaps are closed here:

- ``==`` is not enough for a guard: ``Partial.__eq__`` compares only the reduce
  op, so a user ``Partial`` subclass with its own reduction equals
  ``Partial('sum')`` and a graph traced for one ran for the other.  The guard
  here also checks the exact type;
- the guard failure reads ``placement changed: Shard(dim=0) -> Replicate()
  (arg p)``.

The DTensor spec guard (placements of a DTensor input) is in
:mod:`dynamo_vars.dtensor_api`.
"""

from __future__ import annotations

import functools
from typing import Any

from dynamo_vars import guards

__all__: list[str] = []


def same_placement(a: Any, b: Any) -> bool:
    """Equal and of the very same class (a subclass is another placement)."""
    return type(a) is type(b) and a == b


def same_placements(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_placement(x, y) for x, y in zip(a, b))


def _placement_guard(original: Any) -> Any:
    from torch.distributed.tensor import Placement

    @functools.wraps(original)
    def EQUALS_MATCH(self: Any, guard: Any, recompile_hint: str | None = None) -> None:
        value = self.get(guard)
        if not isinstance(value, Placement):
            return original(self, guard, recompile_hint)

        def check(x: Any) -> bool:
            return same_placement(x, value)

        def explain_value(_: Any, new: Any) -> str | None:
            return None if new == value else f"placement changed: {value!r} -> {new!r} ({{what}})"

        def explain_type(_: Any, new: Any) -> str | None:
            if type(new) is type(value):
                return None
            return (
                f"placement class changed: {type(value).__qualname__} -> {type(new).__qualname__} "
                f"(equal by ==: {value!r}) ({{what}})"
            )

        key = guards.record(value, {"value": explain_value, "type": explain_type})
        self.get_guard_manager(guard).add_lambda_guard(check, guards.code_parts(key, guard.name), guard.user_stack)

    return EQUALS_MATCH


GUARD_BUILDERS = {"EQUALS_MATCH": _placement_guard}
