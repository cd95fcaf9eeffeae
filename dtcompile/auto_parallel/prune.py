"""Dominated candidates, removed before the solver: the same optimum from a smaller integer program.

A candidate ``a`` of a group (a node, or the tied copies of one) is *dominated* by
a candidate ``b`` of the same group when swapping ``a`` for ``b`` in any choice of
the other groups can make nothing dearer or infeasible:

- ``b`` costs no more than ``a`` (its own cost, times the group's copies);
- on every edge block to or from the group, and for every candidate of the group
  at the other end, ``b``'s pair costs no more (an impossible pair, ``inf``, only
  where ``a``'s is impossible too) and its parameter collectives join no bucket
  ``a``'s pair does not (a bucket's launch latency is never negative);
- every fan-out rule ``a`` satisfies, ``b`` satisfies: as a fan-out's reader, every
  fan-out candidate that suits ``a`` suits ``b``; as the fan-out, every reader
  candidate that suits ``a`` suits ``b``;
- under a memory budget, ``b`` holds no more bytes per rank: its parameters (a
  parameter budget), or what it and each pair of its edges keep at the step's peak
  (a step budget, :mod:`~dtcompile.auto_parallel.peak`).

Each such swap keeps every constraint and lowers or keeps the objective, so some
optimal choice uses no dominated candidate: removing them leaves the optimum's
value unchanged (:func:`undominated`).  Of candidates that dominate each other
(equal in all of the above) the first is kept, so the result does not depend on
anything but the candidates' order.  Removing candidates can make more of their
neighbours' dominated; the rounds repeat until none is removed.

The test is autoparallel's and the classic one for pairwise cost models (a
label whose unary and pairwise costs are no lower than another's everywhere can
be dropped); the solver's ``y`` variables grow with the product of the two ends'
candidates, so the program shrinks quadratically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dtcompile.auto_parallel.graph import Problem

__all__ = ["EdgeBlock", "edge_blocks", "undominated"]


class EdgeBlock:
    """All edges between two groups, their cost matrices summed; per pair, the buckets its
    collectives join as a bit mask over ``keys`` (``None``: no bucketed collective on it)."""

    def __init__(self, cost: np.ndarray, buckets: list[list[tuple[Any, ...]]] | None,
                 memory: np.ndarray | None = None) -> None:
        self.cost = cost
        self.buckets = buckets
        self.memory = memory
        """Bytes per pair the step keeps at its peak (:mod:`~dtcompile.auto_parallel.peak`), or ``None``."""
        self.keys: list[Any] = []
        self.masks: np.ndarray | None = None
        if buckets is not None:
            index: dict[Any, int] = {}
            for row in buckets:
                for pair in row:
                    for key in pair:
                        index.setdefault(key, len(index))
            self.keys = list(index)
            if len(index) <= 62:  # one int64 bit each; more, and no candidate of its ends is pruned
                self.masks = np.array(
                    [[sum(1 << index[key] for key in pair) for pair in row] for row in buckets], dtype=np.int64
                ).reshape(cost.shape)


def edge_blocks(problem: Problem, memory: Mapping[int, np.ndarray] | None = None) -> dict[tuple[str, str], EdgeBlock]:
    """The problem's edges grouped by (producer group, consumer group), costs summed (and
    ``memory``, per edge index the bytes per pair at the step's peak, summed likewise)."""
    matrices: dict[tuple[str, str], np.ndarray] = {}
    buckets: dict[tuple[str, str], Any] = {}
    held: dict[tuple[str, str], np.ndarray] = {}
    for index, edge in enumerate(problem.edges):
        gp, gc = problem.nodes[edge.producer].group, problem.nodes[edge.consumer].group
        if gp == gc:
            raise AssertionError(f"edge {edge.producer} -> {edge.consumer} inside one tied group")
        matrix = np.asarray(edge.cost, dtype=float)  # its shape was checked where it was built
        key = (gp, gc)
        matrices[key] = matrix if key not in matrices else matrices[key] + matrix
        if edge.buckets is not None:
            buckets[key] = edge.buckets  # tied copies of one edge join the same buckets
        if memory is not None and index in memory:
            held[key] = memory[index] if key not in held else held[key] + memory[index]
    return {key: EdgeBlock(matrix, buckets.get(key), held.get(key)) for key, matrix in matrices.items()}


