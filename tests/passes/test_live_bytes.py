"""The incremental peak estimate (#70): :class:`~dtcompile.graph.memory.LiveBytes`, overlap's
:class:`~dtcompile.graph.schedule.MovingSchedule` and bucketing's open buckets
(:class:`~dtcompile.passes.bucket_spans.BucketSpans`) answer what a walk of the whole
schedule answers."""

from __future__ import annotations

import random

from dtcompile.graph.memory import LiveBytes, clipped
from dtcompile.graph.schedule import MovingSchedule


def _walk(curve: list[int], spans: list[tuple[int, int, int]]) -> list[int]:
    """The live bytes with ``spans`` added, by a walk of every position."""
    live = list(curve)
    for start, end, num in clipped(spans, len(curve)):
        for i in range(start, end + 1):
            live[i] += num
    return live


def test_live_bytes_answers_what_a_walk_of_the_schedule_answers() -> None:
    rng = random.Random(0)
    for length in (1, 2, 3, 7, 8, 9, 100):
        values = [rng.randint(0, 1000) for _ in range(length)]
        live = LiveBytes(values)
        for _ in range(500):
            start = rng.randrange(length)
            end = rng.randrange(start, length)
            what = rng.random()
            if what < 0.4:
                num = rng.randint(-300, 300)
                live.add(start, end, num)
                values[start : end + 1] = [v + num for v in values[start : end + 1]]
            elif what < 0.5:
                values[start] = rng.randint(0, 1000)
                live.assign(start, [values[start]])
            elif what < 0.6:
                values[start : end + 1] = [rng.randint(0, 1000) for _ in range(end + 1 - start)]
                live.assign(start, values[start : end + 1])
            elif what < 0.8:
                assert live.get(start) == values[start]
            else:
                assert live.max_over(start, end) == max(values[start : end + 1])
            assert live.peak == max(values)
        copy = live.copy()
        copy.add(0, length - 1, 1)
        assert (live.peak, copy.peak) == (max(values), max(values) + 1)


def test_a_moving_schedule_answers_what_a_list_of_positions_shifted_at_each_move_answers() -> None:
    """Overlap's hoists (#70): every answer of :class:`MovingSchedule`, after any moves of
    nodes earlier (into a slot already holding moved nodes, within one slot, across empty
    slots), equals the list of nodes and their live bytes, shifted at each move."""
    rng = random.Random(3)
    for length in (2, 3, 5, 8, 33, 200):
        order = [f"n{i}" for i in range(length)]
        values = [rng.randint(0, 1000) for _ in range(length)]
        schedule = MovingSchedule(order, values)
        for _ in range(300):
            p = rng.randrange(1, length)
            # Often right after a node moved before, as overlap's collectives chain.
            a = rng.randrange(p) if rng.random() < 0.7 else max(0, p - rng.randint(1, 3))
            node, anchor, num = order[p], order[a], rng.randint(-50, 300)
            assert schedule.peak_between(anchor, node) == max(values[a:p])
            assert [schedule.position(n) for n in (anchor, node)] == [a, p]
            assert schedule.key(anchor) < schedule.key(node)
            if rng.random() < 0.6:
                moved = values[a] + num
                values[a + 1 : p] = [v + num for v in values[a + 1 : p]]
                del order[p], values[p]
                order.insert(a + 1, node)
                values.insert(a + 1, moved)
                schedule.move_after(node, anchor, num)
            assert schedule.peak == max(values)
        assert [schedule.position(n) for n in order] == list(range(length))
        assert sorted(order, key=schedule.key) == order
        assert [schedule.peak_between(order[i], order[i + 1]) for i in range(length - 1)] == values[:-1]


class _Value:
    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4


class _Node:
    def __init__(self, *args: object) -> None:
        self.args = args


class _Tracker:
    def __init__(self, spans: dict[object, tuple[int, int, int]]) -> None:
        self.spans = spans

    def span(self, node: object) -> tuple[int, int, int]:
        return self.spans.get(node, (0, -1, 0))


def test_a_buckets_spans_kept_as_members_join_are_what_adding_them_all_again_gives() -> None:
    """Bucketing's open buckets (#70): after each member joins (kept or taken back), the
    live bytes are the schedule's plus every bucket's :func:`memory_spans` added afresh."""
    from types import SimpleNamespace

    from dtcompile.passes.bucket_spans import BucketSpans, memory_spans

    rng = random.Random(4)
    length = 60
    for _ in range(200):
        curve = [rng.randint(0, 100) for _ in range(length)]
        live = LiveBytes(curve)
        spans, index, members = {}, {}, []
        for _ in range(rng.randint(2, 12)):
            source, node = _Node(), None
            ready = rng.randrange(length - 1)
            node = _Node(source)
            index[node] = rng.randint(ready + 1, length - 1)
            spans[source] = (0, rng.randint(ready, length - 1), rng.randint(0, 40))
            spans[node] = (index[node], length - 1, rng.randint(0, 40))
            members.append(SimpleNamespace(
                node=node, value=_Value(rng.randint(1, 10)), ready=ready,
                source_at=rng.randint(ready, length - 1), copied_bytes=rng.choice([0, rng.randint(1, 30)]),
            ))
        tracker = _Tracker(spans)
        bucket = BucketSpans(live, index, tracker, members[0])
        kept = [members[0]]
        for member in members[1:]:
            bucket.join(member)
            assert [live.get(i) for i in range(length)] == _walk(curve, memory_spans([*kept, member], index, tracker))
            if rng.random() < 0.7:
                bucket.keep()
                kept.append(member)
            else:
                bucket.undo()
            assert [live.get(i) for i in range(length)] == _walk(curve, memory_spans(kept, index, tracker))
        assert bucket.members == kept and bucket.ready == max(m.ready for m in kept)
