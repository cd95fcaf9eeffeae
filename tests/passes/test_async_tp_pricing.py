"""When the ``async_tp`` pass fuses a collective with its matmuls: by price, or forced.

The price is what the fused kernel hides of the collective under the graph's cost
profile.  On a 1-rank group no data moves, so the priced pass declines and says so;
``force_async_tp`` fuses there anyway (what the CUDA tier's 1-GPU tests need to run the
symm_mem kernels), and says that it was forced and what the price said.  At Llama-3-8B
layer sizes on 2, 4 and 8 ranks the priced pass fuses every pair of the TP + SP block
the pass knows: that is where fusing pays, and a pricing change that stops paying there
fails here, on CPU, where CI runs no GPU.
"""

from __future__ import annotations

import pytest
import torch

import dtcompile
from dtcompile._testing.models import Block, BlockArgs, SequenceParallelMLP, parallelize_block
from dtcompile.cache_keys import compile_key, key_fields
from dtcompile.config import DTCompileConfig
from dtcompile.cost import get_profile
from dtcompile.records import Action
from dtcompile.testing import collective_schedule

LLAMA_8B = BlockArgs(dim=4096, n_heads=32, hidden=14336)
"""Llama-3-8B's layer sizes (as ``benchmarks/comm_passes.py`` and ``cuda_check.py`` use them)."""

ONE_RANK = "its group has 1 rank: no data moves, so there is no communication to hide"


def _async_tp(records) -> list[tuple[str, object]]:
    """``(graph kind, outcome)`` of every ``async_tp`` decision of these records, in order."""
    return [(str(r.kind), d) for r in records for p in r.passes if p.name == "async_tp" for d in p.decisions]


def _one_rank_step(fake_world, **options):
    """SequenceParallelMLP (gather -> mm -> relu -> mm -> reduce-scatter, functional
    collectives on the world group) on a fake world of 1 rank, one training step under
    ``h100``, whose profile has fused kernels: only the group's size can decline."""
    fake_world(1)
    group = torch.distributed.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    model = SequenceParallelMLP(group, torch.randn(32, 64, generator=gen), torch.randn(64, 32, generator=gen))
    x = torch.randn(16, 32, generator=gen, requires_grad=True)
    backend = dtcompile.backend(inductor=False, cost_profile="h100", **options)
    schedule = collective_schedule(model, x, backend=backend)
    return schedule, backend.records


def test_on_a_1_rank_group_the_priced_pass_declines_and_says_why(fake_world):
    schedule, records = _one_rank_step(fake_world)
    collectives = [*schedule.forward, *schedule.backward]
    assert [c.op for c in collectives] == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    assert not any(c.fused for c in collectives), [str(c) for c in collectives]
    decisions = _async_tp(records)
    assert len(decisions) == 4, decisions
    for kind, outcome in decisions:
        assert outcome.action is Action.SKIPPED, (kind, str(outcome))
        assert outcome.text == f"not fused: {ONE_RANK}", (kind, str(outcome))
        assert (outcome.price.saves_us, outcome.price.costs_us, outcome.price.profile) == (0.0, 0.0, "h100")
    kind, first = decisions[0]
    assert (kind, str(first)) == ("forward", f"all_gather_into_tensor: not fused: {ONE_RANK}: saves 0 us, costs 0 us (h100)")


def test_force_async_tp_fuses_every_pair_and_records_that_it_was_forced(fake_world):
    schedule, records = _one_rank_step(fake_world, force_async_tp=True)
    fused = [(c.op, bool(c.fused)) for c in (*schedule.forward, *schedule.backward)]
    assert fused == [("all_gather", True), ("reduce_scatter", True), ("all_gather", True), ("reduce_scatter", True)]
    decisions = _async_tp(records)
    assert [outcome.action for _, outcome in decisions] == [Action.FUSED] * 4
    forced = f"; forced by force_async_tp (the price alone would not fuse it: {ONE_RANK})"
    for kind, outcome in decisions:
        assert outcome.text.endswith(forced), (kind, str(outcome))
        assert not outcome.price.pays and str(outcome).endswith(f"{forced}: saves 0 us, costs 0 us (h100)")
    assert [f"{kind}: {outcome.text.removesuffix(forced)}" for kind, outcome in decisions] == [
        "forward: fused all_gather(dim 0) + 1 matmul(s): all_gather_into_tensor -> mm",
        "forward: fused matmul + reduce_scatter(dim 0): mm_1 -> reduce_scatter_tensor",
        "backward: fused all_gather(dim 0) + 1 matmul(s): all_gather_into_tensor_1 -> mm_3",
        "backward: fused matmul + reduce_scatter(dim 0): mm_5 -> reduce_scatter_tensor_1",
    ]


