"""Reordering for compute/communication overlap: issue collectives early, wait late.

After AOTAutograd every functional collective is followed at once by its
``wait_tensor``, so nothing overlaps.  This pass

1. moves every ``wait_tensor`` down to just before the first node that uses its
   result (a wait that nobody uses stays where it is);
2. moves every collective up to just after the last of its inputs, or of the
   graph's communication before it if that is later (see below), unless the
   bytes of the collectives then in flight at once (issued, not yet waited on)
   would pass ``config.overlap_memory_budget_bytes``, or the graph's estimated
   peak (:mod:`dtcompile.graph.memory`) its memory budget
   (``config.memory_budget_bytes``): an early collective holds its output buffer
   for longer;
3. where the compute between a collective and its wait is estimated shorter
   than the collective (``config.cost_profile``), moves compute that the
   collective does not depend on from before it to just after it (latest first,
   back to the previous collective's wait, or the communication before it) until
   the window covers it: in a backward pass, the weight-gradient matmuls behind a
   reduce-scatter of the input gradient; where those moves together would take
   the estimated peak over the memory budget, none of them is made.

The graph computes the same values (only the order of independent nodes
changes), and issues its communication in the order it was traced: a
collective is never issued before another collective, nor before an ordering
barrier (:func:`dtcompile.base.op_facts.is_ordering_barrier`: P2P, c10d's own
ops, effectful or mutating custom ops, which communicate or may), nor before a
``local_map`` region that issues either; compute never moves across a barrier.
Ranks pair their collectives by the order they issue them, and the pass prices
each graph from its own rank's shapes, which may differ between ranks: keeping
the traced order is what keeps its decisions, however they differ, from
pairing the wrong collectives.  Waits issue nothing and still sink past
anything.  Fused collective-matmuls (``async_tp``) are left where they are:
they overlap inside.  A data-dependent collective (a MoE's token all-to-all,
its split sizes read from a tensor) is not moved either, nor compute under it:
its buffer and its time are only estimates, so neither the budget nor the
window can be checked; its wait still moves down to its first user.  In the
bytes in flight that decide whether another collective moves, it counts its
estimate (:data:`dtcompile.base.sizes.UNBACKED_HINT` per unknown size).  A
``local_map`` region is one node here: its estimate is its body's
(:func:`dtcompile.cost.simulate.region_timeline`), and one that issues
collectives is not moved, nor compute across it.  :func:`dtcompile.cost.simulate.simulate` estimates what is
gained; every move, and every move refused, is recorded.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Sequence
from typing import Any

from torch import fx

from dtcompile.base.notation import format_bytes
from dtcompile.base.op_facts import WAIT, is_ordering_barrier
from dtcompile.cost import collective_time_us
from dtcompile.cost.simulate import priced_once, simulate
from dtcompile.graph.collectives import collective_info
from dtcompile.graph.memory import PeakTracker
from dtcompile.graph.regions import issues_collectives
from dtcompile.graph.schedule import MovingSchedule, SlotCounts
from dtcompile.passes.context import PassContext
from dtcompile.records import Action, Outcome

__all__ = ["reorder_for_overlap"]

_DATA_DEPENDENT = "its sizes are data-dependent"


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _sink_waits(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Moves each wait down to just before its first user.

    Only waits move, each once, so the other nodes keep their order, and a wait not yet
    moved is still where it was traced.  Every node keeps its traced place as a slot; a
    moved wait joins its first user's slot, right before it, and a node's place is the
    count of the nodes in the slots up to its own (:class:`SlotCounts`), less those moved
    in before it.  A move and the distance it records cost ``O(log n)``, where shifting the
    places the wait crosses cost the distance: most of the graph for a wait first read far
    away (a gradient that only an optimizer at the graph's end reads).  AOTAutograd's and
    ``compile_step``'s graphs mostly leave each wait at its first user already."""
    moved = 0
    nodes = list(gm.graph.nodes)
    slot = {node: i for i, node in enumerate(nodes)}
    counts = SlotCounts(len(nodes))
    for wait in [n for n in nodes if n.target is WAIT]:
        users = [u for u in wait.users if u.op != "output"]
        if not users:
            continue
        first = min(users, key=slot.__getitem__)
        # Both are their slots' last nodes (the waits moved in go before a slot's node).
        distance = counts.before(slot[first] + 1) - counts.before(slot[wait] + 1) - 1
        if distance > 0:
            first.prepend(wait)
            counts.add(slot[wait], -1)
            counts.add(slot[first], 1)
            moved += 1
            ctx.moved(wait.name, f"waits {distance} node(s) later, before {first.name}")
    return moved


