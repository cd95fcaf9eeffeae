"""DTensor code written outside this repository, as users write it: each case once
returned a wrong number, leaked a fake object or crashed where eager works.

Compiled runs are checked against eager on real collectives (threaded ranks,
or gloo processes where eager itself is not thread-safe) and, where eager is
not the ground truth, against a single-process reference computed by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor as dtensor
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard

import dtcompile
from dtcompile.testing import fake_world, run_gloo, run_threaded
from dtcompile.testing.worlds import _mesh

BACKEND_OPTIONS = {"inductor": False}


def _compiled(fn, **kwargs):
    return torch.compile(fn, backend=dtcompile.backend(**BACKEND_OPTIONS), fullgraph=True, **kwargs)


# ---- a user Partial with its own reduction


class PNormPartial(Partial):
    """A p-norm partial, as gradient-norm clipping code writes it: the reduction is
    ``(sum_r x_r ** p) ** (1 / p)``.  It does not define ``__eq__``, so it equals
    ``Partial('sum')`` by ``==``."""

    def __init__(self, p: float = 2.0) -> None:
        super().__init__("sum")
        self.p = p

    def _reduce_value(self, tensor, mesh, mesh_dim):
        powered = super()._reduce_value(tensor.abs().pow(self.p), mesh, mesh_dim)
        return powered.pow(1.0 / self.p)

    def _reduce_shard_value(self, tensor, mesh, mesh_dim, shard_spec):
        powered = super()._reduce_shard_value(tensor.abs().pow(self.p), mesh, mesh_dim, shard_spec)
        return powered.pow(1.0 / self.p)


def _pnorm_rank(rank: int) -> dict[str, torch.Tensor]:
    mesh = _mesh(2, None, None)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)

    def from_local_then_full(t):
        return DTensor.from_local(t, mesh, [PNormPartial()], run_check=False).full_tensor()

    def redistribute_input(d):
        return d.redistribute(mesh, [Replicate()]).to_local()

    def reduce_scatter(t):
        return DTensor.from_local(t, mesh, [PNormPartial()], run_check=False).redistribute(mesh, [Shard(0)]).full_tensor()

    # Eager DTensor caches redistribution plans by spec equality: after a
    # Partial('sum') of this shape, it runs the base class's reduction for the
    # subclass too.  The compiled code must not depend on that cache.
    DTensor.from_local(x, mesh, [Partial()], run_check=False).full_tensor()
    DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(0)])
    return {
        "reduce_scatter": _compiled(reduce_scatter)(x),
        "from_local": _compiled(from_local_then_full)(x),
        "input": _compiled(redistribute_input)(DTensor.from_local(x, mesh, [PNormPartial()], run_check=False)),
    }


def test_a_partial_subclass_reduction_is_its_own_not_the_base_class():
    reference = (torch.tensor([1.0, 2.0, 3.0, 4.0]) ** 2 * (1 + 2**2)) ** 0.5
    for rank, results in enumerate(run_threaded(2, _pnorm_rank)):
        for how, got in results.items():
            torch.testing.assert_close(got, reference, msg=f"rank {rank}, {how}")


# ---- objects in a compiled function's results


def test_placements_made_in_compiled_code_come_back_real():
    with fake_world(2) as mesh:

        def build(m):
            a = dtensor.full((4, 4), 2.0, device_mesh=m, placements=[Shard(0)])
            b = dtensor.ones(4, 4, device_mesh=m, placements=[Replicate()])
            return a, a.shape, a.placements, b.placements, Shard(1), a.device_mesh

        a, shape, placements_a, placements_b, literal, out_mesh = _compiled(build)(mesh)
    assert (placements_a, placements_b, literal) == ((Shard(0),), (Replicate(),), Shard(1))
    assert [type(p) for p in (*placements_a, *placements_b, literal)] == [Shard, Replicate, Shard]
    assert out_mesh is mesh and a.device_mesh is mesh
    assert shape == torch.Size([4, 4])


# ---- crashes where eager works


def _strided_rank(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    mesh = _mesh(2, None, None)
    x = torch.arange(8.0).reshape(4, 2) + 10 * rank

    def gather(t):
        d = DTensor.from_local(t, mesh, [_StridedShard(0, split_factor=2)], run_check=False)
        return d.redistribute(mesh, [Replicate()]).to_local()

    return gather(x), _compiled(gather)(x)


def test_strided_shard_gathered_to_replicate():
    for eager, compiled in run_threaded(2, _strided_rank):
        # split_factor=2 interleaves the ranks' halves: rows 0-1 of rank 0, of rank 1, rows 2-3 of each.
        assert eager[:, 0].tolist() == [0, 2, 10, 12, 4, 6, 14, 16]
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _flattened_rank(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    mesh = _mesh(4, (2, 2), ("dp", "tp"))
    x = torch.full((2,), float(rank))

    def all_reduce_over_both(t, m):
        return funcol.all_reduce(t, "sum", m["dp", "tp"]._flatten("dp_tp"))

    # Compiled first: the flattened mesh does not exist yet (made in the compiled code).
    compiled = _compiled(all_reduce_over_both)(x, mesh)
    return all_reduce_over_both(x, mesh), compiled


def test_flattened_mesh_as_the_group_of_a_functional_collective():
    for eager, compiled in run_threaded(4, _flattened_rank):
        assert eager.tolist() == [6.0, 6.0]
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ---- loss_parallel: the forward compiled, the backward under loss_parallel() after it


def _loss_inside(logits, target):
    with loss_parallel():
        return F.cross_entropy(logits, target)


def _loss_parallel_step(mesh, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    full = torch.arange(32.0).reshape(4, 8).sin()
    target = torch.tensor([1, 7, 0, 4])
    logits = distribute_tensor(full, mesh, [Shard(-1)], src_data_rank=None).requires_grad_()
    loss = (_compiled(_loss_inside) if compiled else _loss_inside)(logits, target)
    with loss_parallel():
        loss.backward()
    return loss.full_tensor(), logits.grad.full_tensor()


def test_loss_parallel_in_compiled_code_backward_after_it_compiles():
    """The graph's backward is traced at compile time, after the region ended
    (it failed: nll_loss_backward got mixed torch.Tensor and DTensor)."""
    with fake_world(2) as mesh:
        eager = _loss_parallel_step(mesh, compiled=False)
        compiled = _loss_parallel_step(mesh, compiled=True)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


def _loss_parallel_gloo_rank(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mesh = _mesh(2, None, None)
    return [_loss_parallel_step(mesh, compiled) for compiled in (False, True)]


@pytest.mark.gloo
def test_loss_parallel_backward_matches_eager_and_reference_on_gloo():
    # Gloo processes: loss_parallel() flips process-wide DTensor state, which
    # rank threads would race on.
    full = torch.arange(32.0).reshape(4, 8).sin().requires_grad_()
    loss = F.cross_entropy(full, torch.tensor([1, 7, 0, 4]))
    loss.backward()
    for rank, (eager, compiled) in enumerate(run_gloo(2, _loss_parallel_gloo_rank, timeout=300)):
        for what, run in (("eager", eager), ("compiled", compiled)):
            torch.testing.assert_close(run[0], loss.detach(), msg=f"rank {rank} {what} loss")
            torch.testing.assert_close(run[1], full.grad, msg=f"rank {rank} {what} grad")


# ---- a local_map region Dynamo cannot trace: a graph break, never an internal error

_seen: list[int] = []


def _region_prints(t):
    print("inside the region")
    return t * 2


def _region_appends(t):
    _seen.append(1)
    return t * 2


def _region_branches_on_data(t):
    if t.sum() > 0:
        return t * 2
    return t * 3


@pytest.mark.parametrize("body", [_region_prints, _region_appends, _region_branches_on_data], ids=lambda f: f.__name__)
def test_an_untraceable_region_runs_eagerly_behind_a_graph_break(body, capsys):
    from torch._dynamo.utils import counters

    with fake_world(2) as mesh:
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)], src_data_rank=None)
        region = dtcompile.local_map(body, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)

        def step(d):
            return region(d) + 1

        torch._dynamo.reset()
        counters.clear()
        _seen.clear()
        out = torch.compile(step, backend=dtcompile.backend(**BACKEND_OPTIONS))(x)
        assert out.to_local().eq(3.0).all() and out.placements == (Shard(0),)
        # The region's Python ran, once, as eager runs it.
        if body is _region_prints:
            assert capsys.readouterr().out.count("inside the region") == 1
        if body is _region_appends:
            assert _seen == [1]
        (reason,) = counters["graph_break"]
        assert reason.startswith("dtcompile: ")
        assert f"local_map {body.__name__}:" in reason

        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=f"local_map {body.__name__}:"):
            _compiled(step)(x)


# ---- messages: what was wrong and the fix


def test_dtensors_on_two_meshes_name_both_meshes_and_the_fix():
    with fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        x = distribute_tensor(torch.ones(4, 4), mesh["dp"], [Shard(0)], src_data_rank=None)
        y = distribute_tensor(torch.ones(4, 4), mesh["tp"], [Shard(0)], src_data_rank=None)
        with pytest.raises(Exception) as err:
            _compiled(lambda a, b: a + b)(x, y)
    message = str(err.value)
    assert "dtcompile: add takes DTensors on 2 meshes (a on DeviceMesh((dp=2)); b on DeviceMesh((tp=2)))" in message
    assert "Give every operand the same mesh" in message


def test_a_region_closing_over_a_dtensor_says_to_pass_it_in():
    with fake_world(2) as mesh:
        w = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()], src_data_rank=None)
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)], src_data_rank=None)

        def project(t):
            return t @ w

        region = dtcompile.local_map(project, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)
        with pytest.raises(torch._dynamo.exc.Unsupported) as err:
            _compiled(lambda d: region(d))(x)
    message = str(err.value)
    assert "dtcompile: local_map region that closes over a DTensor" in message
    assert "the region project uses the DTensor without taking it as an argument" in message
    assert "Pass it as an argument of the region and give its in_placements" in message


def test_a_backend_used_after_uninstall_says_its_dynamo_support_is_off():
    import dynamo_vars

    backend = dtcompile.backend(inductor=False)
    with fake_world(2) as mesh:

        def make(m):
            return dtensor.ones(4, 4, device_mesh=m, placements=[Shard(0)]).to_local() + 1

        def scale(t):
            return t * 2

        try:
            with pytest.warns(UserWarning, match="the dtcompile backends made before are on stock Dynamo now"):
                dynamo_vars.uninstall()
            torch._dynamo.reset()
            with pytest.raises(Exception, match="Failed to convert args/kwargs to proxy"):
                torch.compile(make, backend=backend, fullgraph=True)(mesh)
            with pytest.warns(UserWarning, match="this graph was traced with dynamo_vars uninstalled"):
                torch.compile(scale, backend=backend, fullgraph=True)(torch.ones(2))
        finally:
            dynamo_vars.install()
            torch._dynamo.reset()
        assert torch.compile(make, backend=backend, fullgraph=True)(mesh).eq(2.0).all()


# ---- a region given one tensor twice (found by the fuzzer)


def _twice_rank(rank: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    mesh = _mesh(2, None, None)

    def mul_add(a, b):
        return a * b + a

    region = dtcompile.local_map(mul_add, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]), device_mesh=mesh)

    def step(fn):
        x = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]).requires_grad_()
        out = fn(x)
        out.sum().backward()
        return out.full_tensor(), x.grad.full_tensor()

    return step(lambda x: region(x, x)), step(_compiled(lambda x: region(x, x)))


def test_a_region_given_one_tensor_twice():
    """HOP operands must not alias: the second place gets a copy (it was a graph break)."""
    x = torch.arange(12.0).reshape(4, 3)
    for eager, compiled in run_threaded(2, _twice_rank):
        torch.testing.assert_close(eager[0], x * x + x)
        torch.testing.assert_close(eager[1], 2 * x + 1)
        for got, want in zip(compiled, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- DTensor random factories (found by the fuzzer)


@pytest.mark.parametrize("factory", [dtensor.rand, dtensor.randn], ids=lambda f: f.__name__)
def test_a_random_factory_runs_eagerly_with_dtensors_rng(factory):
    """They compiled to a draw from each rank's own generator, where eager draws with
    DTensor's RNG tracker (and refuses on a CPU mesh): Replicate shards that need not
    agree across ranks.  Now a named graph break: the call runs as eager runs it."""
    from torch._dynamo.utils import counters

    with fake_world(2) as mesh:

        def step(t):
            return factory(4, 2, device_mesh=mesh, placements=[Replicate()]) + t

        x = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()], src_data_rank=None)
        with pytest.raises(AssertionError) as eager_error:
            step(x)
        torch._dynamo.reset()
        counters.clear()
        with pytest.raises(type(eager_error.value)):
            torch.compile(step, backend=dtcompile.backend(**BACKEND_OPTIONS))(x)
        ours = f"dtcompile: DTensor random factory {factory.__name__}() inside a compiled region"
        assert [n for reason, n in counters["graph_break"].items() if reason.startswith(ours)] == [1]
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="whose state compiled code cannot read or advance"):
            _compiled(step)(x)


# ---- an output that is a view of a DTensor input (found by the fuzzer)


def _views_rank(rank: int) -> list[tuple]:
    mesh = _mesh(2, None, None)

    def views(x, y):
        return x.unsqueeze(0), y.permute(1, 0), x[1:].view(5, 1), x * 2

    def run(fn):
        x = distribute_tensor(torch.arange(6.0), mesh, [Replicate()]).requires_grad_()
        y = DTensor.from_local(torch.ones(1, 1) * (rank + 1), mesh, [_StridedShard(0, split_factor=2)], run_check=False)
        outs = fn(x, y)
        sum(o.to_local().sum() for o in outs if o.requires_grad).backward()
        aliases = [o._local_tensor.untyped_storage().data_ptr() in (x._local_tensor.untyped_storage().data_ptr(), y._local_tensor.untyped_storage().data_ptr()) for o in outs]
        return [(o.placements, o.shape, o.to_local()) for o in outs], aliases, x.grad.to_local()

    return [run(views), run(_compiled(views))]


def test_outputs_that_are_views_of_dtensor_inputs_are_eager_views():
    """AOTAutograd regenerates such an output with as_strided, which DTensor refuses
    (or, on an empty _StridedShard, got the placement wrong); the view ops now run
    on the real input after the compiled call, as eager runs them."""
    for eager, compiled in run_threaded(2, _views_rank):
        assert eager[1] == compiled[1] == [True, True, True, False]
        for (e_placements, e_shape, e_value), (c_placements, c_shape, c_value) in zip(eager[0], compiled[0]):
            assert (c_placements, c_shape) == (e_placements, e_shape)
            torch.testing.assert_close(c_value, e_value, rtol=0, atol=0)
        torch.testing.assert_close(compiled[2], eager[2], rtol=0, atol=0)


# ---- a flattening view that DTensor answers with _StridedShard


def test_a_view_that_makes_a_strided_shard_compiles_forward_and_backward():
    """``(x * 2).view(-1)`` of a Shard(1) DTensor is a _StridedShard whose spec carries
    its shard order; stock DTensor.__tensor_unflatten__ rebuilt it without that and
    DTensorSpec refused ("doesn't allow specify shard_order"), also with aot_eager."""
    with fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        results = []
        for fn in (lambda t: (t * 2).view(-1), _compiled(lambda t: (t * 2).view(-1))):
            x = distribute_tensor(torch.arange(25.0).reshape(5, 5), mesh, [Replicate(), Shard(1)], src_data_rank=None)
            x.requires_grad_()
            out = fn(x)
            out.to_local().sum().backward()
            results.append((out.placements, out.shape, out.to_local(), x.grad.placements, x.grad.to_local()))
    (placements, shape, local, grad_placements, grad), compiled = results
    assert placements == (Replicate(), _StridedShard(0, split_factor=5)) and shape == (25,)
    assert compiled[:2] == (placements, shape) and compiled[3] == grad_placements
    torch.testing.assert_close(compiled[2], local, rtol=0, atol=0)
    torch.testing.assert_close(compiled[4], grad, rtol=0, atol=0)


def test_the_unflatten_patch_differs_from_stock_only_where_stock_raises():
    """dynamo_vars keeps ``DTensor.__tensor_unflatten__`` patched while installed, for every
    backend in the process (dtcompile/base/process_changes.py): it must rebuild every spec
    stock rebuilds the same, and differ only on the one stock refuses."""
    from torch.distributed.tensor import DTensor

    import dynamo_vars
    from dynamo_vars.dtensor_api import _unflatten_keeping_shard_order

    with dynamo_vars.enabled(False):
        stock = vars(DTensor)["__tensor_unflatten__"]
    patched = _unflatten_keeping_shard_order(stock).__func__
    with fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        x = distribute_tensor(torch.arange(25.0).reshape(5, 5), mesh, [Replicate(), Shard(1)], src_data_rank=None)
        for plain in (x, x * 2, x.redistribute(mesh, [Shard(0), Replicate()])):
            names, spec = plain.__tensor_flatten__()
            inner = {name: getattr(plain, name) for name in names}
            ours, theirs = patched(inner, spec, plain.shape, plain.stride()), stock.__func__(inner, spec, plain.shape, plain.stride())
            assert (ours.placements, ours.shape, ours._spec.shard_order) == (theirs.placements, theirs.shape, theirs._spec.shard_order)
            assert ours._local_tensor is theirs._local_tensor is plain._local_tensor
        strided = (x * 2).view(-1)
        names, spec = strided.__tensor_flatten__()
        inner = {name: getattr(strided, name) for name in names}
        with pytest.raises(Exception, match="shard_order"):
            stock.__func__(inner, spec, strided.shape, strided.stride())
        rebuilt = patched(inner, spec, strided.shape, strided.stride())
        assert rebuilt.placements == strided.placements and rebuilt._spec.shard_order == strided._spec.shard_order
