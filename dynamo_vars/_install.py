"""The one place where dynamo_vars changes Dynamo, and undoes it.

Dynamo has no public registry for new variable trackers, so everything
dynamo_vars adds goes through three well-defined hooks, each applied and
reverted here and nowhere else:

1. ``VariableBuilder._id_dispatch``: Dynamo's table of objects, by identity, that
   get their own tracker when first seen.  Each family module lists the
   functions it handles (``ID_HANDLERS``: function -> ``(builder, value) -> tracker``).
2. ``GuardBuilder`` methods: the guards for DTensor specs, meshes and placements
   (``GUARD_BUILDERS``: method name -> replacement ``(original) -> method``).
3. The opaque-type registry of torch: members added to a registered type
   (``OPAQUE_MEMBERS``: type -> {member: MemberType}).

Installing changes what Dynamo can trace and how guards describe themselves;
it does not change a graph that already traced (tested in
``tests/test_dynamo_vars.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["enabled", "install", "is_installed", "uninstall"]

_lock = threading.Lock()
_undo: list[Callable[[], None]] = []


def _families() -> list[Any]:
    from dynamo_vars import device_mesh, dtensor_api, local_map, placements, process_groups

    return [device_mesh, placements, process_groups, dtensor_api, local_map]


def is_installed() -> bool:
    return bool(_undo)


def install() -> None:
    """Install dynamo_vars into Dynamo (idempotent).  ``uninstall()`` undoes it."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    with _lock:
        if _undo:
            return
        try:
            _install_locked()
        except BaseException:
            _uninstall_locked()
            raise


def _install_locked() -> None:
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._library import opaque_object

    families = _families()

    handlers: dict[int, Callable[..., Any]] = {}
    for family in families:
        for fn, handler in getattr(family, "ID_HANDLERS", dict)().items():
            handlers[id(fn)] = handler
    original_id_dispatch = VariableBuilder.__dict__["_id_dispatch"]

    def _id_dispatch(cls: type) -> dict[int, Callable[..., Any]]:
        return {**original_id_dispatch.__func__(cls), **handlers}

    VariableBuilder._id_dispatch = classmethod(_id_dispatch)
    _undo.append(lambda: setattr(VariableBuilder, "_id_dispatch", original_id_dispatch))

    for family in families:
        for name, make in getattr(family, "GUARD_BUILDERS", {}).items():
            original = GuardBuilder.__dict__[name]
            setattr(GuardBuilder, name, make(original))
            _undo.append(lambda name=name, original=original: setattr(GuardBuilder, name, original))

    for family in families:
        for cls, members in getattr(family, "OPAQUE_MEMBERS", dict)().items():
            info = opaque_object._resolve_opaque_type_info(cls)
            added = {k: v for k, v in members.items() if k not in info.members}
            info.members.update(added)
            _undo.append(lambda info=info, added=added: [info.members.pop(k, None) for k in added])


def _uninstall_locked() -> None:
    while _undo:
        _undo.pop()()


def uninstall() -> None:
    """Restore Dynamo as it was before :func:`install`.  Compiled code is kept;
    call ``torch._dynamo.reset()`` to drop graphs traced while installed."""
    with _lock:
        _uninstall_locked()


@contextlib.contextmanager
def enabled(flag: bool = True) -> Iterator[None]:
    """Install (``flag=True``) or uninstall dynamo_vars for the block, then restore the previous state."""
    before = is_installed()
    install() if flag else uninstall()
    try:
        yield
    finally:
        if before != is_installed():
            install() if before else uninstall()
