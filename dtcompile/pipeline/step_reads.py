"""The optimizer's step counts read once in a traced training step (#70).

Adam and AdamW keep a ``step`` count per parameter and read it as a Python number each
step (``step_t += 1; step = step_t.item()``, then ``1 - beta1 ** step``, ``lr / ...``,
``(...) ** 0.5``) where they are not ``capturable``.  Traced, each read is its own
unbacked symbol, and each parameter's scalars are symbolic arithmetic that torch's
sympy-backed shape environment works out anew (about a third of AdamW's trace, which is
linear in the parameters; the rest is the update's tensor ops).

Where every parameter's count is the same when the step is traced, and the optimizer is
one whose counts all gain one before each is read once (:func:`reads_steps_once`),
the trace reads the first parameter's count and gives that value to the other
parameters' reads (:func:`one_step_read`): the scalars are the same Python arithmetic on
the same value, so the graph's update is eager's, bit for bit.  The compiled step keys its
graphs on whether the counts are equal (:class:`dtcompile.step.CompiledStep`): counts that
differ at a call (a parameter that got no gradient on some step, a state loaded from
elsewhere) take a graph traced with each count read on its own.

With one count read, every parameter's scalars are the same computations on the same
value: each is traced once (:class:`ScalarsOnce`), where each parameter's update made its
own nodes, and the others' updates take its result.  The graph computes what eager does;
it has a handful of scalar nodes where it had about eight a parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OneStepRead", "ScalarsOnce", "one_step_read", "reads_steps_once", "step_counts"]

_SHARED_OPTIMIZERS = ("Adam", "AdamW")
"""torch.optim's optimizers whose every ``step`` count gains one before each is read once a step."""


def step_counts(state: dict[Any, Any]) -> list[torch.Tensor]:
    """The ``step`` counts of an optimizer's per-parameter ``state`` (its ``state`` or its
    ``state_dict()["state"]``), in its order."""
    return [s["step"] for s in state.values() if isinstance(s, dict) and isinstance(s.get("step"), torch.Tensor)]


def reads_steps_once(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether a trace of ``optimizer``'s step may read one count for all its parameters:
    it is torch's Adam or AdamW (exactly: a subclass may step otherwise), no group is
    ``capturable``, ``fused`` or ``differentiable`` (those read no count, or read it as a
    tensor), and every parameter's ``step`` holds the same count now."""
    if optimizer is None or type(optimizer) not in tuple(getattr(torch.optim, n) for n in _SHARED_OPTIMIZERS):
        return False
    if any(group.get(flag) for group in optimizer.param_groups for flag in ("capturable", "fused", "differentiable")):
        return False
    counts = step_counts(optimizer.state)
    if len(counts) < 2 or any(t.numel() != 1 or t.device.type != "cpu" for t in counts):
        return False
    first = counts[0].item()
    return all(t.item() == first for t in counts[1:])


class OneStepRead(TorchDispatchMode):
    """While on: a read of any of ``counts`` (``aten._local_scalar_dense``, what ``.item()``
    runs) after as many in-place changes as the first read's count had gives the first
    read's value; any other read reads its own.  :attr:`shared`: how many reads took the
    first's."""

    def __init__(self, counts: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._counts = list(counts)  # kept alive: their ids key the reads
        self._version = {id(t): t._version for t in self._counts}
        self._first: tuple[int, Any] | None = None
        self.shared = 0
        self.scalars: ScalarsOnce | None = None
        """The trace's scalar computations traced once, where :func:`one_step_read` made them so."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) in self._version:
            changes = args[0]._version - self._version[id(args[0])]
            if self._first is None:
                self._first = (changes, func(*args, **kwargs))
                return self._first[1]
            if changes == self._first[0]:
                self.shared += 1
                return self._first[1]
        return func(*args, **kwargs)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class ScalarsOnce:
    """A make_fx trace's symbolic scalar arithmetic, each computation traced once: its proxy
    mode's ``__sym_dispatch__`` (where ``1 - beta1 ** step`` on a symbolic ``step`` is traced)
    given a computation it traced before, the same function on the same symbols and the
    same constants, returns that one's result.  The arithmetic is pure, so the result is
    the same value; the graph has one node for it.

    Keyed on the symbols by identity (kept alive here) and on the constants by type and
    exact value (a float by its bits: ``0.0`` and ``-0.0`` differ); a NaN, a list or any
    other argument is traced as torch traces it."""

    def __init__(self, dispatch: Callable[..., Any]) -> None:
        self._dispatch = dispatch
        self._traced: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}
        self.reused = 0
        """How many computations took one traced before."""

    def __call__(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = None if kwargs else _scalar_key(func, args)
        if key is None:
            return self._dispatch(func, types, args, kwargs)
        traced = self._traced.get(key)
        if traced is not None:
            self.reused += 1
            return traced[1]
        out = self._dispatch(func, types, args, kwargs)
        self._traced[key] = (args, out)  # the symbols stay alive: their ids key the computation
        return out


def _scalar_key(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    parts: list[Any] = [func]
    for arg in args:
        if isinstance(arg, _SYMBOLIC):
            parts.append(("sym", id(arg.node)))
        elif type(arg) is float:
            if arg != arg:  # NaN
                return None
            parts.append((float, arg.hex()))
        elif type(arg) in (int, bool):
            parts.append((type(arg), arg))
        else:
            return None
    return tuple(parts)


@contextlib.contextmanager
def scalars_once() -> Iterator[ScalarsOnce | None]:
    """:class:`ScalarsOnce` on the running make_fx trace's proxy mode while inside (that
    one object's attribute, removed on exit); nothing outside a trace."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None or "__sym_dispatch__" in vars(mode):
        yield None
        return
    once = ScalarsOnce(mode.__sym_dispatch__)
    mode.__sym_dispatch__ = once  # type: ignore[method-assign]  # handle_sym_dispatch calls it by name
    try:
        yield once
    finally:
        del mode.__sym_dispatch__


@contextlib.contextmanager
def one_step_read(counts: Sequence[torch.Tensor]) -> Iterator[OneStepRead | None]:
    """:class:`OneStepRead` over ``counts`` while inside, the scalars computed from the one
    count traced once (:class:`ScalarsOnce`); nothing where there are none."""
    if not counts:
        yield None
        return
    with OneStepRead(counts) as mode, scalars_once() as once:
        mode.scalars = once
        yield mode
