"""Inspection: cost model, annotations of every node, explain(), TORCH_TRACE artifacts, tlparse, the HTML report."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

import dtcompile
from dtcompile._testing.cases import CASES
from dtcompile.base.channels import Artifact, GraphKind, Meta
from dtcompile.cost import (
    PROFILES,
    HardwareProfile,
    LinkCost,
    collective_time_us,
    get_profile,
    register_profile,
)
from dtcompile_tools import report as report_tool

# ---------------------------------------------------------------- cost model


def test_cost_formulas_by_hand():
    """The h100 profile's NVLink (360 GB/s, 0.6 us per hop, 6.6 us base) on 1 MiB, worked by hand:
    an all-gather over 4 ranks is 6.6 + 3 hops x 0.6 + 3/4 MiB at 360 GB/s (2.1845 us)."""
    nvlink = PROFILES["h100"].intra_node
    mib = 1 << 20
    assert collective_time_us("all_gather", mib, 4, nvlink) == pytest.approx(10.5845, abs=1e-4)
    assert collective_time_us("reduce_scatter", mib, 4, nvlink) == collective_time_us("all_gather", mib, 4, nvlink)
    # 6 hops, 6/4 MiB on the wire (4.3691 us).
    assert collective_time_us("all_reduce", mib, 4, nvlink) == pytest.approx(14.5691, abs=1e-4)
    # 7 hops, 7/8 MiB (2.5486 us).
    assert collective_time_us("all_to_all", mib, 8, nvlink) == pytest.approx(13.3486, abs=1e-4)
    # 1 hop, the whole MiB (2.9127 us).
    assert collective_time_us("broadcast", mib, 2, nvlink) == pytest.approx(10.1127, abs=1e-4)
    assert collective_time_us("all_reduce", mib, 1, nvlink) == 0.0


def test_axis_within_a_node_uses_nvlink_and_across_nodes_infiniband():
    h100 = get_profile("h100")
    assert h100.link(8) is h100.intra_node and h100.link(9) is h100.inter_node
    gib = 1 << 30
    # 1 GiB all-reduce over 16 ranks across two nodes: 6.6 us base, 15 x 2 hops of 2.7 us (81 us),
    # 30/16 of the bytes at 45 GB/s (44,739.2427 us).
    assert collective_time_us("all_reduce", gib, 16, h100.link(16)) == pytest.approx(44826.8427, abs=1e-3)


def test_profiles_can_be_added_and_are_checked_by_name():
    with pytest.raises(ValueError, match=r"unknown cost profile 'tpu'; the profiles are \['a100', 'cpu_gloo', 'h100', 'inter_node_ib'\]"):
        dtcompile.backend(cost_profile="tpu")
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        LinkCost(bandwidth_gbps=0, hop_latency_us=1)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        collective_time_us("gather", 8, 2, PROFILES["h100"].intra_node)
    link = LinkCost(bandwidth_gbps=100.0, hop_latency_us=1.0, base_latency_us=0.0)
    profile = register_profile(HardwareProfile(name="test_box", description="test", intra_node=link, inter_node=link, devices_per_node=4))
    try:
        assert dtcompile.backend(cost_profile="test_box").config.cost_profile == "test_box"
        assert collective_time_us("all_gather", 400, 4, profile.link(4)) == pytest.approx(3 + 300 / 100e9 * 1e6)
    finally:
        del PROFILES["test_box"]


# ---------------------------------------------------------------- annotations


def _explain(case_name: str, world_size: int, mesh) -> dtcompile.Report:
    case = CASES[case_name]
    _, parallel, x = case.build(mesh)
    return dtcompile.explain(parallel)(case.local_input(x, mesh))


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.slow
def test_every_aot_call_node_is_annotated_and_bytes_follow_from_shapes(fake_world, case_name):
    case = CASES[case_name]
    world_size = 8 if case_name == "block_2d" else 4
    report = _explain(case_name, world_size, fake_world(world_size, case.mesh_shape(world_size), case.mesh_dim_names))
    assert {"forward", "backward"} <= {g.kind for g in report.graphs}
    num_nodes = 0
    for graph in report.graphs:
        for node in graph.graph.graph.nodes:
            if node.op != "call_function":
                continue
            num_nodes += 1
            note = node.meta[Meta.ANNOTATION]
            info = node.meta.get(Meta.COLLECTIVE)
            if info is None:
                # every other node names the Dynamo node it comes from
                assert note.startswith(("from ", "grad of ")), (node.name, note)
                assert note.split(";")[0].split(":")[0].split()[-1] in graph.info.node_names, (node.name, note)
                continue
            if info.fused and info.op == "all_gather":
                value = node.meta["val"][0]  # the gathered operand
            elif info.fused:
                value = torch.empty(node.args[2], dtype=node.args[0].meta["val"].dtype, device="meta")  # the product
            else:
                value = (node if info.op == "all_gather" else node.args[0]).meta["val"]
            assert info.bytes == math.prod(value.shape) * value.element_size()
            assert node.meta[Meta.COST_US] > 0
    assert num_nodes > 40
    # every collective is charged to a DTensor op of the Dynamo graph
    for graph in report.graphs:
        assert "?" not in graph.info.communication


def test_annotated_placements_tp_mlp(fake_world):
    report = _explain("tp_mlp", 4, fake_world(4, (4,), ("tp",)))
    assert_expected_inline(
        report.graphs[0].info.format(),
        """\
