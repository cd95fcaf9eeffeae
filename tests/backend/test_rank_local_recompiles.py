"""Ranks that recompile differently because their shapes differ run as on stock torch.

Under dynamic shapes a rank recompiles on its own: its shard of an unevenly split
batch is 1 row long and specializes, or its own sequence length does.  Its peers
run the graph they have, and the collectives of the two graphs pair up: the
ranks' check must not wait for peers that will never compile that graph (it
did: the job hung for ``check_ranks_timeout_s``).  Each program here runs on two
gloo ranks with the check on, as a user's job does, and is compared with eager
on each rank and with the math on one process; the check's outcomes show that
the rank-local recompile was matched against what its frame's ranks agreed on,
not exchanged.  The wait itself logs no c10d warning, and says once when a peer
is late.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile.ranks.schedule import (
    CheckOutcome,
    Obtained,
    Schedule,
    Scheduled,
    agreed_axes,
    agreed_earlier,
    agreement_marks,
)
from dtcompile.testing import run_gloo

TOL = dict(rtol=1e-5, atol=1e-5)
ROWS = (8, 5, 7, 3)
"""Global batch sizes: local rows 4/4, 3/2, 4/3, 2/1 on two ranks (rank 1's 1 specializes)."""
C10D_WAIT_WARNING = "waitForInput"
SERIALIZE_WARNING = "unable to serialize"


def _program(x: DTensor, mesh: Any) -> tuple[torch.Tensor, DTensor]:
    y = x * 2 + 1
    return y.sum(1).full_tensor(), y.redistribute(mesh, [Replicate()])


def _rank_uneven(rank: int, world: int, dynamic: bool | None, inductor: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    backend = dtcompile.backend(inductor=inductor)
    compiled = torch.compile(_program, backend=backend, **({} if dynamic is None else {"dynamic": dynamic}))
    steps = []
    for rows in ROWS:
        full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
        x = distribute_tensor(full, mesh, [Shard(0)])
        (a, b), (ea, eb) = compiled(x, mesh), _program(x, mesh)
        steps.append({"full": full, "got": (a, b.to_local()), "eager": (ea, eb.to_local())})
    return {"steps": steps, "checks": [str(c.outcome) for c in backend.checks], "graphs": len(backend.records)}


def _assert_uneven_runs(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        for step in run["steps"]:
            want = step["full"] * 2 + 1
            for got, eager in zip(step["got"], step["eager"]):
                torch.testing.assert_close(got, eager, **TOL)
            torch.testing.assert_close(step["got"][0], want.sum(1), **TOL)
            torch.testing.assert_close(step["got"][1], want, **TOL)
        assert run["checks"][0] == CheckOutcome.AGREED, (rank, run["checks"])
    # Rank 1 compiled one graph more than rank 0 (its 1-row shard), as stock torch does,
    # and its check took what the frame's ranks had agreed on: nothing exchanged.
    assert runs[1]["graphs"] == runs[0]["graphs"] + 1, [r["graphs"] for r in runs]
    assert runs[1]["checks"][-1] == CheckOutcome.EARLIER_OTHER_SIZES, runs[1]["checks"]


@pytest.mark.gloo
@pytest.mark.inductor
def test_gloo_uneven_shards_under_dynamic_true_with_default_options_run_as_stock(capfd):
    """The program that hung: ``dynamic=True``, Inductor, the check on (the defaults)."""
    start = time.monotonic()
    runs = run_gloo(2, _rank_uneven, 2, True, True, timeout=150)
    assert time.monotonic() - start < 120
    _assert_uneven_runs(runs)
    err = capfd.readouterr().err
    # torch cannot save a DTensor spec of symbolic size: the AOT cache is off for these graphs, quietly.
    assert SERIALIZE_WARNING not in err and C10D_WAIT_WARNING not in err


@pytest.mark.gloo
def test_gloo_uneven_shards_under_automatic_dynamic_shapes_run_as_stock(capfd):
    """torch.compile's defaults: static first, then dynamic, then rank 1's 1-row specialization."""
    runs = run_gloo(2, _rank_uneven, 2, None, False, timeout=120)
    _assert_uneven_runs(runs)
    assert runs[0]["checks"] == [CheckOutcome.AGREED, CheckOutcome.AGREED], runs[0]["checks"]
    assert C10D_WAIT_WARNING not in capfd.readouterr().err


# ---------------------------------------------------------------------------
# Per-rank sequence lengths: each rank its own data, forward and backward.

LENGTHS = ((8, 3), (8, 7), (6, 5), (4, 9))
"""Per step, each rank's sequence length: rank 1 meets a second length (and recompiles for
dynamic shapes) a step before rank 0 does.  (No length of 1: there stock torch fails too,
``x @ w`` of a DTensor whose specialized local size is 1 raising a TypeError in Dynamo.)"""


def _batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, LENGTHS[step][rank], 4, generator=generator)


def _weight() -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(7))


def _loss(x: DTensor, w: DTensor) -> torch.Tensor:
    return (x @ w).relu().sum().full_tensor()


def _rank_lengths(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(_loss, backend=backend)
    steps = []
    for step in range(len(LENGTHS)):
        x = DTensor.from_local(_batch(rank, step), mesh, [Shard(0)], run_check=False)
        got, eager = [], []
        for fn, out in ((compiled, got), (_loss, eager)):
            w = distribute_tensor(_weight(), mesh, [Replicate()]).requires_grad_()
            loss = fn(x, w)
            loss.backward()
            out += [loss.detach(), w.grad.full_tensor()]
        steps.append({"got": got, "eager": eager})
    return {"steps": steps, "checks": [str(c.outcome) for c in backend.checks], "graphs": len(backend.records)}


@pytest.mark.gloo
def test_gloo_per_rank_sequence_lengths_recompile_per_rank_and_equal_eager_and_one_process(capfd):
    runs = run_gloo(2, _rank_lengths, 2, timeout=120)
    w = _weight().requires_grad_()
    for step in range(len(LENGTHS)):
        w.grad = None
        loss = sum((_batch(rank, step) @ w).relu().sum() for rank in range(2))
        loss.backward()
        for rank, run in enumerate(runs):
            got, eager = run["steps"][step]["got"], run["steps"][step]["eager"]
            for what, g, e, want in zip(("loss", "weight grad"), got, eager, (loss.detach(), w.grad)):
                torch.testing.assert_close(g, e, **TOL, msg=lambda m, s=step, r=rank, x=what: f"step {s} rank {r} {x}: {m}")
                torch.testing.assert_close(g, want, **TOL, msg=lambda m, s=step, r=rank, x=what: f"step {s} rank {r} {x} vs one process: {m}")
    # Each rank recompiled for its second length at its own step; those checks exchanged nothing.
    for run in runs:
        assert any(c.startswith("agreed on by an earlier graph") for c in run["checks"]), run["checks"]
    assert C10D_WAIT_WARNING not in capfd.readouterr().err


# ---------------------------------------------------------------------------
# A late peer: the check waits without c10d warnings and says so once.


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_late(rank: int, world: int, late_s: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    logger = logging.getLogger("dtcompile.ranks.check")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        mesh = init_device_mesh("cpu", (world,))
        x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
        backend = dtcompile.backend(inductor=False)
        compiled = torch.compile(_program, backend=backend)
        if rank == 1:
            time.sleep(late_s)
        a, _ = compiled(x, mesh)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"out": a, "checks": [str(c.outcome) for c in backend.checks], "log": handler.lines}


@pytest.mark.gloo
def test_gloo_a_peer_5_s_late_agrees_without_c10d_warnings_and_is_named_once(capfd):
    runs = run_gloo(2, _rank_late, 2, 5.0, timeout=120)
    want = (torch.arange(32.0).reshape(8, 4) * 2 + 1).sum(1)
    for run in runs:
        assert run["checks"] == [CheckOutcome.AGREED], run["checks"]
        torch.testing.assert_close(run["out"], want)
    waited = [line for line in runs[0]["log"] if "waited" in line]
    assert len(waited) == 1 and "for rank(s) [1]" in waited[0], runs[0]["log"]
    assert not [line for line in runs[1]["log"] if "waited" in line], runs[1]["log"]
    assert C10D_WAIT_WARNING not in capfd.readouterr().err


# ---------------------------------------------------------------------------
# The rule, on schedules.


def _scheduled(*shapes: tuple[int, ...], kind: str = "forward") -> tuple[Scheduled, ...]:
    return tuple(Scheduled(kind, i, "all_gather", "dp", 2, "float32", shape) for i, shape in enumerate(shapes))


def _schedule(collectives: tuple[Scheduled, ...] | None, *, bucketed: bool = False, graph: str = "a",
              obtained: Obtained = Obtained.COMPILED, **kw: Any) -> Schedule:
    decided = {"bucket_cap_bytes": "64", "Dynamo graph": graph}
    return Schedule("0/1", obtained, collectives, decided, bucketed=bucketed, **kw)


def test_a_recompile_needs_no_exchange_where_its_frame_agreed_on_its_collectives():
    marks = agreement_marks(_schedule(_scheduled((6,), (6, 4))))
    assert agreed_earlier(_schedule(_scheduled((6,), (6, 4)), graph="b"), marks) == CheckOutcome.EARLIER
    # Other sizes, chosen by the program (this rank's shapes): the same collectives pair up.
    assert agreed_earlier(_schedule(_scheduled((4,), (4, 4)), graph="b"), marks) == CheckOutcome.EARLIER_OTHER_SIZES
    # Unknown here (served from the cache without its schedule): the same settings.
    assert agreed_earlier(_schedule(None, graph="b"), marks) == CheckOutcome.EARLIER_SETTINGS


def test_a_recompile_with_new_collectives_or_dtcompile_chosen_sizes_is_exchanged():
    marks = agreement_marks(_schedule(_scheduled((6,), (6, 4))))
    # One more collective, another op, another graph: new collectives.
    assert agreed_earlier(_schedule(_scheduled((6,), (6, 4), (2,))), marks) is None
    assert agreed_earlier(_schedule(_scheduled((6,), kind="backward") + _scheduled((6, 4))[1:]), marks) is None
    # Bucketed: the sizes are dtcompile's decision (A+B, C against A, B+C), so they must match.
    bucketed = agreement_marks(_schedule(_scheduled((10,), (4,)), bucketed=True))
    assert agreed_earlier(_schedule(_scheduled((4,), (10,)), bucketed=True), bucketed) is None
    assert agreed_earlier(_schedule(_scheduled((10,), (4,)), bucketed=True), bucketed) == CheckOutcome.EARLIER
    # Other settings with unknown collectives; a graph run eagerly (every rank must learn it).
    other = Schedule("0/1", "served from the compile cache", None, {"bucket_cap_bytes": "128", "Dynamo graph": "a"})
    assert agreed_earlier(other, marks) is None
    eager = _schedule(None, obtained=Obtained.EAGER, why_eager="AssertionError: torch cannot trace it")
    assert eager.eager and eager.how == "run eagerly (AssertionError: torch cannot trace it)"
    assert Schedule.from_json(eager.to_json()) == eager
    assert agreed_earlier(eager, marks) is None


def test_a_schedule_round_trips_through_json():
    schedule = _schedule(_scheduled((6,), (6, 4)) + (Scheduled("backward", 0, "all_to_all", "ep", 4, "bfloat16", None),), bucketed=True)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert str(schedule.collectives[1]) == "forward collective 1: all_gather[dp] x2 float32[6, 4]"
    assert str(schedule.collectives[2]) == "backward collective 0: all_to_all[ep] x4 bfloat16"


# ---------------------------------------------------------------------------
# Differential: uneven-shard programs under dynamic shapes, stock against dtcompile.


def _sum_rows(x: DTensor, mesh: Any) -> Any:
    return x.sum(0).full_tensor()


def _scaled_replicated(x: DTensor, mesh: Any) -> Any:
    return (x.relu() * 3).redistribute(mesh, [Replicate()]).to_local()


def _matmul(x: DTensor, mesh: Any) -> Any:
    w = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])
    return (x @ w).tanh().full_tensor()


