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
- optional step memory (the step's peak per rank, :mod:`~dtcompile.auto_parallel.peak`):
  per moment of the step (the turn to the backward, the end of it),
  ``constant + sum bytes(n, s) x[n, s] + sum bytes(b, i, j) y[b, i, j] + W w <= budget``
  (the pairs' bytes, saved for the backward, at the turn only), with ``w`` in ``[0, 1]``
  the backward's working set as a share of the largest ``W``:
  ``W w >= sum work(n, s) x[n, s]`` per group;
- objective: every group's candidate cost times its number of copies, plus every
  block's ``cost . y``.

:func:`solve` builds that program reduced, to the same optimum: candidates another
candidate dominates are left out (:mod:`~dtcompile.auto_parallel.prune`), and a
bucket takes one row per edge block, ``z[k] >= sum y[b, i, j]`` over the block's
pairs that join it (one pair of a block is chosen, so the sum is that pair's
``y``; the linear relaxation, which splits a choice over pairs, is much tighter
than with a row per pair).  HiGHS then solves it without its presolve, up to 100
branch-and-bound nodes and without its feasibility-jump heuristic, and with both
where that did not finish (:func:`_run`).  On a
one-layer Llama on 2 x 2 the solve went from 9.5 s to 0.5 s; ``reduced=False``
solves the plain program, and the tests check that both reach the same optimum.

Each constraint is built by a named builder (:func:`_one_choice_per_group`,
:func:`_edge_blocks`, :func:`_fanout_agreement`, :func:`_memory_budget`, :func:`_step_memory`) and
belongs to a named family (``edge a -> b``, ``readers of x_fanout``,
``param_memory_budget_bytes``...).  When no choice satisfies them all,
:class:`Infeasible` names the families that conflict: an irreducible set found
by dropping each family in turn (:func:`conflicting_constraints`).

``highspy`` is an optional dependency (``pip install 'dtcompile[autoparallel]'``):
HiGHS is a maintained open-source MIP solver with a Python API that builds a
model in memory, with no subprocess or temporary files as PuLP+CBC uses.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from dtcompile.auto_parallel.graph import Problem
from dtcompile.auto_parallel.peak import MOMENTS, TURN, StepMemory
from dtcompile.auto_parallel.prune import EdgeBlock, edge_blocks, undominated
from dtcompile.auto_parallel.transfer import launch_latency_us
from dtcompile.base.notation import format_bytes

__all__ = ["Infeasible", "SolveResult", "conflicting_constraints", "solve"]


class Infeasible(ValueError):
    """No choice of placements satisfies the constraints (layouts pinned, memory budget).

    ``conflict``: the named constraint families that cannot all hold (see :func:`conflicting_constraints`);
    ``min_param_bytes``: the fewest parameter bytes per rank the allowed layouts reach;
    ``least_peak_bytes``: see below."""

    def __init__(self, message: str, conflict: list[str] | None = None, min_param_bytes: int | None = None,
                 least_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.conflict = list(conflict or ())
        self.min_param_bytes = min_param_bytes
        self.least_peak_bytes = least_peak_bytes
        """With a step memory budget in the conflict: the least step peak per rank any plan reaches."""


@dataclass(frozen=True)
class SolveResult:
    choice: dict[str, int]
    """Node name -> index of its chosen candidate."""
    buckets: tuple[Any, ...]
    """The buckets of parameter collectives the plan uses (see :mod:`dtcompile.auto_parallel.edges`)."""
    objective_us: float
    seconds: float
    num_variables: int
    num_constraints: int
    num_groups: int
    num_candidates: int = 0
    """Candidates of the groups, before dominated ones were removed."""
    num_kept: int = 0
    """Candidates the program chose among."""


def _highspy() -> Any:
    try:
        import highspy
    except ImportError:
        raise ImportError(
            "dtcompile.auto_parallel needs the HiGHS solver: pip install 'dtcompile[autoparallel]' (or pip install highspy)"
        ) from None
    return highspy


@dataclass
class _Program:
    """The integer program as it is built: columns, and rows each in a named constraint family."""

    cost: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[str, list[int], list[float], float, float]] = field(default_factory=list)
    """``(family, columns, coefficients, lower, upper)``."""
    x: dict[str, int] = field(default_factory=dict)
    """Group -> its first choice column (one column per candidate in ``alive``)."""
    z: dict[Any, int] = field(default_factory=dict)
    """Bucket -> its column."""
    alive: dict[str, list[int]] = field(default_factory=dict)
    """Group -> the indices of the candidates it may take (all, unless dominated ones were
    removed: :mod:`~dtcompile.auto_parallel.prune`)."""

    reduced: bool = True
    """The program as :func:`solve` builds it by default: one bucket row per edge block and bucket,
    solved first without HiGHS's presolve (:func:`_run`).  ``False``: the plain formulation of the
    module docstring (one bucket row per pair, presolve on), kept to check the reduced one against."""
    position: dict[str, dict[int, int]] = field(default_factory=dict)
    """Group -> candidate index -> its offset from the group's first column."""
    saved_pairs: dict[int, float] = field(default_factory=dict)
    """Edge pair column -> bytes the forward saves for the backward on it (with a step memory model)."""
    held: dict[str, dict[int, float]] = field(default_factory=dict)
    """Moment of the step (:data:`~dtcompile.auto_parallel.peak.MOMENTS`) -> column -> bytes it
    keeps alive then (with a step memory model)."""

    def col(self, group: str, candidate: int) -> int:
        """The column of ``group`` taking its candidate ``candidate`` (one in ``alive``)."""
        return self.x[group] + self.position[group][candidate]

    def column(self, cost: float, integer: bool) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, family: str, cols: list[int], vals: list[float], lower: float, upper: float) -> None:
        self.rows.append((family, cols, vals, lower, upper))


def _one_choice_per_group(problem: Problem, program: _Program, groups: dict[str, list[str]]) -> None:
    """``x[g, s]`` binary, cost times copies; family ``one candidate of <group>``: ``sum_s x[g, s] = 1``.
    Over the candidates in ``program.alive`` (all of a group it does not name)."""
    for g, names in groups.items():
        candidates = problem.nodes[g].candidates
        kept = program.alive.setdefault(g, list(range(len(candidates))))
        program.x[g] = len(program.cost)
        program.position[g] = {s: i for i, s in enumerate(kept)}
        for s in kept:
            program.column(candidates[s].cost_us * len(names), True)
        n = len(kept)
        program.row(f"one candidate of {g}", list(range(program.x[g], program.x[g] + n)), [1.0] * n, 1.0, 1.0)


def _edge_blocks(problem: Problem, program: _Program, blocks: dict[tuple[str, str], EdgeBlock] | None = None) -> None:
    """``y`` per possible pair of each edge block; family ``edge <producer> -> <consumer>``: its
    rows and columns sum to the two groups' choices; family ``bucket <key>``: ``z[k] >= y``."""
    import numpy as np

    for (gp, gc), block in (blocks if blocks is not None else edge_blocks(problem)).items():
        family = f"edge {gp} -> {gc}"
        rows, cols_kept = program.alive[gp], program.alive[gc]
        matrix = block.cost[np.ix_(rows, cols_kept)]
        by_row: dict[int, list[int]] = {}
        by_col: dict[int, list[int]] = {}
        by_bucket: dict[Any, list[int]] = {}
        held = block.memory[np.ix_(rows, cols_kept)] if block.memory is not None else None
        for i, j in zip(*np.nonzero(np.isfinite(matrix))):
            col = program.column(float(matrix[i, j]), False)
            if held is not None and held[i, j]:
                program.saved_pairs[col] = float(held[i, j])
            by_row.setdefault(int(i), []).append(col)
            by_col.setdefault(int(j), []).append(col)
            for bucket in block.buckets[rows[i]][cols_kept[j]] if block.buckets is not None else ():
                by_bucket.setdefault(bucket, []).append(col)
        # One pair of the block is chosen, so its pairs that join a bucket sum to at most 1:
        # the bucket is used when that sum is (one row per block and bucket, tighter than one
        # per pair where the relaxation splits the choice).
        for bucket, cols in by_bucket.items():
            if bucket not in program.z:
                program.z[bucket] = program.column(launch_latency_us(bucket, problem.profile), True)
            for members in [cols] if program.reduced else [[c] for c in cols]:
                program.row(f"bucket {bucket}", members + [program.z[bucket]], [1.0] * len(members) + [-1.0],
                            -math.inf, 0.0)
        for i in range(matrix.shape[0]):
            cols = by_row.get(i, [])
            program.row(family, cols + [program.x[gp] + i], [1.0] * len(cols) + [-1.0], 0.0, 0.0)
        for j in range(matrix.shape[1]):
            cols = by_col.get(j, [])
            program.row(family, cols + [program.x[gc] + j], [1.0] * len(cols) + [-1.0], 0.0, 0.0)


def _fanout_agreement(problem: Problem, program: _Program) -> None:
    """Family ``readers of <fan-out>``: ``x[f, a] <= sum_{j ok with a} x[c, j]`` per reader."""
    seen = set()
    for link in problem.fanout_rules:
        gf, gc = problem.nodes[link.fanout].group, problem.nodes[link.consumer].group
        key = (gf, gc, tuple(tuple(r) for r in link.ok))
        if key in seen:
            continue
        seen.add(key)
        for a in program.alive[gf]:
            cols = [program.col(gc, j) for j in program.alive[gc] if link.ok[a][j]]
            program.row(f"readers of {gf}", [program.col(gf, a)] + cols, [1.0] + [-1.0] * len(cols), -math.inf, 0.0)


def _memory_budget(problem: Problem, program: _Program, budget: int | None) -> None:
    """Family ``param_memory_budget_bytes``: ``sum bytes(p, s) x[p, s] <= budget``."""
    if budget is None:
        return
    per_col: dict[int, float] = {}
    for name, sizes in problem.param_bytes.items():
        g = problem.nodes[name].group  # tied parameters: each copy's bytes count
        for s in program.alive[g]:
            col = program.col(g, s)
            per_col[col] = per_col.get(col, 0.0) + float(sizes[s])
    program.row("param_memory_budget_bytes", list(per_col), list(per_col.values()), -math.inf, float(budget))


def _step_memory(problem: Problem, program: _Program, memory: StepMemory | None, budget: int | None) -> None:
    """Family ``memory_budget_bytes``: the step's peak per rank (:mod:`~dtcompile.auto_parallel.peak`)
    at most ``budget`` at each of its moments (the columns' bytes per moment kept in
    ``program.held``); nothing without a budget."""
    if memory is None or budget is None:
        return
    scale = max((float(w.max()) for w in memory.working.values()), default=0.0)
    work = program.column(0.0, False) if scale else None
    seen = set()
    for name, sizes in memory.working.items():
        g = problem.nodes[name].group  # tied copies: one at a time
        if g not in seen:
            seen.add(g)
            cols = [program.col(g, s) for s in program.alive[g]]
            program.row("backward working set", [work] + cols, [scale] + [-float(sizes[s]) for s in program.alive[g]],
                        0.0, math.inf)
    for moment in MOMENTS:
        held = program.held.setdefault(moment, {})
        if work is not None:
            held[work] = scale
        for per_node in memory.terms(moment):
            for name, sizes in per_node.items():
                g = problem.nodes[name].group  # tied copies: each copy's bytes count
                for s in program.alive[g]:
                    if sizes[s]:
                        col = program.col(g, s)
                        held[col] = held.get(col, 0.0) + float(sizes[s])
        if moment == TURN:
            for col, num in program.saved_pairs.items():
                held[col] = held.get(col, 0.0) + num
        program.row("memory_budget_bytes", list(held), list(held.values()), -math.inf, float(budget - memory.constant))


def _least_peak(program: _Program, memory: StepMemory, time_limit_s: float) -> int | None:
    """The least step peak any choice reaches under the other constraints (``None``: none holds):
    ``min P`` with ``P >= `` each moment, ``P`` a share of an upper bound."""
    highspy = _highspy()
    bound = sum(sum(vals.values()) for vals in program.held.values()) or 1.0
    least = _Program(**{**program.__dict__, "cost": [0.0] * len(program.cost), "integer": list(program.integer),
                        "rows": list(program.rows)})
    peak = least.column(bound, False)
    for vals in program.held.values():
        least.row("peak", [peak, *vals], [bound] + [-v for v in vals.values()], 0.0, math.inf)
    h, status = _run(least, time_limit_s, frozenset({"memory_budget_bytes"}))
    if status != highspy.HighsModelStatus.kOptimal:
        return None
    return memory.constant + round(h.getInfo().objective_function_value)


def _run(program: _Program, time_limit_s: float, skip: frozenset[str] = frozenset()) -> tuple[Any, Any]:
    """Solve ``program`` without the families in ``skip``; ``(HiGHS, status)``."""
    highspy = _highspy()
    rows = [r for r in program.rows if r[0] not in skip]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.passModel(_lp(program, rows))
    if program.reduced:
        # HiGHS's presolve took most of the time on these programs (4.6 of 8.1 s on a one-layer
        # Llama on 2 x 2, solved at the root without it); but without it some need thousands of
        # nodes to close the last 1e-5 of the gap (DeepSeek-V3's on a 1-D mesh: over 500 s, with
        # it 0.3 s).  So: first without, up to a number of nodes (a limit of work, not of time:
        # the same program gets the same answer on every rank and machine), then with it.
        # The first try runs without the feasibility-jump heuristic, which HiGHS runs before
        # the root's linear relaxation: that relaxation is nearly integral on these programs
        # and finds the optimum, where the jump took a fifth to a third of the solve to find
        # a far worse one (Phi-3 on 2 x 4: 1.05 s with it, 0.65 s without; the same optimum).
        h.setOptionValue("presolve", "off")
        h.setOptionValue("mip_max_nodes", _NODES_WITHOUT_PRESOLVE)
        h.setOptionValue(_FEASIBILITY_JUMP, False)
        h.run()
        status = h.getModelStatus()
        if status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible):
            return h, status
        h.clearSolver()
        h.setOptionValue("presolve", "on")
        h.setOptionValue("mip_max_nodes", _NO_LIMIT)
        h.setOptionValue(_FEASIBILITY_JUMP, True)
    h.run()
    return h, h.getModelStatus()


