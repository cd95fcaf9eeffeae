"""DTensor's global switches in compiled code: ``implicit_replication()`` and ``loss_parallel()``.

Both are context managers that flip process-wide DTensor state.  Stock Dynamo
does not trace them (the whole frame silently runs eagerly, or fails with
"mixed torch.Tensor and DTensor").  Here each becomes a context that sets the
state both while Dynamo traces and, through ``set_*`` calls kept in the graph,
while AOTAutograd re-traces it.

``loss_parallel()`` has a backward half.  Eager DTensor looks its loss
handlers up when the backward runs, so torch requires ``loss.backward()`` to
run under ``loss_parallel()`` too.  A compiled graph's backward is traced at
compile time, inside AOTAutograd's joint trace, after the forward's
``loss_parallel()`` block has ended.  :func:`loss_parallel_backward` (the
backend enters it around AOTAutograd) keeps the backward handlers installed
until the joint trace ends, for graphs that enter ``loss_parallel()``: the
compiled backward is the one eager runs under ``loss_parallel()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch.fx.node import has_side_effect

from dtcompile.base.scoped_patch import ScopedPatch
from dynamo_vars._trackers import Handler, state_context

__all__ = ["loss_parallel_backward"]

@has_side_effect
def set_implicit_replication(enabled: bool) -> None:
    """Graph call that turns DTensor's implicit replication on or off (kept by DCE)."""
    torch._C._set_dtensor_allow_implicit_replication(enabled)


def _implicit_replication_enabled() -> bool:
    return torch._C._get_dtensor_allow_implicit_replication()


def _loss_ops() -> tuple[dict[Any, Any], dict[Any, Any]]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    return customized_loss_ops, DTensor._op_dispatcher._custom_op_handlers


def _is_backward_op(op: Any) -> bool:
    return "backward" in op._schema.name


def _loss_parallel_enabled() -> bool:
    loss_ops, handlers = _loss_ops()
    return all(handlers.get(op) is fn for op, fn in loss_ops.items())


@has_side_effect
def set_loss_parallel(enabled: bool) -> None:
    """Graph call that installs or removes ``loss_parallel``'s DTensor op handlers (kept by DCE).

    Inside :func:`loss_parallel_backward`, removing leaves the backward handlers.
    """
    loss_ops, handlers = _loss_ops()
    if enabled:
        handlers.update(loss_ops)
        return
    for op, fn in loss_ops.items():
        if handlers.get(op) is fn and not (_keeping_backward_handlers.active and _is_backward_op(op)):
            del handlers[op]


def _enters_loss_parallel(gm: fx.GraphModule) -> bool:
    return any(
        node.op == "call_function" and node.target is set_loss_parallel and node.args == (True,)
        for node in gm.graph.nodes
    )


@contextlib.contextmanager
def loss_parallel_backward(gm: fx.GraphModule) -> Iterator[None]:
    """Around AOTAutograd's trace of Dynamo graph ``gm``: when ``gm`` enters
    ``loss_parallel()``, its backward is traced with loss_parallel's backward
    handlers, as eager runs it under ``loss_parallel()`` (see the module doc)."""
    if not _enters_loss_parallel(gm):
        yield
        return
    with _keeping_backward_handlers():
        yield


def _keep_backward_handlers() -> Callable[[], None]:
    """Notes loss_parallel's backward entries of DTensor's handler table; the undo puts
    them back as they were.  The table is one per process, so the entries are kept
    while any thread's joint trace needs them (a :class:`ScopedPatch`): ranks run as
    threads trace at the same time, and the first to finish must not take them from
    the others."""
    loss_ops, handlers = _loss_ops()
    before = {op: handlers.get(op) for op in loss_ops if _is_backward_op(op)}

    def undo() -> None:
        for op, fn in before.items():
            if fn is None:
                handlers.pop(op, None)
            else:
                handlers[op] = fn

    return undo


_keeping_backward_handlers = ScopedPatch(_keep_backward_handlers)


def ID_HANDLERS() -> dict[Callable[..., Any], Handler]:
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel

    return {
        implicit_replication: state_context(set_implicit_replication, _implicit_replication_enabled, True),
        loss_parallel: state_context(set_loss_parallel, _loss_parallel_enabled, True),
    }
