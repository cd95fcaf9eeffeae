"""The stack traces ``compile_step``'s trace records on its nodes, each stack formatted once.

``make_fx(record_stack_traces=True)`` extracts and symbolizes the whole Python stack for every
node it makes (``CapturedTraceback``: each frame's file, line and name, then a ``linecache``
read per frame), then keeps the frames of the model's ``forward`` methods.  A deep model's
layers run the same code lines, so most nodes share one kept stack with many others: here a
node's stack is read off its frames' code and line numbers (no symbolizing), filtered by
torch's rule, and formatted the first time that stack is seen.  The text is torch's, node for
node (``tests/backend/test_compile_step.py``)."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch.fx

_Frame = tuple[str, int, str]
_METHOD = "forward"  # the modules' method whose frames torch keeps (a method's name, not a graph's kind)


class StackTraces:
    """What ``make_fx(record_stack_traces=True)`` records as each node's ``stack_trace``, for
    the nodes a tracer makes while :meth:`recording` it, but while :meth:`off`."""

    def __init__(self) -> None:
        from torch.fx.experimental.symbolic_shapes import uninteresting_files
        from torch.fx.proxy import _STACK_TRACE_ANCHORS

        self._skipped = uninteresting_files()
        self._anchors = _STACK_TRACE_ANCHORS
        self._texts: dict[tuple[_Frame, ...], str] = {}
        self._on = True

    @contextlib.contextmanager
    def recording(self, tracer: Any) -> Iterator[None]:
        """Inside: the nodes ``tracer`` (a ``make_fx`` tracer that records no stack trace of
        its own) makes get the stack trace torch's would record."""
        create_node = tracer.create_node

        def create_recorded(*args: Any, **kwargs: Any) -> torch.fx.Node:
            node = create_node(*args, **kwargs)
            if self._on and not node.stack_trace and node.op not in ("placeholder", "output"):
                text = self._stack_of(sys._getframe(1))
                if text:
                    node.stack_trace = text
            return node

        tracer.create_node = create_recorded
        try:
            yield
        finally:
            del tracer.create_node  # the class's again

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Inside: no stack trace recorded (an optimizer's update runs in no ``forward``: torch
        would record none, after reading the stack of each of its nodes)."""
        on, self._on = self._on, False
        try:
            yield
        finally:
            self._on = on

    def _stack_of(self, frame: Any) -> str:
        """Torch's rule (``Tracer._filter_traceback_frames`` with forward frames only): the
        frames named ``forward``, of ``torch/__init__.py`` or anchored, not of a file torch
        finds uninteresting, outermost first, formatted as ``traceback`` formats them."""
        kept: list[_Frame] = []
        while frame is not None:
            code = frame.f_code
            name, file = code.co_name, code.co_filename
            if (name == _METHOD or file.endswith("torch/__init__.py") or (file, name) in self._anchors) and (
                file not in self._skipped
            ):
                kept.append((file, frame.f_lineno, name))
            frame = frame.f_back
        key = tuple(kept)
        text = self._texts.get(key)
        if text is None:
            frames = [traceback.FrameSummary(file, line, name) for file, line, name in reversed(kept)]
            text = self._texts[key] = "".join(traceback.StackSummary.from_list(frames).format()).strip()
        return text