def test_force_async_tp_is_checked_keyed_and_compared_by_the_ranks():
    with pytest.raises(TypeError) as err:
        dtcompile.backend(force_async_tp="always")
    assert str(err.value) == "dtcompile: force_async_tp must be True or False, got str 'always'"
    assert dtcompile.backend(force_async_tp=True).config.force_async_tp is True
    base, forced = DTCompileConfig(), DTCompileConfig(force_async_tp=True)
    assert base != forced and hash(base) != hash(forced)
    # It changes graphs: in the compile caches' key, and in what the ranks' check compares
    # (the decided fields are key_fields).
    h100 = get_profile("h100")
    assert compile_key(forced, h100) != compile_key(base, h100)
    assert key_fields(forced)["force_async_tp"] == "True" and key_fields(base)["force_async_tp"] == "False"


def _llama_block_decisions(mesh) -> tuple[list[str], list[tuple[str, object]]]:
    """The TP + SP block at Llama-3-8B layer sizes (bf16, batch 2 x seq 8192) on ``mesh``,
    one training step on meta tensors (nothing is allocated) under ``h100``: which
    collectives are fused, and the ``async_tp`` decisions."""
    with torch.device("meta"):
        model = Block(LLAMA_8B).to(torch.bfloat16)
    parallel = parallelize_block(model, mesh)
    x = torch.empty(2, 8192, LLAMA_8B.dim, dtype=torch.bfloat16, device="meta")
    backend = dtcompile.backend(inductor=False, cost_profile="h100")
    schedule = collective_schedule(parallel, x, backend=backend)
    fused = [f"{kind}: {c.op}" for kind, items in (("forward", schedule.forward), ("backward", schedule.backward)) for c in items if c.fused]
    return fused, _async_tp(backend.records)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.slow
def test_the_priced_pass_fuses_the_llama_8b_tp_sp_block_on_2_4_and_8_ranks(fake_world, ranks):
    """The fake process group on a cpu mesh, meta tensors.  Not a cuda mesh: without a GPU,
    AOTAutograd's trace of fake CUDA tensors asks for a CUDA context (and falls back to
    eager), and a CUDA graph on the fake group is declined before any price, as it is not
    NCCL (:func:`dtcompile.base.fused_ops.decomposed_on`).  A CPU graph is not asked about its group,
    so the price under ``h100`` alone decides here, as it does on an NCCL group."""
    fused, decisions = _llama_block_decisions(fake_world(ranks, (ranks,), ("tp",)))
    # Every pair the pass knows; the backward's reduce-scatters of a sum of matmuls and the
    # output's all-gather (no matmul) are not pairs.
    assert fused == [
        "forward: all_gather", "forward: reduce_scatter", "forward: all_gather", "forward: reduce_scatter",
        "backward: all_gather", "backward: all_gather",
    ], [f"{kind}: {d}" for kind, d in decisions]
    priced = [(kind, d) for kind, d in decisions if d.price is not None]
    assert len(priced) == 6 and all(d.action is Action.FUSED for _, d in priced), [f"{kind}: {d}" for kind, d in priced]
    # Tens of microseconds and more hidden per pair, each.
    assert all(d.price.saves_us > 10 and d.price.costs_us == 0 and d.price.profile == "h100" for _, d in priced), [
        f"{kind}: {d}" for kind, d in priced
    ]
