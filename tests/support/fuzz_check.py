"""Judging a run: compiled against eager on every rank, the verdict, and the summary of a batch.

Verdicts (``Verdict.kind``), the first four are bugs:

- ``mismatch``: both sides ran, and an output, the loss or a gradient differs on
  some rank (kind, placements, global shape, dtype, or values beyond the
  tolerance);
- ``internal_error``: eager ran, compiled raised (not a graph break);
- ``compiled_accepts``: eager raised on every rank, compiled ran on every rank;
- ``hang``: the world stopped in this program (a rank stuck in a collective),
  or some ranks raised where the others ran (``eager ranks disagree``: eager
  itself is at fault; ``compiled ranks disagree``);
- ``graph_break``: eager ran, compiled raised Dynamo's ``Unsupported``
  (``fullgraph=True``): a gap, listed, not a failure;
- ``both_raise``: both refused on every rank; ``same`` when compiled's message
  carries eager's first line, else ``other`` (listed: a worse message is not a
  wrong result);
- ``ok``.

Tolerance: float32, rtol = atol = 1e-5.  Compiled code runs the same local ops
on the same shards with the same collectives (the threaded group reduces in
rank order on both sides), so most values agree bit for bit; what differs is
the order of float operations where AOTAutograd decomposes an op (softmax,
mean, var, addmm) -- a few ulps (float32 eps is 1.2e-7) on values of order 1 to
100, far below 1e-5.  The summary reports the largest difference seen, as a
share of the tolerance, and how many programs matched bit for bit.
Values computed from random numbers are compared by kind, placements and
shape only: compiled RNG is not eager RNG.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from support.fuzz_programs import Program
from support.fuzz_world import ProgramRun, Side, Value, error_summary

__all__ = ["BUGS", "Verdict", "classify", "format_summary"]

RTOL = ATOL = 1e-5
BUGS = ("mismatch", "internal_error", "compiled_accepts", "hang")


@dataclass(frozen=True)
class Verdict:
    kind: str
    detail: str = ""
    signature: str = ""
    """What identifies the failure across programs: the verdict and a normalized first line."""
    max_diff: float = 0.0
    """The largest ``|compiled - eager| / (atol + rtol * |eager|)`` over compared values (1 is the tolerance)."""

    @property
    def is_bug(self) -> bool:
        return self.kind in BUGS


def _first_line(error: str | None) -> str:
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return lines[0] if lines else ""


def _normalize(text: str) -> str:
    """An error's first line with the program-specific parts (numbers, names, shapes) blanked."""
    text = re.sub(r"\bt\d+\b|\bx\d+\b|region_t\d+", "V", text)
    text = re.sub(r"0x[0-9a-f]+", "ADDR", text)
    text = re.sub(r"\d+", "N", text)
    return text[:160]


def _root_error(side: Side) -> str:
    return error_summary(side.error or "")


def _compare_values(what: str, want: Value | None, got: Value | None, values: bool) -> tuple[list[str], float]:
    if (want is None) != (got is None):
        return [f"{what}: presence differ: eager has {'none' if want is None else 'one'}, compiled has {'none' if got is None else 'one'}"], 0.0
    if want is None or got is None:
        return [], 0.0
    meta_want = (want.kind, want.placements, want.shape, want.dtype)
    meta_got = (got.kind, got.placements, got.shape, got.dtype)
    if meta_want != meta_got:
        fields = [f for f, w, g in zip(("kind", "placements", "shape", "dtype"), meta_want, meta_got) if w != g]
        return [f"{what}: {'/'.join(fields)} differ: compiled is {meta_got}, eager is {meta_want}"], 0.0
    if not values or want.local is None or got.local is None:
        return [], 0.0
    if want.local.shape != got.local.shape:
        return [f"{what}: local shape differ: {tuple(got.local.shape)} compiled, {tuple(want.local.shape)} eager"], 0.0
    diff = 0.0
    if want.local.numel() and want.local.is_floating_point():
        finite = torch.isfinite(want.local) & torch.isfinite(got.local)
        if finite.any():
            w, g = want.local[finite].double(), got.local[finite].double()
            diff = float(((w - g).abs() / (ATOL + RTOL * w.abs())).max())
    try:
        torch.testing.assert_close(got.local, want.local, rtol=RTOL, atol=ATOL, equal_nan=True)
    except AssertionError as err:
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
        return [f"{what}: values differ: {detail}"], diff
    return [], diff


def _compare_sides(program: Program, rank: int, eager: Side, compiled: Side) -> tuple[list[str], float]:
    rng = program.rng
    problems: list[str] = []
    max_diff = 0.0
    if len(eager.outputs) != len(compiled.outputs):
        return [f"rank {rank}, outputs: count differ: {len(compiled.outputs)} compiled, {len(eager.outputs)} eager"], 0.0
    pairs = [(f"output {name}", w, g, name not in rng) for name, w, g in zip(program.outputs, eager.outputs, compiled.outputs)]
    loss_rng = any(name in rng for name, _ in program.loss)
    pairs.append(("loss", eager.loss, compiled.loss, not loss_rng))
    for spec, w, g in zip(program.inputs, eager.grads, compiled.grads):
        pairs.append((f"grad of {spec.name}", w, g, not loss_rng))
    for what, w, g, values in pairs:
        found, diff = _compare_values(f"rank {rank}, {what}", w, g, values)
        problems += found
        max_diff = max(max_diff, diff)
    return problems, max_diff


