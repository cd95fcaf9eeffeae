"""Ranks that compiled a graph differently stop with an error before its first collective.

A compiled graph's collectives pair up across ranks only if every rank compiled
the same ones, in the same order, with the same sizes and groups.  What
dtcompile decides them from is not always shared: its options, the cost profile
(``auto`` reads a calibrated file, a GPU's name), whether the graph was compiled
here, served by a compile cache or run eagerly because torch could not trace
it, dtcompile's and torch's versions, the Dynamo graph itself (a recompile on
one rank).  Ranks that differ in any of these can bucket, order or fuse
differently, and the first sign of it is gloo aborting both processes
(``Received data size doesn't match expected size``) or NCCL hanging until its
watchdog fires, or, where sizes happen to agree, wrong numbers.

So before a compiled Dynamo graph first runs, its ranks compare what they
compiled (:func:`agree`): each rank writes a :class:`Schedule` digest (every
collective of its forward and backward: op, mesh axis, group size, dtype and
shape, in order) to the process group's store and reads those of its peers, one
mesh axis after another (so what one axis's ranks learn reaches the whole mesh),
and then every rank does the same thing:

- all agree: the compiled graph runs, and the check never runs again for it;
- a rank ran the graph eagerly (``eager_fallback``): every rank runs it eagerly,
  DTensor's own collectives on each, with a warning;
- schedules differ: every rank raises :class:`RanksDisagree`, naming the graph,
  the ranks on each side, the first collective that differs and the inputs
  that differ between them (an option, the profile, the cache): the user's to
  fix; or, where the ranks traced the same collectives with the same settings
  and dtcompile's passes made different ones of them
  (:func:`dtcompile.ranks.disagreement.own_making`), that it is dtcompile's bug, not
  the user's (the message: :mod:`dtcompile.ranks.disagreement`);
- a peer does not come within ``check_ranks_timeout_s``: :class:`RanksDisagree`
  naming it (it is running another graph, e.g. one it recompiled).

The exchange goes through the store, not a collective: a check that a peer
answers with a real collective (a rank that recompiled, or runs another graph)
would abort gloo by itself.  A graph served by AOTAutograd's cache traced
nothing here; its schedule is read back from what the run that compiled it
wrote beside the cache (:func:`dtcompile.ranks.schedule.save_schedule`), or, where that is gone, the
inputs it was decided from are compared instead.

A recompile is often one rank's alone: under dynamic shapes a rank whose own
shard or sequence is 0 or 1 long specializes, a guard on a rank's own value
fails.  Its peers run the graph they have and never come to compare the new
one, so a check that waited for them would hang the job.  What must pair up is
the collectives that run together, so a recompile whose collectives its
frame's ranks already agreed on needs no exchange (:func:`dtcompile.ranks.schedule.agreed_earlier`): the
same collectives; the same ones with other sizes where the sizes are the
program's (rank-dependent shapes) and not dtcompile's (bucketing); or, where
the collectives are unknown here, the same settings.  Only a recompile with new
collectives is exchanged, and those ranks that issue them meet at the check.

The wait polls the store (no c10d warning per slice, as ``store.wait`` logs)
and says once, at INFO, which peers it has waited for a few seconds.

Off with ``dtcompile.backend(check_ranks=False)``; skipped where it cannot
matter: no process group, the fake group, groups of one rank, and a graph
this rank compiled without collectives (a graph that only some ranks run, such
as rank 0's evaluation, must not wait for the others; where a peer compiled
collectives for it, that peer's check names this rank as not coming).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import fx

from dtcompile.graph.collectives import axis_name, group_names_in
from dtcompile.ranks.disagreement import disagreement_message
from dtcompile.ranks.schedule import Schedule, short_digest

if TYPE_CHECKING:
    from dtcompile.records import RankCheck

__all__ = [
    "ABORT_KEY",
    "RankChecker",
    "RanksDisagree",
    "abort_checks",
    "agree",
    "check_groups",
    "checks_waiting_for",
    "is_simulated",
    "meet",
    "read_detail",
    "settle",
    "settled",
    "world_can_disagree",
]

log = logging.getLogger(__name__)

_PREFIX = "dtcompile/ranks/check"
# Backends whose ranks are one process's simulation: they cannot compile differently.
_SIMULATED = frozenset({"fake"})


class RanksDisagree(RuntimeError):
    """Ranks compiled one graph differently; raised on every rank before its first collective."""


# ---------------------------------------------------------------------------
# Which groups a graph's ranks compare on.


def world_can_disagree() -> bool:
    """Whether this process has ranks that can compile differently: an initialized
    process group that is not one process's simulation."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and not is_simulated(None)


