"""A bucket's copies in and out are dtcompile's ops, so that a model's repeated layers share
their Inductor kernels (#70).

As ``cat``, ``slice`` and ``reshape`` nodes, Inductor wrote each bucket member's offset into
the source of its copy's kernel, and fused some copies into their neighbours: at 8 Llama3
layers, 96 C++ kernels to compile where stock compiled 18, 2.9x its cold-start seconds.
``dtcompile::pack_columns`` / ``unpack_columns`` (:mod:`dtcompile.base.bucket_ops`) are
called as extern kernels and the layers' kernels are the same again.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch import fx

import dtcompile
from dtcompile._testing.cases import assert_steps_close, rank_eager_and_compiled
from dtcompile._testing.models import build_norm_mlp_stack
from dtcompile.base.bucket_ops import pack_columns, unpack_columns
from dtcompile.base.channels import Meta
from dtcompile.base.op_facts import is_ordering_barrier
from dtcompile.testing import fake_world, run_threaded


def test_the_ops_copy_what_cat_and_slices_do() -> None:
    """Values as ``cat`` of the tensors' rows and the columns' slices; their fakes' shapes; fresh results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng = random.Random(0)
    for _ in range(50):
        rows = rng.choice([1, 2, 3, 4])
        tensors = [
            torch.randn(rows * rng.randint(1, 3), *[rng.randint(1, 3)] * rng.randint(0, 2))
            for _ in range(rng.randint(1, 4))
        ]
        if rows == 2 and rng.random() < 0.5:  # rows of a tensor whose first dim they do not divide
            tensors.append(torch.randn(3, 4))
        packed = pack_columns(tensors, rows)
        assert torch.equal(packed, torch.cat([t.reshape(rows, -1) for t in tensors], dim=1).reshape(-1))
        table = packed.view(rows, -1)
        widths = [t.numel() // rows for t in tensors]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        # Some columns (clones), or every one in order (split_with_sizes_copy).
        keep = sorted(rng.sample(range(len(tensors)), rng.randint(1, len(tensors))))
        if rng.random() < 0.5:
            keep = list(range(len(tensors)))
        outs = unpack_columns(table, [offsets[i] for i in keep], [widths[i] for i in keep])
        for out, i in zip(outs, keep):
            assert out.is_contiguous() and out.untyped_storage().data_ptr() != table.untyped_storage().data_ptr()
            assert torch.equal(out.reshape(tensors[i].shape), tensors[i].reshape(rows, -1).reshape(tensors[i].shape))
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) for t in tensors]
            assert torch.ops.dtcompile.pack_columns(fakes, rows).shape == packed.shape
            fake_outs = torch.ops.dtcompile.unpack_columns(
                mode.from_tensor(table), [offsets[i] for i in keep], [widths[i] for i in keep]
            )
            assert [o.shape for o in fake_outs] == [o.shape for o in outs]


def test_the_ops_are_no_ordering_barriers() -> None:
    """They compute on this rank and issue nothing: collectives may move across them."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    packed = graph.call_function(torch.ops.dtcompile.pack_columns.default, ([a], 1))
    unpacked = graph.call_function(torch.ops.dtcompile.unpack_columns.default, (packed, [0], [1]))
    assert not is_ordering_barrier(packed) and not is_ordering_barrier(unpacked)


_KERNEL = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|triton)\(", re.M)


def _kernels(layers: int, backend) -> tuple[int, int, list[str]]:
    """One forward and backward of SimpleFSDP's NormMLPStack at ``layers`` layers through
    ``backend`` (Inductor's code generation), on the fake group of 4: the kernels Inductor
    defined (each a source of its own to compile), the largest bucket's members, and the code."""
    from torch._inductor.utils import run_and_get_code

    with fake_world(4, (4,), ("dp",)) as mesh:
        _, parallel, x = build_norm_mlp_stack(mesh, rows=4, dim=16, hidden=32, layers=layers)
        torch._dynamo.reset()

        def step() -> None:
            torch.compile(parallel, backend=backend)(x.chunk(4)[0]).sum().backward()

        _, codes = run_and_get_code(step)
    records = getattr(backend, "records", ())
    largest = max((len(n.meta.get(Meta.BUCKET, ())) for r in records for n in r.graph.graph.nodes), default=0)
    return sum(len(_KERNEL.findall(code)) for code in codes), largest, codes


@pytest.mark.inductor
@pytest.mark.slow
def test_repeated_layers_share_their_kernels() -> None:
    """From 2 to 6 layers, with buckets spanning layers, dtcompile has Inductor compile no more
    kernels than stock Inductor does, nor more new ones (the stack's own kernels grow a little
    with depth for stock too: 9 to 16).  On the copies as aten's ops, 14 to 28."""
    stock_small, _, _ = _kernels(2, "inductor")
    stock_large, _, _ = _kernels(6, "inductor")
    small, _, _ = _kernels(2, dtcompile.backend())
    large, members, codes = _kernels(6, dtcompile.backend())
    assert members >= 4, f"the test needs buckets of several layers' members, the largest has {members}"
    assert any("dtcompile.unpack_columns" in code for code in codes)
    assert large <= stock_large and large - small <= stock_large - stock_small, (
        f"kernels at 2 and 6 layers: dtcompile {small} and {large}, stock Inductor {stock_small} and {stock_large}"
    )


def _gathered_stack(rank: int, world_size: int):
    return rank_eager_and_compiled(rank, "gathered_stack", world_size, {})


@pytest.mark.inductor
@pytest.mark.slow
def test_bucketed_and_compiled_by_inductor_equals_eager() -> None:
    """The ops under Inductor, on real collectives: the bucketed stack equals eager, forward and backward."""
    for rank, (eager, compiled, graphs) in enumerate(run_threaded(4, _gathered_stack, 4, timeout=600)):
        assert graphs >= 2
        assert_steps_close(compiled, eager, f"rank {rank}: compiled vs eager", rtol=1e-5, atol=1e-5)
