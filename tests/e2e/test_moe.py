"""Mixture of experts with expert parallelism (issue #16): compiled == eager == one process.

The model (:class:`dtcompile._testing.models.MoE`) routes each token to its
top-k experts; with the experts sharded over the mesh's ``ep`` axis, tokens go
to their experts' ranks and back through ``all_to_all_single`` whose split
sizes come from ``.tolist()`` of the token counts, as torchtitan's
``AllToAllTokenDispatcher`` does.  Under ``capture_scalar_outputs`` (as
torchtitan compiles) those sizes are unbacked symbols: the collectives are
data-dependent, which dtcompile must cost, report and schedule without
guarding on them.  Ranks are threads (real collectives); the reference is the
same weights in one process computing every expert on every token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.tensor import DTensor

import dtcompile
from dtcompile._testing.models import build_moe
from dtcompile.artifacts import collectives_json
from dtcompile.records import Action
from dtcompile.testing import fake_world, run_threaded
from dtcompile.testing.worlds import _mesh, wait_for_eager_on_every_rank
from dtcompile_tools import report as report_tool

WORLDS = {2: ((2,), ("ep",)), 4: ((2, 2), ("dp", "ep"))}
"""World size -> mesh shape and axis names: experts over ``ep``; with 4 ranks also
data parallel over ``dp`` (every rank feeds its own tokens either way)."""
STEPS = 3
# Measured: errors <= 1e-6 on losses of 3 to 9, <= 5e-7 on outputs and gradients
# (gradients up to 1.6).
TOL = dict(rtol=1e-5, atol=1e-6)


def _backend():
    return dtcompile.backend(inductor=False)


@dataclass(frozen=True)
class _Step:
    loss: torch.Tensor
    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    """Full gradients by the reference model's parameter names."""


def _reference_name(name: str) -> str:
    # parametrize stores a DTensor parameter as `[<module>.]parametrizations.<name>.original`.
    return re.sub(r"(^|\.)parametrizations\.", r"\1", name).removesuffix(".original")


def _train(model, params: torch.nn.Module, x: torch.Tensor, num_tokens: int) -> list[_Step]:
    """:data:`STEPS` SGD steps; the loss is this rank's part of the whole batch's
    ``out.pow(2).mean()`` (the model sums gradients over ranks, see ``parallelize_moe``)."""
    optimizer = torch.optim.SGD(params.parameters(), lr=0.5)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        out = model(x)
        loss = out.pow(2).sum() / num_tokens
        loss.backward()
        grads = {}
        for name, p in params.named_parameters():
            assert p.grad is not None, f"{name} got no gradient"
            grads[_reference_name(name)] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        steps.append(_Step(loss.detach().clone(), out.detach().clone(), grads))
        optimizer.step()
    return steps


def _rank_eager_and_compiled(rank: int, world_size: int, by_name: bool = False) -> tuple[list[_Step], list[_Step], list]:
    mesh = _mesh(world_size, *WORLDS[world_size])
    _, model, x = build_moe(mesh)
    local_x = x.chunk(world_size)[rank]
    eager = _train(model, model, local_x, x.shape[0])
    wait_for_eager_on_every_rank()
    _, model, _ = build_moe(mesh)
    # By name: the default backend, Inductor lowering included (its records are
    # the whole process's, shared by the rank threads, so none are returned).
    backend = "dtcompile" if by_name else _backend()
    # Config patches are thread-local: each rank thread sets its own.
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = _train(torch.compile(model, backend=backend, fullgraph=True), model, local_x, x.shape[0])
    return eager, compiled, [] if by_name else list(backend.records)


def _reference(world_size: int) -> tuple[list[_Step], int]:
    with fake_world(world_size, *WORLDS[world_size]) as mesh:
        reference, _, x = build_moe(mesh)
    return _train(reference, reference, x, x.shape[0]), x.shape[0]


def _assert_step_close(got: _Step, want: _Step, what: str) -> None:
    torch.testing.assert_close(got.loss, want.loss, **TOL, msg=lambda m: f"{what}: loss: {m}")
    torch.testing.assert_close(got.output, want.output, **TOL, msg=lambda m: f"{what}: output: {m}")
    assert got.grads.keys() == want.grads.keys(), what
    for name, grad in got.grads.items():
        torch.testing.assert_close(grad, want.grads[name], **TOL, msg=lambda m, n=name: f"{what}: grad of {n}: {m}")


@pytest.mark.models
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_expert_parallel_compiled_matches_eager_and_reference(world_size):
    reference, _ = _reference(world_size)
    results = run_threaded(world_size, _rank_eager_and_compiled, world_size)
    for step in range(STEPS):
        want = reference[step]
        # Each rank's loss is its part of the whole: their sum is the reference's.
        total = sum(eager[step].loss for eager, _, _ in results)
        torch.testing.assert_close(total, want.loss, **TOL, msg=lambda m, s=step: f"step {s}: loss: {m}")
        for rank, (eager, compiled, _) in enumerate(results):
            local_want = _Step(eager[step].loss, want.output.chunk(world_size)[rank], want.grads)
            _assert_step_close(eager[step], local_want, f"rank {rank} step {step} eager vs reference")
            _assert_step_close(compiled[step], eager[step], f"rank {rank} step {step} compiled vs eager")
    for rank, (_, _, records) in enumerate(results):
        # One forward and one backward for all 3 steps: the split sizes changed, nothing recompiled.
        assert [r.kind for r in records] == ["forward", "backward"], f"rank {rank}"
        dispatched = [c for r in records for c in r.collectives if c.op == "all_to_all" and c.data_dependent]
        assert len(dispatched) == 4, f"rank {rank}: {[str(c) for r in records for c in r.collectives]}"