def _hoist_collectives(
    gm: fx.GraphModule,
    infos: dict[fx.Node, Any],
    communication: set[fx.Node],
    budget: int,
    tracker: PeakTracker,
    ctx: PassContext,
) -> int:
    """Moves each collective up to just after its last input, or the communication before
    it (see the module docstring).  The order and the live bytes are kept as collectives
    move (:class:`~dtcompile.graph.schedule.MovingSchedule`: a move and each question cost
    ``O(log n)``, not the distance it crosses); the bytes in flight are read off the
    collectives issued so far that may still be in flight (:class:`_InFlight`)."""
    moved = 0
    schedule = MovingSchedule(list(gm.graph.nodes), tracker.estimate.curve)
    issued = _InFlight(schedule)
    previous: fx.Node | None = None  # the communication before this node, in the traced order
    for node in list(gm.graph.nodes):
        info = infos.get(node)
        earlier, previous = previous, (node if node in communication else previous)
        if info is None or info.fused:
            continue
        try:
            if info.data_dependent:
                ctx.skipped(node.name, f"not issued earlier: {_DATA_DEPENDENT}, so the bytes in flight are unknown")
                continue
            # Never before the communication issued before it: the ranks' order stays the traced one.
            after = [*node.all_input_nodes, *([earlier] if earlier is not None else [])]
            anchor = max(after, key=schedule.key) if after else next(iter(gm.graph.nodes))
            distance = schedule.position(node) - schedule.position(anchor) - 1
            if distance <= 0:
                continue
            in_flight = issued.bytes_after(anchor) + info.bytes
            if in_flight > budget:
                ctx.skipped(node.name, f"not issued earlier: {in_flight} B in flight would pass overlap_memory_budget_bytes")
                continue
            buffer = tracker.span(node)[2]
            peak = max(schedule.peak, schedule.peak_between(anchor, node) + buffer)
            if peak > tracker.budget:
                ctx.skipped(
                    node.name,
                    f"not issued earlier: its {format_bytes(buffer)} buffer alive from {anchor.name} on would take the "
                    f"estimated peak to {format_bytes(peak)}, over the memory budget {format_bytes(tracker.budget)} "
                    f"({ctx.budget_why})",
                )
                continue
            schedule.move_after(node, anchor, buffer)
            anchor.append(node)
            moved += 1
            ctx.moved(node.name, f"issued {distance} node(s) earlier, after {anchor.name}")
        finally:  # moved or not, it is issued before whatever the collectives after it ask about
            issued.add(node, info)
    return moved


class _InFlight:
    """The bytes of the collectives issued at or before a node and waited on after it, for
    :func:`_hoist_collectives`, which asks in the graph's order.

    Asked at a node, it counts what a walk of the graph up to there would: the
    collectives (not fused) that :func:`_hoist_collectives` has passed are the ones at or
    before any node it asks about (a collective never moves above the communication
    before it), the others are after it.  The nodes it is asked about come later and
    later (each is at or after the communication before the collective asking, which the
    previous asking collective is at or after), and a wait never moves: a collective whose
    waits all run by a node asked about is never in flight again.  So the collectives
    are kept by the slot of their last wait (a wait keeps its own,
    :class:`~dtcompile.graph.schedule.MovingSchedule`), and each is added once and
    dropped once: ``O(log n)`` each, where a deep model holds hundreds in flight."""

    def __init__(self, schedule: MovingSchedule) -> None:
        self.schedule = schedule
        self.issued: list[tuple[int, int]] = []  # a heap of (its last wait's slot, bytes)
        self.total = 0

    def add(self, node: fx.Node, info: Any) -> None:
        waits = [self.schedule.key(u)[0] for u in node.users if u.target is WAIT]
        if waits:  # one with no wait is never in flight
            heapq.heappush(self.issued, (max(waits), info.bytes))
            self.total += info.bytes

    def bytes_after(self, anchor: fx.Node) -> int:
        # A wait runs after a node of another slot exactly when its slot is later; it is
        # the first node of its own.
        slot = self.schedule.key(anchor)[0]
        while self.issued and self.issued[0][0] <= slot:
            self.total -= heapq.heappop(self.issued)[1]
        return self.total