on DeviceMesh((tp=4), 'cpu', stride=(1,))
input_tensor = torch.distributed.tensor._api.DTensor.from_local(l_x_, DeviceMesh((tp=4)), (Replicate()), run_check=False) -> Spec(f32[4, 16](R))
linear = torch._C._nn.linear(Spec(f32[4, 16](R)), Spec(f32[32, 16](S(0))), Spec(f32[32](S(0)))) -> Spec(f32[4, 32](S(1)))
outputs = .redistribute(Spec(f32[4, 32](S(1))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[4, 32](S(1)))
hook_result = .to_local(Spec(f32[4, 32](S(1))))
input_tensor_2 = torch.distributed.tensor._api.DTensor.from_local(input_tensor_1, DeviceMesh((tp=4)), (Shard(dim=-1)), run_check=False) -> Spec(f32[4, 32](S(1)))
linear_1 = torch._C._nn.linear(Spec(f32[4, 32](S(1))), Spec(f32[16, 32](S(1))), Spec(f32[16](R))) -> Spec(f32[4, 16](P(sum)))
outputs_1 = .redistribute(Spec(f32[4, 16](P(sum))), placements=(Replicate()), async_op=True) -> Spec(f32[4, 16](R))  # forward all_reduce[tp] x4 256 B ~10.2 us
hook_result_1 = .to_local(Spec(f32[4, 16](R)))""",
    )


def test_annotated_placements_fsdp_mlp(fake_world):
    report = _explain("fsdp_mlp", 4, fake_world(4, (4,), ("dp",)))
    assert_expected_inline(
        report.graphs[0].info.format(),
        """\
on DeviceMesh((dp=4), 'cpu', stride=(1,))
redistribute = .redistribute(Spec(f32[32, 16](S(0))), placements=[Replicate()]) -> Spec(f32[32, 16](R))  # forward all_gather[dp] x4 2176 B ~8.4 us
local = .to_local(Spec(f32[32, 16](R)), grad_placements=[Partial(avg)])
redistribute_1 = .redistribute(Spec(f32[32](S(0))), placements=[Replicate()]) -> Spec(f32[32](R))
local_1 = .to_local(Spec(f32[32](R)), grad_placements=[Partial(avg)])  # backward reduce_scatter[dp] x4 2176 B ~8.4 us
redistribute_2 = .redistribute(Spec(f32[16, 32](S(0))), placements=[Replicate()]) -> Spec(f32[16, 32](R))  # forward all_gather[dp] x4 2112 B ~8.4 us; backward all_gather[dp] x4 2048 B ~8.4 us
local_2 = .to_local(Spec(f32[16, 32](R)), grad_placements=[Partial(avg)])
redistribute_3 = .redistribute(Spec(f32[16](S(0))), placements=[Replicate()]) -> Spec(f32[16](R))
local_3 = .to_local(Spec(f32[16](R)), grad_placements=[Partial(avg)])  # backward reduce_scatter[dp] x4 2112 B ~8.4 us""",
    )


def _aot_text(case_name: str, mesh) -> str:
    report = _explain(case_name, 4, mesh)
    forward, backward = (next(g for g in report.graphs if g.kind == kind) for kind in ("forward", "backward"))
    return f"-- forward --\n{forward.annotated()}\n-- backward --\n{backward.annotated()}"