@pytest.mark.inductor
def test_moe_expert_parallel_compiles_by_name_with_inductor():
    """``backend="dtcompile"``, lowered by Inductor: compiled equals eager on 2 ranks."""
    for rank, (eager, compiled, _) in enumerate(run_threaded(2, _rank_eager_and_compiled, 2, True)):
        for step in range(STEPS):
            _assert_step_close(compiled[step], eager[step], f"rank {rank} step {step} compiled (Inductor) vs eager")


def _rank_records(rank: int) -> list:
    """One compiled step on 2 ranks (ep=2); the backend's records."""
    mesh = _mesh(2, *WORLDS[2])
    _, model, x = build_moe(mesh)
    backend = _backend()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(model, backend=backend, fullgraph=True)(x.chunk(2)[rank]).pow(2).sum().backward()
    return list(backend.records)


@pytest.mark.models
def test_moe_all_to_all_is_reported_data_dependent_and_left_alone():
    records = run_threaded(2, _rank_records)[0]
    assert [r.kind for r in records] == ["forward", "backward"]
    # The token counts' exchange has a known size; dispatch and combine (and their
    # backward) do not: their text says so where the bytes would be.
    assert_expected_inline("\n".join(f"{r.kind}: {c}" for r in records for c in r.collectives), """\
forward: all_to_all[ep, group_size=2] int64[4] 32 B
forward: all_to_all[ep, group_size=2] float32 data-dependent
forward: all_to_all[ep, group_size=2] float32 data-dependent
backward: all_to_all[ep, group_size=2] float32 data-dependent
backward: all_to_all[ep, group_size=2] float32 data-dependent
backward: all_reduce[ep, group_size=2] float32[40] 160 B""")
    dependent = {r.kind: [c.node for c in r.collectives if c.data_dependent] for r in records}

    # overlap neither issues them earlier nor moves compute under them; annotate
    # costs them from the estimate; each says so, once per pass and collective.
    for record in records:
        passes = {p.name: p for p in record.passes}
        for name in ("overlap", "annotate"):
            skipped = [d.node for d in passes[name].decisions if d.action is Action.SKIPPED and "data-dependent" in d.text]
            assert sorted(skipped) == sorted(dependent[record.kind] * (2 if name == "overlap" else 1)), (record.kind, name)
        moved = [d.node for d in passes["overlap"].decisions if d.action is Action.MOVED]
        assert not set(moved) & set(dependent[record.kind]), moved
    overlap = next(p for p in records[0].passes if p.name == "overlap")
    assert_expected_inline("\n".join(str(d) for d in overlap.decisions if d.action is Action.SKIPPED), """\
all_to_all_single_1: not issued earlier: its sizes are data-dependent, so the bytes in flight are unknown
all_to_all_single_2: not issued earlier: its sizes are data-dependent, so the bytes in flight are unknown
all_to_all_single_1: no compute moved under it: its sizes are data-dependent, so its time is unknown
all_to_all_single_2: no compute moved under it: its sizes are data-dependent, so its time is unknown""")

    text = dtcompile.Report(tuple(records), (), ()).text(aot_graphs=False)
    table = text.split("== collectives ==\n", 1)[1].split("\n== graph breaks ==", 1)[0]
    assert_expected_inline(re.sub(r"^\d+/\d+ ", "<id> ", table, flags=re.M), """\
graph          op              axis   group          bytes   est. us
<id> forward    all_to_all      ep         2             32       7.2
<id> forward    all_to_all      ep         2 data-dependent       7.2
<id> forward    all_to_all      ep         2 data-dependent       7.9
<id> backward   all_to_all      ep         2 data-dependent       7.2
<id> backward   all_to_all      ep         2 data-dependent       7.9
<id> backward   all_reduce      ep         2            160       7.8
total forward: 3 collectives, 32 B per rank and 2 data-dependent, ~22.3 us
total backward: 3 collectives, 160 B per rank and 2 data-dependent, ~22.9 us""")
    assert "forward all_to_all[ep] x2 data-dependent ~" in text  # charged to the Dynamo graph

    data = {r.kind: collectives_json(r) for r in records}
    assert [c["data_dependent"] for c in data["forward"]["collectives"]] == [False, True, True]
    assert data["forward"]["totals"] == {"count": 3, "bytes": 32, "data_dependent": 2, "estimated_us": data["forward"]["totals"]["estimated_us"]}

    compiles = report_tool.RankTrace(0)
    compiles.compiles["0/0"].collectives.update(data)
    page = report_tool.render_html(report_tool.Trace({0: compiles}))
    assert page.count("<td>data-dependent</td>") == 4
    assert "<td>192 and 4 data-dependent</td>" in page  # bytes per rank per step


@pytest.mark.models
def test_moe_schedule_text_says_data_dependent_not_an_estimate():
    from dtcompile.testing.schedule import CollectiveSchedule, ScheduledCollective, _fields

    records = run_threaded(2, _rank_records)[0]
    items = {
        kind: tuple(ScheduledCollective(**_fields(c), graph="0/0") for r in records if r.kind == kind for c in r.collectives)
        for kind in ("forward", "backward")
    }
    schedule = CollectiveSchedule(items["forward"], items["backward"], (("forward", "0/0"), ("backward", "0/0")))
    assert_expected_inline(str(schedule), """\
forward 0/0:
  all_to_all            ep     x2    int64[4]  32 B
  all_to_all            ep     x2    float32  data-dependent
  all_to_all            ep     x2    float32  data-dependent
backward 0/0:
  all_to_all            ep     x2    float32  data-dependent
  all_to_all            ep     x2    float32  data-dependent
  all_reduce            ep     x2    float32[40]  160 B
forward total: 3 collectives, 32 B per rank and 2 data-dependent
backward total: 3 collectives, 160 B per rank and 2 data-dependent""")