def _fill_windows(
    gm: fx.GraphModule, infos: dict[fx.Node, Any], communication: set[fx.Node], ctx: PassContext, times: dict[fx.Node, float]
) -> int:
    """Moves independent compute from before each collective to right after it, until the
    compute between the collective and its wait covers its time.

    Each collective reads only its own stretch of the graph: its window, up to where the
    compute there covers it, and the nodes before it that it could move, back to the
    communication, wait or barrier before it (or until they cover it); each node's time is
    priced once (``times``, shared with the pass's simulations).  The collective's ancestors
    among those nodes are found on the same walk back: a node is an ancestor when a node
    already seen to be one (or the collective) reads it, and the walk meets every reader of
    a node before the node itself, so it decides as the whole set of ancestors would."""
    profile = ctx.profile
    nodes = list(gm.graph.nodes)
    windows = _Windows(nodes, [priced_once(n, profile, times) for n in nodes])
    moved = 0
    for node in nodes:
        info = infos.get(node)
        waits = [u for u in node.users if u.target is WAIT]
        if info is None or info.fused or len(waits) != 1:
            continue
        if info.data_dependent:
            ctx.skipped(node.name, f"no compute moved under it: {_DATA_DEPENDENT}, so its time is unknown")
            continue
        wait = waits[0]
        need = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
        have = windows.compute_between(node, wait, need)
        if have is None:  # the window covers it
            continue
        # Walking back from the collective, its ancestors are the nodes some already-seen
        # ancestor (or the collective) reads: the walk visits every user before what it uses.
        ancestors = set(node.all_input_nodes)
        candidates = []
        added: list[float] = []
        before = node.prev
        while before.op != "root":
            if before.op != "call_function" or before.target is WAIT or before in communication:
                break  # do not move compute across another collective or wait, a barrier, or a region issuing one
            if before in ancestors:
                ancestors.update(before.all_input_nodes)
            else:
                candidates.append(before)
                added.append(priced_once(before, profile, times))
                have += added[-1]
                if windows.reaches(node, wait, have, added, need):
                    break
            before = before.prev
        # Keep the moved nodes' own order: they go right after the collective, first first.
        anchor = node
        for candidate in reversed(candidates):
            anchor.append(candidate)
            anchor = candidate
        if candidates:
            moved += len(candidates)
            ctx.moved(node.name, f"{len(candidates)} independent node(s) moved after it, to run under it")
    return moved


class _Windows:
    """The compute between a collective and its wait, for :func:`_fill_windows`, read off
    prefix sums of the nodes' times.

    :func:`_fill_windows` moves nodes from before the collective it is at to right after it,
    and goes through the collectives in order, so the nodes after the one it is at are those
    it was given, in their order.  The sum of the window's times then reads off the prefix
    sums: ``O(1)`` per collective, where adding the times up node by node cost the length of
    the window, up to where it covers the collective (a few hundred nodes in a deep model's
    whole-step graph, for each of its hundreds of collectives; the whole window where it
    does not cover it, which on a model whose collectives outlast its compute is most).
    Rounding sets the prefix sums' difference apart from the sum added up node by node, by
    far less than :attr:`_TIE`: only where a sum lands within that of the collective's time
    can the two decide differently, and there (:meth:`compute_between`, :meth:`reaches`)
    the sum is added up node by node, in the order the walk it replaced added it, so every
    decision is that walk's."""

    _TIE = 1e-9
    """Relative: far past the rounding of either sum, over any graph."""

    def __init__(self, nodes: Sequence[fx.Node], times: Sequence[float]) -> None:
        self.times = times
        self.place = {node: i for i, node in enumerate(nodes)}
        self.prefix = list(itertools.accumulate(times, initial=0.0))

    def compute_between(self, node: fx.Node, wait: fx.Node, need: float) -> float | None:
        """None where the nodes between ``node`` and ``wait`` take ``need`` microseconds or
        more, else what they take (to within rounding; added up in order, from 0, within
        :attr:`_TIE` of ``need``)."""
        start, stop = self._window(node, wait)
        tie = self._tie(need)
        approx = self.prefix[stop] - self.prefix[start]
        if approx >= need + tie:
            return None
        if approx < need - tie:
            return approx
        have = self._added_up(start, stop)
        return None if have >= need else have

    def reaches(self, node: fx.Node, wait: fx.Node, have: float, added: Sequence[float], need: float) -> bool:
        """Whether the window's compute and then ``added`` (times, in the order the walk back
        added them; ``have``: their sum as the walk keeps it) take ``need`` or more, as adding
        them all up in that order decides."""
        if abs(have - need) > self._tie(need):
            return have >= need
        exact = self._added_up(*self._window(node, wait))
        for time in added:
            exact += time
        return exact >= need

    def _window(self, node: fx.Node, wait: fx.Node) -> tuple[int, int]:
        """The positions of the nodes strictly between ``node`` and ``wait`` (none when
        the wait comes right after it)."""
        start = self.place[node] + 1
        return start, max(start, self.place[wait])

    def _tie(self, need: float) -> float:
        return self._TIE * (self.prefix[-1] + need)

    def _added_up(self, start: int, stop: int) -> float:
        have = 0.0
        for i in range(start, stop):
            have += self.times[i]
        return have


