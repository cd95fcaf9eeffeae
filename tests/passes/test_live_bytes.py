"""The incremental peak estimate (#70): :class:`~dtcompile.graph.memory.LiveBytes` and the
bucketing pass's span differences answer what a walk of the whole schedule answers."""

from __future__ import annotations

import random

from dtcompile.graph.memory import LiveBytes, clipped, span_difference


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
                assert live.values(start, end) == values[start : end + 1]
            else:
                assert live.max_over(start, end) == max(values[start : end + 1])
            assert live.peak == max(values)
        copy = live.copy()
        copy.add(0, length - 1, 1)
        assert (live.peak, copy.peak) == (max(values), max(values) + 1)


def test_a_span_difference_takes_the_old_spans_live_bytes_to_the_new_ones() -> None:
    rng = random.Random(1)
    length = 50
    curve = [rng.randint(0, 100) for _ in range(length)]

    def spans() -> list[tuple[int, int, int]]:
        return [(s, s + rng.randint(-2, 10), rng.randint(0, 50)) for s in (rng.randrange(length) for _ in range(rng.randint(0, 6)))]

    for _ in range(300):
        old, new = spans(), spans()
        live = LiveBytes(_walk(curve, old))
        change = span_difference(old, new, length)
        live.add_spans(change)
        assert [live.get(i) for i in range(length)] == _walk(curve, new)
        live.add_spans(change, -1)
        assert [live.get(i) for i in range(length)] == _walk(curve, old)


def test_a_gathered_members_reshape_is_contiguous_as_torch_says() -> None:
    """The bucketing pass reads off the sizes whether a member's reshaped column of a
    gathered bucket is contiguous; torch's own reshape says the same."""
    import math

    import torch

    from dtcompile.passes._graph import reshape_is_contiguous

    rng = random.Random(2)
    for _ in range(3000):
        rows = rng.choice([1, 2, 3, 4, 8])
        piece_shape = [rng.choice([1, 1, 2, 3, 4, 6]) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.1:
            piece_shape.append(0)
        piece = math.prod(piece_shape)
        offset, after = rng.choice([0, 0, 1, 5]), rng.choice([0, 0, 2, 7])
        total = offset + piece + after
        # The member's shape, or another of as many elements: dims split or merged anywhere.
        flat = [rows, *piece_shape] if rng.random() < 0.5 else [rows * piece]
        if rng.random() < 0.5 and rows * piece:
            numel, shape = rows * piece, []
            while numel > 1:
                d = rng.choice([d for d in range(1, numel + 1) if numel % d == 0])
                shape.append(d)
                numel //= d
            shape += [1] * rng.randint(0, 2)
            rng.shuffle(shape)
            flat = shape or [1]
        columns = torch.empty(rows, total, device="meta")[:, offset : offset + piece]
        assert reshape_is_contiguous(rows, total, offset, piece, flat) == columns.reshape(flat).is_contiguous(), (
            rows, total, offset, piece, flat)