# The first try's limit (see _run): the programs it serves close at the root.
_NODES_WITHOUT_PRESOLVE = 100
_NO_LIMIT = 2**31 - 1
# (HiGHS before 1.10 has no such heuristic; setting the option there only fails.)
_FEASIBILITY_JUMP = "mip_heuristic_run_feasibility_jump"


def _lp(program: _Program, rows: list[Any]) -> Any:
    """HiGHS's model of ``program`` with these ``rows``."""
    highspy = _highspy()
    import numpy as np

    lp = highspy.HighsLp()
    lp.num_col_ = len(program.cost)
    lp.num_row_ = len(rows)
    lp.col_cost_ = np.asarray(program.cost)
    lp.col_lower_ = np.zeros(len(program.cost))
    lp.col_upper_ = np.ones(len(program.cost))
    lp.row_lower_ = np.asarray([r[3] for r in rows])
    lp.row_upper_ = np.asarray([r[4] for r in rows])
    starts, index, value = [0], [], []
    for _, cols, vals, _, _ in rows:
        index += cols
        value += vals
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in program.integer]
    return lp


# Families every choice needs (one candidate per group): never among the conflicting ones.
_STRUCTURAL = "one candidate of "


def conflicting_constraints(program: _Program, time_limit_s: float = 60.0, max_solves: int = 200) -> list[str]:
    """An irreducible set of named constraint families that cannot all hold (a deletion filter,
    as autoparallel's ``get_violated_constraints_log`` reports violated constraints by name):
    each family is dropped in turn, and kept out when the rest is still infeasible.  ``[]`` when
    all can hold."""
    highspy = _highspy()
    if _run(program, time_limit_s)[1] == highspy.HighsModelStatus.kOptimal:
        return []  # nothing conflicts
    families = list(dict.fromkeys(r[0] for r in program.rows if not r[0].startswith(_STRUCTURAL)))
    dropped: set[str] = set()
    needed: list[str] = []
    for solves, family in enumerate(families):
        if solves >= max_solves:
            return needed + [f for f in families if f not in dropped and f not in needed]
        _, status = _run(program, time_limit_s, frozenset(dropped | {family}))
        if status == highspy.HighsModelStatus.kOptimal:
            needed.append(family)  # without it the rest can hold: part of the conflict
        else:
            dropped.add(family)
    return needed


