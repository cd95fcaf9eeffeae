"""The per-rank-shapes fuzzer's report: outcomes by entry and family, what the passes
rewrote with equal and with unequal sizes, peak memory, and each distinct failure.

:func:`format_report` is what ``tests/fuzz/test_rank_shapes.py`` prints in pytest's
summary and ``benchmarks/rank_shapes_fuzz.py`` prints (Markdown tables, for
``benchmarks/RESULTS.md``).  A pass that rewrites a share of the equal-sized cases of a
family and entry but a clearly smaller share of the unequal ones is listed under
"rewritten with equal sizes, less with unequal": the passes must rewrite what they
rewrite whatever each rank's batch.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from support.rank_shapes_run import OUTCOMES, CaseResult

__all__ = ["failures", "format_report", "signature"]

_FAILED = tuple(o for o in OUTCOMES if o != "ok")
# A share of unequal cases this much below the equal cases' is listed (and at least 2 cases apart).
_SHARE_GAP = 0.25


def signature(result: CaseResult) -> str:
    """What tells one failure from another: the outcome, the family and entry, and the telling
    line of the first rank that has one, its numbers, names and ranks left out."""
    lines = [r.detail.splitlines()[0] for r in result.ranks if r.status == result.outcome and r.detail]
    text = lines[0] if lines else (result.detail or result.note).split(" | ")[0]
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    text = re.sub(r"\[N(, N)*\]", "[N]", text)
    return f"{result.outcome} {result.case.family} {result.case.entry}: {text[:220]}"


def failures(results: Sequence[CaseResult]) -> dict[str, list[CaseResult]]:
    """The failed cases by :func:`signature`, most frequent first."""
    found: dict[str, list[CaseResult]] = defaultdict(list)
    for result in results:
        if result.outcome != "ok":
            found[signature(result)].append(result)
    return dict(sorted(found.items(), key=lambda kv: -len(kv[1])))


def _share(hit: int, total: int) -> str:
    return f"{hit}/{total}" if total else "-"


def _rewrites(result: CaseResult) -> set[str]:
    """The ``pass:action`` every rank's forward (step) graphs had at least once."""
    if not result.ranks:
        return set()
    kinds = [{k for k, v in r.rewrites.items() if v and not k.startswith("all:")} for r in result.ranks]
    return set.intersection(*kinds)


def _outcome_table(results: Sequence[CaseResult]) -> list[str]:
    rows: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for result in results:
        rows[(result.case.entry, result.case.family)].append(result)
    lines = [
        "| entry | family | cases | " + " | ".join(OUTCOMES) + " | bucketed, equal sizes | bucketed, unequal | s per case |",
        "|---|---|---:|" + "---:|" * len(OUTCOMES) + "---:|---:|---:|",
    ]
    for (entry, family), group in [*sorted(rows.items()), (("all", ""), list(results))]:
        counts = [sum(r.outcome == o for r in group) for o in OUTCOMES]
        equal = [r for r in group if r.case.equal and r.ranks]
        unequal = [r for r in group if not r.case.equal and r.ranks]
        seconds = [max(x.seconds for x in r.ranks) for r in group if r.ranks]
        per_case = f"{sum(seconds) / len(seconds):.1f}" if seconds else "-"
        lines.append(
            f"| {entry} | {family} | {len(group)} | " + " | ".join(map(str, counts))
            + f" | {_share(sum(r.bucketed for r in equal), len(equal))} | {_share(sum(r.bucketed for r in unequal), len(unequal))}"
            + f" | {per_case} |"
        )
    return lines


def _rewrite_table(results: Sequence[CaseResult]) -> tuple[list[str], list[str]]:
    """Each pass's rewrites, the share of equal- and of unequal-sized cases with them (cases
    every rank finished), by entry and family; and the ones listed as less with unequal."""
    groups: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for result in results:
        if result.ranks:
            groups[(result.case.entry, result.case.family)].append(result)
    lines = ["| entry | family | pass: action | equal sizes | unequal |", "|---|---|---|---:|---:|"]
    less = []
    for (entry, family), group in sorted(groups.items()):
        equal = [r for r in group if r.case.equal]
        unequal = [r for r in group if not r.case.equal]
        for rewrite in sorted(set().union(*(_rewrites(r) for r in group))):
            e = sum(rewrite in _rewrites(r) for r in equal)
            u = sum(rewrite in _rewrites(r) for r in unequal)
            lines.append(f"| {entry} | {family} | {rewrite} | {_share(e, len(equal))} | {_share(u, len(unequal))} |")
            # Listed where the unequal cases' share is clearly lower: by the gap, and by at least
            # two of the cases the equal cases' share would have them rewrite.
            expected = e / len(equal) * len(unequal) if equal else 0.0
            if equal and unequal and u / len(unequal) < e / len(equal) - _SHARE_GAP and expected - u >= 2:
                missing = [r.case for r in unequal if rewrite not in _rewrites(r)]
                less.append(
                    f"- {entry} {family} {rewrite}: {_share(e, len(equal))} equal-sized cases, {_share(u, len(unequal))} unequal; "
                    f"first without: {missing[0].describe()}"
                )
    return lines, less


def format_report(results: Sequence[CaseResult], seconds: float, seed: int | None = None) -> str:
    """The report (see the module docstring); ``seconds``: the run's wall time."""
    failed = sum(r.outcome != "ok" for r in results)
    head = f"{len(results)} cases in {seconds:.0f} s" + (f" (seed {seed})" if seed is not None else "")
    head += f": {len(results) - failed} ok, {failed} failed"
    rss: dict[int, int] = defaultdict(int)
    for result in results:
        for r in result.ranks:
            rss[result.case.spec.world_size] = max(rss[result.case.spec.world_size], r.rss_kb)
    out = [head, "", *_outcome_table(results), ""]
    out.append("Peak RSS of a rank process (its ru_maxrss, the largest): " + ", ".join(
        f"{rss[w] / 1024:.0f} MiB on {w} ranks" for w in sorted(rss)
    ))
    rewrites, less = _rewrite_table(results)
    out += ["", "What the passes rewrote in the forward (step) graphs, on every rank:", "", *rewrites]
    out += ["", "Rewritten with equal sizes, less with unequal:", *(less or ["- none"])]
    found = failures(results)
    out += ["", f"Distinct failures: {len(found)}"]
    for sig, group in found.items():
        first = group[0]
        out.append(f"- {len(group)} x {sig}")
        out.append(f"    first: {first.case.describe()}")
        out.append(f"    {first.detail[:600]}")
        if first.note:
            out.append(f"    note: {first.note[:400]}")
    notes = [r for r in results if r.outcome == "ok" and r.note]
    if notes:
        out += ["", f"Cases that passed in a world that then failed: {len(notes)}"]
        out += [f"- {r.case.describe()}: {r.note[:300]}" for r in notes[:5]]
    return "\n".join(out)
