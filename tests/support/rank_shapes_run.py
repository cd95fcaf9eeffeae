"""Running the per-rank-shapes fuzzer's cases on gloo ranks, and judging them.

One :func:`dtcompile.testing.run_gloo` world per world size runs a list of cases
(:mod:`support.rank_shapes_fuzz`): each rank process walks the list, and per case

- starts a default process group of the case's own (a prefix of the job's store),
  so that no case reads what an earlier one settled or checked there, as a fresh
  job would; empties Dynamo's caches and DTensor's sharding caches;
- builds two copies of the case's model (the same seed), runs the stock eager one
  for every step (Dynamo entry: forward, ``out.pow(2).mean()``, backward; step
  entry: the same and AdamW's step), then the other through the case's entry with
  every pass on; and compares each step's output, loss and gradients (Dynamo) or
  loss and parameters (step) with eager's, local shards, to 1e-5;
- notes what dtcompile's passes rewrote (every decision but ``skipped``, by pass:
  ``bucketing:bucketed``) and each compiled graph's collectives per mesh axis,
  which :func:`judge` pairs between the ranks;
- meets its peers through the store before the next case.  A rank that raised
  first ends its peers' waits for it at dtcompile's checks; a peer left in a
  collective raises at its group's timeout (every mesh axis's group gets one:
  twice ``check_ranks_timeout_s``), and every rank goes on with the next case.
  A rank that dies (gloo aborts the process) fails the whole ``run_gloo``: the
  cases every rank wrote to its progress file are kept, the one it died in is
  run again alone (does it abort by itself?), and a fresh world runs the rest.

A case's :attr:`CaseResult.outcome` is, first that applies: ``invalid`` (stock
eager raised: the generator's fault), ``error`` (dtcompile's side raised something
other than the two below), ``disagree`` (:class:`~dtcompile.ranks.check.RanksDisagree`),
``abort`` (gloo: a size that does not match, a peer gone, a rank dead),
``mismatch`` (values differ from eager's), ``unpaired`` (two ranks of a group
compiled collectives that cannot pair: on a data axis, a graph whose collectives
there no graph of the peer has; on any other, not the same graphs), ``ok``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from support.rank_shapes_fuzz import Case

__all__ = ["CaseResult", "RankOutcome", "judge", "run_cases", "run_cases_on_rank"]

TOL = dict(rtol=1e-5, atol=1e-5)
OUTCOMES = ("ok", "disagree", "abort", "mismatch", "unpaired", "error", "invalid")
# What gloo's errors say: a size that does not match, a peer gone, a collective past its timeout.
_GLOO_MARKERS = (
    "Received data size", "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "gloo/transport",
)


@dataclass
class RankOutcome:
    """One rank's run of one case: plain data (it travels as JSON)."""

    index: int
    rank: int
    coordinate: list[int] = field(default_factory=list)
    status: str = "ok"
    """``ok``, ``mismatch``, ``disagree``, ``abort``, ``error`` or ``invalid`` (see the module docstring)."""
    detail: str = ""
    """The error's type and telling line, or the first value that differs."""
    max_diff: float = 0.0
    rewrites: dict[str, int] = field(default_factory=dict)
    """``pass:action`` -> decisions of the forward (Dynamo) or step graphs; ``all:`` prefix: every graph."""
    graphs: list[list[Any]] = field(default_factory=list)
    """Each compiled graph: ``[kind, {axis: [collective, ...]}, [bucketing's decisions]]`` in compile order."""
    checks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_kb: int = 0

    @property
    def bucketed(self) -> int:
        return self.rewrites.get("bucketing:bucketed", 0)


@dataclass
class CaseResult:
    case: Case
    outcome: str
    detail: str = ""
    ranks: list[RankOutcome] = field(default_factory=list)
    """Every rank's outcome, where every rank finished the case."""
    note: str = ""

    @property
    def bucketed(self) -> bool:
        """The forward (step graph) was bucketed, on every rank."""
        return bool(self.ranks) and all(r.bucketed > 0 for r in self.ranks)


