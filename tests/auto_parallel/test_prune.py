"""Dominated candidates (``dtcompile.auto_parallel.prune``): what is removed, what must stay, and the
solver reaching the plain program's optimum without them.  Small problems built by hand; every plan
of the zoo and the plan fuzzer checks the same optimum on real models (``assert_same_optimum``)."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import Shard

from dtcompile.auto_parallel.graph import Candidate, Edge, FanoutRule, PNode, Problem
from dtcompile.auto_parallel.prune import edge_blocks, undominated
from dtcompile.auto_parallel.solver import solve

INF = math.inf
META = [((8, 8), None)]


def _candidates(costs):
    return [Candidate((), ((Shard(i % 2),),), forward_us=c) for i, c in enumerate(costs)]


def _node(name, kind, costs):
    return PNode(name, kind, [], META, [False], _candidates(costs), target=kind, group=name)


def _problem(nodes, edges, rules=(), param_bytes=None):
    return Problem(None, None, {n.name: n for n in nodes}, list(edges), list(rules), None, dict(param_bytes or {}))


def _undominated(problem, with_memory=False):
    return undominated(problem, problem.groups(), edge_blocks(problem), with_memory)


def test_a_candidate_dearer_everywhere_is_removed_and_the_others_stay():
    a = _node("a", "op", [1.0, 0.5, 2.0])
    b = _node("b", "op", [0.0, 0.0])
    # a2 costs more than a0 and each of its pairs too; a1 is cheaper but its pair with b0 is
    # impossible, so neither a0 nor a1 dominates the other.
    edge = Edge("a", 0, "b", 0, [[1.0, 2.0], [INF, 0.5], [1.0, 3.0]])
    assert _undominated(_problem([a, b], [edge])) == {"a": [0, 1], "b": [0, 1]}


def test_equal_candidates_keep_the_first_one():
    a = _node("a", "op", [1.0, 1.0, 1.0])
    b = _node("b", "op", [0.0])
    edge = Edge("a", 0, "b", 0, [[2.0], [2.0], [2.0]])
    assert _undominated(_problem([a, b], [edge]))["a"] == [0]


def test_an_impossible_pair_is_never_dominating():
    a = _node("a", "op", [0.0, 0.0])
    b = _node("b", "op", [0.0, 1.0])
    # a1 is cheaper with b1 but impossible with b0, where a0 is possible: both stay (and b's
    # two, b1 being dearer but cheaper to reach from a1).
    edge = Edge("a", 0, "b", 0, [[1.0, 1.0], [INF, 0.0]])
    assert _undominated(_problem([a, b], [edge])) == {"a": [0, 1], "b": [0, 1]}


def test_memory_counts_only_under_a_budget():
    p = _node("p", "param", [0.0, 0.0])
    b = _node("b", "op", [0.0])
    # p1 is dearer on the edge but holds fewer bytes.
    edge = Edge("p", 0, "b", 0, [[1.0], [2.0]])
    problem = _problem([p, b], [edge], param_bytes={"p": [1024, 256]})
    assert _undominated(problem, with_memory=False)["p"] == [0]
    assert _undominated(problem, with_memory=True)["p"] == [0, 1]


def test_a_fanout_reader_keeps_what_a_fanout_candidate_needs():
    f = _node("f", "fanout", [0.0, 0.0])
    c = _node("c", "op", [1.0, 0.0])
    # c1 is cheaper, but only c0 suits the fan-out's candidate 0: both stay.
    rule = FanoutRule("f", "c", 0, [[True, False], [False, True]])
    assert _undominated(_problem([f, c], [], [rule]))["c"] == [0, 1]
    # Where c1 suits everything c0 does, c0 goes.
    rule = FanoutRule("f", "c", 0, [[True, True], [False, True]])
    assert _undominated(_problem([f, c], [], [rule]))["c"] == [1]


def test_removals_repeat_until_none_is_left_to_remove():
    a = _node("a", "op", [0.0, 0.0])
    b = _node("b", "op", [0.0, 1.0])
    c = _node("c", "op", [0.0, 0.0])
    # b1 is dearer than b0 everywhere; once it is gone, a1 (cheaper than a0 only with b1) is
    # dominated by a0, and then c1 (cheaper than c0 only with a1) by c0.
    ab = Edge("a", 0, "b", 0, [[1.0, 3.0], [2.0, 2.0]])
    ca = Edge("c", 0, "a", 0, [[1.0, 3.0], [2.0, 2.0]])
    assert _undominated(_problem([a, b, c], [ab, ca])) == {"a": [0], "b": [0], "c": [0]}


@pytest.mark.parametrize("budget", [None, 1024])
def test_the_reduced_program_reaches_the_plain_programs_optimum(budget):
    import random

    rng = random.Random(7)
    # Candidate 3 of every node copies candidate 0, a little dearer everywhere: always removed.
    costs = [[rng.choice([0.0, 1.0, 2.0]) for _ in range(3)] for _ in range(6)]
    nodes = [_node(f"n{i}", "param" if i < 2 else "op", c + [c[0] + 1.0]) for i, c in enumerate(costs)]
    edges = []
    for i, j in [(0, 2), (1, 2), (2, 3), (3, 4), (2, 5), (4, 5)]:
        matrix = [[rng.choice([0.0, 0.5, 1.0, 3.0, INF]) if (r + s) % 3 else 1.0 for s in range(3)] for r in range(3)]
        matrix = [row + [row[0] + 0.5] for row in matrix]
        edges.append(Edge(f"n{i}", 0, f"n{j}", 0, matrix + [[c + 0.5 for c in matrix[0]]]))
    problem = _problem(nodes, edges, param_bytes={"n0": [512, 256, 256, 512], "n1": [512, 512, 128, 512]})
    assert all(3 not in kept for kept in _undominated(problem, budget is not None).values())
    reduced = solve(problem, param_memory_budget_bytes=budget)
    plain = solve(problem, param_memory_budget_bytes=budget, reduced=False)
    assert reduced.objective_us == pytest.approx(plain.objective_us, abs=1e-9)
    assert reduced.num_variables < plain.num_variables


def test_a_candidate_joining_a_bucket_the_other_does_not_is_not_dominated_by_cost_alone():
    p = _node("p", "param", [0.0, 0.0])
    b = _node("b", "op", [0.0])
    bucket = ("forward", "all_gather", "tp", 4, 1)
    # p0's gather is cheaper on the wire but opens a bucket (its launch latency, paid once) p1's
    # transfer does not need: both stay.  Without the bucket, p1 goes.
    edge = Edge("p", 0, "b", 0, [[1.0], [2.0]], buckets=[[(bucket,)], [()]])
    assert _undominated(_problem([p, b], [edge]))["p"] == [0, 1]
    edge = Edge("p", 0, "b", 0, [[1.0], [2.0]], buckets=[[(bucket,)], [(bucket,)]])
    assert _undominated(_problem([p, b], [edge]))["p"] == [0]
