"""What ranks send pairs up: Inductor's code issues the communication in the order the ranks traced it.

Ranks pair their collectives and sends by the order they issue them.  Inductor's
``simple_overlap`` (on by default from torch 2.14) moves a functional collective earlier
past a custom op that communicates (a ``FallbackKernel`` to it), and where it does so on one
rank only the ranks pair the wrong collectives, silently (pytorch/pytorch#189454).  dtcompile
counts such an op as an ordering barrier (:func:`dtcompile.base.op_facts.is_ordering_barrier`)
and switches that pass off for a graph holding one and other communication.

Two programs on 2 gloo ranks, each compiled by stock ``inductor`` and by
``dtcompile.backend()`` (Inductor on), the order of the communication calls read from
Inductor's generated code (``run_and_get_code``):

- a custom all-gather (``commorder::all_gather``, effectful, :mod:`support.comm_ops`), then a
  functional all-gather whose input is a graph input on rank 0 and the custom one's result
  on rank 1: stock Inductor issues the functional one first on rank 0 only, and both ranks'
  results are wrong; dtcompile's equal eager;
- a ring: a custom ``send`` and ``barrier``, then ``dist.irecv`` (traced by Dynamo as
  ``_c10d_functional.irecv`` under ``enable_p2p_compilation``) and a custom wait for the
  sends: stock Inductor posts the receive before the send and the barrier on every rank
  (a deadlock on NCCL; gloo's sends do not wait for it), dtcompile keeps the traced order.

The stock runs show the test can fail; where torch stops reordering them, they say so.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from support import comm_ops  # noqa: F401 - defines the commorder ops (and on each rank that imports this)

import dtcompile
from dtcompile.base.torch_compat import INDUCTOR_SIMPLE_OVERLAP, inductor_reorders_collectives
from dtcompile.testing import run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.inductor]

WORLD_SIZE = 2
TIMEOUT = 240.0
_COMMUNICATION_CALL = re.compile(r"torch\.ops\.(commorder\.\w+|_c10d_functional\.\w+)\.default\(")


def communication_calls(code: str) -> list[str]:
    """The communication Inductor's generated ``code`` issues, in its order (waits left out)."""
    calls = [m.group(1) for m in _COMMUNICATION_CALL.finditer(code)]
    return [c for c in calls if not c.startswith("_c10d_functional.wait_tensor")]


def gather_after_custom_gather(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom all-gather, then a functional one of ``w`` (rank 0) or of its result (rank 1)."""
    gathered = torch.ops.commorder.all_gather(x)
    source = w if dist.get_rank() == 0 else gathered[: w.shape[0]] * 2
    return gathered + 1, funcol.all_gather_tensor(source, 0, dist.group.WORLD) * 3


def ring(x: torch.Tensor, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each rank sends ``x * 2`` to the next (custom ops) and receives from the previous."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sent = torch.ops.commorder.send(x * 2, (rank + 1) % world_size)
    torch.ops.commorder.barrier(x)
    dist.irecv(received, (rank - 1) % world_size).wait()
    done = torch.ops.commorder.wait_sends(received)
    return received + 1, sent, done


def _inputs(program: str, rank: int) -> tuple[torch.Tensor, ...]:
    """Fresh inputs (the ring receives into its second)."""
    x = torch.arange(4.0) + 10 * rank
    return (x, torch.arange(4.0) * 100 + rank) if program == "gather" else (x, torch.zeros(4))


def _compiled_on_rank(rank: int, program: str) -> dict[str, Any]:
    """Eager, then stock Inductor and dtcompile: each one's outputs and its communication calls."""
    from torch._inductor.utils import run_and_get_code

    fn = gather_after_custom_gather if program == "gather" else ring
    found: dict[str, Any] = {"eager": fn(*_inputs(program, rank))}
    with torch._dynamo.config.patch(enable_p2p_compilation=True):
        for name in ("inductor", "dtcompile"):
            backend = dtcompile.backend() if name == "dtcompile" else name
            torch._dynamo.reset()
            out, codes = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True), *_inputs(program, rank))
            found[name] = out
            found[f"{name} calls"] = [communication_calls(code) for code in codes if communication_calls(code)]
            if name == "dtcompile":
                found["lowering"] = [record.lowering for record in backend.records]
    return found


def _check(program: str, traced_order: list[str], tmp_path) -> list[dict[str, Any]]:
    """dtcompile's code issues ``traced_order`` and equals eager on every rank; the ranks' runs."""
    runs = run_gloo(WORLD_SIZE, _compiled_on_rank, program, timeout=TIMEOUT,
                    env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})  # a fresh cache: Inductor generates the code
    for rank, run in enumerate(runs):
        assert run["dtcompile calls"] == [traced_order], f"rank {rank}: {run['dtcompile calls']}"
        for got, want in zip(run["dtcompile"], run["eager"], strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {rank}, dtcompile vs eager: {m}")
        if inductor_reorders_collectives():
            assert run["lowering"] == [{INDUCTOR_SIMPLE_OVERLAP: False}], run["lowering"]
    return runs


def _stock_unchanged(what: str) -> str:
    return (
        f"stock Inductor no longer {what} (pytorch/pytorch#189454 fixed?): this program no longer shows "
        "that dtcompile's ordering matters; find one that does, or drop the stock half"
    )


def test_a_collective_after_a_custom_collective_keeps_its_place_on_every_rank(tmp_path):
    runs = _check("gather", ["commorder.all_gather", "_c10d_functional.all_gather_into_tensor"], tmp_path)
    if not inductor_reorders_collectives():
        return
    # Stock: rank 0 hoists its all-gather of an input above the custom one, rank 1 cannot.
    assert runs[0]["inductor calls"] == [["_c10d_functional.all_gather_into_tensor", "commorder.all_gather"]], (
        _stock_unchanged("hoists the all-gather on rank 0")
    )
    assert runs[1]["inductor calls"] == [["commorder.all_gather", "_c10d_functional.all_gather_into_tensor"]]
    for rank, run in enumerate(runs):
        # The ranks paired each one's first all-gather with the other's: rank 0's gathered
        # w with rank 1's x.  No error, wrong numbers, on both ranks.
        error = max((got - want).abs().max().item() for got, want in zip(run["inductor"], run["eager"]))
        assert error > 100, f"rank {rank}: " + _stock_unchanged("pairs the wrong all-gathers")


def test_a_receive_after_a_custom_send_and_barrier_keeps_its_place_on_every_rank(tmp_path):
    traced = ["commorder.send", "commorder.barrier", "_c10d_functional.irecv", "commorder.wait_sends"]
    runs = _check("ring", traced, tmp_path)
    if not inductor_reorders_collectives():
        return
    for rank, run in enumerate(runs):
        # Stock: the receive is posted first, on every rank.
        assert run["inductor calls"] == [["_c10d_functional.irecv", *traced[:2], traced[3]]], (
            f"rank {rank}: " + _stock_unchanged("posts the receive before the send")
        )