def _mean_then_gather(x: DTensor, mesh: Any) -> Any:
    return (x - x.mean()).full_tensor()


def _reshard_columns(x: DTensor, mesh: Any) -> Any:
    return (x.redistribute(mesh, [Shard(1)]) * 2).full_tensor()


def _backward(x: DTensor, mesh: Any) -> Any:
    x = x.detach().requires_grad_()
    y = (x * x).sum(1).full_tensor()
    y.sum().backward()
    return y.detach(), x.grad.full_tensor()


PROGRAMS = (_sum_rows, _scaled_replicated, _matmul, _mean_then_gather, _reshard_columns, _backward)
SIZES = (8, 5, 7, 3, 2, 6)
"""Global rows per call, over 2 ranks: uneven splits, a 1-row shard on one rank then on both."""


def _rank_programs(rank: int, world: int, dynamic: bool | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    found: dict[str, Any] = {}
    for program in PROGRAMS:
        for mode in ("eager", "aot_eager", "dtcompile"):
            torch._dynamo.reset()
            backend = dtcompile.backend(inductor=False) if mode == "dtcompile" else mode
            fn = program if mode == "eager" else torch.compile(program, backend=backend, dynamic=dynamic)
            outs = []
            for rows in SIZES:
                x = distribute_tensor(torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) - 7, mesh, [Shard(0)])
                try:
                    outs.append(fn(x, mesh))
                except Exception as exc:  # a failure is compared, not raised: stock's decides
                    outs.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    break
            found[f"{program.__name__} {mode}"] = outs
            if mode == "dtcompile":
                found[f"{program.__name__} checks"] = [(str(c.outcome), c.seconds) for c in backend.checks]
    return found