def is_simulated(group: Any) -> bool:
    """Whether ``group`` (``None``: the default one) is one process's simulation of its ranks."""
    import torch.distributed as dist

    return str(dist.get_backend(group)) in _SIMULATED


def ranks_are_threads() -> bool:
    """Whether this process's ranks are threads of it (:func:`dtcompile.testing.run_threaded`,
    torch's threaded process group): they share one Dynamo, its caches, counters and flags."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "threaded"


def reset_dynamo_of_this_rank() -> None:
    """``torch._dynamo.reset()`` where it empties this rank's caches only: not where ranks are
    threads of this process, which share them (a reset would free the code other ranks run;
    :func:`dtcompile.testing.run_threaded` refuses it there).  Callers compile with a backend
    object of their own, which Dynamo compiles anew either way."""
    import torch

    if not ranks_are_threads():
        torch._dynamo.reset()


def check_groups(gm: fx.GraphModule, meshes: Sequence[Any]) -> list[str]:
    """The process groups whose ranks compare this graph, by name, in an order every rank
    shares: each mesh's axes in order, then its flattened ones (a DTensor graph's
    collectives run on them), then the groups the Dynamo graph's own functional
    collectives name; groups of one rank and simulated ones are left out."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from dtcompile.graph.collectives import flattened_axes

    names: list[str] = []
    for mesh in meshes:
        names += list(getattr(mesh, "_dim_group_names", None) or ())
    for mesh in meshes:
        names += list(flattened_axes(mesh))
    names += group_names_in(gm)
    groups = []
    for name in dict.fromkeys(names):
        group = _resolve_process_group(name)
        if group.size() > 1 and not is_simulated(group):
            groups.append(name)
    return groups


# ---------------------------------------------------------------------------
# The exchange.


@dataclass
class _Verdict:
    eager: bool
    disagreement: str


