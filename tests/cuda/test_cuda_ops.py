"""The fused collective-matmul ops on CUDA, on a 1-rank NCCL group (the ``cuda`` tier).

With symmetric memory the ops call torch's ``symm_mem`` kernels; without it
(or where enabling it fails) they run decomposed and say why once.  Either way
their values must equal ``torch.matmul`` and the decomposed path, in fp32 and
bf16, eagerly, compiled by Inductor, and inside a training step compiled by
dtcompile (whose ``async_tp`` pass puts them into the forward and backward
graphs: forced, ``force_async_tp=True``, since on one rank no data moves and
the priced pass declines every fusion).  On one rank the all-gather and the
reduce-scatter are the identity, so the references are plain matmuls.

On a torch older than 2.13 run them through ``python benchmarks/cuda_check.py
--pytest``, which first lets dtcompile import there.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import dtcompile
from dtcompile._testing.models import SequenceParallelMLP
from dtcompile.base import fused_ops as ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (the cuda tier runs on a GPU machine)",
    ),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Largest error allowed, relative to the reference's largest magnitude."""


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    scale = expected.abs().max().float().clamp_min(1e-12)
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(
        dtype
    )


@pytest.fixture(scope="module")
def group_name(tmp_path_factory):
    """The default group: NCCL, one rank, on cuda:0."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialized")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_enable():
    """Symmetric memory is enabled (and a failure logged) anew in the test."""
    ops._enable_symm_mem.cache_clear()
    yield
    ops._enable_symm_mem.cache_clear()


@pytest.fixture
def decomposed(monkeypatch):
    """A function that runs ``fn()`` with the fused ops forced onto their decomposed path."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(
                ops, "symmetric_memory_available", lambda tensor, group_name: False
            )
            return fn()

    return run