def test_annotated_aot_graphs_tp_mlp(fake_world):
    assert_expected_inline(_aot_text("tp_mlp", fake_world(4, (4,), ("tp",))), """\
-- forward --
view = aten.view.default(primals_1, [4, 16])  # from input_tensor: Spec(f32[4, 16](R))
permute = aten.permute.default(primals_3, [1, 0])  # from linear: Spec(f32[4, 32](S(1)))
addmm = aten.addmm.default(primals_5, view, permute)  # from linear: Spec(f32[4, 32](S(1)))
view_1 = aten.view.default(addmm, [4, 8])  # from hook_result
mul = aten.mul.Tensor(view_1, 0.5)  # from input_tensor_1
mul_1 = aten.mul.Tensor(view_1, 0.7071067811865476)  # from input_tensor_1
erf = aten.erf.default(mul_1)  # from input_tensor_1
add = aten.add.Tensor(erf, 1)  # from input_tensor_1
mul_2 = aten.mul.Tensor(mul, add)  # from input_tensor_1
view_2 = aten.view.default(mul_2, [4, 8])  # from input_tensor_2: Spec(f32[4, 32](S(1)))
permute_1 = aten.permute.default(primals_7, [1, 0])  # from linear_1: Spec(f32[4, 16](P(sum)))
div = aten.div.Tensor(primals_9, 4)  # from linear_1: Spec(f32[4, 16](P(sum)))
addmm_1 = aten.addmm.default(div, view_2, permute_1)  # from linear_1: Spec(f32[4, 16](P(sum)))
all_reduce = _c10d_functional.all_reduce.default(addmm_1, 'sum', '0')  # all_reduce[tp] x4 256 B ~10.2 us (h100)
wait_tensor = _c10d_functional.wait_tensor.default(all_reduce)  # from outputs_1: Spec(f32[4, 16](R))
view_3 = aten.view.default(wait_tensor, [4, 16])  # from hook_result_1
permute_2 = aten.permute.default(permute_1, [1, 0])  # from linear_1: Spec(f32[4, 16](P(sum)))
-- backward --
view_4 = aten.view.default(tangents_1, [4, 16])  # grad of hook_result_1
mm = aten.mm.default(view_4, permute_2)  # grad of linear_1: Spec(f32[4, 16](P(sum)))
permute_3 = aten.permute.default(view_4, [1, 0])  # grad of linear_1: Spec(f32[4, 16](P(sum)))
mm_1 = aten.mm.default(permute_3, view_2)  # grad of linear_1: Spec(f32[4, 16](P(sum)))
permute_4 = aten.permute.default(mm_1, [1, 0])  # grad of linear_1: Spec(f32[4, 16](P(sum)))
sum_1 = aten.sum.dim_IntList(view_4, [0], True)  # grad of linear_1: Spec(f32[4, 16](P(sum)))
view_5 = aten.view.default(sum_1, [16])  # grad of linear_1: Spec(f32[4, 16](P(sum)))
permute_5 = aten.permute.default(permute_4, [1, 0])  # grad of linear_1: Spec(f32[4, 16](P(sum)))
view_1 = aten.view.default(addmm, [4, 8])  # from hook_result
mul_1 = aten.mul.Tensor(view_1, 0.7071067811865476)  # from input_tensor_1
erf = aten.erf.default(mul_1)  # from input_tensor_1
add = aten.add.Tensor(erf, 1)  # from input_tensor_1
mul_4 = aten.mul.Tensor(add, 0.5)  # grad of input_tensor_1
mul_5 = aten.mul.Tensor(view_1, view_1)  # grad of input_tensor_1
mul_6 = aten.mul.Tensor(mul_5, -0.5)  # grad of input_tensor_1
exp = aten.exp.default(mul_6)  # grad of input_tensor_1
mul_7 = aten.mul.Tensor(exp, 0.3989422804014327)  # grad of input_tensor_1
mul_8 = aten.mul.Tensor(view_1, mul_7)  # grad of input_tensor_1
add_2 = aten.add.Tensor(mul_4, mul_8)  # grad of input_tensor_1
mul_9 = aten.mul.Tensor(mm, add_2)  # grad of input_tensor_1
view_6 = aten.view.default(mul_9, [4, 8])  # grad of hook_result
permute_6 = aten.permute.default(view_6, [1, 0])  # grad of linear: Spec(f32[4, 32](S(1)))
mm_2 = aten.mm.default(permute_6, view)  # grad of linear: Spec(f32[4, 32](S(1)))
permute_7 = aten.permute.default(mm_2, [1, 0])  # grad of linear: Spec(f32[4, 32](S(1)))
sum_2 = aten.sum.dim_IntList(view_6, [0], True)  # grad of linear: Spec(f32[4, 32](S(1)))
view_7 = aten.view.default(sum_2, [8])  # grad of linear: Spec(f32[4, 32](S(1)))
permute_8 = aten.permute.default(permute_7, [1, 0])  # grad of linear: Spec(f32[4, 32](S(1)))""")


