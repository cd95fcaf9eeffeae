"""What the error of ranks that compiled a graph differently says (:class:`dtcompile.ranks.check.RanksDisagree`).

:func:`disagreement_message` names the graph, the ranks on each side, the first
collective that differs, and what the graphs were decided from that differs between
them (:func:`differences`: an option, the profile, the cache), or, where the ranks
traced the same collectives with the same settings and dtcompile's passes made
different ones of them (:func:`own_making`), that it is dtcompile's bug, not the user's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dtcompile.pass_names import COMMUNICATION_PASSES
from dtcompile.ranks.schedule import Obtained, Schedule

__all__ = ["differences", "disagreement_message", "own_making"]


def disagreement_message(
    compile_id: str, axis: str, sides: Sequence[tuple[list[int], Schedule]], *, compared_schedules: bool
) -> str:
    """The error for ranks on ``sides`` (ranks, what they compiled) of one graph."""
    lines = [
        f"dtcompile: ranks compiled graph {compile_id} differently: its collectives would not pair up on the "
        f"{axis} group (gloo aborts, NCCL hangs, or the numbers are wrong), so every rank stops before the first one."
    ]
    for ranks, schedule in sides:
        on_axis = schedule.on_axis(axis)
        count = "unknown collectives" if on_axis is None else f"{len(on_axis)} collectives on {axis}"
        lines.append(f"  ranks {ranks}: graph {schedule.compile_id}, {schedule.how}, {count}")
    (ranks_a, a), (ranks_b, b) = sides[0], sides[1]
    if compared_schedules:
        lines.append(f"  first difference: {_first_difference(a, b, ranks_a[0], ranks_b[0], axis)}")
    else:
        lines.append("  (a rank's schedule is unknown: served from the compile cache without it, so what the graphs "
                     "were decided from is compared)")
    if own_making(a, b):
        lines.append(
            f"  cause: dtcompile's own. Ranks {ranks_a[0]} and {ranks_b[0]} traced the same collectives with the same "
            "options, cost profile, sources and torch, and dtcompile's passes rewrote them differently (a decision "
            "made from one rank's own shapes, which its peers need not share: a batch of another size). This is a "
            "bug in dtcompile, not in your program or setup; please report it with each rank's TORCH_TRACE log. "
            f"Meanwhile dtcompile.backend(disable_passes={{{', '.join(map(repr, sorted(COMMUNICATION_PASSES)))}}}) "
            "keeps the collectives as traced."
        )
        return "\n".join(lines)
    causes = differences(a.decided_by, b.decided_by, ranks_a[0], ranks_b[0])
    if a.how != b.how:
        causes.append(f"rank {ranks_a[0]}'s graph was {a.how}, rank {ranks_b[0]}'s {b.how}")
    if causes:
        lines.append("  what differs: " + "; ".join(causes))
    else:
        lines.append(
            "  nothing it was decided from differs: the ranks traced the same program to different collectives "
            "(each rank's trace reads its own coordinates, and under uneven shards its own shard sizes); "
            "a bug in torch or dtcompile, please report it"
        )
    lines.append(
        "  Fix: give every rank the same dtcompile options, cost profile (DTCOMPILE_PROFILE_DIR) and compile "
        "cache; dtcompile.backend(check_ranks=False) skips this check."
    )
    return "\n".join(lines)


def own_making(a: Schedule, b: Schedule) -> bool:
    """Whether two ranks' schedules of one graph differ by dtcompile's own making: both
    compiled here from the same collectives as traced (:attr:`Schedule.traced_digest`) and
    the same settings (their Dynamo graphs may differ: a rank's own input shapes), and
    dtcompile's passes made different collectives of them."""
    return (
        a.obtained is b.obtained is Obtained.COMPILED
        and bool(a.traced_digest)
        and a.traced_digest == b.traced_digest
        and a.settings_digest == b.settings_digest
        and a.digest != b.digest
    )


def differences(a: Mapping[str, str], b: Mapping[str, str], rank_a: int, rank_b: int) -> list[str]:
    """What two ranks decided from (by name) that differs, one text each:
    ``name: <rank_a's> on rank A, <rank_b's> on rank B`` (``(none)`` where one has no such entry)."""
    return [
        f"{name}: {a.get(name, '(none)')} on rank {rank_a}, {b.get(name, '(none)')} on rank {rank_b}"
        for name in dict.fromkeys([*a, *b])
        if a.get(name) != b.get(name)
    ]


def _first_difference(a: Schedule, b: Schedule, rank_a: int, rank_b: int, axis: str) -> str:
    ours, theirs = a.on_axis(axis) or (), b.on_axis(axis) or ()
    for x, y in zip(ours, theirs):
        if x != y:
            if x.where != y.where:  # the same collective at another place among the graph's collectives
                return f"{x} on rank {rank_a}, {y} on rank {rank_b}"
            return f"{x.where}: {x.what} on rank {rank_a}, {y.what} on rank {rank_b}"
    longer, rank = (ours, rank_a) if len(ours) > len(theirs) else (theirs, rank_b)
    return f"{longer[min(len(ours), len(theirs))]} on rank {rank} only"