def _min_param_bytes(problem: Problem) -> int:
    """The fewest parameter bytes per rank any choice of candidates holds (pins included)."""
    return sum(int(min(sizes)) for sizes in problem.param_bytes.values())


def _infeasible(problem: Problem, program: _Program, h: Any, status: Any, budget: int | None,
                memory: StepMemory | None = None, step_budget: int | None = None) -> Infeasible:
    conflict = conflicting_constraints(program)
    lines = [f"auto_parallel: the solver found no placement ({h.modelStatusToString(status)})"]
    if conflict:
        lines.append("; these constraints cannot all hold: " + ", ".join(conflict))
    if "memory_budget_bytes" in conflict and memory is not None and step_budget is not None:
        least = _least_peak(program, memory, 600.0)
        lines.append(
            f". memory_budget_bytes={step_budget} ({format_bytes(step_budget)}) is below the least peak any plan "
            f"reaches: {least} B ({format_bytes(least or 0)}) per rank (parameters, gradients, optimizer state, "
            "inputs and what the forward saves for the backward); raise the budget to at least that, or shard more "
            "(a larger mesh, reshard_after_forward=True in the compile config), or make the batch smaller"
        )
        return Infeasible("".join(lines), conflict, _min_param_bytes(problem), least)
    if "param_memory_budget_bytes" in conflict and budget is not None:
        lines.append(
            f". param_memory_budget_bytes={budget}: the parameters take at least {_min_param_bytes(problem)} B per "
            "rank in any layout they may take (with the pinned ones); loosen the budget or the pinned layouts"
        )
    else:
        lines.append("; loosen param_memory_budget_bytes or the pinned layouts (fixed=..., input/output_placements)")
    return Infeasible("".join(lines), conflict, _min_param_bytes(problem))