def _error_line(exc: BaseException) -> str:
    """``Type: telling line``: Dynamo's wrappers put the underlying error on a later line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0] if lines else ""
    if head.endswith("raised:") and len(lines) > 1:
        head = lines[1]
    return f"{type(exc).__name__}: {head}"[:600]


def _status_of(exc: BaseException) -> str:
    from dtcompile.ranks.check import RanksDisagree

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RanksDisagree) or "RanksDisagree" in text:
        return "disagree"
    if any(marker in text for marker in _GLOO_MARKERS):
        return "abort"
    return "error"


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _steps_dynamo(model: Any, params: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    steps = []
    for x in batches:
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        grads = [_local(p.grad) for p in params.parameters()]
        params.zero_grad(set_to_none=True)
        steps.append({"output": _local(out), "loss": _local(loss), "grads": grads})
    return steps


def _steps_step(step: Callable[[torch.Tensor], torch.Tensor], params: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    steps = []
    for x in batches:
        loss = step(x)
        steps.append({"loss": _local(loss), "params": [_local(p) for p in params.parameters()]})
    return steps


def _eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _first_difference(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> tuple[str, float]:
    """The first value of ``got`` not close to ``want``'s (``""`` if none) and the largest difference."""
    first, largest = "", 0.0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in g:
            many = isinstance(g[key], list)
            for i, (a, b) in enumerate(zip(*((g[key], w[key]) if many else ([g[key]], [w[key]])), strict=True)):
                what = f"step {step} {key}" + (f"[{i}]" if many else "")
                if a is None or b is None or a.shape != b.shape:
                    shapes = [None if t is None else tuple(t.shape) for t in (a, b)]
                    if shapes[0] != shapes[1]:
                        first = first or f"{what}: {shapes[0]} where eager's is {shapes[1]}"
                    continue
                diff = (a - b).abs().max().item() if a.numel() else 0.0
                largest = max(largest, diff)
                if not first and not torch.allclose(a, b, **TOL, equal_nan=True):
                    first = f"{what}: differs by {diff:.3g} from eager's"
    return first, largest


def _rewrites(records: Sequence[Any]) -> dict[str, int]:
    from dtcompile.base.channels import GraphKind
    from dtcompile.records import Action

    counts: dict[str, int] = defaultdict(int)
    for record in records:
        main = record.kind in (GraphKind.FORWARD, GraphKind.STEP)
        for p in record.passes:
            for d in p.decisions:
                if d.action is not Action.SKIPPED:
                    counts[f"all:{p.name}:{d.action.value}"] += 1
                    if main:
                        counts[f"{p.name}:{d.action.value}"] += 1
    return dict(counts)


def _graphs(records: Sequence[Any]) -> list[list[Any]]:
    """Each graph: its kind, its collectives by axis, as they must pair (an all-to-all's and
    a data-dependent collective's shapes are each rank's own), and what bucketing decided
    (the first few decisions' texts, to tell why a graph was not bucketed)."""
    out = []
    for record in records:
        by_axis: dict[str, list[str]] = defaultdict(list)
        for c in record.collectives:
            shape = "?" if c.op == "all_to_all" or c.data_dependent else "x".join(map(str, c.shape))
            by_axis[c.axis].append(f"{c.label} x{c.group_size} {str(c.dtype).removeprefix('torch.')}[{shape}]")
        bucketing = [
            f"{d.action.value}: {d.text}"[:240] for p in record.passes if p.name == "bucketing" for d in p.decisions
        ]
        out.append([str(record.kind), dict(by_axis), bucketing[:6]])
    return out


def _gloo(timeout_s: float) -> tuple[str, Any]:
    """gloo with a timeout for a mesh axis's group (``new_group``'s default is 30 minutes):
    a rank left waiting in a collective its peer never joins raises within it."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return "gloo", options


def _run_case(rank: int, case: Case, timeout_s: float) -> RankOutcome:
    from torch.distributed.device_mesh import init_device_mesh

    import dtcompile

    spec = case.spec
    outcome = RankOutcome(case.index, rank)
    mesh = init_device_mesh(
        "cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names,
        backend_override={name: _gloo(2 * timeout_s) for name in spec.mesh_dim_names},
    )
    outcome.coordinate = list(mesh.get_coordinate())
    coordinate = 0 if spec.data_axis is None else outcome.coordinate[spec.mesh_dim_names.index(spec.data_axis)]
    batches = [case.batch(step, coordinate) for step in range(case.steps)]
    model, eager = case.build(mesh)
    options = dict(inductor=False, check_ranks=case.check_ranks, check_ranks_timeout_s=timeout_s)
    try:
        if case.entry == "dynamo":
            want = _steps_dynamo(eager, eager, batches)
        else:
            want = _steps_step(_eager_step(eager, torch.optim.AdamW(eager.parameters(), lr=0.01, foreach=False)), eager, batches)
    except Exception as exc:  # noqa: BLE001 - recorded: stock refused the case
        outcome.status, outcome.detail = "invalid", f"eager: {_error_line(exc)}"
        return outcome
    records: Sequence[Any] = ()
    checks: Sequence[Any] = ()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=case.family == "moe"):
            if case.entry == "dynamo":
                backend = dtcompile.backend(**options)
                records, checks = backend.records, backend.checks
                got = _steps_dynamo(torch.compile(model, backend=backend), model, batches)
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
                step = dtcompile.compile_step(lambda x: model(x).pow(2).mean(), model=model, optimizer=optimizer, **options)
                records, checks = step.step_pass.records, step.step_pass.checks
                got = _steps_step(step, model, batches)
    except Exception as exc:  # noqa: BLE001 - recorded; its peers are told (run_cases_on_rank)
        # The telling line, the whole message (RanksDisagree's says which ranks, the first
        # collective that differs and why), where it was raised.
        outcome.status = _status_of(exc)
        outcome.detail = f"{_error_line(exc)}\n{str(exc)[:1500]}\n{traceback.format_exc()[-2000:]}"
    else:
        first, outcome.max_diff = _first_difference(got, want)
        if first:
            outcome.status, outcome.detail = "mismatch", first
    outcome.rewrites = _rewrites(records)
    outcome.graphs = _graphs(records)
    outcome.checks = [str(c.outcome) for c in checks]
    return outcome


def _new_group(base_store: Any, case: Case, rank: int, timeout_s: float) -> Any:
    """A default process group of the case's own, on a prefix of the job's store."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.PrefixStore(f"rank_shapes/{case.index}", base_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=case.spec.world_size, timeout=timedelta(seconds=timeout_s)
    )
    return store


