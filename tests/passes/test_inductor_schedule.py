"""Who owns the collectives' schedule: dtcompile's passes or Inductor's own ``simple_overlap``.

From torch 2.14 Inductor reorders collectives itself (on by default). Where
dtcompile's ``overlap`` or ``async_tp`` pass runs, dtcompile owns the schedule and
switches Inductor's pass off for its compiles (``record.lowering`` says so); with
both passes disabled, or the setting given, Inductor's choice stands.  Either way
the ranks agree: with both reorderings on, the block on real collectives equals eager.
"""

from __future__ import annotations

import re

import pytest
import torch

import dtcompile
from dtcompile._testing.cases import CASES, assert_steps_close, rank_eager_and_compiled
from dtcompile.base.torch_compat import INDUCTOR_SIMPLE_OVERLAP, inductor_reorders_collectives
from dtcompile.testing import fake_world, run_threaded

pytestmark = pytest.mark.inductor

needs_simple_overlap = pytest.mark.skipif(
    not inductor_reorders_collectives(), reason="this torch's Inductor does not reorder collectives (torch < 2.14)"
)

_COLLECTIVE_CALL = re.compile(
    r"torch\.ops\.(_c10d_functional\.(?:all_gather_into_tensor|reduce_scatter_tensor|all_reduce)"
    r"|dtcompile\.fused_\w+)\.default\("
)


def _forward(**options):
    """The TP + SP block's forward on a fake world of 4, Inductor; the record and Inductor's code."""
    from torch._inductor.utils import run_and_get_code

    backend = dtcompile.backend(**options)
    case = CASES["tp_sp_block"]
    with fake_world(4):
        mesh = case.mesh(4)
        _, parallel, x = case.build(mesh)
        torch._dynamo.reset()
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(parallel, backend=backend, fullgraph=True), case.local_input(x, mesh))
    # The block's own graph (parallelize_module's input and output hooks are frames of their own).
    record = max(backend.records, key=lambda r: len(r.collectives))
    (code,) = [c for c in codes if _collective_order_in(c) and len(_collective_order_in(c)) >= len(record.collectives)]
    return record, code


def _collective_order_in(code: str) -> list[str]:
    return [m.group(1).split(".")[-1] for m in _COLLECTIVE_CALL.finditer(code)]


def _collective_order_of(record) -> list[str]:
    order = []
    for node in record.graph.graph.nodes:
        target = getattr(node.target, "name", lambda: "")()
        name = target.split("::")[-1].split(".")[0]
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce") or name.startswith("fused_"):
            order.append(name)
    return order


def test_inductor_compiles_what_dtcompiles_passes_scheduled():
    """The order of collectives (fused ops included) in Inductor's code is the passes' order."""
    record, code = _forward()
    assert any(p.name == "async_tp" and p.ran for p in record.passes)
    order = _collective_order_of(record)
    assert order and any(name.startswith("fused_") for name in order), order
    assert _collective_order_in(code) == order
    if inductor_reorders_collectives():
        assert record.lowering[INDUCTOR_SIMPLE_OVERLAP] is False
    else:
        assert INDUCTOR_SIMPLE_OVERLAP not in record.lowering


@needs_simple_overlap
@pytest.mark.parametrize(
    "options, expected",
    [
        ({"disable_passes": {"overlap", "async_tp"}}, True),
        ({"disable_passes": {"overlap"}}, False),
        ({"inductor_config": {INDUCTOR_SIMPLE_OVERLAP: True}}, True),
    ],
    ids=["both-passes-off", "async-tp-on", "set-by-the-user"],
)
def test_inductor_keeps_its_own_schedule_where_dtcompile_does_not_take_it(options, expected):
    record, _ = _forward(**options)
    assert record.lowering[INDUCTOR_SIMPLE_OVERLAP] is expected


def _both_reorderings(rank: int, world_size: int):
    options = {"inductor_config": {INDUCTOR_SIMPLE_OVERLAP: True}}
    return rank_eager_and_compiled(rank, "tp_sp_block", world_size, options)


@needs_simple_overlap
def test_with_both_reorderings_on_the_ranks_agree_and_equal_eager():
    """dtcompile's passes, then Inductor's simple_overlap over their fused ops: no hang, eager's numbers."""
    for rank, (eager, compiled, num_graphs) in enumerate(run_threaded(2, _both_reorderings, 2, timeout=600)):
        assert num_graphs >= 2
        assert_steps_close(compiled, eager, f"rank {rank}: compiled vs eager", rtol=1e-5, atol=1e-5)