@pytest.mark.gloo
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
def test_gloo_uneven_programs_that_run_on_stock_run_with_the_check_on_and_equal_eager(dynamic):
    """Each program, called with six batch sizes, on stock ``aot_eager`` and on dtcompile with
    the check on: where stock runs every call, dtcompile does too, equal to eager on each rank,
    and no check waited for a peer (a rank-local recompile is not exchanged)."""
    runs = run_gloo(2, _rank_programs, 2, dynamic, timeout=300)
    compared = 0
    for program in PROGRAMS:
        for rank, run in enumerate(runs):
            eager, stock, ours = (run[f"{program.__name__} {mode}"] for mode in ("eager", "aot_eager", "dtcompile"))
            if any(isinstance(o, str) for o in eager + stock):
                continue  # eager or stock fails: nothing a user could run
            compared += 1
            assert not any(isinstance(o, str) for o in ours), (program.__name__, rank, ours)
            torch.testing.assert_close(ours, eager, **TOL, msg=lambda m, p=program, r=rank: f"{p.__name__} rank {r}: {m}")
            waits = run[f"{program.__name__} checks"]
            assert waits and all(seconds < 10 for _, seconds in waits), (program.__name__, rank, waits)
    assert compared >= 2 * (len(PROGRAMS) - 1), f"only {compared} program-ranks ran on stock"