def classify(run: ProgramRun) -> Verdict:
    if run.ranks is None:
        raised = re.findall(r"rank \d+ raised: (eager|compiled): (.*?)(?:; |$)", run.aborted or "", flags=re.M)
        why = f": some ranks raised in {raised[0][0]}: {_normalize(raised[0][1])}" if raised else ""
        return Verdict("hang", run.aborted or "", "hang" + why)
    eager_raised = [r.eager.error is not None for r in run.ranks]
    compiled_raised = [r.compiled.error is not None for r in run.ranks]
    if len(set(eager_raised)) > 1 or len(set(compiled_raised)) > 1:
        # Some ranks raised, the others ran (their collectives had peers enough to finish).
        detail = "\n".join(
            f"rank {k}: eager {_first_line(r.eager.error) or 'ran'}; compiled {_first_line(r.compiled.error) or 'ran'}"
            for k, r in enumerate(run.ranks)
        )
        side = "eager" if len(set(eager_raised)) > 1 else "compiled"
        error = next(_root_error(getattr(r, side)) for r in run.ranks if getattr(r, side).error is not None)
        return Verdict("hang", "ranks disagree about raising:\n" + detail, f"hang: {side} ranks disagree: {_normalize(error)}")
    first = run.ranks[0]
    if eager_raised[0]:
        eager_error = _root_error(first.eager)
        if not compiled_raised[0]:
            return Verdict("compiled_accepts", f"eager raised {eager_error}; compiled ran", "compiled_accepts: " + _normalize(eager_error))
        compiled_error = first.compiled.error or ""
        eager_line = _first_line(first.eager.error).split(": ", 1)[-1]
        same = eager_line[:80] in compiled_error
        return Verdict(
            "both_raise",
            f"eager: {eager_error}\ncompiled: {_root_error(first.compiled)}",
            ("both_raise: same: " if same else "both_raise: other: ") + _normalize(eager_error),
        )
    if compiled_raised[0]:
        error = _root_error(first.compiled)
        kind = "graph_break" if first.compiled.graph_break else "internal_error"
        return Verdict(kind, first.compiled.trace or error, f"{kind}: {_normalize(error)}")
    problems: list[str] = []
    max_diff = 0.0
    for rank, r in enumerate(run.ranks):
        found, diff = _compare_sides(run.program, rank, r.eager, r.compiled)
        problems += found
        max_diff = max(max_diff, diff)
    if problems:
        what, category = re.sub(r"rank \d+, ", "", problems[0]).split(": ")[:2]
        category = category.removesuffix(" differ")
        where = "grad" if what.startswith("grad") else ("loss" if what == "loss" else "output")
        return Verdict("mismatch", "\n".join(problems[:12]), f"mismatch: {where} {category}", max_diff)
    return Verdict("ok", "", "ok", max_diff)


def format_summary(runs: Sequence[ProgramRun], verdicts: Sequence[Verdict], seconds: float, seed: int) -> str:
    """The report of a batch: counts per mesh, per verdict, coverage, and the distinct non-ok signatures."""
    lines = [f"fuzz: {len(runs)} programs, seed {seed}, {seconds:.1f} s ({seconds / max(len(runs), 1):.2f} s per program)"]
    meshes = collections.Counter(r.program.mesh for r in runs)
    cost = {m: sum(r.seconds for r in runs if r.program.mesh == m) / n for m, n in meshes.items()}
    lines.append("  meshes: " + ", ".join(f"{k} {v} ({cost[k]:.2f} s each, eager and compiled)" for k, v in sorted(meshes.items())))
    kinds = collections.Counter(v.kind for v in verdicts)
    lines.append("  verdicts: " + ", ".join(f"{k} {kinds.get(k, 0)}" for k in ("ok", *BUGS, "graph_break", "both_raise")))
    raising = collections.Counter(v.signature.split(":")[1].strip() for v in verdicts if v.kind == "both_raise")
    lines.append(f"  eager raises: {kinds.get('both_raise', 0) + kinds.get('compiled_accepts', 0)} "
                 f"(compiled raises the same error {raising.get('same', 0)}, another error {raising.get('other', 0)}, "
                 f"runs instead {kinds.get('compiled_accepts', 0)}); "
                 f"generator expected a raise in {sum(r.program.expect_raise for r in runs)}")
    backward = sum(bool(r.program.loss) for r in runs)
    steps = [s for r in runs for s in r.program.steps]
    lines.append(f"  backward: {backward} programs; steps: {len(steps)} ({len(steps) / max(len(runs), 1):.1f} per program)")
    families = collections.Counter(s.kind for s in steps)
    lines.append("  families: " + ", ".join(f"{k} {v}" for k, v in sorted(families.items())))
    ops = collections.Counter(f"{s.kind}.{s.op}" for s in steps)
    lines.append("  ops: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
    placements = collections.Counter(
        p.split("(")[0] + ("('" + p.split("'")[1] + "')" if "'" in p else "")
        for r in runs for i in r.program.inputs for p in i.placements
    )
    lines.append("  input placements: " + ", ".join(f"{k} {v}" for k, v in sorted(placements.items())))
    ok_diffs = [v.max_diff for v in verdicts if v.kind == "ok"]
    lines.append(
        f"  largest difference among matches, as a share of the tolerance: {max(ok_diffs, default=0.0):.3g} "
        f"(0: bit for bit in {sum(d == 0.0 for d in ok_diffs)} of {len(ok_diffs)})"
    )
    by_signature: dict[str, list[int]] = collections.defaultdict(list)
    for k, v in enumerate(verdicts):
        if v.kind not in ("ok",):
            by_signature[v.signature].append(k)
    if by_signature:
        lines.append("  distinct non-ok signatures (count, first program index):")
        for sig, ks in sorted(by_signature.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"    {len(ks):4d}  #{ks[0]:<5d} {sig}")
    return "\n".join(lines)