def _every_rank_came(store: Any, rank: int, world_size: int, ran: bool, timeout_s: float) -> bool:
    """Meets the peers after a case (this rank says whether it finished it without
    raising); whether every peer came within ``timeout_s``."""
    store.set(f"ran/{rank}", "1" if ran else "0")
    try:
        store.wait([f"ran/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - c10d's timeout: a peer still in the case
        return False
    return True


def run_cases_on_rank(rank: int, cases: Sequence[Case], progress_dir: str, timeout_s: float) -> list[RankOutcome]:
    """A rank's walk over ``cases`` (one world size), each case's outcome appended to
    ``progress_dir/rank<rank>.jsonl`` as it ends.  After each case the ranks meet through
    the store; a rank that raised leaves its process group first (its peers' collectives
    end), and where a peer does not come the walk stops (a fresh world runs the rest)."""
    from torch.distributed.distributed_c10d import _get_default_store

    from dtcompile.base.sharding_cache import clear_sharding_caches
    from dtcompile.ranks.check import abort_checks

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cases[0].spec.world_size))
    base_store = _get_default_store()  # held: rank 0's process serves it
    outcomes = []
    with open(Path(progress_dir) / f"rank{rank}.jsonl", "a") as progress:
        for case in cases:
            start = time.perf_counter()
            torch._dynamo.reset()
            clear_sharding_caches()
            store = _new_group(base_store, case, rank, 2 * timeout_s)
            try:
                outcome = _run_case(rank, case, timeout_s)
            except Exception as exc:  # noqa: BLE001 - outside both sides: the mesh, the model's build
                outcome = RankOutcome(case.index, rank, status="error", detail=f"setup: {_error_line(exc)}")
            outcome.seconds = time.perf_counter() - start
            outcome.rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            outcomes.append(outcome)
            progress.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
            progress.flush()
            ran = outcome.status in ("ok", "mismatch")
            if not ran:
                # Its peers' waits for it at dtcompile's checks end now; in a collective, at
                # the group's timeout (a group destroyed while a peer waits can hang both).
                abort_checks(f"rank {rank} stopped ({outcome.detail.splitlines()[0][:200]})")
            if not _every_rank_came(store, rank, case.spec.world_size, ran, 4 * timeout_s):
                break  # a peer is stuck past its group's timeout: a fresh world goes on
    return outcomes


def _groups(ranks: Sequence[RankOutcome], axis: int) -> list[list[RankOutcome]]:
    """The ranks of each group along mesh axis ``axis``: those alike on every other axis."""
    groups: dict[tuple[int, ...], list[RankOutcome]] = defaultdict(list)
    for r in ranks:
        groups[tuple(c for i, c in enumerate(r.coordinate) if i != axis)].append(r)
    return list(groups.values())


def _unpaired(case: Case, ranks: Sequence[RankOutcome]) -> str:
    """Where two ranks of a group compiled collectives that cannot pair (see the module docstring)."""
    spec = case.spec
    for axis, name in enumerate(spec.mesh_dim_names):
        for group in _groups(ranks, axis):
            if name == spec.data_axis:
                # Ranks fed their own data run the graphs of their own shapes side by side.
                seen = [sorted({json.dumps([kind, by_axis.get(name, [])]) for kind, by_axis, _ in r.graphs}) for r in group]
                if any(s != seen[0] for s in seen):
                    return f"{name} group {[r.rank for r in group]}: graphs' collectives there {seen}"
            else:
                seen = [[json.dumps([kind, by_axis.get(name, [])]) for kind, by_axis, _ in r.graphs] for r in group]
                if any(s != seen[0] for s in seen):
                    return f"{name} group {[r.rank for r in group]} (the same data): graphs' collectives there {seen}"
    return ""