def test_annotated_aot_graphs_fsdp_mlp(fake_world):
    assert_expected_inline(_aot_text("fsdp_mlp", fake_world(4, (4,), ("dp",))), """\
-- forward --
pack_columns_default = dtcompile.pack_columns.default([primals_1, primals_3], 1)  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor.default(pack_columns_default, 4, '0')  # all_gather[dp] x4 2176 B ~8.4 us (h100); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
wait_tensor_default = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default)  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
reshape_default = aten.reshape.default(wait_tensor_default, [4, -1])  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
unpack_columns_default = dtcompile.unpack_columns.default(reshape_default, [0, 128], [128, 8])  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
getitem = operator.getitem(unpack_columns_default, 0)  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
getitem_1 = operator.getitem(unpack_columns_default, 1)  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
reshape_default_1 = aten.reshape.default(getitem, [32, 16])  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
reshape_default_2 = aten.reshape.default(getitem_1, [32])  # from redistribute: Spec(f32[32, 16](R)); bucket of 2: all_gather_into_tensor, all_gather_into_tensor_1
pack_columns_default_1 = dtcompile.pack_columns.default([primals_6, primals_8], 1)  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor.default(pack_columns_default_1, 4, '0')  # all_gather[dp] x4 2112 B ~8.4 us (h100); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1)  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
reshape_default_3 = aten.reshape.default(wait_tensor_default_1, [4, -1])  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
unpack_columns_default_1 = dtcompile.unpack_columns.default(reshape_default_3, [0, 128], [128, 4])  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
getitem_2 = operator.getitem(unpack_columns_default_1, 0)  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
getitem_3 = operator.getitem(unpack_columns_default_1, 1)  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
reshape_default_4 = aten.reshape.default(getitem_2, [16, 32])  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
reshape_default_5 = aten.reshape.default(getitem_3, [16])  # from redistribute_2: Spec(f32[16, 32](R)); bucket of 2: all_gather_into_tensor_2, all_gather_into_tensor_3
view = aten.view.default(reshape_default_1, [32, 16])  # from local
view_1 = aten.view.default(reshape_default_2, [32])  # from local_1
permute = aten.permute.default(view, [1, 0])  # from linear
addmm = aten.addmm.default(view_1, primals_5, permute)  # from linear
mul = aten.mul.Tensor(addmm, 0.5)  # from gelu
mul_1 = aten.mul.Tensor(addmm, 0.7071067811865476)  # from gelu
erf = aten.erf.default(mul_1)  # from gelu
add = aten.add.Tensor(erf, 1)  # from gelu
mul_2 = aten.mul.Tensor(mul, add)  # from gelu
view_2 = aten.view.default(reshape_default_4, [16, 32])  # from local_2
view_3 = aten.view.default(reshape_default_5, [16])  # from local_3
permute_1 = aten.permute.default(view_2, [1, 0])  # from linear_1
addmm_1 = aten.addmm.default(view_3, mul_2, permute_1)  # from linear_1
-- backward --
all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor.default(primals_6, 4, '0')  # all_gather[dp] x4 2048 B ~8.4 us (h100)
wait_tensor_2 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_2)  # from redistribute_2: Spec(f32[16, 32](R))
permute_3 = aten.permute.default(tangents_1, [1, 0])  # grad of linear_1
mm_1 = aten.mm.default(permute_3, mul_2)  # grad of linear_1
permute_4 = aten.permute.default(mm_1, [1, 0])  # grad of linear_1
sum_1 = aten.sum.dim_IntList(tangents_1, [0], True)  # grad of linear_1
view_4 = aten.view.default(sum_1, [16])  # grad of linear_1
permute_5 = aten.permute.default(permute_4, [1, 0])  # grad of linear_1
view_5 = aten.view.default(view_4, [16])  # grad of local_3
view_6 = aten.view.default(permute_5, [16, 32])  # grad of local_2
pack_columns_default = dtcompile.pack_columns.default([view_5, view_6], 4)  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
reduce_scatter_tensor_default = _c10d_functional.reduce_scatter_tensor.default(pack_columns_default, 'avg', 4, '0')  # reduce_scatter[dp] x4 2112 B ~8.4 us (h100); bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
view_2 = aten.view.default(wait_tensor_2, [16, 32])  # from local_2
permute_1 = aten.permute.default(view_2, [1, 0])  # from linear_1
permute_2 = aten.permute.default(permute_1, [1, 0])  # grad of linear_1
mm = aten.mm.default(tangents_1, permute_2)  # grad of linear_1
wait_tensor_default = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
mul_1 = aten.mul.Tensor(addmm, 0.7071067811865476)  # from gelu
erf = aten.erf.default(mul_1)  # from gelu
add = aten.add.Tensor(erf, 1)  # from gelu
mul_4 = aten.mul.Tensor(add, 0.5)  # grad of gelu
mul_5 = aten.mul.Tensor(addmm, addmm)  # grad of gelu
mul_6 = aten.mul.Tensor(mul_5, -0.5)  # grad of gelu
exp = aten.exp.default(mul_6)  # grad of gelu
mul_7 = aten.mul.Tensor(exp, 0.3989422804014327)  # grad of gelu
mul_8 = aten.mul.Tensor(addmm, mul_7)  # grad of gelu
add_2 = aten.add.Tensor(mul_4, mul_8)  # grad of gelu
mul_9 = aten.mul.Tensor(mm, add_2)  # grad of gelu
permute_6 = aten.permute.default(mul_9, [1, 0])  # grad of linear
mm_2 = aten.mm.default(permute_6, primals_5)  # grad of linear
permute_7 = aten.permute.default(mm_2, [1, 0])  # grad of linear
sum_2 = aten.sum.dim_IntList(mul_9, [0], True)  # grad of linear
view_7 = aten.view.default(sum_2, [32])  # grad of linear
permute_8 = aten.permute.default(permute_7, [1, 0])  # grad of linear
view_8 = aten.view.default(view_7, [32])  # grad of local_1
view_9 = aten.view.default(permute_8, [32, 16])  # grad of local
pack_columns_default_1 = dtcompile.pack_columns.default([view_8, view_9], 4)  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
reduce_scatter_tensor_default_1 = _c10d_functional.reduce_scatter_tensor.default(pack_columns_default_1, 'avg', 4, '0')  # reduce_scatter[dp] x4 2176 B ~8.4 us (h100); bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
slice_tensor = aten.slice.Tensor(wait_tensor_default, 0, 0, 4)  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
reshape_default = aten.reshape.default(slice_tensor, [4])  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
slice_tensor_1 = aten.slice.Tensor(wait_tensor_default, 0, 4, 132)  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
reshape_default_1 = aten.reshape.default(slice_tensor_1, [4, 32])  # grad of local_3; bucket of 2: reduce_scatter_tensor, reduce_scatter_tensor_1
wait_tensor_default_1 = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1)  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
slice_tensor_2 = aten.slice.Tensor(wait_tensor_default_1, 0, 0, 8)  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
reshape_default_2 = aten.reshape.default(slice_tensor_2, [8])  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
slice_tensor_3 = aten.slice.Tensor(wait_tensor_default_1, 0, 8, 136)  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3
reshape_default_3 = aten.reshape.default(slice_tensor_3, [8, 16])  # grad of local_1; bucket of 2: reduce_scatter_tensor_2, reduce_scatter_tensor_3""")


