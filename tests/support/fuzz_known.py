"""Which component a failure belongs to, and the failures already known (pinned, not yet fixed).

:func:`diagnose` re-runs a failing program with parts of the compiler taken
away, each time on fresh threaded ranks, and names the first configuration in
which it passes:

- ``pass:<name>``: dtcompile with that one pass switched off passes -- the pass is at fault;
- ``dtcompile backend``: torch's ``aot_eager`` (with dtcompile's Dynamo support) passes,
  though no single pass explains it -- the backend's pipeline or lowering;
- ``AOTAutograd``: the Dynamo graph run as it is passes, ``aot_eager`` fails -- torch's
  AOTAutograd on DTensor (or a difference between DTensor's eager and traced paths);
- ``Dynamo``: even the Dynamo graph run as it is fails -- dtcompile's ``dynamo_vars``
  or Dynamo itself.

:data:`KNOWN` lists the failures that are pinned in ``tests/fuzz/test_fuzz_regressions.py``
(``xfail(strict=True)``) but not fixed: a failure matching one is counted as
known, not as a new bug.  When a fix makes its regression test XPASS, delete
the entry here too, so that the fuzzer guards the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from support.fuzz_check import Verdict, classify
from support.fuzz_programs import Program
from support.fuzz_world import run_programs

__all__ = ["KNOWN", "Known", "check_program", "diagnose", "known_bug"]

PASSES = ("async_tp", "bucketing", "overlap", "annotate")


def check_program(program: Program, make_backend: Callable[[], Any] | None = None, **kwargs: Any) -> Verdict:
    """One program on fresh threaded ranks, judged."""
    if make_backend is None:
        return classify(run_programs([program], **kwargs)[0])
    return classify(run_programs([program], make_backend, **kwargs)[0])


def _dtcompile(**options: Any) -> Callable[[], Any]:
    def make() -> Any:
        import dtcompile

        return dtcompile.backend(inductor=False, **options)

    return make


def _aot_eager() -> Any:
    from torch._dynamo.backends.debugging import aot_eager

    _dtcompile()()  # installs dtcompile's Dynamo support, as the default tier has it
    return aot_eager


def _graph_as_is() -> Any:
    _dtcompile()()
    return lambda gm, example_inputs: gm.forward


def diagnose(program: Program, *, barrier_timeout: float = 20.0) -> str:
    """The part of the compiler a failing program's failure goes away without (see the module docstring)."""
    timeouts = {"barrier_timeout": barrier_timeout}
    if not check_program(program, _aot_eager, **timeouts).is_bug:
        for name in PASSES:
            if not check_program(program, _dtcompile(disable_passes={name}), **timeouts).is_bug:
                return f"pass:{name}"
        return "dtcompile backend"
    if not check_program(program, _graph_as_is, **timeouts).is_bug:
        return "AOTAutograd"
    return "Dynamo"


@dataclass(frozen=True)
class Known:
    name: str
    regressions: tuple[str, ...]
    """The pinned tests in test_fuzz_regressions.py."""
    signature: str
    """A regular expression the failure's signature matches."""
    culprits: tuple[str, ...] = ()
    """What :func:`diagnose` must say (one of them), when the signature alone is not specific."""
    owner: str = "dtcompile"
    """``dtcompile`` (to fix here) or ``torch`` (stock torch, seen through dtcompile)."""


KNOWN: tuple[Known, ...] = (
    Known(
        "eager itself raises on some ranks only (a reduction over a dim whose shard is empty there)",
        ("test_eager_amax_over_an_empty_shard",),
        r"^hang: (eager ranks disagree|some ranks raised in eager)",
        owner="torch",
    ),
)


def known_bug(program: Program, verdict: Verdict, culprit: Callable[[], str]) -> Known | None:
    """The known failure this one is, if any; ``culprit`` is called only when an entry needs it."""
    for known in KNOWN:
        if re.search(known.signature, verdict.signature) and (not known.culprits or culprit() in known.culprits):
            return known
    return None
