"""The four shared models compile with dtcompile on the fake process group."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile._testing.cases import CASES
from dtcompile.testing import (
    assert_no_graph_breaks,
    assert_no_recompiles,
    collective_schedule,
)


def _compile_steps(case_name: str, mesh, backend) -> None:
    """Three compiled training steps, then one more call: no recompile, every grad set."""
    case = CASES[case_name]
    _, parallel, x = case.build(mesh)
    compiled = torch.compile(parallel, backend=backend, fullgraph=True)
    local_x = case.local_input(x, mesh)
    with assert_no_graph_breaks():
        compiled(local_x).pow(2).mean().backward()
    with assert_no_recompiles():
        for _ in range(3):
            compiled(local_x).pow(2).mean().backward()
            assert all(p.grad is not None for p in parallel.parameters())


def _schedule(case_name: str, mesh) -> str:
    """The collective schedule of one step, compiled with the default dtcompile (Inductor)."""
    case = CASES[case_name]
    _, parallel, x = case.build(mesh)
    return str(collective_schedule(parallel, case.local_input(x, mesh), backend=dtcompile.backend()))


@pytest.mark.models
def test_tp_mlp_schedule(world4):
    mesh = CASES["tp_mlp"].mesh(4)
    _compile_steps("tp_mlp", mesh, dtcompile.backend())
    assert_expected_inline(_schedule("tp_mlp", mesh), """\
forward 0/0:
  all_reduce            tp     x4    float32[4, 16]  256 B
backward 0/0: (no collectives)
forward total: 1 collectives, 256 B per rank
backward total: 0 collectives, 0 B per rank""")


@pytest.mark.models
def test_tp_sp_block_schedule(world4):
    mesh = CASES["tp_sp_block"].mesh(4)
    _compile_steps("tp_sp_block", mesh, dtcompile.backend())
    assert_expected_inline(_schedule("tp_sp_block", mesh), """\
forward 0/0: (no collectives)
forward 1/0:
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter+matmul tp     x4    float32[2, 8, 64]  4096 B
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter+matmul tp     x4    float32[2, 8, 64]  4096 B
forward 2/0:
  all_gather            tp     x4    float32[8, 2, 64]  4096 B
backward 2/0: (no collectives)
backward 1/0:
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter        tp     x4    float32[8, 2, 64]  4096 B
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter        tp     x4    float32[8, 2, 64]  4096 B
forward total: 5 collectives, 20480 B per rank
backward total: 4 collectives, 16384 B per rank""")


@pytest.mark.models
def test_fsdp_mlp_schedule(world4):
    mesh = CASES["fsdp_mlp"].mesh(4)
    _compile_steps("fsdp_mlp", mesh, dtcompile.backend())
    assert_expected_inline(_schedule("fsdp_mlp", mesh), """\
forward 0/0:
  all_gather            dp     x4    float32[544]  2176 B
  all_gather            dp     x4    float32[528]  2112 B
backward 0/0:
  all_gather            dp     x4    float32[16, 32]  2048 B
  reduce_scatter+matmul dp     x4    float32[16, 32]  2048 B
  reduce_scatter        dp     x4    float32[48]  192 B
  reduce_scatter+matmul dp     x4    float32[32, 16]  2048 B
forward total: 2 collectives, 4288 B per rank
backward total: 4 collectives, 6336 B per rank""")


@pytest.mark.models
def test_2d_block_schedule(world8):
    mesh = CASES["block_2d"].mesh(8)
    _compile_steps("block_2d", mesh, dtcompile.backend())
    # Backward: the TP+SP collectives, plus one all-reduce over dp per parameter
    # (7 weights, 2 norm scales).
    assert_expected_inline(_schedule("block_2d", mesh), """\
forward 0/0: (no collectives)
forward 1/0:
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter+matmul tp     x4    float32[2, 8, 64]  4096 B
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  reduce_scatter+matmul tp     x4    float32[2, 8, 64]  4096 B
forward 2/0:
  all_gather            tp     x4    float32[8, 2, 64]  4096 B
backward 2/0: (no collectives)
backward 1/0:
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  all_reduce            dp     x2    float32[4096]  16384 B
  reduce_scatter        tp     x4    float32[8, 2, 64]  4096 B
  all_reduce            tp     x4    float32[64]  256 B
  all_reduce            dp     x2    float32[2112]  8448 B
  all_gather+matmul     tp     x4    float32[2, 8, 64]  4096 B
  all_reduce            dp     x2    float32[2048]  8192 B
  all_reduce            dp     x2    float32[16, 64]  4096 B
  reduce_scatter        tp     x4    float32[8, 2, 64]  4096 B
  all_reduce            tp     x4    float32[64]  256 B
  all_reduce            dp     x2    float32[1088]  4352 B
forward total: 5 collectives, 20480 B per rank
backward total: 11 collectives, 58368 B per rank""")


@pytest.mark.slow
def test_collective_bytes_follow_from_shapes(world4):
    case = CASES["tp_sp_block"]
    mesh = case.mesh(4)
    _, parallel, x = case.build(mesh)
    schedule = collective_schedule(parallel, x, backend=dtcompile.backend(inductor=False, disable_passes={"async_tp"}))
    gather = schedule.forward[0]
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
