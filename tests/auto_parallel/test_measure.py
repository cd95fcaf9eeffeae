"""The solver's prices agree with what DTensor does: redistributions planned without tracing
issue the collectives a traced redistribution issues, and an op measured on fake shards keeps
its strategy's layouts and hands back its gradients where DTensor puts them."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

from dtcompile.auto_parallel.measure import (
    _TensorSlot,
    measure_op,
    plan_redistribution,
    redistribution_copy_bytes,
    trace_redistribution,
)
from dtcompile.cost import get_profile

H100 = get_profile("h100")
SHAPE = (16, 16, 8)  # every dim shards evenly over both axes: the layouts the solver offers
PER_AXIS = [Replicate(), Shard(0), Shard(1), Shard(2), Partial()]


def _pairs(ndim: int, step: int):
    layouts = list(itertools.product(PER_AXIS, repeat=ndim))
    pairs = [
        (src, dst) for src in layouts for dst in layouts
        if src != dst and not any(isinstance(d, Partial) and d != s for s, d in zip(src, dst))
    ]
    return pairs[::step]


def _keys(collectives):
    return [(c.op, c.axis, c.group_size, c.bytes) for c in collectives]


@pytest.mark.parametrize("world, shape, names, step", [(4, (4,), ("tp",), 1), (8, (2, 4), ("dp", "tp"), 7)], ids=["1d", "2d"])
def test_planned_redistributions_issue_the_traced_collectives(fake_world, world, shape, names, step):
    mesh = fake_world(world, shape, names)
    pairs = _pairs(len(shape), step)
    assert len(pairs) > 15
    for src, dst in pairs:
        planned = plan_redistribution(SHAPE, torch.float32, src, dst, mesh)
        traced = trace_redistribution(SHAPE, torch.float32, src, dst, mesh, H100)
        assert _keys(planned) == _keys(traced), f"{src} -> {dst}"


def test_strided_layouts_are_fsdp2_over_tp_and_gather_in_one_step(fake_world):
    from torch.distributed.tensor.placement_types import _StridedShard

    from dtcompile.auto_parallel.placements import layouts, local_numel, strided_variant

    mesh = fake_world(8, (2, 4), ("dp", "tp"))
    strided = (_StridedShard(0, split_factor=4), Shard(0))
    assert strided in layouts((16, 8), (2, 4), strided=True)
    assert strided not in layouts((16, 8), (2, 4))
    assert strided_variant((Shard(1), Shard(0)), (2, 4)) is None  # other dims: nothing to stride
    assert strided_variant((Shard(0), Shard(0), Shard(0)), (2, 2, 2)) is None  # two strided axes: left out
    assert local_numel((16, 8), strided, (2, 4)) == 16
    # Gathered over dp it is tp's Shard(0): one all-gather; its Partial gradient reduce-scatters
    # straight back; (S(0), S(0)) would need the whole tensor gathered and cut again.
    for src, dst, op in [
        (strided, (Replicate(), Shard(0)), "all_gather"),
        ((Partial(), Shard(0)), strided, "reduce_scatter"),
        ((_StridedShard(1, split_factor=4), Shard(1)), (Replicate(), Shard(1)), "all_gather"),
    ]:
        planned = plan_redistribution(SHAPE[:2], torch.float32, src, dst, mesh)
        assert _keys(planned) == _keys(trace_redistribution(SHAPE[:2], torch.float32, src, dst, mesh, H100))
        assert [(c.op, c.axis) for c in planned] == [(op, "dp")], f"{src} -> {dst}"
    assert len(plan_redistribution(SHAPE[:2], torch.float32, (Shard(0), Shard(0)), (Replicate(), Shard(0)), mesh)) > 1


def test_a_plan_made_before_the_mesh_was_flattened_does_not_answer_after(fake_world):
    # The mesh compares equal before and after _flatten; DTensor gathers over the flattened
    # mesh once it exists, in one collective instead of one per axis.
    mesh = fake_world(8, (2, 4), ("dp", "tp"))
    src, dst = (Shard(0), Shard(0)), (Replicate(), Replicate())
    assert [c.axis for c in plan_redistribution(SHAPE, torch.float32, src, dst, mesh)] == ["tp", "dp"]
    mesh._flatten("dp_tp")
    planned = plan_redistribution(SHAPE, torch.float32, src, dst, mesh)
    assert _keys(planned) == [("all_gather", "dp_tp", 8, 16 * 16 * 8 * 4)]
    assert _keys(planned) == _keys(trace_redistribution(SHAPE, torch.float32, src, dst, mesh, H100))


def test_copy_bytes_count_the_cat_after_gathering_another_dim(tp_mesh):
    full = 16 * 16 * 8 * 4
    assert redistribution_copy_bytes(SHAPE, torch.float32, (Shard(0),), (Replicate(),), tp_mesh) == 0
    assert redistribution_copy_bytes(SHAPE, torch.float32, (Shard(1),), (Replicate(),), tp_mesh) == 2 * full
    assert redistribution_copy_bytes(SHAPE, torch.float32, (Replicate(),), (Shard(1),), tp_mesh) == 2 * full // 4


def test_a_measured_matmul_keeps_its_layouts_and_reports_its_gradients(tp_mesh):
    # x replicated times w sharded on columns: output sharded on columns; backward
    # gives x a partial gradient (a sum over the column shards) and w its own layout.
    m = measure_op(
        torch.ops.aten.mm.default, (_TensorSlot(0), _TensorSlot(1)), {},
        [((4, 16), torch.float32, True), ((16, 32), torch.float32, True)],
        [(Replicate(),), (Shard(1),)], [((4, 32), torch.float32)], [(Shard(1),)],
        tp_mesh, H100, FakeTensorMode(),
    )
    assert m.out_layouts == ((Shard(1),),)
    assert m.grad_layouts == ((Partial(),), (Shard(1),))
    assert m.collectives == ()
    # forward: one local [4, 16] x [16, 8] matmul; backward: two.
    one = 2 * 4 * 8 * 16 / (H100.matmul_tflops * 1e12) * 1e6
    assert m.forward_us == pytest.approx(one)
    assert m.backward_us == pytest.approx(2 * one)


def test_a_partial_gradient_passes_through_a_transpose(tp_mesh):
    # The data-parallel weight's path: t(w) replicated, its gradient arriving Partial
    # goes back to w Partial, to be reduced where w is read (the FSDP reduce-scatter).
    m = measure_op(
        torch.ops.aten.t.default, (_TensorSlot(0),), {}, [((32, 16), torch.float32, True)],
        [(Replicate(),)], [((16, 32), torch.float32)], [(Partial(),)], tp_mesh, H100, FakeTensorMode(),
    )
    assert m.out_layouts == ((Replicate(),),)
    assert m.grad_layouts == ((Partial(),),)
    assert m.collectives == () and m.forward_us == m.backward_us == 0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_planning_an_embedding_leaves_no_fake_mask_for_the_users_next_embedding(tp_mesh, compiled):
    # A measured row-sharded embedding's partial output kept its fake index mask in DTensor's
    # cached _MaskPartial: the user's next row-parallel embedding on the mesh, eager or
    # compiled, then failed with "Mixing fake modes" (transformers' TP plan after a plan).
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import dtcompile

    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = torch.randint(0, 16, (4, 8))
    dtcompile.auto_parallel.plan(torch.nn.Embedding(16, 8), tp_mesh, (ids,))
    parallel = parallelize_module(torch.nn.Embedding(16, 8), tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    run = torch.compile(parallel, backend="eager", fullgraph=True) if compiled else parallel
    out = run(ids)
    assert out.shape == (4, 8, 8) and not isinstance(out, torch._subclasses.FakeTensor)


def test_placement_kinds_are_answered_as_isinstance_answers():
    """``is_shard``, ``is_strided`` and ``is_partial`` read the known types from a table before
    ``isinstance``: each answers as ``isinstance`` does, for every kind, subclasses included."""
    from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

    from dtcompile.auto_parallel.placements import is_partial, is_shard, is_strided

    kinds = [Shard(0), Shard(2), _StridedShard(0, split_factor=2), Replicate(), Partial(), Partial("avg"), _MaskPartial()]
    for p in kinds:
        assert is_shard(p) == isinstance(p, (Shard, _StridedShard)), p
        assert is_strided(p) == isinstance(p, _StridedShard), p
        assert is_partial(p) == isinstance(p, Partial), p
    assert [is_partial(p) for p in kinds] == [False, False, False, False, True, True, True]
