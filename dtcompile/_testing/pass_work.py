"""The work done inside dtcompile's passes, counted, for the tests and benchmarks of how it
grows with the graph (issue #70): counts a slower or busier machine, or a larger heap, does
not change, where seconds do."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PassWork", "counting_pass_work"]


@dataclass
class PassWork:
    """What :func:`counting_pass_work` counted, over every ``run_passes`` call in its block."""

    nodes: int = 0
    """The nodes of the graphs the passes were given."""
    lines: Counter[tuple[str, str]] = field(default_factory=Counter)
    """The lines of dtcompile's own code run, by ``(file, function)``: also the steps of a
    loop that calls nothing (``"lines"``)."""
    calls: int = 0
    """The Python function calls made, anywhere (cProfile; ``"calls"``)."""


@contextlib.contextmanager
def counting_pass_work(how: str) -> Iterator[PassWork]:
    """Counts the work inside ``run_passes``, as each front door calls it (the Dynamo path's
    :mod:`dtcompile.pipeline.graph_compile`, ``compile_step``'s
    :mod:`dtcompile.pipeline.step_pass`): ``how`` ``"lines"`` (``sys.settrace``, the previous
    trace function back after each call) or ``"calls"`` (cProfile)."""
    import dtcompile
    import dtcompile.pipeline.graph_compile as graph_compile
    import dtcompile.pipeline.step_pass as step_pass

    if how not in ("lines", "calls"):
        raise ValueError(f"counting_pass_work: how={how!r}; count 'lines' or 'calls'")
    work = PassWork()
    package = str(Path(dtcompile.__file__).resolve().parent)
    original = step_pass.run_passes

    def line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            work.lines[frame.f_code.co_filename, frame.f_code.co_name] += 1
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename.startswith(package) else None

    def counted(gm: Any, *args: Any, **kwargs: Any) -> Any:
        work.nodes += len(gm.graph.nodes)
        if how == "lines":
            previous = sys.gettrace()
            sys.settrace(call)
            try:
                return original(gm, *args, **kwargs)
            finally:
                sys.settrace(previous)
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        try:
            return original(gm, *args, **kwargs)
        finally:
            profile.disable()
            work.calls += pstats.Stats(profile).total_calls

    step_pass.run_passes = graph_compile.run_passes = counted
    try:
        yield work
    finally:
        step_pass.run_passes = graph_compile.run_passes = original