@pytest.mark.slow
def test_annotated_placements_tp_sp_block(fake_world):
    report = _explain("tp_sp_block", 4, fake_world(4, (4,), ("tp",)))
    (main,) = {g.info.compile_id: g.info for g in report.graphs if g.info.compile_id == "1/0"}.values()
    assert_expected_inline(main.format(), """\
on DeviceMesh((tp=4), 'cpu', stride=(1,))
args_result = torch.distributed.tensor._api.DTensor.from_local(l_x_, DeviceMesh((tp=4)), (Shard(dim=1)), run_check=False) -> Spec(f32[2, 8, 64](S(1)))
pow_1 = .pow(Spec(f32[2, 8, 64](S(1))), 2) -> Spec(f32[2, 8, 64](S(1)))
mean = .mean(Spec(f32[2, 8, 64](S(1))), -1, keepdim=True) -> Spec(f32[2, 8, 1](S(1)))
add = operator.add(Spec(f32[2, 8, 1](S(1))), 1e-06) -> Spec(f32[2, 8, 1](S(1)))
rsqrt = torch._VariableFunctionsClass.rsqrt(Spec(f32[2, 8, 1](S(1)))) -> Spec(f32[2, 8, 1](S(1)))
mul = operator.mul(Spec(f32[2, 8, 64](S(1))), Spec(f32[2, 8, 1](S(1)))) -> Spec(f32[2, 8, 64](S(1)))
hook_result = operator.mul(Spec(f32[2, 8, 64](S(1))), Spec(f32[64](R))) -> Spec(f32[2, 8, 64](S(1)))
dt_inp = .redistribute(Spec(f32[2, 8, 64](S(1))), placements=(Replicate())) -> Spec(f32[2, 8, 64](R))  # forward all_gather+matmul[tp] x4 4096 B ~8.4 us; backward reduce_scatter[tp] x4 4096 B ~8.4 us
linear = torch._C._nn.linear(Spec(f32[2, 8, 64](R)), Spec(f32[64, 64](S(0))), None) -> Spec(f32[2, 8, 64](S(2)))
outputs = .redistribute(Spec(f32[2, 8, 64](S(2))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[2, 8, 64](S(2)))
hook_result_1 = .to_local(Spec(f32[2, 8, 64](S(2))))
linear_1 = torch._C._nn.linear(Spec(f32[2, 8, 64](R)), Spec(f32[64, 64](S(0))), None) -> Spec(f32[2, 8, 64](S(2)))
outputs_1 = .redistribute(Spec(f32[2, 8, 64](S(2))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[2, 8, 64](S(2)))
hook_result_2 = .to_local(Spec(f32[2, 8, 64](S(2))))
linear_2 = torch._C._nn.linear(Spec(f32[2, 8, 64](R)), Spec(f32[64, 64](S(0))), None) -> Spec(f32[2, 8, 64](S(2)))
outputs_2 = .redistribute(Spec(f32[2, 8, 64](S(2))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[2, 8, 64](S(2)))
hook_result_3 = .to_local(Spec(f32[2, 8, 64](S(2))))
input_tensor_1 = torch.distributed.tensor._api.DTensor.from_local(input_tensor, DeviceMesh((tp=4)), (Shard(dim=-1)), run_check=False) -> Spec(f32[2, 8, 64](S(2)))
linear_3 = torch._C._nn.linear(Spec(f32[2, 8, 64](S(2))), Spec(f32[64, 64](S(1))), None) -> Spec(f32[2, 8, 64](P(sum)))
outputs_3 = .redistribute(Spec(f32[2, 8, 64](P(sum))), placements=(Shard(dim=1)), async_op=True) -> Spec(f32[2, 8, 64](S(1)))  # forward reduce_scatter+matmul[tp] x4 4096 B ~8.4 us; backward all_gather+matmul[tp] x4 4096 B ~8.4 us
hook_result_4 = .to_local(Spec(f32[2, 8, 64](S(1))))
args_result_1 = torch.distributed.tensor._api.DTensor.from_local(h, DeviceMesh((tp=4)), (Shard(dim=1)), run_check=False) -> Spec(f32[2, 8, 64](S(1)))
pow_2 = .pow(Spec(f32[2, 8, 64](S(1))), 2) -> Spec(f32[2, 8, 64](S(1)))
mean_1 = .mean(Spec(f32[2, 8, 64](S(1))), -1, keepdim=True) -> Spec(f32[2, 8, 1](S(1)))
add_2 = operator.add(Spec(f32[2, 8, 1](S(1))), 1e-06) -> Spec(f32[2, 8, 1](S(1)))
rsqrt_1 = torch._VariableFunctionsClass.rsqrt(Spec(f32[2, 8, 1](S(1)))) -> Spec(f32[2, 8, 1](S(1)))
mul_2 = operator.mul(Spec(f32[2, 8, 64](S(1))), Spec(f32[2, 8, 1](S(1)))) -> Spec(f32[2, 8, 64](S(1)))
hook_result_5 = operator.mul(Spec(f32[2, 8, 64](S(1))), Spec(f32[64](R))) -> Spec(f32[2, 8, 64](S(1)))
dt_inp_1 = .redistribute(Spec(f32[2, 8, 64](S(1))), placements=(Replicate())) -> Spec(f32[2, 8, 64](R))  # forward all_gather+matmul[tp] x4 4096 B ~8.4 us; backward reduce_scatter[tp] x4 4096 B ~8.4 us
linear_4 = torch._C._nn.linear(Spec(f32[2, 8, 64](R)), Spec(f32[128, 64](S(0))), None) -> Spec(f32[2, 8, 128](S(2)))
outputs_4 = .redistribute(Spec(f32[2, 8, 128](S(2))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[2, 8, 128](S(2)))
hook_result_6 = .to_local(Spec(f32[2, 8, 128](S(2))))
linear_5 = torch._C._nn.linear(Spec(f32[2, 8, 64](R)), Spec(f32[128, 64](S(0))), None) -> Spec(f32[2, 8, 128](S(2)))
outputs_5 = .redistribute(Spec(f32[2, 8, 128](S(2))), placements=(Shard(dim=-1)), async_op=True) -> Spec(f32[2, 8, 128](S(2)))
hook_result_7 = .to_local(Spec(f32[2, 8, 128](S(2))))
input_tensor_3 = torch.distributed.tensor._api.DTensor.from_local(input_tensor_2, DeviceMesh((tp=4)), (Shard(dim=-1)), run_check=False) -> Spec(f32[2, 8, 128](S(2)))
linear_6 = torch._C._nn.linear(Spec(f32[2, 8, 128](S(2))), Spec(f32[64, 128](S(1))), None) -> Spec(f32[2, 8, 64](P(sum)))
outputs_6 = .redistribute(Spec(f32[2, 8, 64](P(sum))), placements=(Shard(dim=1)), async_op=True) -> Spec(f32[2, 8, 64](S(1)))  # forward reduce_scatter+matmul[tp] x4 4096 B ~8.4 us; backward all_gather+matmul[tp] x4 4096 B ~8.4 us
hook_result_8 = .to_local(Spec(f32[2, 8, 64](S(1))))""")


