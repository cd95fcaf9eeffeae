"""The four shared models compile with dtcompile on the fake process group."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile._testing.cases import CASES


def _schedule(backend: dtcompile.DTCompileBackend) -> str:
    """The collectives of every compiled graph, one line each, in compile order."""
    lines = []
    for record in backend.records:
        ops = ", ".join(f"{c.op}[{c.axis}]" for c in record.collectives) or "-"
        lines.append(f"{record.compile_id} {record.kind}: {ops}")
    return "\n".join(lines)


def _compile_step(case_name: str, mesh, backend) -> CompileCounterWithBackend:
    case = CASES[case_name]
    _, parallel, x = case.build(mesh)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(parallel, backend=counter, fullgraph=True)
    local_x = case.local_input(x, mesh)
    for _ in range(3):
        out = compiled(local_x)
        out.pow(2).mean().backward()
        assert all(p.grad is not None for p in parallel.parameters())
    frames = counter.frame_count
    compiled(local_x)
    # The same inputs never recompile: every frame compiled once, on the first call.
    assert counter.frame_count == frames
    return counter


EXPECTED_SCHEDULES = {
    "tp_mlp": """\
0/0 forward: all_reduce[tp]
0/0 backward: -""",
    "tp_sp_block": """\
0/0 inference: -
1/0 forward: all_gather[tp], reduce_scatter[tp], all_gather[tp], reduce_scatter[tp]
2/0 forward: all_gather[tp]
2/0 backward: -
1/0 backward: all_gather[tp], reduce_scatter[tp], all_gather[tp], reduce_scatter[tp]""",
    "fsdp_mlp": """\
0/0 forward: all_gather[dp], all_gather[dp], all_gather[dp], all_gather[dp]
0/0 backward: reduce_scatter[dp], reduce_scatter[dp], reduce_scatter[dp], reduce_scatter[dp]""",
}


@pytest.mark.parametrize("case_name", ["tp_mlp", "tp_sp_block", "fsdp_mlp"])
def test_1d_models_compile_forward_and_backward(world4, case_name):
    backend = dtcompile.backend()
    mesh = CASES[case_name].mesh(4)
    _compile_step(case_name, mesh, backend)
    assert _schedule(backend) == EXPECTED_SCHEDULES[case_name]


def test_2d_block_compiles_forward_and_backward(world8):
    backend = dtcompile.backend()
    mesh = CASES["block_2d"].mesh(8)
    _compile_step("block_2d", mesh, backend)
    schedule = _schedule(backend).splitlines()
    assert schedule[:4] == EXPECTED_SCHEDULES["tp_sp_block"].splitlines()[:4]
    # Backward: the TP+SP collectives, plus one all-reduce over dp per parameter
    # (7 weights, 2 norm scales) and the norm-scale all-reduces over tp.
    backward = [c for c in backend.records if c.compile_id == "1/0" and c.kind == "backward"]
    (backward,) = backward
    ops = [f"{c.op}[{c.axis}]" for c in backward.collectives]
    assert ops.count("all_reduce[dp]") == 9
    assert ops.count("all_gather[tp]") == 2 and ops.count("reduce_scatter[tp]") == 2
    assert {c.group_size for c in backward.collectives if c.axis == "dp"} == {2}


def test_collective_bytes_follow_from_shapes(world4):
    backend = dtcompile.backend(inductor=False)
    mesh = CASES["tp_sp_block"].mesh(4)
    _compile_step("tp_sp_block", mesh, backend)
    forward = next(r for r in backend.records if r.compile_id == "1/0" and r.kind == "forward")
    gather = forward.collectives[0]
    # batch 2, seq 8, dim 64, float32: the gathered activation is 2 * 8 * 64 * 4 bytes.
    assert (gather.op, gather.group_size, gather.bytes) == ("all_gather", 4, 2 * 8 * 64 * 4)
    assert gather.shape == (8, 2, 64) and gather.dtype == torch.float32


def test_dtensors_on_different_meshes_fail_with_a_clear_error(world4):
    mesh_a = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    mesh_b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = distribute_tensor(torch.randn(8, 8), mesh_a, [Shard(0)])
    b = distribute_tensor(torch.randn(8, 8), mesh_b, [Replicate(), Shard(0)])

    def add(a: DTensor, b: DTensor) -> DTensor:
        return a + b

    with pytest.raises(RuntimeError) as eager_err:
        add(a, b)
    with pytest.raises(RuntimeError) as compiled_err:
        torch.compile(add, backend=dtcompile.backend(inductor=False), fullgraph=True)(a, b)
    what = (
        "Cannot run aten.add.Tensor on inputs with different meshes: got "
        "DeviceMesh((tp=4), 'cpu', stride=(1,)) and DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1))"
    )
    assert what in str(eager_err.value)
    # Compiled, the same words plus where in the user's code it happened.
    assert what in str(compiled_err.value)
    assert "return a + b" in str(compiled_err.value)