def agree(schedule: Schedule, groups: Sequence[str], timeout_s: float, axes: Mapping[str, str] | None = None) -> bool:
    """Compares ``schedule`` with this graph's peers on each of ``groups`` (process group
    names; ``axes`` names their mesh axes); see the module docstring.  Returns whether
    every rank runs the graph eagerly; raises :class:`RanksDisagree` on every rank where
    they compiled it differently."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    store = _get_default_store()
    rank = dist.get_rank()
    detail = schedule.to_json()
    verdict = _Verdict(eager=schedule.eager, disagreement="")
    for name in groups:
        ranks = dist.get_process_group_ranks(_resolve_process_group(name))
        axis = axis_name(name, axes)
        peers = _exchange(axis, ranks, rank, timeout_s, schedule, detail, verdict)
        verdict.eager = verdict.eager or any(peer["eager"] for peer in peers)
        if not verdict.disagreement:
            verdict.disagreement = next((p["disagreement"] for p in peers if p["disagreement"]), "")
        if not verdict.disagreement and not verdict.eager:
            verdict.disagreement = _compare(store, schedule.compile_id, axis, peers)
    if verdict.eager:
        return True
    if verdict.disagreement:
        raise RanksDisagree(verdict.disagreement)
    return False


def _exchange(
    axis: str,
    ranks: Sequence[int],
    rank: int,
    timeout_s: float,
    schedule: Schedule,
    detail: str,
    verdict: _Verdict,
) -> list[dict[str, Any]]:
    """This rank's digest for one group written, and every rank's of that group read."""
    mine = {
        "compile_id": schedule.compile_id,
        "digest": schedule.digest_on(axis),
        "decided": schedule.decided_by_digest,
        "eager": verdict.eager,
        "disagreement": verdict.disagreement,
    }
    return meet(
        "", ranks, mine, detail, timeout_s,
        waiting=f"rank {rank} waits at the check of graph {schedule.compile_id} on the {axis} group {list(ranks)}",
        ended=f"dtcompile: graph {schedule.compile_id}'s check on the {axis} group {list(ranks)} was ended",
        late=lambda missing: (
            f"dtcompile: rank(s) {missing} of the {axis} group {list(ranks)} did not come to compare "
            f"graph {schedule.compile_id} with rank {rank} within check_ranks_timeout_s={timeout_s:g} s: they "
            "are running another graph (one this rank compiled with new collectives and they did not: a "
            "recompile on some ranks only, or a graph break taken on some ranks only), or are still compiling "
            "(raise check_ranks_timeout_s where compiles take longer), or have stopped"
        ),
    )


def _prefix(topic: str, ranks: Sequence[int]) -> str:
    group_key = short_digest(",".join(map(str, ranks)))
    return f"{_PREFIX}/{topic}/{group_key}" if topic else f"{_PREFIX}/{group_key}"


def meet(
    topic: str,
    ranks: Sequence[int],
    entry: Mapping[str, Any],
    detail: str,
    timeout_s: float,
    *,
    waiting: str,
    ended: str,
    late: Callable[[list[int]], str],
    wait: bool = True,
) -> list[dict[str, Any]]:
    """Writes this rank's ``entry`` (JSON) and ``detail`` to the default process group's
    store, then reads every entry of ``ranks``: the n-th meeting of this rank on ``topic``
    and these ranks meets each peer's n-th.  An entry read carries ``rank`` and ``detail``,
    the key of its rank's detail (read it with :func:`read_detail` where needed).

    A peer not there within ``timeout_s`` ends the wait with :class:`RanksDisagree` saying
    ``late(missing ranks)``; :func:`abort_checks` ends it saying ``ended`` and the reason.
    ``waiting`` says what this rank waits for (logs, :func:`checks_waiting_for`).
    ``wait=False`` only writes (a rank that stops anyway leaves its peers its entry) and
    returns nothing."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank = dist.get_rank()
    prefix = _prefix(topic, ranks)
    seq = store.add(f"{prefix}/count/{rank}", 1)
    base = f"{prefix}/{seq}"
    mine = {**entry, "rank": rank, "detail": f"{base}/{rank}/detail"}
    # Four round trips: the count, both keys, the wait, the peers' entries.
    store.multi_set([f"{base}/{rank}", f"{base}/{rank}/detail"], [json.dumps(mine), detail])
    if not wait:
        return []
    keys = [f"{base}/{r}" for r in ranks]
    try:
        _wait(store, dict(zip(ranks, keys)), timeout_s, waiting)
    except _Aborted as exc:
        raise RanksDisagree(f"{ended}: {exc}") from None
    except _TimedOut as exc:
        raise RanksDisagree(late(exc.missing)) from None
    return [json.loads(value) for value in store.multi_get(keys)]


def settle(topic: str, ranks: Sequence[int], value: str) -> bool:
    """Settles ``topic`` for ``ranks`` with this rank's ``value`` if no rank has claimed it
    yet, and says whether it did; a later rank reads what was settled (:func:`settled`).

    The first rank to claim a topic decides it and never waits; every other rank waits
    only for that one, which is already past its claim: no rank waits for a rank that
    waits, so the ranks cannot deadlock, whether they compile at once (processes),
    one after another (threads, which compile under Dynamo's one lock), or alone
    (a recompile on one rank, a rank whose compile cache served the graph)."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    prefix = _prefix(topic, ranks)
    if store.add(f"{prefix}/claim", 1) != 1:
        return False
    store.set(f"{prefix}/settled", value)
    return True


def settled(topic: str, ranks: Sequence[int], timeout_s: float, *, waiting: str, late: str) -> str:
    """What the rank that claimed ``topic`` for ``ranks`` settled (:func:`settle`), once it is
    there; :class:`RanksDisagree` saying ``late`` after ``timeout_s``, or the reason of an
    :func:`abort_checks`."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    key = f"{_prefix(topic, ranks)}/settled"
    try:
        _wait(store, {-1: key}, timeout_s, waiting)
    except _Aborted as exc:
        raise RanksDisagree(f"dtcompile: {waiting} was ended: {exc}") from None
    except _TimedOut:
        raise RanksDisagree(late) from None
    value = store.get(key)
    return value.decode() if isinstance(value, bytes) else value


