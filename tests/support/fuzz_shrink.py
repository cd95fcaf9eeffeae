"""Shrinking a failing program to a small one that fails the same way.

Hypothesis's own shrinker would need the failing example to be a hypothesis
test case; here programs are drawn in a batch and run together in long-lived
worlds, so a failure is shrunk afterwards, on the program itself: greedy
passes over structural simplifications, each candidate run alone in a fresh
world and kept when its verdict has the same signature (same verdict kind, same
normalized error or mismatch category):

- no backward; fewer outputs; the program cut after step k, returning step k;
- a step no one reads removed (a cut leaves them: computing a value that is
  not returned can matter, e.g. to a pass that moves collectives);
- a step bypassed (its uses read one of its arguments instead);
- unused inputs dropped; an input without ``requires_grad``; an input's
  placement made ``Replicate()``, ``Partial()`` or a plain ``Shard``.

Steps no output needs are dropped after most changes.  The result is the repro to pin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from support.fuzz_check import Verdict
from support.fuzz_programs import Program

__all__ = ["shrink"]


def _prune(p: Program) -> Program:
    """Drops the steps no output needs (and loss terms of outputs that are gone)."""
    loss = tuple((name, how) for name, how in p.loss if name in p.outputs)
    live = set(p.outputs) | {name for name, _ in loss}
    kept = []
    for step in reversed(p.steps):
        if step.out in live:
            kept.append(step)
            live.update(step.args)
    return p.replace(steps=tuple(reversed(kept)), loss=loss)


def _rename(p: Program, old: str, new: str) -> Program:
    steps = tuple(s.replace_args(old, new) for s in p.steps if s.out != old)
    outputs = tuple(dict.fromkeys(new if o == old else o for o in p.outputs))
    loss = tuple(dict.fromkeys((new if n == old else n, how) for n, how in p.loss))
    return p.replace(steps=steps, outputs=outputs, loss=loss)


def _candidates(p: Program) -> Iterator[Program]:
    if p.loss:
        yield p.replace(loss=())
    if len(p.outputs) > 1:
        for out in p.outputs:
            yield _prune(p.replace(outputs=tuple(o for o in p.outputs if o != out)))
    for k, step in enumerate(p.steps[:-1]):
        cut = p.replace(steps=p.steps[: k + 1], outputs=(step.out,), expect_raise=False, loss=())
        yield cut
        for how in dict.fromkeys(how for _, how in p.loss):
            yield cut.replace(loss=((step.out, how),))
    used = {a for s in p.steps for a in s.args} | set(p.outputs)
    for step in p.steps:
        if step.out not in used:
            yield p.replace(steps=tuple(s for s in p.steps if s is not step))
    for step in p.steps:
        for arg in dict.fromkeys(step.args):
            if arg != step.out:
                yield _prune(_rename(p, step.out, arg))
    used = {a for s in p.steps for a in s.args}
    unused = [i for i in p.inputs if i.name not in used]
    if unused and len(unused) < len(p.inputs):
        yield p.replace(inputs=tuple(i for i in p.inputs if i.name in used))
    for k, spec in enumerate(p.inputs):
        if spec.requires_grad:
            yield p.replace(inputs=_with(p, k, spec.__class__(spec.name, spec.shape, spec.placements, False, spec.seed)))
        for axis, placement in enumerate(spec.placements):
            simpler = ["Replicate()"]
            if placement.startswith("Partial("):
                simpler.append("Partial()")
            if placement.startswith("_StridedShard("):
                simpler.append(f"Shard({placement.split('(')[1].split(',')[0]})")
            for text in simpler:
                if text != placement:
                    placements = spec.placements[:axis] + (text,) + spec.placements[axis + 1 :]
                    yield p.replace(inputs=_with(p, k, spec.__class__(spec.name, spec.shape, placements, spec.requires_grad, spec.seed)))


def _with(p: Program, k: int, spec: object) -> tuple:
    return p.inputs[:k] + (spec,) + p.inputs[k + 1 :]


def shrink(
    program: Program,
    signature: str,
    check: Callable[[Program], Verdict],
    *,
    budget_s: float = 180.0,
) -> tuple[Program, int]:
    """The smallest program found that ``check`` still judges with ``signature``; also how many runs it took.

    Programs written by hand (``manual`` steps) are returned as they are.
    """
    if any(step.kind == "manual" for step in program.steps):
        return program, 0
    deadline = time.monotonic() + budget_s
    current, runs, tried = program, 0, {program}
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for candidate in _candidates(current):
            if candidate in tried or not candidate.steps or not candidate.outputs:
                continue
            tried.add(candidate)
            runs += 1
            if check(candidate).signature == signature:
                current, improved = candidate, True
                break
            if time.monotonic() >= deadline:
                break
    return current, runs