def test_only_the_axes_whose_collectives_are_new_meet_again():
    """FSDP x TP recompiled on one dp coordinate: its tp collectives have sizes of their own,
    its dp ones are those its dp peers (which did not recompile) agreed on."""
    def two_axes(tp_shape: tuple[int, ...], *, dp_shape: tuple[int, ...] = (800,)) -> tuple[Scheduled, ...]:
        return (Scheduled("forward", 0, "all_gather", "dp", 2, "float32", dp_shape),
                Scheduled("forward", 1, "all_gather", "tp", 2, "float32", tp_shape))

    marks = agreement_marks(_schedule(two_axes((2, 16)), bucketed=True))
    recompiled = _schedule(two_axes((4, 16)), bucketed=True, graph="b")
    assert agreed_earlier(recompiled, marks) is None
    assert agreed_axes(recompiled, marks) == {"dp"}
    # A dp bucket of another size is dtcompile's decision: the dp group meets too.
    assert agreed_axes(_schedule(two_axes((4, 16), dp_shape=(512,)), bucketed=True), marks) == set()
    # Unbucketed, the program's own sizes on both axes pair up whatever they are.
    plain = agreement_marks(_schedule(two_axes((2, 16))))
    assert agreed_axes(_schedule(two_axes((4, 16), dp_shape=(512,))), plain) == {"dp", "tp"}
    # Every rank must learn of a graph run eagerly.
    assert agreed_axes(_schedule(None, obtained=Obtained.EAGER), marks) == set()
