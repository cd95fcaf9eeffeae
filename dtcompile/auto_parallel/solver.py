"""The placement problem as an integer program, solved with HiGHS (``highspy``).

Variables, constraints and objective (``x`` binary, ``y`` continuous in ``[0, 1]``):

- ``x[g, s]``: group ``g`` (a node, or the tied copies of one node across
  repeated layers) takes candidate ``s``; ``sum_s x[g, s] = 1``;
- ``y[b, i, j]`` for each edge block ``b`` (all edges between the same two groups,
  their cost matrices summed) and each *possible* pair of the producer's
  candidate ``i`` and the consumer's ``j``: ``sum_j y[b, i, j] = x[gp, i]`` and
  ``sum_i y[b, i, j] = x[gc, j]``.  With ``x`` integral this forces
  ``y[b, i, j] = x[gp, i] * x[gc, j]``, the edge's cost enters linearly, and an
  impossible pair has no ``y``, so it cannot be chosen (autoparallel's
  linearisation, one variable per pair rather than per input choice);
- a fan-out must suit each consumer: ``x[f, a] <= sum_{j ok with a} x[c, j]``;
- ``z[k]`` binary per bucket ``k`` (kind, mesh axis, direction) of parameter
  collectives: ``z[k] >= y[b, i, j]`` for each pair whose collectives join it;
  a bucket's launch latency counts once (:func:`~dtcompile.auto_parallel.transfer.bucketed_time_us`);
- optional parameter memory: ``sum bytes(p, s) x[p, s] <= budget``;
- objective: every group's candidate cost times its number of copies, plus every
  block's ``cost . y``.

``highspy`` is an optional dependency (``pip install 'dtcompile[autoparallel]'``):
HiGHS is a maintained open-source MIP solver with a Python API that builds a
model in memory, with no subprocess or temporary files as PuLP+CBC uses.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from dtcompile.auto_parallel.problem import Problem
from dtcompile.auto_parallel.transfer import launch_latency_us

__all__ = ["Infeasible", "SolveResult", "solve"]


class Infeasible(ValueError):
    """No choice of placements satisfies the constraints (layouts pinned, memory budget)."""


@dataclass(frozen=True)
class SolveResult:
    choice: dict[str, int]
    """Node name -> index of its chosen candidate."""
    buckets: tuple[Any, ...]
    """The buckets of parameter collectives the plan uses (see :mod:`dtcompile.auto_parallel.problem`)."""
    objective_us: float
    seconds: float
    num_variables: int
    num_constraints: int
    num_groups: int


def _highspy() -> Any:
    try:
        import highspy
    except ImportError:
        raise ImportError(
            "dtcompile.auto_parallel needs the HiGHS solver: pip install 'dtcompile[autoparallel]' (or pip install highspy)"
        ) from None
    return highspy


def solve(problem: Problem, *, param_memory_budget_bytes: int | None = None, time_limit_s: float = 600.0) -> SolveResult:
    """Choose one candidate per node minimising the step's estimated time."""
    highspy = _highspy()
    import numpy as np

    start = time.perf_counter()
    groups = problem.groups()
    members = {g: len(names) for g, names in groups.items()}
    col_cost: list[float] = []
    col_int: list[int] = []
    x: dict[str, int] = {}  # group -> first column
    for g in groups:
        node = problem.nodes[g]
        x[g] = len(col_cost)
        for c in node.candidates:
            col_cost.append(c.cost_us * members[g])
            col_int.append(1)
    rows: list[tuple[list[int], list[float], float, float]] = []
    for g in groups:
        n = len(problem.nodes[g].candidates)
        rows.append((list(range(x[g], x[g] + n)), [1.0] * n, 1.0, 1.0))

    blocks: dict[tuple[str, str], Any] = {}
    block_buckets: dict[tuple[str, str], Any] = {}
    for edge in problem.edges:
        gp, gc = problem.nodes[edge.producer].group, problem.nodes[edge.consumer].group
        if gp == gc:
            raise AssertionError(f"edge {edge.producer} -> {edge.consumer} inside one tied group")
        matrix = np.asarray(edge.cost, dtype=float)
        key = (gp, gc)
        blocks[key] = matrix if key not in blocks else blocks[key] + matrix
        if edge.buckets is not None:
            block_buckets[key] = edge.buckets  # tied copies of one edge join the same buckets
    z: dict[Any, int] = {}  # bucket -> its column: 1 when any parameter collective joins it
    for (gp, gc), matrix in blocks.items():
        by_row: dict[int, list[int]] = {}
        by_col: dict[int, list[int]] = {}
        buckets = block_buckets.get((gp, gc))
        for i, j in zip(*np.nonzero(np.isfinite(matrix))):
            col = len(col_cost)
            col_cost.append(float(matrix[i, j]))
            col_int.append(0)
            by_row.setdefault(int(i), []).append(col)
            by_col.setdefault(int(j), []).append(col)
            for bucket in buckets[i][j] if buckets is not None else ():
                if bucket not in z:
                    z[bucket] = len(col_cost)
                    col_cost.append(launch_latency_us(bucket, problem.profile))
                    col_int.append(1)
                rows.append(([col, z[bucket]], [1.0, -1.0], -math.inf, 0.0))
        for i in range(matrix.shape[0]):
            cols = by_row.get(i, [])
            rows.append((cols + [x[gp] + i], [1.0] * len(cols) + [-1.0], 0.0, 0.0))
        for j in range(matrix.shape[1]):
            cols = by_col.get(j, [])
            rows.append((cols + [x[gc] + j], [1.0] * len(cols) + [-1.0], 0.0, 0.0))

    seen_links = set()
    for link in problem.links:
        gf, gc = problem.nodes[link.fanout].group, problem.nodes[link.consumer].group
        key = (gf, gc, tuple(tuple(r) for r in link.ok))
        if key in seen_links:
            continue
        seen_links.add(key)
        for a, ok in enumerate(link.ok):
            cols = [x[gc] + j for j, good in enumerate(ok) if good]
            rows.append(([x[gf] + a] + cols, [1.0] + [-1.0] * len(cols), -math.inf, 0.0))

    if param_memory_budget_bytes is not None:
        per_col: dict[int, float] = {}
        for name, sizes in problem.param_bytes.items():
            g = problem.nodes[name].group  # tied parameters: each copy's bytes count
            for s, size in enumerate(sizes):
                per_col[x[g] + s] = per_col.get(x[g] + s, 0.0) + float(size)
        rows.append((list(per_col), list(per_col.values()), -math.inf, float(param_memory_budget_bytes)))

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-9)
    lp = highspy.HighsLp()
    lp.num_col_ = len(col_cost)
    lp.num_row_ = len(rows)
    lp.col_cost_ = np.asarray(col_cost)
    lp.col_lower_ = np.zeros(len(col_cost))
    lp.col_upper_ = np.ones(len(col_cost))
    lp.row_lower_ = np.asarray([r[2] for r in rows])
    lp.row_upper_ = np.asarray([r[3] for r in rows])
    starts, index, value = [0], [], []
    for cols, vals, _, _ in rows:
        index += cols
        value += vals
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in col_int]
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise Infeasible(
            f"auto_parallel: the solver found no placement ({h.modelStatusToString(status)}); "
            "loosen param_memory_budget_bytes or the pinned layouts"
        )
    values = h.getSolution().col_value
    choice: dict[str, int] = {}
    for g, names in groups.items():
        n = len(problem.nodes[g].candidates)
        best = max(range(n), key=lambda s: values[x[g] + s])
        for name in names:
            choice[name] = best
    used = tuple(bucket for bucket, col in z.items() if values[col] > 0.5)
    return SolveResult(
        choice, used, float(h.getInfo().objective_function_value), time.perf_counter() - start,
        len(col_cost), len(rows), len(groups),
    )
