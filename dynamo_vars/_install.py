"""The one place where dynamo_vars changes Dynamo, and undoes it.

Nothing happens at import: installing is :func:`install`, which the dtcompile
backend calls when it is looked up by name or built with ``dtcompile.backend()``.
Dynamo has no public registry for new variable trackers, so everything
dynamo_vars adds goes through four well-defined hooks, each applied and
reverted here and nowhere else:

1. Dynamo's table of objects that get their own tracker when first seen,
   ``VariableBuilder._id_dispatch()`` (a cached dict): handlers are added to
   that very dict, the way ``torch.compiler.substitute_in_graph`` registers its
   polyfills, and removed on uninstall.  A function torch already handles is
   an error (an upgrade of torch took it over), never silently overridden.
   Each family module lists its functions (``ID_HANDLERS``: function ->
   ``(builder, value) -> tracker``).
2. ``GuardBuilder`` methods: the guards for DTensor specs, meshes and placements
   (``GUARD_BUILDERS``: method name -> replacement ``(original) -> method``).
3. The opaque-type registry of torch: members added to a registered type
   (``OPAQUE_MEMBERS``: type -> {member: MemberType}).
4. Functions and methods of Dynamo, wrapped, never rewritten: the wrapper
   adds a context around the original call, or words to its error
   (``WRAPPED``: ``(class or module, name)`` -> replacement
   ``(original) -> function``).

On a torch older than the versions dtcompile is tested on
(:data:`dtcompile.base.torch_contract.TESTED_TORCH`) nothing is installed: one
warning says so, and Dynamo stays stock.  On a newer one the contract
(:func:`dtcompile.base.torch_contract.contract_breaks`: every private name with
its parameters, every object patched) is checked once, at the first install:
where it holds, dynamo_vars installs and one log line (INFO) says so; where it
does not, nothing is installed and one warning names the first names broken
and the last tested release.  Installing changes what Dynamo can
trace and how guards describe themselves; it does not change a graph that
already traced.  Callbacks given to :func:`on_uninstall` run when it is undone
(the named ``dtcompile`` backend forgets itself there, so that the next lookup
by name installs again).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtcompile.base.torch_contract import Break

__all__ = ["enabled", "install", "is_installed", "on_uninstall", "uninstall"]

_lock = threading.RLock()
_undo: list[Callable[[], None]] = []
_on_uninstall: list[Callable[[], None]] = []
_warned_version = False
_newer_breaks: tuple[Break, ...] | None = None
"""On a torch newer than the tested range, the contract's breaks once checked (empty: it holds)."""

log = logging.getLogger(__name__)


class HandlerClashError(RuntimeError):
    """torch's Dynamo already handles a function dynamo_vars would handle."""


def _families() -> list[Any]:
    from dynamo_vars import device_mesh, dtensor_api, dtensor_state, local_map, placements, process_groups

    return [device_mesh, placements, process_groups, dtensor_api, dtensor_state, local_map]


def is_installed() -> bool:
    return bool(_undo)


def install() -> bool:
    """Install dynamo_vars into Dynamo (idempotent); ``uninstall()`` undoes it.

    Returns whether it is installed: False without ``torch.distributed``, on a
    torch older than the tested range, or on a newer one that breaks the
    contract (then stock Dynamo stays, with one warning).
    """
    global _warned_version, _newer_breaks
    import torch.distributed as dist

    from dtcompile.base import torch_contract

    if not dist.is_available():
        return False
    with _lock:
        if _newer_breaks is None and torch_contract.torch_is_newer():
            _newer_breaks = _newer_torch_checked()
        refused = _refusal(_newer_breaks)
        if refused is not None:
            if not _warned_version:
                warnings.warn(refused, stacklevel=2)
                _warned_version = True
            return False
        if _undo:
            return True
        try:
            _install_locked()
        except BaseException:
            _uninstall_locked()
            raise
    return True


def _newer_torch_checked() -> tuple[Break, ...]:
    """The contract's breaks on a torch newer than the tested range; where there are none,
    the one log line saying that the contract holds."""
    import torch

    from dtcompile.base import torch_contract

    breaks = tuple(torch_contract.contract_breaks())
    if not breaks:
        (major, minor) = torch_contract.last_tested()
        log.info(
            "dtcompile: torch %s is newer than the tested range %s (the last tested release is %d.%d); "
            "the contract holds (every private torch name dtcompile relies on outside its test worlds is "
            "there with its parameters, every object it patches is there), so dynamo_vars installs",
            torch.__version__, torch_contract.tested_range(), major, minor,
        )
    return breaks


def _refusal(newer_breaks: tuple[Break, ...] | None) -> str | None:
    """Why this torch gets no dynamo_vars, as the warning says it; None where it does: a
    tested torch, or a newer one whose contract check found ``newer_breaks`` empty."""
    import torch

    from dtcompile.base import torch_contract

    if torch_contract.torch_is_supported():
        return None
    tested = torch_contract.tested_range()
    stock = "Dynamo's DTensor support (dynamo_vars) is not installed and Dynamo stays stock"
    if not torch_contract.torch_is_newer():
        return (
            f"dtcompile: torch {torch.__version__} is outside the tested range {tested}; {stock}. "
            f"Install a tested torch (pip install 'torch{tested}')."
        )
    assert newer_breaks is not None  # install() checks a newer torch's contract first
    if not newer_breaks:
        return None
    (major, minor) = torch_contract.last_tested()
    return (
        f"dtcompile: torch {torch.__version__} is newer than the tested range {tested} (the last tested "
        f"release is {major}.{minor}) and breaks the contract of private torch names dtcompile relies on: "
        f"{torch_contract.describe(newer_breaks)}; {stock}. Install torch {major}.{minor} "
        f"(pip install 'torch{tested}') or report it to dtcompile."
    )


def _install_locked() -> None:
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._library import opaque_object

    families = _families()

    table = VariableBuilder._id_dispatch()
    for family in families:
        for fn, handler in getattr(family, "ID_HANDLERS", dict)().items():
            if id(fn) in table:
                raise HandlerClashError(
                    f"dynamo_vars: torch's Dynamo already handles {fn.__module__}.{fn.__qualname__} "
                    f"({family.__name__} handles it too); this torch is newer than dtcompile knows. "
                    "Use a tested torch, or report it to dtcompile."
                )
            table[id(fn)] = handler
            _undo.append(lambda key=id(fn), handler=handler: _remove_handler(table, key, handler))

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


    for family in families:
        for (owner, name), make in getattr(family, "WRAPPED", dict)().items():
            original = vars(owner)[name]
            setattr(owner, name, make(original))
            _undo.append(lambda owner=owner, name=name, original=original: setattr(owner, name, original))


def _remove_handler(table: dict[int, Any], key: int, handler: Any) -> None:
    if table.get(key) is handler:
        del table[key]


def _uninstall_locked() -> None:
    was_installed = bool(_undo)
    while _undo:
        _undo.pop()()
    if was_installed:
        for callback in list(_on_uninstall):
            callback()


def uninstall() -> None:
    """Restore Dynamo as it was before :func:`install`.  Compiled code is kept;
    call ``torch._dynamo.reset()`` to drop graphs traced while installed."""
    with _lock:
        _uninstall_locked()


def on_uninstall(callback: Callable[[], None]) -> None:
    """Call ``callback`` each time an installed dynamo_vars is uninstalled (once per registration)."""
    with _lock:
        if callback not in _on_uninstall:
            _on_uninstall.append(callback)


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
