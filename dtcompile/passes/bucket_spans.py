"""What a bucket adds to a graph's live bytes, for :mod:`dtcompile.passes.bucketing` (issue #70).

A bucket is issued once its last input can exist (its ``ready``), so
(:func:`memory_spans`) each member's input stays alive from where it was last read
up to there, the copies moved up with an input are made there, a gathered result is
alive from there rather than from its own collective, and the bucket's buffers are
all alive there at once.

Bucketing prices each member joining an open bucket against the live bytes with
every bucket added (:class:`BucketSpans`).  Written out again at each join, the
bucket's spans cost the bucket's size each, and a small model under a large cap,
whose buckets hold a tenth of the graph's collectives, grew with the square of its
depth.  A join moves ``ready`` later or leaves it; what that changes is a stretch of
each kind of span, the same for every member whose span reaches it: kept as the sum
of those members' bytes, and each member's span that starts or stops reaching it
found in a heap, a join costs ``O(log n)`` and each member, once, what it starts or
stops.  Exact: the live bytes are what adding every span again would give.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from torch import fx

from dtcompile.graph.memory import LiveBytes, PeakTracker

__all__ = ["BucketSpans", "Span", "memory_spans"]

Span = tuple[int, int, int]
"""``(first, last position, bytes)``: bytes alive over a stretch of the schedule."""


def _buffer_bytes(member: Any, tracker: PeakTracker) -> int:
    return member.value.numel() * member.value.element_size() + tracker.span(member.node)[2]


def memory_spans(members: Sequence[Any], index: dict[fx.Node, int], tracker: PeakTracker) -> list[Span]:
    """What bucketing ``members`` (bucketing's members) adds to the graph's live bytes, as
    spans of the schedule before the rewrite (see the module docstring); none for one
    member."""
    if len(members) < 2:
        return []
    ready = max(m.ready for m in members)
    spans, buffers = [], 0
    for member in members:
        _, input_end, input_bytes = tracker.span(member.node.args[0])
        _, _, result_bytes = tracker.span(member.node)
        buffers += _buffer_bytes(member, tracker)
        if ready > input_end:
            spans.append((input_end + 1, ready, input_bytes))
        if ready < member.source_at and member.copied_bytes:  # copies made earlier, at the bucket
            spans.append((ready, member.source_at - 1, member.copied_bytes))
        if ready < index[member.node]:
            spans.append((ready, index[member.node] - 1, result_bytes))
    spans.append((ready, ready, buffers))
    return spans


class BucketSpans:
    """The spans of one open bucket (:func:`memory_spans` of its members) kept added to
    ``live`` as members join it (see the module docstring).

    :meth:`join` adds what a member joining changes; then :meth:`keep` keeps the member,
    or :meth:`undo` takes the change back."""

    def __init__(self, live: LiveBytes, index: dict[fx.Node, int], tracker: PeakTracker, first: Any) -> None:
        self.live, self.index, self.tracker = live, index, tracker
        self.members = [first]
        self.ready = first.ready
        # Each kind of span by the members whose span reaches ``ready`` (a sum) and those
        # whose span starts or stops as ``ready`` moves (a heap on where it does).
        self._reading = 0  # inputs read last before ready: alive up to it
        self._unread: list[tuple[int, int, int]] = []  # (input's last read, bytes, tie) from ready on
        self._early = {"copies": 0, "results": 0}  # made at ready, alive until the member's own place
        self._until: dict[str, list[tuple[int, int, int]]] = {"copies": [], "results": []}
        self._buffers = 0
        self._count = 0  # a tie-breaker for the heaps, and what each join pushed
        self._trial: tuple[Any, ...] = ()  # what the join on trial changed, for keep or undo
        self._enter(first, self.ready, [])

    def _push(self, heap: list[tuple[int, int, int]], at: int, num: int) -> None:
        self._count += 1
        heapq.heappush(heap, (at, num, self._count))

    def _enter(self, member: Any, ready: int, adds: list[Span]) -> None:
        """``member``'s own spans at ``ready``, into the sums and heaps (and ``adds``)."""
        _, input_end, input_bytes = self.tracker.span(member.node.args[0])
        _, _, result_bytes = self.tracker.span(member.node)
        if ready > input_end:
            adds.append((input_end + 1, ready, input_bytes))
            self._reading += input_bytes
        else:
            self._push(self._unread, input_end, input_bytes)
        for kind, until, num in (
            ("copies", member.source_at, member.copied_bytes),
            ("results", self.index[member.node], result_bytes),
        ):
            if ready < until and num:
                adds.append((ready, until - 1, num))
                self._early[kind] += num
                self._push(self._until[kind], until, num)
        self._buffers += _buffer_bytes(member, self.tracker)

    def join(self, member: Any) -> None:
        """Adds to ``live`` what ``member`` joining changes (taken back by :meth:`undo`)."""
        old, new = self.ready, max(self.ready, member.ready)
        adds: list[Span] = []
        popped: list[tuple[str, tuple[int, int, int]]] = []
        saved = (dict(self._early), self._reading, self._buffers)
        if new > old:
            adds.append((old + 1, new, self._reading))
            while self._unread and self._unread[0][0] < new:
                item = heapq.heappop(self._unread)
                popped.append(("unread", item))
                adds.append((item[0] + 1, new, item[1]))
                self._reading += item[1]
            for kind, heap in self._until.items():
                while heap and heap[0][0] <= new:
                    item = heapq.heappop(heap)
                    popped.append((kind, item))
                    adds.append((old, item[0] - 1, -item[1]))
                    self._early[kind] -= item[1]
                adds.append((old, new - 1, -self._early[kind]))
        pushed = self._count
        buffers = self._buffers
        self._enter(member, new, adds)
        if len(self.members) == 1:  # nothing was added for one member: add the pair's spans
            adds = memory_spans([*self.members, member], self.index, self.tracker)
        else:
            adds += [(old, old, -buffers), (new, new, self._buffers)]
        for start, end, num in adds:
            self.live.add(start, end, num)
        self._trial = (member, new, adds, popped, *saved, pushed)

    def keep(self) -> None:
        """Keeps the member :meth:`join` added."""
        member, self.ready = self._trial[:2]
        self.members.append(member)
        self._trial = ()

    def undo(self) -> None:
        """Takes back what :meth:`join` added."""
        _, _, adds, popped, early, reading, buffers, pushed = self._trial
        for start, end, num in adds:
            self.live.add(start, end, -num)
        heaps = {"unread": self._unread, **self._until}
        for heap in heaps.values():  # less what the member pushed
            kept = [item for item in heap if item[2] <= pushed]
            if len(kept) != len(heap):
                heap[:] = kept
                heapq.heapify(heap)
        for name, item in popped:
            heapq.heappush(heaps[name], item)
        self._early, self._reading, self._buffers = early, reading, buffers
        self._trial = ()
