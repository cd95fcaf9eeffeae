"""A change to torch that holds only while some compile needs it: a bottom-layer helper.

Rank threads compile at the same time, so a change made for one compile and
undone when it ends could be undone under another.  :class:`ScopedPatch`
counts its users: the change is made when the first one enters and undone when
the last one leaves.  What it changes must therefore act the same for every
thread (a rule that reads a thread-local, a reducer that pickles faithfully).

torch.fx's tracer makes such a change itself, for no one to share: while it traces
(``make_fx`` too, and AOTAutograd inside every ``torch.compile``) it keeps its patcher
in a module global and patches ``torch.nn.Module.__call__`` for the process, so two
traces at once break each other (``CURRENT_PATCHER is None in finally block``).
Dynamo compiles one frame at a time under its compile lock; every dtcompile path that
traces with torch.fx outside a compile holds that same lock (:func:`fx_tracing`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["ScopedPatch", "fx_tracing"]


def fx_tracing() -> contextlib.AbstractContextManager[bool]:
    """The lock a trace with torch.fx holds (see the module): Dynamo's compile lock, re-entrant,
    so that a plan's or a step's trace and the compiles of other threads run in turn."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


class ScopedPatch:
    """``apply()`` makes the change and returns the function that undoes it.

    ``with patch():`` holds it for the block; nested and concurrent blocks share one change.
    """

    def __init__(self, apply: Callable[[], Callable[[], None]]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._users = 0
        self._undo: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        """Whether some block holds the change now."""
        return self._users > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._undo = self._apply()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._undo is not None:
                    undo, self._undo = self._undo, None
                    undo()