def read_detail(entry: Mapping[str, Any]) -> str:
    """The detail a peer wrote beside its ``entry`` at :func:`meet`."""
    from torch.distributed.distributed_c10d import _get_default_store

    value = _get_default_store().get(entry["detail"])
    return value.decode() if isinstance(value, bytes) else value


def _compare(store: Any, compile_id: str, axis: str, peers: Sequence[Mapping[str, Any]]) -> str:
    """Empty where ``peers`` compiled alike, else the error that says how they differ.

    Schedules are compared where every peer knows its own; where one does not (a
    cache entry whose schedule was not saved), what they were decided from."""
    known = all(peer["digest"] for peer in peers)
    field = "digest" if known else "decided"
    sides: dict[str, list[Mapping[str, Any]]] = {}
    for peer in peers:
        sides.setdefault(peer[field], []).append(peer)
    if len(sides) == 1:
        return ""
    schedules = [(sorted(p["rank"] for p in side), Schedule.from_json(store.get(side[0]["detail"]))) for side in sides.values()]
    return disagreement_message(compile_id, axis, schedules, compared_schedules=known)


ABORT_KEY = f"{_PREFIX}/abort"
"""A key in the default process group's store that ends every waiting check (see :func:`abort_checks`)."""


def abort_checks(reason: str) -> None:
    """Ends the checks ranks of this job wait in, with :class:`RanksDisagree` saying ``reason``:
    for a launcher or test world whose rank failed where its peers cannot see it (they wait
    at a check for a rank that will never come).  A no-op without a process group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    if dist.is_available() and dist.is_initialized():
        _get_default_store().set(ABORT_KEY, reason)


# Thread -> (what its rank waits for at a check, the store, each peer's key).
_WAITING: dict[int, tuple[str, Any, dict[int, str]]] = {}


def checks_waiting_for(rank: int) -> list[str]:
    """The checks ranks of this process wait at now for ``rank`` (which has not come), one
    line each: for a test world that must tell a rank waiting for a peer that will never
    come from one waiting for a slow peer."""
    found = []
    for what, store, keys in list(_WAITING.values()):
        if rank in keys and not store.check([keys[rank]]):
            found.append(what)
    return found


def _wait(store: Any, keys: dict[int, str], timeout_s: float, what: str) -> None:
    """Waits until every rank's key of ``keys`` is in ``store``, for up to ``timeout_s``;
    ended early by :func:`abort_checks`.

    It polls (``store.check``) rather than ``store.wait``: a TCPStore client logs two c10d
    warnings for every ``wait`` that times out, and a wait that must notice an abort has to
    time out now and then.  Past :data:`_TELL_AFTER_S` it says once, at INFO, which peers it
    waits for."""
    import threading
    import time

    start = time.monotonic()
    deadline = start + timeout_s
    pause, told, last_abort_look = _FIRST_PAUSE_S, False, start
    _WAITING[threading.get_ident()] = (what, store, keys)
    try:
        while not store.check(list(keys.values())):
            now = time.monotonic()
            if now - last_abort_look >= _ABORT_LOOK_S or now >= deadline:
                last_abort_look = now
                if store.check([ABORT_KEY]):
                    raise _Aborted(store.get(ABORT_KEY).decode())
            if now >= deadline:
                raise _TimedOut([r for r, key in keys.items() if not store.check([key])])
            if not told and now - start >= _TELL_AFTER_S:
                told = True
                missing = [r for r, key in keys.items() if not store.check([key])]
                log.info("dtcompile: %s: waited %.0f s so far for rank(s) %s", what, now - start, missing)
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, _LAST_PAUSE_S)
    finally:
        _WAITING.pop(threading.get_ident(), None)


class _Aborted(Exception):
    pass


class _TimedOut(Exception):
    def __init__(self, missing: list[int]) -> None:
        super().__init__(missing)
        self.missing = missing


# A waiting check looks at its peers' keys after 1 ms, then ever less often, at least every
# 50 ms; for an abort about once a second; and says what it waits for after 3 s.
_FIRST_PAUSE_S = 0.001
_LAST_PAUSE_S = 0.05
_ABORT_LOOK_S = 1.0
_TELL_AFTER_S = 3.0


class RankChecker:
    """The ranks' check of each graph one front door compiles (:func:`agree`), recorded in
    ``checks``: one implementation for the Dynamo backend and :func:`dtcompile.compile_step`.

    A recompile is often this rank's alone (its own shapes specialized, a guard on its
    own values, a batch of another size), and its peers then never come to compare it.
    So a graph whose collectives its frame's ranks already agreed on is not exchanged
    (:func:`dtcompile.ranks.schedule.agreed_earlier`): the same collectives, or the same
    ones with other sizes where the sizes are the program's (not a bucketing decision),
    or, where this rank does not know them (served from the cache without them), the
    same settings they were decided from.  Where only some mesh axes' collectives are new,
    only those axes' groups meet (:func:`dtcompile.ranks.schedule.agreed_axes`), and the record
    names them."""

    def __init__(self, checks: MutableSequence[Any]) -> None:
        self.checks = checks
        # (rank, frame) -> what its ranks agreed on (rank: ranks as threads share a front door).
        self._agreed: dict[tuple[int, str], set[tuple[str, str]]] = {}

    def check(
        self,
        schedule: Schedule,
        groups: Sequence[str],
        timeout_s: float,
        axes: Mapping[str, str],
        charge: Callable[[RankCheck], None] | None = None,
    ) -> bool:
        """Whether every rank runs ``schedule``'s graph eagerly; raises :class:`RanksDisagree`
        where its ranks compiled it differently.  ``charge``, where given, is handed the
        :class:`~dtcompile.records.RankCheck` it records, to charge the exchange to the
        compile (:meth:`dtcompile.records.StageSeconds.add_check`)."""
        import time

        import torch.distributed as dist

        from dtcompile.ranks.schedule import CheckOutcome, agreed_axes, agreed_earlier, agreement_marks
        from dtcompile.records import RankCheck

        agreed = self._agreed.setdefault((dist.get_rank(), schedule.frame), set())

        def record(outcome: CheckOutcome, met_on: Sequence[str], seconds: float = 0.0) -> None:
            check = RankCheck(schedule.compile_id, tuple(met_on), outcome, seconds, bool(schedule.digest))
            self.checks.append(check)
            log.info("%s", check)
            if charge is not None:
                charge(check)

        earlier = agreed_earlier(schedule, agreed)
        if earlier:
            record(earlier, groups)
            return False
        # Only the groups whose collectives are new here meet: the others' peers may never
        # compile this graph (a recompile on one dp coordinate).
        settled = agreed_axes(schedule, agreed)
        meeting = [name for name in groups if axis_name(name, axes) not in settled]
        if settled and not meeting:
            record(CheckOutcome.EARLIER, groups)
            return False
        start = time.perf_counter()
        try:
            eager = agree(schedule, meeting, timeout_s, axes)
        except RanksDisagree:
            record(CheckOutcome.DISAGREE, meeting, time.perf_counter() - start)
            raise
        record(CheckOutcome.EAGER if eager else CheckOutcome.AGREED, meeting, time.perf_counter() - start)
        if not eager:
            agreed.update(agreement_marks(schedule))
        return eager


class CheckedOnFirstCall:
    """A compiled Dynamo graph whose first call first checks that its ranks agree (:func:`agree`).

    ``compiled`` runs after that, or ``eager`` where some rank runs the graph eagerly."""

    def __init__(
        self,
        compiled: Callable[..., Any],
        eager: Callable[..., Any],
        check: Callable[[], bool],
        on_eager: Callable[[], None],
    ) -> None:
        self._run = compiled
        self._eager = eager
        self._check: Callable[[], bool] | None = check
        self._on_eager = on_eager
        self._failed: RanksDisagree | None = None

    def __call__(self, *args: Any) -> Any:
        if self._failed is not None:
            # Its ranks disagree: running it would pair collectives that do not match.
            raise self._failed
        if self._check is not None:
            try:
                eager = self._check()
            except RanksDisagree as exc:
                self._failed = exc
                raise
            self._check = None
            if eager:
                self._on_eager()
                self._run = self._eager
        return self._run(*args)