@pytest.mark.slow
def test_annotated_placements_block_2d_collectives(fake_world):
    report = _explain("block_2d", 8, fake_world(8, (2, 4), ("dp", "tp")))
    (main,) = {g.info.compile_id: g.info for g in report.graphs if g.info.compile_id == "1/0"}.values()
    commented = [line for line in main.format().splitlines() if "  # " in line]
    assert_expected_inline("\n".join(commented), """\
x = torch.distributed.tensor._api.DTensor.from_local(local, DeviceMesh((tp=4)), [Replicate()], run_check=False) -> Spec(f32[64](R))  # backward all_reduce[tp] x4 256 B ~10.2 us
dt_inp = .redistribute(Spec(f32[2, 8, 64](S(1))), placements=(Replicate())) -> Spec(f32[2, 8, 64](R))  # forward all_gather+matmul[tp] x4 4096 B ~8.4 us; backward reduce_scatter[tp] x4 4096 B ~8.4 us
local_1 = .to_local(Spec(f32[64, 64](RS(0))), grad_placements=[Partial(avg), Shard(dim=0)])  # backward all_reduce[dp] x2 4352 B ~7.8 us
local_3 = .to_local(Spec(f32[64, 64](RS(0))), grad_placements=[Partial(avg), Shard(dim=0)])  # backward all_reduce[dp] x2 8192 B ~7.8 us
outputs_3 = .redistribute(Spec(f32[2, 8, 64](P(sum))), placements=(Shard(dim=1)), async_op=True) -> Spec(f32[2, 8, 64](S(1)))  # forward reduce_scatter+matmul[tp] x4 4096 B ~8.4 us; backward all_gather+matmul[tp] x4 4096 B ~8.4 us
x_5 = torch.distributed.tensor._api.DTensor.from_local(local_5, DeviceMesh((tp=4)), [Replicate()], run_check=False) -> Spec(f32[64](R))  # backward all_reduce[tp] x4 256 B ~10.2 us
dt_inp_1 = .redistribute(Spec(f32[2, 8, 64](S(1))), placements=(Replicate())) -> Spec(f32[2, 8, 64](R))  # forward all_gather+matmul[tp] x4 4096 B ~8.4 us; backward reduce_scatter[tp] x4 4096 B ~8.4 us
local_6 = .to_local(Spec(f32[128, 64](RS(0))), grad_placements=[Partial(avg), Shard(dim=0)])  # backward all_reduce[dp] x2 12544 B ~7.8 us
local_7 = .to_local(Spec(f32[128, 64](RS(0))), grad_placements=[Partial(avg), Shard(dim=0)])  # backward all_reduce[dp] x2 8192 B ~7.8 us
local_8 = .to_local(Spec(f32[64, 128](RS(1))), grad_placements=[Partial(avg), Shard(dim=1)])  # backward all_reduce[dp] x2 8192 B ~7.8 us
outputs_6 = .redistribute(Spec(f32[2, 8, 64](P(sum))), placements=(Shard(dim=1)), async_op=True) -> Spec(f32[2, 8, 64](S(1)))  # forward reduce_scatter+matmul[tp] x4 4096 B ~8.4 us; backward all_gather+matmul[tp] x4 4096 B ~8.4 us""")


def test_explain_reports_graph_breaks_and_recompiles_in_placement_words(fake_world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = fake_world(4, (4,), ("tp",))

    def step(d):
        d = d * 2
        torch._dynamo.graph_break()
        return d.redistribute(mesh, [Replicate()])

    explain = dtcompile.explain(step, backward=False)
    first = explain(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
    assert len(first.graph_breaks) == 1 and "torch._dynamo.graph_break()" in first.graph_breaks[0]
    assert first.recompiles == ()
    second = explain(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()], src_data_rank=None))
    assert second.recompiles[0] == "step: 0/0: placements of arg d changed: (Shard(dim=0),) -> (Replicate(),)"
    text = str(second)
    assert "== collectives ==" in text and "all_gather      tp" in text
    assert "== recompiles ==\n- step: 0/0: placements of arg d changed" in text


def test_report_option_prints_each_graph(fake_world, capsys):
    mesh = fake_world(4, (4,), ("tp",))
    _, parallel, x = CASES["tp_mlp"].build(mesh)
    torch.compile(parallel, backend=dtcompile.backend(inductor=False, report=True))(x)
    out = capsys.readouterr().out
    assert out.startswith(
        "== dtcompile 0/0 forward (cost profile h100: auto: cpu tensors on fake, a test world standing in for "
        "a job, priced as the h100 it simulates) ==\n-- DTensor placements (Dynamo graph) --\n"
    )
    assert "all_reduce = _c10d_functional.all_reduce.default(addmm_1, 'sum', '0')  # all_reduce[tp] x4 256 B ~10.2 us (h100)" in out