def judge(case: Case, ranks: Sequence[RankOutcome]) -> CaseResult:
    """The case's outcome from every rank's (the first of :data:`OUTCOMES`' order that applies)."""
    for status in ("invalid", "error", "disagree", "abort", "mismatch"):
        hit = [r for r in ranks if r.status == status]
        if hit:
            detail = "; ".join(f"rank {r.rank}: {r.detail.splitlines()[0] if r.detail else ''}" for r in hit)
            return CaseResult(case, status, detail, list(ranks))
    unpaired = _unpaired(case, ranks)
    if unpaired:
        return CaseResult(case, "unpaired", unpaired, list(ranks))
    return CaseResult(case, "ok", "", list(ranks))


def _read_progress(progress_dir: str, world_size: int) -> dict[int, list[RankOutcome]]:
    found: dict[int, list[RankOutcome]] = defaultdict(list)
    for rank in range(world_size):
        path = Path(progress_dir) / f"rank{rank}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                outcome = RankOutcome(**json.loads(line))
                found[outcome.index].append(outcome)
    return found


def _run_world(world_size: int, cases: Sequence[Case], timeout_s: float, case_budget_s: float) -> tuple[dict[int, list[RankOutcome]], str]:
    """One ``run_gloo`` over ``cases``: the outcomes the ranks wrote down, by case (every
    rank's where all finished it), and the failure's text where the world failed."""
    from dtcompile.testing import RankFailure, run_gloo

    with tempfile.TemporaryDirectory(prefix="rank-shapes-") as progress_dir:
        failure = ""
        try:
            run_gloo(world_size, run_cases_on_rank, list(cases), progress_dir, timeout_s,
                     timeout=60.0 + case_budget_s * len(cases))
        except RankFailure as exc:
            failure = str(exc)
        found = _read_progress(progress_dir, world_size)
    return {i: sorted(rs, key=lambda r: r.rank) for i, rs in found.items()}, failure


def _failure_text(failure: str) -> str:
    """A world's failure in a line or two: each rank's last traceback line."""
    lines = [line for line in failure.splitlines() if line.strip()]
    tails = [lines[i - 1].strip() for i, line in enumerate(lines) if line.startswith("--- rank") and i > 0]
    return " | ".join([*tails, lines[-1].strip() if lines else ""])[:1200]


def run_cases(
    cases: Sequence[Case],
    *,
    batch_size: int = 50,
    timeout_s: float = 30.0,
    case_budget_s: float = 30.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[CaseResult]:
    """Every case run and judged, in the order given; ``batch_size`` cases per ``run_gloo``
    world (of each world size).  ``timeout_s``: dtcompile's ``check_ranks_timeout_s``
    (twice it, the process group's timeout); ``case_budget_s``: the world's time per
    case on 2 ranks (4 ranks: three times it)."""
    results: dict[int, CaseResult] = {}
    by_world: dict[int, list[Case]] = defaultdict(list)
    for case in cases:
        by_world[case.spec.world_size].append(case)
    for world_size, todo in sorted(by_world.items()):
        budget = case_budget_s * (3 if world_size > 2 else 1)
        queue, alone = list(todo), False
        while queue:
            chunk = queue[:1] if alone else queue[:batch_size]
            finished, failure = _run_world(world_size, chunk, timeout_s, budget)
            done = 0
            while done < len(chunk) and len(finished.get(chunk[done].index, ())) == world_size:
                results[chunk[done].index] = judge(chunk[done], finished[chunk[done].index])
                done += 1
            alone = False
            if done < len(chunk) and failure and len(chunk) > 1:
                alone = True  # the world died in chunk[done]: alone, it says whether it aborts by itself
            elif done < len(chunk) and (failure or done == 0):
                # Alone, and the world died in it (or, never seen, no rank wrote it down).
                case, partial = chunk[done], finished.get(chunk[done].index, [])
                result = judge(case, partial)
                if result.outcome == "ok":
                    result.outcome, result.detail = "abort", _failure_text(failure) or "no rank finished it"
                missing = sorted(set(range(world_size)) - {r.rank for r in partial})
                result.note = f"rank(s) {missing} did not finish it: {_failure_text(failure)}"
                results[case.index] = result
                done += 1
            elif failure:
                results[chunk[-1].index].note = f"the world failed after it: {_failure_text(failure)}"
            # Otherwise a rank raised in chunk[done - 1] and every rank stopped there: the rest runs anew.
            queue = queue[done:]
            if progress is not None:
                progress(len(results), len(cases))
    return [results[case.index] for case in cases]