@pytest.fixture
def symm_mem_calls(monkeypatch):
    """Counts calls of torch's symm_mem kernels (the spies call the real kernels)."""
    # Inductor's first import builds its decomposition table from the op namespaces,
    # which a spy (a function in place of an op) breaks: import it before they go in.
    import torch._inductor.compile_fx  # noqa: F401
    import torch.distributed._symmetric_memory

    calls = {"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}
    for name in calls:
        real = getattr(torch.ops.symm_mem, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch.ops.symm_mem, name, spy)
    return calls


def test_symmetric_memory_is_enabled_on_one_rank_or_the_reason_is_logged_once(
    group_name, fresh_enable, caplog
):
    probe = torch.empty(1, device="cuda")
    with caplog.at_level(logging.INFO, logger="dtcompile.base.fused_ops"):
        first = ops.symmetric_memory_available(probe, group_name)
        second = ops.symmetric_memory_available(probe, group_name)
    assert first == second
    reasons = [r.getMessage() for r in caplog.records if r.name == "dtcompile.base.fused_ops"]
    if first:
        assert reasons == []
    else:
        assert len(reasons) == 1 and repr(group_name) in reasons[0], reasons
    print(
        f"symmetric memory on 1 rank: {'enabled' if first else 'not enabled: ' + reasons[0]}"
    )


def test_a_failed_enable_runs_decomposed_and_logs_the_reason_once(
    group_name, fresh_enable, monkeypatch, caplog
):
    from torch.distributed import _symmetric_memory

    def refuse(name):
        raise RuntimeError("no symmetric memory on this test machine")

    monkeypatch.setattr(_symmetric_memory, "enable_symm_mem_for_group", refuse)
    a, b = (
        _randn(2, 8, 16, dtype=torch.float32, seed=0),
        _randn(16, 24, dtype=torch.float32, seed=1),
    )
    with caplog.at_level(logging.INFO, logger="dtcompile.base.fused_ops"):
        for _ in range(2):
            gathered, (out,) = torch.ops.dtcompile.fused_all_gather_matmul(
                a, [b], 1, group_name
            )
            scattered = torch.ops.dtcompile.fused_matmul_reduce_scatter(
                a.view(-1, 16), b, [2, 8, 24], "sum", 1, group_name
            )
            assert torch.equal(gathered, a)
            assert _relative_error(out, a @ b) < TOLERANCE[torch.float32]
            assert _relative_error(scattered, a @ b) < TOLERANCE[torch.float32]
    records = [r for r in caplog.records if r.name == "dtcompile.base.fused_ops"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "no symmetric memory on this test machine" in records[0].getMessage()
    assert (
        repr(group_name) in records[0].getMessage()
        and records[0].levelno == logging.WARNING
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gather_dim", [0, 1])
def test_fused_all_gather_matmul_equals_matmul_and_the_decomposed_path(
    group_name, decomposed, dtype, gather_dim
):
    a_shard = _randn(4, 64, 256, dtype=dtype, seed=2)
    bs = [_randn(256, 192, dtype=dtype, seed=3), _randn(256, 64, dtype=dtype, seed=4)]

    def run():
        return torch.ops.dtcompile.fused_all_gather_matmul(
            a_shard, bs, gather_dim, group_name
        )

    gathered, outs = run()
    reference_gathered, reference_outs = decomposed(run)
    # One rank: the gather is the shard itself.
    assert torch.equal(gathered, a_shard) and torch.equal(reference_gathered, a_shard)
    assert gathered.is_contiguous() and all(
        out.is_contiguous() for out in outs
    )  # as the op's fake says
    for out, reference, b in zip(outs, reference_outs, bs):
        assert _relative_error(out, torch.matmul(a_shard, b)) < TOLERANCE[dtype]
        assert _relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_fused_matmul_reduce_scatter_equals_matmul_and_the_decomposed_path(
    group_name, decomposed, dtype, scatter_dim
):
    a = _randn(4 * 64, 256, dtype=dtype, seed=5)
    b = _randn(256, 192, dtype=dtype, seed=6)

    def run():
        return torch.ops.dtcompile.fused_matmul_reduce_scatter(
            a, b, [4, 64, 192], "sum", scatter_dim, group_name
        )

    out = run()
    assert out.shape == (4, 64, 192) and out.is_contiguous()
    assert _relative_error(out, torch.matmul(a, b).view(4, 64, 192)) < TOLERANCE[dtype]
    assert _relative_error(out, decomposed(run)) < TOLERANCE[dtype]


def test_the_symm_mem_kernels_run_when_symmetric_memory_is_enabled(
    group_name, symm_mem_calls
):
    a = _randn(2, 32, 64, dtype=torch.bfloat16, seed=7)
    if not ops.symmetric_memory_available(a, group_name):
        pytest.skip(
            "symmetric memory is not enabled on this machine (the reason is logged by dtcompile.base.fused_ops)"
        )
    b = _randn(64, 48, dtype=torch.bfloat16, seed=8)
    torch.ops.dtcompile.fused_all_gather_matmul(a, [b], 1, group_name)
    torch.ops.dtcompile.fused_matmul_reduce_scatter(
        a.view(-1, 64), b, [2, 32, 48], "sum", 1, group_name
    )
    assert symm_mem_calls == {
        "fused_all_gather_matmul": 1,
        "fused_matmul_reduce_scatter": 1,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.inductor
def test_fused_ops_compiled_by_inductor_equal_matmul(group_name, dtype):
    """Inductor plans the ops' outputs with their fakes' strides (and checks them)."""
    a_shard = _randn(4, 64, 256, dtype=dtype, seed=9)
    b = _randn(256, 192, dtype=dtype, seed=10)

    def fn(a_shard, b):
        gathered, (out,) = torch.ops.dtcompile.fused_all_gather_matmul(
            a_shard, [b], 1, group_name
        )
        scattered = torch.ops.dtcompile.fused_matmul_reduce_scatter(
            torch.relu(out).view(-1, 192), b.t(), [4, 64, 256], "sum", 1, group_name
        )
        return gathered * 2, scattered + 1

    gathered, scattered = torch.compile(fn, backend="inductor", fullgraph=True)(
        a_shard, b
    )
    assert torch.equal(gathered, a_shard * 2)
    reference = (torch.relu(a_shard @ b) @ b.t()) + 1
    assert _relative_error(scattered, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_training_step_compiled_by_dtcompile_runs_the_fused_ops_and_equals_matmul(
    group_name, symm_mem_calls, decomposed, dtype
):
    model = SequenceParallelMLP(
        group_name, _randn(256, 512, dtype=dtype, seed=11) / 256**0.5, _randn(512, 256, dtype=dtype, seed=12) / 512**0.5
    )
    x = _randn(128, 256, dtype=dtype, seed=13).requires_grad_()
    # Plain reference: one rank, so the gather and the scatter are the identity.
    x_ref, w1, w2 = (
        t.detach().clone().requires_grad_() for t in (x, model.w1, model.w2)
    )
    expected = torch.relu(torch.matmul(x_ref, w1)) @ w2
    expected.float().pow(2).mean().backward()

    # On one rank no data moves, so the priced async_tp pass fuses nothing: force it,
    # so that the step runs the fused ops.  No AOT cache: the records are inspected.
    backend = dtcompile.DTCompileBackend(
        dtcompile.DTCompileConfig(force_async_tp=True, aot_cache=False)
    )  # no DTensor: dynamo_vars not needed
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step():
        for t in (x, model.w1, model.w2):
            t.grad = None
        out = compiled(x)
        out.float().pow(2).mean().backward()
        return [out.detach(), x.grad, model.w1.grad, model.w2.grad]

    fused_step = step()
    calls = dict(symm_mem_calls)
    decomposed_step = decomposed(step)  # the same compiled graphs, the fused ops decomposed

    fused = {(r.kind, c.op) for r in backend.records for c in r.collectives if c.fused}
    assert fused == {
        ("forward", "all_gather"),
        ("forward", "reduce_scatter"),
        ("backward", "all_gather"),
        ("backward", "reduce_scatter"),
    }, [str(c) for r in backend.records for c in r.collectives]
    decisions = [d for r in backend.records for p in r.passes if p.name == "async_tp" for d in p.decisions]
    assert decisions and all(
        d.text.startswith("fused ") and "forced by force_async_tp" in d.text for d in decisions
    ), [str(d) for d in decisions]
    for actual, reference, via_decomposed in zip(
        fused_step, [expected.detach(), x_ref.grad, w1.grad, w2.grad], decomposed_step
    ):
        assert _relative_error(actual, reference) < TOLERANCE[dtype]
        assert _relative_error(actual, via_decomposed) < TOLERANCE[dtype]
    if ops.symmetric_memory_available(x, group_name):
        assert (
            calls["fused_all_gather_matmul"] >= 2
            and calls["fused_matmul_reduce_scatter"] >= 2
        ), calls
    else:
        assert sum(calls.values()) == 0
    assert symm_mem_calls == calls  # the decomposed step called no symm_mem kernel