def solve(
    problem: Problem, *, param_memory_budget_bytes: int | None = None, time_limit_s: float = 600.0,
    reduced: bool = True, memory: StepMemory | None = None, memory_budget_bytes: int | None = None,
) -> SolveResult:
    """Choose one candidate per node minimising the step's estimated time; :class:`Infeasible`,
    naming the constraint families that conflict, when no choice satisfies them all.
    ``memory_budget_bytes``: the most the step may hold at its peak per rank, as ``memory``
    (:func:`~dtcompile.auto_parallel.peak.step_memory`) estimates it.
    ``reduced=False`` solves the plain program (every candidate, one bucket row per pair,
    HiGHS's presolve on): the same optimum, slower; for checking the reductions."""
    highspy = _highspy()
    start = time.perf_counter()
    groups = problem.groups()
    step_budget = memory is not None and memory_budget_bytes is not None
    blocks = edge_blocks(problem, memory.edges if memory is not None else None)
    with_memory = param_memory_budget_bytes is not None
    alive = undominated(problem, groups, blocks, with_memory,
                        step_memory=[*memory.terms(TURN), memory.grads, memory.working] if step_budget else None
                        ) if reduced else {}
    program = _Program(alive=alive, reduced=reduced)
    _one_choice_per_group(problem, program, groups)
    _edge_blocks(problem, program, blocks)
    _fanout_agreement(problem, program)
    _memory_budget(problem, program, param_memory_budget_bytes)
    _step_memory(problem, program, memory, memory_budget_bytes)
    h, status = _run(program, time_limit_s)
    if status != highspy.HighsModelStatus.kOptimal:
        raise _infeasible(problem, program, h, status, param_memory_budget_bytes, memory, memory_budget_bytes)
    values = h.getSolution().col_value
    choice: dict[str, int] = {}
    for g, names in groups.items():
        best = max(program.alive[g], key=lambda s: values[program.col(g, s)])
        for name in names:
            choice[name] = best
    used = tuple(bucket for bucket, col in program.z.items() if values[col] > 0.5)
    return SolveResult(
        choice, used, float(h.getInfo().objective_function_value), time.perf_counter() - start,
        len(program.cost), len(program.rows), len(groups),
        sum(len(problem.nodes[g].candidates) for g in groups), sum(map(len, program.alive.values())),
    )