def _rows_dominated(cost: np.ndarray, masks: np.ndarray | None) -> np.ndarray:
    """``D[a, b]``: row ``b`` of ``cost`` is no dearer than row ``a`` in every column, and its
    buckets are a subset of ``a``'s wherever ``a``'s pair is possible."""
    if cost.shape[1] == 0:
        return np.ones((cost.shape[0],) * 2, dtype=bool)
    no_dearer = (cost[None, :, :] <= cost[:, None, :]).all(axis=2)
    if masks is None:
        return no_dearer
    extra = (masks[None, :, :] & ~masks[:, None, :]) != 0  # b joins a bucket a does not
    possible = np.isfinite(cost)[:, None, :]
    return no_dearer & ~(extra & possible).any(axis=2)


def _subset_rows(ok: np.ndarray) -> np.ndarray:
    """``D[a, b]``: every column true in row ``a`` of ``ok`` is true in row ``b``."""
    return ~(ok[:, None, :] & ~ok[None, :, :]).any(axis=2)


def undominated(
    problem: Problem,
    groups: Mapping[str, list[str]],
    blocks: Mapping[tuple[str, str], EdgeBlock],
    with_memory: bool,
    max_rounds: int = 8,
    step_memory: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> dict[str, list[int]]:
    """Per group, the indices of its candidates that no other candidate dominates (see the module
    docstring); ``with_memory``: a parameter memory budget constrains the choice;
    ``step_memory``: a step budget does, with these bytes per node and candidate, each
    mapping compared on its own (and the blocks' ``memory``)."""
    alive = {g: np.arange(len(problem.nodes[g].candidates)) for g in groups}
    cost = {g: np.array([c.cost_us * len(names) for c in problem.nodes[g].candidates]) for g, names in groups.items()}
    memories: list[dict[str, np.ndarray]] = []
    if with_memory:
        memory: dict[str, np.ndarray] = {}
        for name, sizes in problem.param_bytes.items():
            g = problem.nodes[name].group
            memory[g] = memory.get(g, 0) + np.asarray(sizes, dtype=float)
        memories.append(memory)
    for per_node in step_memory or ():
        memory = {}
        for name, sizes in per_node.items():
            g = problem.nodes[name].group
            memory[g] = memory.get(g, 0) + sizes
        memories.append(memory)
    incident: dict[str, list[tuple[str, tuple[str, str]]]] = {g: [] for g in groups}
    for gp, gc in blocks:
        incident[gp].append(("producer", (gp, gc)))
        incident[gc].append(("consumer", (gp, gc)))
    rules: dict[str, list[tuple[str, str, np.ndarray]]] = {g: [] for g in groups}
    for link in problem.fanout_rules:
        gf, gc = problem.nodes[link.fanout].group, problem.nodes[link.consumer].group
        ok = np.asarray(link.ok, dtype=bool).reshape(len(problem.nodes[link.fanout].candidates), -1)
        rules[gf].append(("fanout", gc, ok))
        rules[gc].append(("reader", gf, ok))

    for _ in range(max_rounds):
        removed = False
        for g in groups:
            keep = alive[g]
            if len(keep) <= 1:
                continue
            c = cost[g][keep]
            dominated = c[None, :] <= c[:, None]
            for memory in memories:
                if g in memory:
                    m = memory[g][keep]
                    dominated &= m[None, :] <= m[:, None]
            for side, key in incident[g]:
                block = blocks[key]
                other = alive[key[1] if side == "producer" else key[0]]
                if block.buckets is not None and block.masks is None:
                    dominated[:] = False  # too many buckets to compare: keep every candidate
                    break
                if side == "producer":
                    matrix = block.cost[np.ix_(keep, other)]
                    masks = block.masks[np.ix_(keep, other)] if block.masks is not None else None
                    held = block.memory[np.ix_(keep, other)] if block.memory is not None else None
                else:
                    matrix = block.cost[np.ix_(other, keep)].T
                    masks = block.masks[np.ix_(other, keep)].T if block.masks is not None else None
                    held = block.memory[np.ix_(other, keep)].T if block.memory is not None else None
                dominated &= _rows_dominated(matrix, masks)
                if held is not None and step_memory is not None:
                    dominated &= _rows_dominated(held, None)
            for role, other_group, ok in rules[g]:
                if role == "fanout":  # g's rows: what reader candidates suit each of g's
                    dominated &= _subset_rows(ok[np.ix_(keep, alive[other_group])])
                else:  # g reads the fan-out: what fan-out candidates suit each of g's
                    dominated &= _subset_rows(ok[np.ix_(alive[other_group], keep)].T)
            np.fill_diagonal(dominated, False)
            # Of two that dominate each other, the later one goes.
            mutual = dominated & dominated.T
            order = np.arange(len(keep))
            dominated &= ~mutual | (order[None, :] < order[:, None])
            gone = dominated.any(axis=1)
            if gone.any():
                alive[g] = keep[~gone]
                removed = True
        if not removed:
            break
    return {g: [int(i) for i in keep] for g, keep in alive.items()}