# ---------------------------------------------------------------- TORCH_TRACE, tlparse, dtcompile-report


_TRACED_PROGRAM = textwrap.dedent(
    """
    import torch, dtcompile
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from dtcompile._testing.cases import CASES
    from dtcompile.testing import fake_world
    with fake_world(4, (4,), ("tp",)) as mesh:
        _, parallel, x = CASES["tp_mlp"].build(mesh)
        torch.compile(parallel, backend="dtcompile")(x).sum().backward()
        def step(d):
            d = d * 2
            torch._dynamo.graph_break()
            return d.redistribute(mesh, [Replicate()])
        compiled = torch.compile(step, backend=dtcompile.backend(inductor=False))
        compiled(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
        compiled(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()], src_data_rank=None))
        reference, _, x = CASES["tp_mlp"].build(mesh)
        dtcompile.auto_parallel.plan(reference, mesh, (x,))
    """
)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """A TORCH_TRACE of the TP MLP (Inductor, forward and backward) and of a program that
    graph-breaks and recompiles, from a fresh process."""
    directory = tmp_path_factory.mktemp("trace")
    # Its own compile caches: a graph an earlier test compiled would be served by
    # AOTAutograd's cache, and a served graph leaves no dtcompile artifacts but one.
    cache = tmp_path_factory.mktemp("inductor-cache")
    env = {**os.environ, "TORCH_TRACE": str(directory), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", _TRACED_PROGRAM], env=env, check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return directory


def test_artifacts_are_in_the_trace(trace_dir):
    (log,) = trace_dir.glob("dedicated_log_torch_trace_rank_0_*.log")
    names = [json.loads(line.split("] ", 1)[1])["artifact"]["name"] for line in log.read_text().splitlines() if '"artifact"' in line and not line.startswith("\t")]
    forward, backward = GraphKind.FORWARD, GraphKind.BACKWARD
    expected = [Artifact.PLACEMENTS, Artifact.graph(forward), Artifact.collectives(forward), Artifact.graph(backward), Artifact.collectives(backward)]
    for name in expected:
        assert name in names


@pytest.mark.subprocess
def test_tlparse_shows_the_dtcompile_artifacts(trace_dir, tmp_path):
    tlparse = shutil.which("tlparse")
    assert tlparse is not None, "tlparse is a test dependency (pip install -e '.[test]')"
    (log,) = trace_dir.glob("dedicated_log_torch_trace_rank_0_*.log")
    out = subprocess.run([tlparse, str(log), "-o", str(tmp_path / "tl"), "--overwrite", "--no-browser"], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    compile_dir = tmp_path / "tl" / "-_0_0_0"
    files = {p.name.rsplit("_", 1)[0] for p in compile_dir.iterdir()}
    assert {Artifact.PLACEMENTS, Artifact.graph(GraphKind.FORWARD), Artifact.graph(GraphKind.BACKWARD)} <= files
    (collectives,) = compile_dir.glob(f"{Artifact.collectives(GraphKind.FORWARD)}_*.json")
    data = json.loads(collectives.read_text())
    assert [(c["op"], c["axis"], c["bytes"]) for c in data["collectives"]] == [("all_reduce", "tp", 256)]
    index = (compile_dir / "..").resolve() / "index.html"
    assert Artifact.PLACEMENTS in index.read_text()


def test_report_tool_writes_every_section(trace_dir, tmp_path):
    assert report_tool.main([str(trace_dir), "-o", str(tmp_path)]) == 0
    page = (tmp_path / "index.html").read_text()
    for section in ['id="summary"', 'id="divergence"', 'id="auto-parallel"', 'id="compile-0_0"', 'id="graph-breaks"', 'id="recompiles"']:
        assert section in page
    # The auto-parallel plan, one line per node (the MLP's first matmul).
    assert re.search(r"addmm = aten\.addmm\(w1\.bias, input0, t\)  # placement=\(.*\) -&gt; .*, cost=\[", page)
    assert "all_reduce[tp] x4 256 B" in page
    assert "<td>annotate</td>" in page  # the passes table
    assert "placements of arg d changed: (Shard(dim=0),) -&gt; (Replicate(),)" in page
    assert "Graph break in user code" in page


@pytest.mark.inductor
def test_report_tool_shows_each_graphs_compile_seconds_inductors_too(trace_dir):
    trace = report_tool.read_trace(trace_dir)
    seconds = trace.ranks[0].compiles["0/0"].seconds
    assert sorted(seconds) == ["backward", "forward"]
    assert all(data["stages"]["Inductor"] > 0 for data in seconds.values()), seconds
    page = report_tool.render_html(trace)
    table = page[page.index("<h3>Compile seconds</h3>") :].split("</table>")[0]
    assert '<th class="n">Inductor</th>' in table and "<td>backward</td>" in table


def test_report_tool_checks_that_ranks_agree(trace_dir, tmp_path):
    (log,) = trace_dir.glob("dedicated_log_torch_trace_rank_0_*.log")
    agree = tmp_path / "agree"
    agree.mkdir()
    shutil.copy(log, agree / log.name)
    shutil.copy(log, agree / log.name.replace("rank_0", "rank_1"))
    assert "all 2 ranks issue the same collectives in the same order" in report_tool.render_html(report_tool.read_trace(agree))
    diverged = tmp_path / "diverged"
    diverged.mkdir()
    shutil.copy(log, diverged / log.name)
    # A collective's dtype and bytes (a memory entry's are not compared across ranks).
    text = log.read_text()
    differs = text.replace('"dtype": "float32", "bytes": 256, "data_dependent"', '"dtype": "bfloat16", "bytes": 128, "data_dependent"', 1)
    assert differs != text
    (diverged / log.name.replace("rank_0", "rank_1")).write_text(differs)
    page = report_tool.render_html(report_tool.read_trace(diverged))
    assert "compile 0/0: rank 1&#x27;s collectives on tp differ from rank 0&#x27;s" in page


def test_the_report_judges_ranks_collectives_by_the_checks_rule(trace_dir, tmp_path):
    """An all-to-all's sizes are each rank's own (a MoE's token counts): the ranks' check
    agrees on it, and the report, reading the same rule, shows no divergence; its op does count."""
    (log,) = trace_dir.glob("dedicated_log_torch_trace_rank_0_*.log")
    text = log.read_text()
    as_all_to_all = text.replace('"op": "all_reduce", "label": "all_reduce"', '"op": "all_to_all", "label": "all_to_all"')
    assert as_all_to_all != text
    other_sizes = as_all_to_all.replace('"bytes": 256, "data_dependent"', '"bytes": 512, "data_dependent"', 1)
    other_sizes = re.sub(r'("op": "all_to_all", "label": "all_to_all", "axis": "tp", "group_size": 4, "shape": )\[[^\]]*\]', r"\1[16, 8]", other_sizes, count=1)
    assert other_sizes != as_all_to_all
    for name, (zero, one) in {"sizes": (as_all_to_all, other_sizes), "op": (text, as_all_to_all)}.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / log.name).write_text(zero)
        (folder / log.name.replace("rank_0", "rank_1")).write_text(one)
        page = report_tool.render_html(report_tool.read_trace(folder))
        agreed = "all 2 ranks issue the same collectives in the same order" in page
        assert agreed == (name == "sizes"), name


def test_report_tool_puts_a_depyf_dump_beside_the_report(fake_world, trace_dir, tmp_path):
    mesh = fake_world(4, (4,), ("tp",))
    _, parallel, x = CASES["tp_mlp"].build(mesh)
    dump = tmp_path / "depyf"
    report = dtcompile.explain(parallel, depyf_dir=str(dump))(x)
    assert "== collectives ==" in str(report)
    assert any(p.name.startswith("full_code_for_") for p in dump.iterdir())
    out = tmp_path / "out"
    assert report_tool.main([str(trace_dir), "-o", str(out), "--depyf", str(dump)]) == 0
    page = (out / "index.html").read_text()
    assert 'id="depyf"' in page
    copied = sorted(p.name for p in (out / "depyf").iterdir())
    assert copied == sorted(p.name for p in dump.glob("*.py"))
    assert all(f'href="depyf/{name}"' in page for name in copied)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_tool.main([str(trace_dir), "-o", str(out), "--depyf", str(empty)]) == 2


def test_report_tool_refuses_a_missing_or_malformed_trace(tmp_path, capsys):
    assert report_tool.main([str(tmp_path / "nope"), "-o", str(tmp_path / "out")]) == 2
    assert "no such directory; pass the directory TORCH_TRACE pointed at" in capsys.readouterr().err
    assert report_tool.main([str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "no TORCH_TRACE logs (dedicated_log_torch_trace_rank_*.log)" in capsys.readouterr().err
    (tmp_path / "dedicated_log_torch_trace_rank_0_x.log").write_text("hello\n")
    assert report_tool.main([str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "dedicated_log_torch_trace_rank_0_x.log:1: not a TORCH_TRACE log line: 'hello'" in capsys.readouterr().err


@pytest.mark.subprocess
def test_report_command_is_installed(trace_dir, tmp_path):
    command = shutil.which("dtcompile-report")
    assert command is not None
    out = subprocess.run([command, str(trace_dir / "missing")], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such directory" in out.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian package 'chromium'; .ci/run installs it)")
@pytest.mark.subprocess
def test_report_renders_in_headless_chromium(trace_dir, tmp_path):
    assert report_tool.main([str(trace_dir), "-o", str(tmp_path)]) == 0
    url = (tmp_path / "index.html").as_uri()
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *_CHROMIUM_FLAGS, *profile, "--dump-dom", url], check=False, capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for section in ['id="summary"', 'id="divergence"', 'id="compile-0_0"', 'id="graph-breaks"', 'id="recompiles"']:
        assert section in dom.stdout
    # The browser parsed each graph's timeline as SVG: its bars are elements of the DOM.
    timelines = re.findall(r'<svg class="timeline".*?</svg>', dom.stdout, flags=re.S)
    assert len(timelines) >= 2
    assert any('<rect class="compute"' in svg for svg in timelines)
    assert any('<rect class="comm"' in svg for svg in timelines)
    assert "CONSOLE" not in dom.stderr and "Uncaught" not in dom.stderr
    shot = tmp_path / "report.png"
    run = subprocess.run(
        [CHROMIUM, *_CHROMIUM_FLAGS, *profile, f"--screenshot={shot}", "--window-size=1200,1600", url],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # A rendered page, not a blank one: a blank 1200x1600 PNG compresses to a few KB.
    assert len(data) > 20_000
