"""Progress on long work: a bar where a terminal is attached, log lines otherwise.

Planning a large model with :mod:`dtcompile.auto_parallel`, calibrating a cost
profile and reading many ranks' logs into a report take from seconds to a
minute.  Where standard error is a terminal, :class:`Progress` draws a
``tqdm`` bar there (tqdm: small, pure Python, what the PyTorch ecosystem already
shows bars with; it handles terminals, widths and rates); elsewhere (a job's
log file, CI) it logs a line on the ``dtcompile.progress`` logger at most every
tenth of the way and at the end, so a log shows what ran and how long it took.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["Progress", "track"]

log = logging.getLogger("dtcompile.progress")  # the name users configure, wherever the module lives

T = TypeVar("T")


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


class Progress:
    """``total`` steps of the work called ``what``; :meth:`step` after each (naming it, if it has a
    name), :meth:`close` at the end (or use it as a context manager).  ``show=False`` shows
    nothing (a rank other than the first, where every rank does the same work)."""

    def __init__(self, what: str, total: int, unit: str = "step", show: bool = True) -> None:
        self.what, self.total, self.unit, self.show = what, total, unit, show
        self.done = 0
        self._start = time.perf_counter()
        self._logged = 0
        self._bar: Any = None
        if show and _terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, leave=False, dynamic_ncols=True)

    def step(self, name: str = "", n: int = 1) -> None:
        self.done += n
        if not self.show:
            return
        if self._bar is not None:
            self._bar.update(n)
            if name:  # a named stage: shown at once, however soon the next comes
                self._bar.set_postfix_str(name)
            return
        # A line at most every tenth of the way (and at the end).
        if self.done * 10 // max(self.total, 1) > self._logged:
            self._logged = self.done * 10 // max(self.total, 1)
            done = f" ({name})" if name else ""
            log.info("%s: %d/%d %ss%s, %.1f s", self.what, self.done, self.total, self.unit, done, self._seconds())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.show:
            log.info("%s: done, %d %ss in %.1f s", self.what, self.done, self.unit, self._seconds())

    def _seconds(self) -> float:
        return time.perf_counter() - self._start

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(items: Iterable[T], what: str, total: int | None = None, unit: str = "item") -> Iterator[T]:
    """``items``, one :meth:`Progress.step` each (``total`` defaults to ``len(items)``)."""
    count = total if total is not None else len(items)  # type: ignore[arg-type]
    with Progress(what, count, unit) as progress:
        for item in items:
            yield item
            progress.step()
