"""Overlap's and bucketing's walks, made linear in the graph (#70), answer what the walks they
replace answered: the waits' sinking (:func:`~dtcompile.passes.overlap._sink_waits`), the
compute under a collective (:class:`~dtcompile.passes.overlap._Windows`) and a bucket's
replaced waits (:func:`~dtcompile.passes._graph.replace_uses`)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from torch import fx

from dtcompile.base.op_facts import WAIT
from dtcompile.passes._graph import replace_uses
from dtcompile.passes.overlap import _sink_waits, _Windows

aten = torch.ops.aten


class _Moves:
    """The part of a pass's context that ``_sink_waits`` records to."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str]] = []

    def moved(self, name: str, text: str) -> None:
        self.moves.append((name, text))


def _random_graph(rng: random.Random, length: int) -> fx.GraphModule:
    """Placeholders, then adds and waits reading random earlier values (a wait's users: any
    later nodes, or none), the output reading a few."""
    graph = fx.Graph()
    values = [graph.placeholder(f"x{i}") for i in range(3)]
    for _ in range(length):
        if rng.random() < 0.3:
            node = graph.call_function(WAIT, (rng.choice(values),))
        else:
            node = graph.call_function(aten.add.Tensor, (rng.choice(values), rng.choice(values)))
        values.append(node)
    graph.output(tuple(rng.sample(values, 3)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _sink_waits_by_shifting(gm: fx.GraphModule, ctx: _Moves) -> int:
    """The walk ``_sink_waits`` replaced: a list of positions, shifted at each move."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    moved = 0
    for wait in [n for n in gm.graph.nodes if n.target is WAIT]:
        users = [u for u in wait.users if u.op != "output"]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        distance = order[first] - order[wait] - 1
        if distance > 0:
            node = wait.next
            while node is not first:
                order[node] -= 1
                node = node.next
            first.prepend(wait)
            order[wait] = order[first] - 1
            moved += 1
            ctx.moved(wait.name, f"waits {distance} node(s) later, before {first.name}")
    return moved


def test_waits_sink_to_where_shifting_every_position_they_cross_put_them() -> None:
    rng = random.Random(0)
    for length in (1, 2, 5, 20, 80, 300):
        for _ in range(20):
            seed = rng.randrange(1 << 30)
            mine, theirs = _random_graph(random.Random(seed), length), _random_graph(random.Random(seed), length)
            got, expected = _Moves(), _Moves()
            assert _sink_waits(mine, got) == _sink_waits_by_shifting(theirs, expected)
            assert got.moves == expected.moves
            assert [n.name for n in mine.graph.nodes] == [n.name for n in theirs.graph.nodes]
            mine.graph.lint()


def _walk(times: list[float], start: int, stop: int, need: float) -> float | None:
    """The walk ``_Windows`` replaced: the window's times added up node by node."""
    have = 0.0
    for i in range(start, stop):
        if have >= need:
            break
        have += times[i]
    return None if have >= need else have


def _random_windows(
    rng: random.Random, length: int, graphs: int, windows_each: int
) -> Iterator[tuple[_Windows, list[float], fx.Node, fx.Node, float]]:
    """Windows of random graphs: ``(windows, times, node, wait, total)``, ``total`` the
    times strictly between ``node`` and ``wait`` added up in order.  Times of every scale,
    zeros (views), and tenths whose sums meet a collective's time exactly."""
    graph = fx.Graph()
    nodes = [graph.placeholder(f"n{i}") for i in range(length)]
    for _ in range(graphs):
        times = [rng.choice([0.0, rng.random(), rng.random() * 1e4, 0.1, 0.2, 0.3]) for _ in nodes]
        windows = _Windows(nodes, times)
        for _ in range(windows_each):
            start = rng.randrange(len(nodes))
            stop = rng.randrange(start, len(nodes))
            total = 0.0
            for i in range(start + 1, stop):
                total += times[i]
            yield windows, times, nodes[start], nodes[stop], total


def test_the_compute_under_a_collective_is_what_adding_it_up_node_by_node_gives() -> None:
    rng = random.Random(1)
    for windows, times, node, wait, total in _random_windows(rng, 400, 30, 300):
        start, stop = windows.place[node], windows.place[wait]
        need = rng.choice([total, total * (1 + 1e-15), total * (1 - 1e-15), total / 2, total * 2, 0.0, 1e-300])
        got, walked = windows.compute_between(node, wait, need), _walk(times, start + 1, stop, need)
        # Covered or not as the walk says; what an uncovered window takes, to within rounding
        # (the walk back goes on from it, and decides its ties node by node: below).
        assert (got is None) == (walked is None)
        if got is not None:
            assert abs(got - walked) <= 1e-12 * (sum(times) + need)


def test_the_walk_back_stops_where_adding_every_time_up_in_order_reaches_the_collective() -> None:
    """``_Windows.reaches``, given the window's sum as ``compute_between`` reads it plus the
    times the walk back added, decides as adding them all up node by node, in that order,
    from the window's first node: also where the sum meets the collective's time exactly, or
    a rounding away from it."""
    rng = random.Random(3)
    checked = ties = 0
    for windows, _, node, wait, total in _random_windows(rng, 300, 30, 200):
        added = [rng.choice([0.0, 0.1, 0.2, 0.3, rng.random() * 1e3]) for _ in range(rng.randrange(1, 12))]
        exact = total
        for time in added:
            exact += time
        need = rng.choice([exact, exact * (1 + 1e-15), exact * (1 - 1e-15), exact + 0.1, exact / 2, exact * 2])
        have = windows.compute_between(node, wait, need)
        if have is None:  # the window alone covers it: no walk back
            continue
        for time in added:
            have += time
        assert windows.reaches(node, wait, have, added, need) == (exact >= need)
        checked += 1
        ties += need in (exact, exact * (1 + 1e-15), exact * (1 - 1e-15))
    assert checked > 1000 and ties > 300  # the ties were met, not skipped


def _bucket_like_graph(rng: random.Random) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """Waits, and readers of them (a fused node reading every one, some in kwargs, each
    several times), and the nodes that replace the waits."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    waits = [graph.call_function(WAIT, (x,)) for _ in range(8)]
    news = [graph.call_function(aten.neg.default, (x,)) for _ in waits]
    for _ in range(6):
        read = rng.sample(waits, rng.randint(1, len(waits)))
        graph.call_function(aten._foreach_add.List, (read, [rng.choice(waits), x]), {"alpha": 1})
        graph.call_function(aten.add.Tensor, (rng.choice(waits),), {"other": rng.choice(waits)})
    graph.output((waits[0], x))
    return fx.GraphModule(torch.nn.Module(), graph), waits, news


def test_replaced_waits_are_read_where_replace_all_uses_with_puts_them() -> None:
    rng = random.Random(2)
    for _ in range(50):
        seed = rng.randrange(1 << 30)
        mine, my_waits, my_news = _bucket_like_graph(random.Random(seed))
        theirs, their_waits, their_news = _bucket_like_graph(random.Random(seed))
        replace_uses(dict(zip(my_waits, my_news)))
        for old, new in zip(their_waits, their_news):
            old.replace_all_uses_with(new)
        assert mine.graph.python_code("self").src == theirs.graph.python_code("self").src
        for a, b in zip(mine.graph.nodes, theirs.graph.nodes):
            assert {u.name for u in a.users} == {u.name for u in b.users}
            assert [n.name for n in a.all_input_nodes] == [n.name for n in b.all_input_nodes]
        assert all(not wait.users for wait in my_waits)