def _peak_in_flight(graph: fx.Graph, infos: dict[fx.Node, Any]) -> int:
    """The most bytes of collectives in flight at once (issued, not yet waited on), read
    where each collective is issued: one walk, the collectives in flight in a heap by their
    last wait's position."""
    order = _order(graph)
    in_flight: list[tuple[int, int]] = []  # (its last wait's position, bytes)
    total = peak = 0
    for node in graph.nodes:
        info = infos.get(node)
        if info is None:
            continue
        position = order[node]
        while in_flight and in_flight[0][0] <= position:
            total -= heapq.heappop(in_flight)[1]
        waits = [order[u] for u in node.users if u.target is WAIT]
        if not info.fused and waits and max(waits) > position:
            heapq.heappush(in_flight, (max(waits), info.bytes))
            total += info.bytes
        peak = max(peak, total)
    return peak


def _put_back(order: Sequence[fx.Node]) -> None:
    """Puts the graph's nodes back in ``order`` (the same nodes, as listed before some moves)."""
    for previous, node in itertools.pairwise(order):
        previous.append(node)


def reorder_for_overlap(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """See the module docstring."""
    # Described once: moving nodes changes no collective (nor what a region issues).
    infos = {node: info for node in gm.graph.nodes if (info := collective_info(node)) is not None}
    if not infos:
        return gm
    # What issues communication, in its traced order: collectives, barriers (a region holding
    # one is one), regions issuing collectives, and the getitems that read their outputs.
    # Moving nodes changes none of them either.
    communication = {
        node for node in gm.graph.nodes if node in infos or is_ordering_barrier(node) or issues_collectives(node)
    }
    communication |= {user for node in communication for user in node.users if user.target is operator.getitem}
    original = list(gm.graph.nodes)
    times: dict[fx.Node, float] = {}  # each node's compute time, priced once for the pass
    before = simulate(gm.graph, ctx.profile, times, infos).total_us
    held = _peak_in_flight(gm.graph, infos)
    outcomes = len(ctx.outcomes)
    moved = _sink_waits(gm, ctx)
    # Sinking a wait moves no allocation (a wait is its collective's buffer): the memory as found.
    tracker = ctx.peak_tracker(gm)
    peak_before = tracker.estimate.peak_bytes
    moved += _hoist_collectives(gm, infos, communication, ctx.config.overlap_memory_budget_bytes, tracker, ctx)
    hoisted, recorded = list(gm.graph.nodes), len(ctx.outcomes)
    filled = _fill_windows(gm, infos, communication, ctx, times)
    peak = None
    if filled:
        peak = ctx.estimate(gm).peak_bytes
        if peak > ctx.budget_bytes:
            _put_back(hoisted)
            del ctx.outcomes[recorded:]
            ctx.skipped(
                "graph",
                f"no compute moved under collectives: {filled} move(s) would take the estimated peak to "
                f"{format_bytes(peak)}, over the memory budget {format_bytes(ctx.budget_bytes)} ({ctx.budget_why})",
            )
            filled, peak = 0, None
    moved += filled
    if not moved:
        return gm
    if peak is None:
        peak = ctx.estimate(gm).peak_bytes
    adds = peak - peak_before
    # Rounded: moving nodes whose estimates sum alike leaves float noise, not a gain.
    price = ctx.price(round(before - simulate(gm.graph, ctx.profile, times, infos).total_us, 6), 0.0, adds_bytes=adds)
    more = _peak_in_flight(gm.graph, infos) - held
    if not price.pays:
        _put_back(original)
        del ctx.outcomes[outcomes:]
        ctx.skipped(
            "graph",
            f"not reordered: {moved} move(s) would hide no communication (the profile overlaps "
            f"{ctx.profile.overlap:.0%} of a collective with compute) and hold {more} B more in flight",
            price,
        )
        return gm
    # The pass's verdict first, then each move.
    ctx.outcomes.insert(outcomes, Outcome(Action.MOVED, f"{moved} move(s), {more} B more in flight at the peak", "graph", price))
    gm.graph.lint()
    return gm
