"""``dtcompile.hops.local_map``: one op from Dynamo to the backend, with its placements; numerics; bad input."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

import dtcompile
from dtcompile._testing.regions import BACKENDS, REGION_CASES, reference_step, run_case
from dtcompile.base.channels import Meta
from dtcompile.base.torch_compat import subclass_outer_size_from_inner
from dtcompile.graph.regions import format_with_regions
from dtcompile.hops import (
    LocalMapError,
    PlacementCheckError,
    RegionSpec,
    local_map,
    parse_placements,
)
from dtcompile.testing import simulated_world


def _mesh(fake_world, case):
    return fake_world(4, case.mesh_shape, case.mesh_names)


def _graphs(case_name, mesh):
    """The Dynamo graph and dtcompile's forward and backward AOT graphs as the passes saw
    them (regions not yet inlined), after one compiled step with backward."""
    case = REGION_CASES[case_name]
    backend = dtcompile.backend(inductor=False)
    dynamo = []

    def capture(gm, example_inputs):
        dynamo.append(format_with_regions(gm))
        return backend(gm, example_inputs)

    inputs = case.inputs(mesh, case.global_inputs())
    out = torch.compile(case.make(mesh), backend=capture, fullgraph=True)(*inputs)
    out.to_local().sum().backward()
    (forward,) = [r for r in backend.records if r.kind == "forward"]
    (backward,) = [r for r in backend.records if r.kind == "backward"]
    assert len(dynamo) == 1
    return dynamo[0], forward, backward


# ---------------------------------------------------------------- one op, with its placements


@pytest.mark.parametrize("case_name", list(REGION_CASES))
def test_region_is_one_op_in_every_graph(fake_world, case_name):
    """Dynamo, forward and backward graphs each hold exactly one region node, whose
    spec argument carries the declared placements (backward: gradients in/out)."""
    case = REGION_CASES[case_name]
    dynamo, forward, backward = _graphs(case_name, _mesh(fake_world, case))
    for text in (dynamo, forward.with_regions, backward.with_regions):
        assert sum(line.count(" = local_map[") for line in text.splitlines()) == 1, text
    assert len(forward.regions) == len(backward.regions) == 1
    fw_spec, bw_spec = forward.regions[0].spec, backward.regions[0].spec
    assert not fw_spec.backward and bw_spec.backward
    assert bw_spec.in_placements == fw_spec.out_placements
    assert bw_spec.out_placements == fw_spec.in_grad_placements
    # Lowered: no region left, every body op spliced in and tagged with its region.
    for record in (forward, backward):
        assert "local_map" not in record.graph.code
        tagged = [n for n in record.graph.graph.nodes if n.meta.get(Meta.REGION)]
        assert len(tagged) == record.regions[0].ops


# ---------------------------------------------------------------- the graphs, pinned


def test_sharded_pointwise_graphs(fake_world):
    dynamo, forward, backward = _graphs(
        "sharded_pointwise", _mesh(fake_world, REGION_CASES["sharded_pointwise"])
    )
    assert_expected_inline(
        dynamo,
        """\
gelu_scale = local_map[gelu_scale on (tp=4): [S(0)] -> [S(0)] | grads [S(0)]](l_x_)
    def local_map_body_0(x):
        gelu = gelu(x)
        mul = mul(gelu, 3.0)
        return (mul,)
getitem = getitem(gelu_scale, 0)
add = add(getitem, 1.0)""",
    )
    assert_expected_inline(
        forward.with_regions,
        """\
view = aten.view.default(primals_1, [2, 6])
gelu_scale = local_map[gelu_scale on (tp=4): [S(0)] -> [S(0)] | grads [S(0)] | saved 1](view)
    def local_map_body_0(arg0_1):
        mul = aten.mul.Tensor(arg0_1, 0.5)
        mul_1 = aten.mul.Tensor(arg0_1, 0.7071067811865476)
        erf = aten.erf.default(mul_1)
        add = aten.add.Tensor(erf, 1)
        mul_2 = aten.mul.Tensor(mul, add)
        mul_3 = aten.mul.Tensor(mul_2, 3.0)
        return (mul_3, arg0_1)
getitem = getitem(gelu_scale, 0)
getitem_1 = getitem(gelu_scale, 1)
view_1 = aten.view.default(getitem, [2, 6])
add = aten.add.Tensor(view_1, 1.0)""",
    )
    assert_expected_inline(
        backward.with_regions,
        """\
gelu_scale_1 = local_map[gelu_scale on (tp=4): [S(0)] -> [S(0)] | grads [S(0)] | saved 1 | backward](getitem_1, tangents_1)
    def local_map_backward_0(arg0_1, arg1_1):
        mul = aten.mul.Tensor(arg1_1, 3.0)
        mul_1 = aten.mul.Tensor(arg0_1, 0.7071067811865476)
        erf = aten.erf.default(mul_1)
        add = aten.add.Tensor(erf, 1)
        mul_2 = aten.mul.Tensor(add, 0.5)
        mul_3 = aten.mul.Tensor(arg0_1, arg0_1)
        mul_4 = aten.mul.Tensor(mul_3, -0.5)
        exp = aten.exp.default(mul_4)
        mul_5 = aten.mul.Tensor(exp, 0.3989422804014327)
        mul_6 = aten.mul.Tensor(arg0_1, mul_5)
        add_1 = aten.add.Tensor(mul_2, mul_6)
        mul_7 = aten.mul.Tensor(mul, add_1)
        return (mul_7,)
getitem_2 = getitem(gelu_scale_1, 0)
view_2 = aten.view.default(getitem_2, [2, 6])""",
    )


def test_replicated_linear_graphs(fake_world):
    dynamo, forward, backward = _graphs(
        "replicated_linear", _mesh(fake_world, REGION_CASES["replicated_linear"])
    )
    assert_expected_inline(
        dynamo,
        """\
linear = local_map[linear on (tp=4): [R, R, R] -> [R] | grads [R, R, R]](l_x_, l_w_, l_b_)
    def local_map_body_0(x, w, b):
        linear = linear(x, w, b)
        return (linear,)
getitem = getitem(linear, 0)
tanh = .tanh(getitem)""",
    )
    assert_expected_inline(
        forward.with_regions,
        """\
view = aten.view.default(primals_1, [4, 6])
view_1 = aten.view.default(primals_3, [5, 6])
view_2 = aten.view.default(primals_5, [5])
linear = local_map[linear on (tp=4): [R, R, R] -> [R] | grads [R, R, R] | saved 2](view, view_1, view_2)
    def local_map_body_0(arg0_1, arg1_1, arg2_1):
        permute = aten.permute.default(arg1_1, [1, 0])
        clone = aten.clone.default(permute, memory_format=torch.contiguous_format)
        addmm = aten.addmm.default(arg2_1, arg0_1, clone)
        return (addmm, arg0_1, clone)
getitem = getitem(linear, 0)
getitem_1 = getitem(linear, 1)
getitem_2 = getitem(linear, 2)
view_3 = aten.view.default(getitem, [4, 5])
tanh = aten.tanh.default(view_3)""",
    )
    assert_expected_inline(
        backward.with_regions,
        """\
alias = aten.alias.default(tanh)
alias_1 = aten.alias.default(alias)
mul = aten.mul.Tensor(alias_1, alias_1)
sub = aten.sub.Tensor(1, mul)
mul_1 = aten.mul.Tensor(tangents_1, sub)
linear_1 = local_map[linear on (tp=4): [R] -> [R, R, R] | grads [R, R, R] | saved 2 | backward](getitem_1, getitem_2, mul_1)
    def local_map_backward_0(arg0_1, arg1_1, arg2_1):
        permute = aten.permute.default(arg1_1, [1, 0])
        clone = aten.clone.default(permute, memory_format=torch.contiguous_format)
        mm = aten.mm.default(arg2_1, clone)
        permute_1 = aten.permute.default(arg2_1, [1, 0])
        clone_1 = aten.clone.default(permute_1, memory_format=torch.contiguous_format)
        mm_1 = aten.mm.default(clone_1, arg0_1)
        permute_2 = aten.permute.default(mm_1, [1, 0])
        clone_2 = aten.clone.default(permute_2, memory_format=torch.contiguous_format)
        sum_1 = aten.sum.dim_IntList(arg2_1, [0], True)
        view = aten.view.default(sum_1, [5])
        clone_3 = aten.clone.default(view)
        permute_3 = aten.permute.default(clone_2, [1, 0])
        clone_4 = aten.clone.default(permute_3, memory_format=torch.contiguous_format)
        return (mm, clone_4, clone_3)
getitem_3 = getitem(linear_1, 0)
getitem_4 = getitem(linear_1, 1)
getitem_5 = getitem(linear_1, 2)
view_4 = aten.view.default(getitem_5, [5])
view_5 = aten.view.default(getitem_4, [5, 6])
view_6 = aten.view.default(getitem_3, [4, 6])""",
    )


def test_cp_attention_graphs(fake_world):
    dynamo, forward, backward = _graphs(
        "cp_attention", _mesh(fake_world, REGION_CASES["cp_attention"])
    )
    assert_expected_inline(
        dynamo,
        """\
attention = local_map[attention on (dp=2, cp=2): [S(0)S(1), S(0)R, S(0)R] -> [S(0)S(1)] | grads [S(0)S(1), S(0)P(sum), S(0)P(sum)]](l_q_, l_k_, l_v_)
    def local_map_body_0(q, k, v):
        transpose = .transpose(k, -2, -1)
        matmul = matmul(q, transpose)
        scores = truediv(matmul, 2.449489742783178)
        softmax = softmax(scores, dim=-1)
        matmul_1 = matmul(softmax, v)
        return (matmul_1,)
getitem = getitem(attention, 0)
mul = mul(getitem, 0.5)""",
    )
    assert_expected_inline(
        forward.with_regions,
        """\
view = aten.view.default(primals_1, [2, 4, 6])
view_1 = aten.view.default(primals_3, [2, 8, 6])
view_2 = aten.view.default(primals_5, [2, 8, 6])
attention = local_map[attention on (dp=2, cp=2): [S(0)S(1), S(0)R, S(0)R] -> [S(0)S(1)] | grads [S(0)S(1), S(0)P(sum), S(0)P(sum)] | saved 5](view, view_1, view_2)
    def local_map_body_0(arg0_1, arg1_1, arg2_1):
        permute = aten.permute.default(arg1_1, [0, 2, 1])
        clone = aten.clone.default(permute, memory_format=torch.contiguous_format)
        expand = aten.expand.default(arg0_1, [2, 4, 6])
        clone_1 = aten.clone.default(expand, memory_format=torch.contiguous_format)
        view = aten.view.default(clone_1, [2, 4, 6])
        clone_2 = aten.clone.default(view)
        expand_1 = aten.expand.default(clone, [2, 6, 8])
        clone_3 = aten.clone.default(expand_1, memory_format=torch.contiguous_format)
        view_1 = aten.view.default(clone_3, [2, 6, 8])
        clone_4 = aten.clone.default(view_1)
        bmm = aten.bmm.default(clone_2, clone_4)
        view_2 = aten.view.default(bmm, [2, 4, 8])
        clone_5 = aten.clone.default(view_2)
        div = aten.div.Tensor(clone_5, 2.449489742783178)
        amax = aten.amax.default(div, [-1], True)
        sub = aten.sub.Tensor(div, amax)
        exp = aten.exp.default(sub)
        sum_1 = aten.sum.dim_IntList(exp, [-1], True)
        div_1 = aten.div.Tensor(exp, sum_1)
        expand_2 = aten.expand.default(div_1, [2, 4, 8])
        clone_6 = aten.clone.default(expand_2, memory_format=torch.contiguous_format)
        view_3 = aten.view.default(clone_6, [2, 4, 8])
        clone_7 = aten.clone.default(view_3)
        expand_3 = aten.expand.default(arg2_1, [2, 8, 6])
        clone_8 = aten.clone.default(expand_3, memory_format=torch.contiguous_format)
        view_4 = aten.view.default(clone_8, [2, 8, 6])
        clone_9 = aten.clone.default(view_4)
        bmm_1 = aten.bmm.default(clone_7, clone_9)
        view_5 = aten.view.default(bmm_1, [2, 4, 6])
        clone_10 = aten.clone.default(view_5)
        return (clone_10, clone_2, clone_4, div_1, clone_7, clone_9)
getitem = getitem(attention, 0)
getitem_1 = getitem(attention, 1)
getitem_2 = getitem(attention, 2)
getitem_3 = getitem(attention, 3)
getitem_4 = getitem(attention, 4)
getitem_5 = getitem(attention, 5)
view_3 = aten.view.default(getitem, [2, 4, 6])
mul = aten.mul.Tensor(view_3, 0.5)""",
    )
    assert_expected_inline(
        backward.with_regions,
        """\
mul_1 = aten.mul.Tensor(tangents_1, 0.5)
attention_1 = local_map[attention on (dp=2, cp=2): [S(0)S(1)] -> [S(0)S(1), S(0)P(sum), S(0)P(sum)] | grads [S(0)S(1), S(0)P(sum), S(0)P(sum)] | saved 5 | backward](getitem_1, getitem_2, getitem_3, getitem_4, getitem_5, mul_1)
    def local_map_backward_0(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1):
        alias = aten.alias.default(arg2_1)
        clone = aten.clone.default(alias, memory_format=torch.contiguous_format)
        view = aten.view.default(arg5_1, [2, 4, 6])
        clone_1 = aten.clone.default(view)
        permute = aten.permute.default(arg3_1, [0, 2, 1])
        clone_2 = aten.clone.default(permute, memory_format=torch.contiguous_format)
        bmm = aten.bmm.default(clone_2, clone_1)
        permute_1 = aten.permute.default(arg4_1, [0, 2, 1])
        clone_3 = aten.clone.default(permute_1, memory_format=torch.contiguous_format)
        bmm_1 = aten.bmm.default(clone_1, clone_3)
        view_1 = aten.view.default(bmm, [2, 8, 6])
        clone_4 = aten.clone.default(view_1)
        view_2 = aten.view.default(bmm_1, [2, 4, 8])
        clone_5 = aten.clone.default(view_2)
        alias_1 = aten.alias.default(clone)
        clone_6 = aten.clone.default(alias_1, memory_format=torch.contiguous_format)
        mul = aten.mul.Tensor(clone_5, clone_6)
        sum_1 = aten.sum.dim_IntList(mul, [-1], True)
        neg = aten.neg.default(clone_6)
        fma = prims.fma.default(neg, sum_1, mul)
        div = aten.div.Tensor(fma, 2.449489742783178)
        view_3 = aten.view.default(div, [2, 4, 8])
        clone_7 = aten.clone.default(view_3)
        permute_2 = aten.permute.default(arg0_1, [0, 2, 1])
        clone_8 = aten.clone.default(permute_2, memory_format=torch.contiguous_format)
        bmm_2 = aten.bmm.default(clone_8, clone_7)
        permute_3 = aten.permute.default(arg1_1, [0, 2, 1])
        clone_9 = aten.clone.default(permute_3, memory_format=torch.contiguous_format)
        bmm_3 = aten.bmm.default(clone_7, clone_9)
        view_4 = aten.view.default(bmm_2, [2, 6, 8])
        clone_10 = aten.clone.default(view_4)
        view_5 = aten.view.default(bmm_3, [2, 4, 6])
        clone_11 = aten.clone.default(view_5)
        permute_4 = aten.permute.default(clone_10, [0, 2, 1])
        clone_12 = aten.clone.default(permute_4, memory_format=torch.contiguous_format)
        return (clone_11, clone_12, clone_4)
getitem_6 = getitem(attention_1, 0)
getitem_7 = getitem(attention_1, 1)
getitem_8 = getitem(attention_1, 2)
view_4 = aten.view.default(getitem_8, [2, 8, 6])
view_5 = aten.view.default(getitem_7, [2, 8, 6])
view_6 = aten.view.default(getitem_6, [2, 4, 6])""",
    )


def test_region_with_collective_graphs(fake_world):
    dynamo, forward, backward = _graphs(
        "region_with_collective",
        _mesh(fake_world, REGION_CASES["region_with_collective"]),
    )
    assert_expected_inline(
        dynamo,
        """\
gather_matmul = local_map[gather_matmul on (tp=4): [S(0), S(1)] -> [S(1)] | grads [S(0), S(1)]](l_x_, l_w_)
    def local_map_body_0(x, w):
        tensor = _c10d_functional.all_gather_into_tensor(x, 4, '0')
        res = _c10d_functional.wait_tensor(tensor)
        matmul = matmul(res, w)
        return (matmul,)
getitem = getitem(gather_matmul, 0)
relu = .relu(getitem)""",
    )
    assert_expected_inline(
        forward.with_regions,
        """\
view = aten.view.default(primals_1, [2, 6])
view_1 = aten.view.default(primals_3, [6, 2])
gather_matmul = local_map[gather_matmul on (tp=4): [S(0), S(1)] -> [S(1)] | grads [S(0), S(1)] | saved 2](view, view_1)
    def local_map_body_0(arg0_1, arg1_1):
        all_gather_into_tensor = _c10d_functional.all_gather_into_tensor.default(arg0_1, 4, '0')
        wait_tensor = _c10d_functional.wait_tensor.default(all_gather_into_tensor)
        mm = aten.mm.default(wait_tensor, arg1_1)
        return (mm, arg1_1, wait_tensor)
getitem = getitem(gather_matmul, 0)
getitem_1 = getitem(gather_matmul, 1)
getitem_2 = getitem(gather_matmul, 2)
view_2 = aten.view.default(getitem, [8, 2])
relu = aten.relu.default(view_2)
alias = aten.alias.default(relu)
alias_1 = aten.alias.default(alias)
le = aten.le.Scalar(alias_1, 0)""",
    )
    assert_expected_inline(
        backward.with_regions,
        """\
scalar_tensor = aten.scalar_tensor.default(0, dtype=torch.float32, layout=torch.strided, device=device(type='cpu'))
where = aten.where.self(le, scalar_tensor, tangents_1)
gather_matmul_1 = local_map[gather_matmul on (tp=4): [S(1)] -> [S(0), S(1)] | grads [S(0), S(1)] | saved 2 | backward](getitem_1, getitem_2, where)
    def local_map_backward_0(arg0_1, arg1_1, arg2_1):
        permute = aten.permute.default(arg1_1, [1, 0])
        clone = aten.clone.default(permute, memory_format=torch.contiguous_format)
        mm = aten.mm.default(clone, arg2_1)
        permute_1 = aten.permute.default(arg0_1, [1, 0])
        clone_1 = aten.clone.default(permute_1, memory_format=torch.contiguous_format)
        mm_1 = aten.mm.default(arg2_1, clone_1)
        reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor.default(mm_1, 'sum', 4, '0')
        wait_tensor = _c10d_functional.wait_tensor.default(reduce_scatter_tensor)
        return (wait_tensor, mm)
getitem_3 = getitem(gather_matmul_1, 0)
getitem_4 = getitem(gather_matmul_1, 1)
view_3 = aten.view.default(getitem_4, [6, 2])
view_4 = aten.view.default(getitem_3, [2, 6])""",
    )


# ---------------------------------------------------------------- numerics


def _values_per_rank(t):
    from torch.distributed._local_tensor import LocalTensor

    return dict(t._local_tensors) if isinstance(t, LocalTensor) else {0: t}


def _assert_close(got, want, what):
    labels = ["output", *(f"grad of input {i}" for i in range(len(want) - 1))]
    for label, g, w in zip(labels, got, want):
        for rank, value in _values_per_rank(g).items():
            torch.testing.assert_close(
                value,
                w,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, r=rank, l=label: f"{what}, rank {r}, {l}: {m}",
            )


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.inductor) if b in ("inductor", "dtcompile_inductor") else b for b in BACKENDS]
)
@pytest.mark.parametrize("case_name", list(REGION_CASES))
def test_simulated_ranks_match_reference(case_name, backend):
    """On LocalTensorMode (4 ranks; the attention case on a 2x2 mesh): output and
    gradients, compiled and eager, equal the single-process reference on every rank."""
    case = REGION_CASES[case_name]
    tensors = case.global_inputs()
    want = reference_step(case, tensors)
    with simulated_world(4, case.mesh_shape, case.mesh_names) as mesh:
        got = run_case(case, mesh, tensors, backend)
        _assert_close(got, want, f"{case_name} ({backend})")


@pytest.mark.gloo
def test_gloo_two_ranks_match_reference():
    """Real ranks (gloo, 127.0.0.1): every case under every backend equals eager and the reference."""
    from dtcompile._testing.regions import gloo_rank
    from dtcompile.testing import run_gloo

    backends = list(BACKENDS)
    per_rank = run_gloo(2, gloo_rank, 2, backends, timeout=900)
    for case_name, case in REGION_CASES.items():
        want = reference_step(case, case.global_inputs())
        for backend in backends:
            for rank, results in enumerate(per_rank):
                _assert_close(
                    results[case_name, backend],
                    want,
                    f"{case_name} ({backend}) on gloo rank {rank}",
                )


# ---------------------------------------------------------------- bad input


def _bad_calls(mesh, mesh2d):
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(8, 4), mesh2d, [Shard(0), Replicate()])

    def add_one(a, b=None):
        return a + 1

    def two_outputs(a):
        return a + 1, a * 2

    return {
        "wrong number of placements": (
            local_map(add_one, [Shard(0)], ([Shard(0)], [Shard(0)]), device_mesh=mesh),
            (x,),
            [
                "in_placements has 2 entries but the region has 1 input",
                "give one placement tuple per input",
            ],
        ),
        "placements longer than the mesh": (
            local_map(
                add_one, [Shard(0)], ([Shard(0), Replicate()],), device_mesh=mesh
            ),
            (x,),
            [
                "in_placements[0] = (Shard(dim=0), Replicate()) has 2 placements but the mesh has 1 axis",
                "give one placement per mesh axis",
            ],
        ),
        "input on another mesh": (
            local_map(add_one, [Shard(0)], ([Shard(0)], [Shard(0)]), device_mesh=mesh),
            (x, y),
            [
                "input 1 is a DTensor on DeviceMesh((dp=2, tp=2))",
                "device_mesh is DeviceMesh((tp=4))",
                "redistribute it onto the region's mesh",
            ],
        ),
        "mismatched input placements": (
            local_map(add_one, [Shard(0)], ([Replicate()],), device_mesh=mesh),
            (x,),
            [
                "input 0 has placements S(0) but in_placements[0] is R",
                "pass redistribute_inputs=True",
            ],
        ),
        "more outputs than declared": (
            local_map(two_outputs, [Shard(0)], ([Shard(0)],), device_mesh=mesh),
            (x,),
            [
                "local_map two_outputs: the region returned 2 outputs",
                "out_placements declares 1",
                "give one placement tuple (None for a non-tensor) per output",
            ],
        ),
    }


@pytest.mark.parametrize(
    "label",
    [
        "wrong number of placements",
        "placements longer than the mesh",
        "input on another mesh",
        "mismatched input placements",
        "more outputs than declared",
    ],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_input_names_the_argument_and_the_fix(fake_world, label, compiled):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = fake_world(4, (4,), ("tp",))
    fn, args, phrases = _bad_calls(
        mesh, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    )[label]
    if compiled:
        fn = torch.compile(
            fn, backend=dtcompile.backend(inductor=False), fullgraph=True
        )
        error = torch._dynamo.exc.Unsupported
    else:
        error = LocalMapError
    with pytest.raises(error) as info:
        fn(*args)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


def test_side_effects_in_a_region_are_refused(tp_mesh):
    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    log = []

    @local_map(
        out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=tp_mesh
    )
    def logs(a):
        log.append(a.shape)
        return a + 1

    @local_map(
        out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=tp_mesh
    )
    def writes_input(a):
        a.add_(1)
        return a * 2

    for region in (logs, writes_input):
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            torch.compile(
                region, backend=dtcompile.backend(inductor=False), fullgraph=True
            )(x)
        assert "dtcompile: side effect inside a local_map region" in str(info.value)
        assert "a region must be a pure function of its arguments" in str(info.value)
        assert "Return new tensors instead of writing into inputs" in str(info.value)


def test_closing_over_a_dtensor_is_refused(tp_mesh):
    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    z = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])

    @local_map(
        out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=tp_mesh
    )
    def uses_z(a):
        return a + z.to_local()

    with pytest.raises(
        torch._dynamo.exc.Unsupported, match="Pass it as an argument of the region"
    ):
        torch.compile(
            uses_z, backend=dtcompile.backend(inductor=False), fullgraph=True
        )(x)


# ---------------------------------------------------------------- check_placements


def _sum_rows(mesh, reduce):
    import torch.distributed._functional_collectives as funcol

    @local_map(
        out_placements=[Replicate()],
        in_placements=([Shard(0)],),
        device_mesh=mesh,
        check_placements=True,
    )
    def sum_rows(a):
        partial = a.sum(0)
        return funcol.all_reduce(partial, "sum", (mesh, 0)) if reduce else partial

    return sum_rows


def test_check_placements_catches_a_forgotten_all_reduce():
    x = torch.randn(8, 4)
    with simulated_world(4, (4,), ("tp",)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0)])
        with pytest.raises(PlacementCheckError) as info:
            _sum_rows(mesh, reduce=False)(dx)
        assert (
            "local_map sum_rows: output 0 is declared R (Replicate on mesh axis 'tp')"
            in str(info.value)
        )
        assert "but differs between ranks 0 and 1" in str(info.value)
        assert "funcol.all_reduce over 'tp') or declare it Partial()" in str(info.value)
        out = _sum_rows(mesh, reduce=True)(dx)
        for value in _values_per_rank(out.to_local()).values():
            torch.testing.assert_close(value, x.sum(0))


def test_check_placements_checks_each_axis_of_a_2d_mesh():
    """Replicate on dp, Shard on tp: each dp group must agree, the tp shards may differ."""
    x = torch.randn(4, 8)
    with simulated_world(4, (2, 2), ("dp", "tp")) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        region = local_map(
            lambda a: a.sum(0, keepdim=True),
            [Replicate(), Shard(1)],
            ([Shard(0), Shard(1)],),
            check_placements=True,
        )
        with pytest.raises(PlacementCheckError, match="Replicate on mesh axis 'dp'"):
            region(dx)
        fixed = local_map(
            lambda a: a.sum(0, keepdim=True) * 0 + 1,
            [Replicate(), Shard(1)],
            ([Shard(0), Shard(1)],),
            check_placements=True,
        )
        assert fixed(dx).shape == (1, 8)


def test_check_placements_catches_inconsistent_shard_shapes():
    x = torch.randn(7, 4)  # rows 2, 2, 2, 1 on the four ranks
    with simulated_world(4, (4,), ("tp",)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0)])
        transposed = local_map(
            lambda a: a.t().contiguous(),
            [Shard(0)],
            ([Shard(0)],),
            check_placements=True,
        )
        with pytest.raises(PlacementCheckError) as info:
            transposed(dx)
        assert "output 0 is declared S(0) (Shard(0) on mesh axis 'tp')" in str(
            info.value
        )
        assert "shards may differ only along dim 0" in str(info.value)


def test_check_placements_needs_simulated_ranks(tp_mesh):
    dx = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    with pytest.raises(
        PlacementCheckError,
        match="run the region under torch.distributed._local_tensor.LocalTensorMode",
    ):
        _sum_rows(tp_mesh, reduce=False)(dx)


def test_check_placements_in_compiled_code_runs_eagerly(tp_mesh):
    dx = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    with pytest.raises(
        torch._dynamo.exc.Unsupported,
        match="check_placements compares each output across all simulated ranks",
    ):
        torch.compile(
            _sum_rows(tp_mesh, reduce=True),
            backend=dtcompile.backend(inductor=False),
            fullgraph=True,
        )(dx)


# ---------------------------------------------------------------- what a region may take and return


def _compiled_matches_eager(fn, *args):
    """``fn`` compiled (one graph, one region node) equals eager, per output leaf and rank."""
    from torch.utils._pytree import tree_leaves

    from dtcompile.testing import assert_no_graph_breaks

    backend = dtcompile.backend(inductor=False)
    with assert_no_graph_breaks():
        got = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    want = fn(*args)
    got_leaves, want_leaves = tree_leaves(got), tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert type(g) is type(w)
        if isinstance(w, DTensor):
            assert g.placements == w.placements and g.device_mesh is w.device_mesh
            for rank, value in _values_per_rank(g.to_local()).items():
                torch.testing.assert_close(value, _values_per_rank(w.to_local())[rank])
        else:
            assert g == w
    (record,) = [r for r in backend.records if r.kind in ("forward", "inference")]
    assert len(record.regions) == 1
    return got, record.regions[0].spec


def test_non_tensor_arguments_anywhere_nested_outputs_and_inferred_mesh(tp_mesh):
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    dx = distribute_tensor(x, tp_mesh, [Shard(0)])
    dy = distribute_tensor(y, tp_mesh, [Replicate()])

    # No device_mesh: the mesh of the DTensor inputs.  Inputs nested in a tuple,
    # a float first and a string last; outputs nested, with a non-tensor among them.
    @local_map(
        out_placements=([Shard(0)], None, [Shard(0)], [Replicate()]),
        in_placements=(None, [Shard(0)], [Replicate()], None),
    )
    def region(scale, pair, mode):
        a, b = pair
        assert mode == "sum"
        return (a * scale, "done", [a + b[: a.shape[0]], b * 2])

    def fn(a, b):
        out, tag, (total, doubled) = region(3.0, (a, b), "sum")
        return out, tag, total, doubled

    (out, tag, total, _doubled), spec = _compiled_matches_eager(fn, dx, dy)
    assert tag == "done"
    assert spec.mesh == "(tp=4)"
    assert spec.in_placements == ("S(0)", "R")
    assert spec.out_placements == ("S(0)", "S(0)", "R")
    # This process is rank 0 of the fake world: its shard of x is the first 2 rows.
    torch.testing.assert_close(out.to_local(), x[:2] * 3.0)
    torch.testing.assert_close(total.to_local(), x[:2] + y[:2])


def test_plain_tensor_inputs_and_closures_are_operands_without_placements(tp_mesh):
    x, bias = torch.randn(8, 4), torch.randn(4)
    dx = distribute_tensor(x, tp_mesh, [Shard(0)])
    scale = torch.full((4,), 2.0)  # a plain tensor the region closes over

    @local_map(
        out_placements=[Shard(0)],
        in_placements=([Shard(0)], [Replicate()]),
        device_mesh=tp_mesh,
    )
    def region(a, b):
        return a * scale + b

    out, spec = _compiled_matches_eager(lambda a: region(a, bias), dx)
    # The plain tensor argument keeps its declared placement; the closure is lifted
    # as an operand with none ("-").
    assert spec.in_placements == ("S(0)", "R", None)
    torch.testing.assert_close(out.to_local(), x[:2] * 2.0 + bias)


def test_a_call_without_dtensors_calls_the_function():
    region = local_map(lambda a: a * 2, [Replicate()], ([Replicate()],))
    x = torch.randn(3)
    out = torch.compile(
        region, backend=dtcompile.backend(inductor=False), fullgraph=True
    )(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, x * 2)


def test_redistribute_inputs_redistributes_in_the_graph(tp_mesh):
    x = torch.randn(8, 4)
    dx = distribute_tensor(x, tp_mesh, [Replicate()])
    region = local_map(
        lambda a: a * 2,
        [Shard(0)],
        ([Shard(0)],),
        device_mesh=tp_mesh,
        redistribute_inputs=True,
    )
    backend = dtcompile.backend(inductor=False)
    out = torch.compile(region, backend=backend, fullgraph=True)(dx)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.to_local(), x[:2] * 2)  # rank 0's shard
    (record,) = backend.records
    assert record.regions[0].spec.redistribute_inputs
    assert record.regions[0].spec.in_placements == ("S(0)",)
    # Replicate -> Shard(0) is a local slice before the region, not inside it.
    assert record.with_regions.index("split") < record.with_regions.index(
        "= local_map["
    )


@pytest.mark.xfail(
    subclass_outer_size_from_inner(),
    reason="torch >= 2.14 specializes a Replicate DTensor's dynamic shard mid-trace "
    "(dtcompile.base.torch_compat.subclass_outer_size_from_inner); the recompile's graph fails at run time",
    strict=True,
    # The recompile's run raises 'expected between 3 and 4 wrapped outputs, got 2' where the
    # test expects the recompile reason: pytest.raises(match=...) fails with an AssertionError.
    raises=AssertionError,
)
def test_same_placements_do_not_recompile_other_placements_do(tp_mesh):
    from dtcompile.testing import assert_no_recompiles

    region = local_map(
        lambda a: a + 1,
        [Shard(0)],
        ([Shard(0)],),
        device_mesh=tp_mesh,
        redistribute_inputs=True,
    )
    compiled = torch.compile(
        region, backend=dtcompile.backend(inductor=False), fullgraph=True
    )
    compiled(distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)]))
    with assert_no_recompiles():
        compiled(distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)]))
    changed = (
        r"placements of args\[0\] changed: \(Shard\(dim=0\),\) -> \(Replicate\(\),\)"
    )
    with pytest.raises(AssertionError, match=changed), assert_no_recompiles():
        compiled(distribute_tensor(torch.randn(8, 4), tp_mesh, [Replicate()]))


def test_dtcompile_exports_local_map_and_it_matches_torchs_eager_local_map():
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    assert dtcompile.local_map is local_map
    import torch.distributed._functional_collectives as funcol

    x, w = torch.randn(8, 6), torch.randn(6, 8)
    with simulated_world(4, (4,), ("tp",)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()

        def gather_matmul(a, b):
            return funcol.all_gather_single(a, 0, (mesh, 0)) @ b

        results = []
        for make in (torch_local_map, dtcompile.local_map):
            region = make(
                gather_matmul,
                out_placements=[Shard(1)],
                in_placements=([Shard(0)], [Shard(1)]),
                device_mesh=mesh,
            )
            out = region(dx, dw).full_tensor()
            out.sum().backward()
            results.append([out, dx.grad.full_tensor(), dw.grad.full_tensor()])
            dx.grad = dw.grad = None
        for ours, theirs in zip(*results):
            for rank, value in _values_per_rank(ours).items():
                torch.testing.assert_close(value, _values_per_rank(theirs)[rank])
        torch.testing.assert_close(_values_per_rank(results[1][0])[0], x @ w)


def test_spec_text_round_trips():
    spec = RegionSpec(
        "attn",
        "(dp=2, cp=2)",
        ("S(0)S(1)", "S(0)R", None),
        ("S(0)S(1)",),
        ("S(0)S(1)", "S(0)P(sum)", None),
        True,
        True,
        3,
    )
    assert str(spec) == (
        "attn on (dp=2, cp=2): [S(0)S(1), S(0)R, -] -> [S(0)S(1)] | grads [S(0)S(1), S(0)P(sum), -] "
        "| saved 3 | backward | redistribute"
    )
    assert RegionSpec.parse(str(spec)) == spec
    from torch.distributed.tensor.placement_types import _StridedShard

    assert parse_placements("_S(0,2)RP(max)") == (
        _StridedShard(0, split_factor=2),
        Replicate(),
        Partial("max"),
    )


def test_regions_are_counted_and_named_in_what_dtcompile_logs(fake_world, caplog):
    import logging

    from dtcompile.artifacts import collectives_json, format_compiled_graph

    case = REGION_CASES["region_with_collective"]
    with caplog.at_level(logging.INFO, logger="dtcompile.compiler"):
        _, forward, backward = _graphs(
            "region_with_collective", _mesh(fake_world, case)
        )
    logged = caplog.text
    assert "forward graph: " in logged and "1 local_map regions" in logged
    assert (
        "region gather_matmul: gather_matmul on (tp=4): [S(0), S(1)] -> [S(1)]"
        in logged
    )
    assert (
        "backward graph: region gather_matmul_1: gather_matmul on (tp=4): [S(1)] -> [S(0), S(1)]"
        in logged
    )
    (fw_region,) = collectives_json(forward)["regions"]
    assert fw_region["name"] == "gather_matmul" and fw_region["ops"] == 3
    assert fw_region["collectives"] == ["all_gather[tp] x4 192 B"]
    (bw_region,) = collectives_json(backward)["regions"]
    assert bw_region["collectives"] == ["reduce_scatter[tp] x4 192 B"]
    report = format_compiled_graph(backward)
    assert "-- local_map regions (one op each until lowering) --" in report
    # Lowered, the region's collective is one of the graph's, costed and tagged with the
    # region; its other nodes name the region's Dynamo node, as does the placement view,
    # which charges it the region's collectives, forward and backward.
    annotated = backward.annotated()
    assert (
        "# reduce_scatter[tp] x4 192 B ~8.4 us (h100); in local_map region gather_matmul (gather_matmul_1)"
        in annotated
    )
    assert (
        "# grad of gather_matmul: Spec(f32[8, 8](S(1))); in local_map region gather_matmul (gather_matmul_1)"
        in annotated
    )
    (region_line,) = [line for line in backward.info.format().splitlines() if line.startswith("gather_matmul = ")]
    assert region_line.endswith("# forward all_gather[tp] x4 192 B ~8.4 us; backward reduce_scatter[tp] x4 192 B ~8.4 us")


def test_a_user_placement_subclass_is_refused_not_taken_for_partial(tp_mesh):
    class MyPartial(Partial):
        pass

    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    region = local_map(
        lambda a: a * 2, [MyPartial()], ([Shard(0)],), device_mesh=tp_mesh
    )
    with pytest.raises(
        LocalMapError,
        match=r"out_placements\[0\]: placement Partial\(sum\) \(MyPartial\) cannot be a region placement",
    ):
        region(x)


@pytest.mark.parametrize("backend", ["dtcompile", "aot_eager"])
def test_several_outputs_backward_and_gradients_carry_the_users_mesh(tp_mesh, backend):
    """Stock's inlined local_map crashed the partitioner here ("Node tangents_2 was invalid,
    but is output") and handed gradients a trace-time fake mesh."""
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    @local_map(
        out_placements=([Shard(0)], [Shard(0)], [Shard(0)]),
        in_placements=([Shard(0)], [Shard(0)]),
    )
    def three(a, b):
        return a * b, a.sin(), b.exp()

    def fn(a, b):
        p, s, e = three(a, b)
        return (p + s * e).sum(dim=1)

    grads = []
    for compiled in (False, True):
        dx = distribute_tensor(x, tp_mesh, [Shard(0)]).requires_grad_()
        dy = distribute_tensor(y, tp_mesh, [Shard(0)]).requires_grad_()
        f = (
            torch.compile(fn, backend=BACKENDS[backend](), fullgraph=True)
            if compiled
            else fn
        )
        f(dx, dy).to_local().sum().backward()
        assert dx.grad.device_mesh is tp_mesh and dy.grad.device_mesh is tp_mesh
        grads.append((dx.grad.to_local(), dy.grad.to_local()))
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)
    a, b = x[:2], y[:2]  # rank 0's shards
    torch.testing.assert_close(grads[1][0], b + a.cos() * b.exp())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_output_kinds_must_match_out_placements(tp_mesh, compiled):
    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)])
    cases = [
        (
            lambda a: (a + 1, a * 2),
            ([Shard(0)], None),
            "output 1 is a tensor but out_placements[1] is None",
        ),
        (
            lambda a: (a + 1, "tag"),
            ([Shard(0)], [Shard(0)]),
            "output 1 is not a tensor but out_placements[1] is S(0)",
        ),
    ]
    for func, out_placements, phrase in cases:
        torch._dynamo.reset()
        fn = local_map(func, out_placements, ([Shard(0)],), device_mesh=tp_mesh)
        if compiled:
            fn = torch.compile(
                fn, backend=dtcompile.backend(inductor=False), fullgraph=True
            )
        with pytest.raises(
            torch._dynamo.exc.Unsupported if compiled else LocalMapError
        ) as info:
            fn(x)
        assert phrase in str(info.value), str(info.value)


# ---------------------------------------------------------------- dynamic shapes


def _gelu_mm(x, w):
    return torch.nn.functional.gelu(x @ w)


def _dynamic_rank(rank: int) -> tuple[list[float], int, list[str]]:
    """Three batch sizes through one ``dynamic=True`` compile of a kept region (real
    collectives on threads): the largest error against the single-process step
    for each, the frames compiled, and the region specs the backend saw."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    region = local_map(
        _gelu_mm,
        [Shard(0)],
        ([Shard(0)], [Replicate()]),
        ([Shard(0)], [Partial()]),
        device_mesh=mesh,
    )
    backend = dtcompile.backend(inductor=False)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(region, backend=counter, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=gen)
    errors = []
    for rows in (4, 6, 10):
        x = torch.randn(rows, 6, generator=gen)
        xd = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        full = compiled(xd, wd).full_tensor()
        full.sum().backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = _gelu_mm(xr, wr)
        ref.sum().backward()
        got = [full, xd.grad.full_tensor(), wd.grad.full_tensor()]
        errors.append(max((g - r).abs().max().item() for g, r in zip(got, [ref, xr.grad, wr.grad])))
    return errors, counter.frame_count, [str(r.spec) for record in backend.records for r in record.regions]


@pytest.mark.models
def test_dynamic_shapes_compile_once_and_match_the_reference():
    """Under ``dynamic=True`` Dynamo passes the region its sizes as operands; the
    region's forward/backward split carries them (saved sizes included) and one
    compile serves every batch size, forward and backward."""
    from dtcompile.testing import run_threaded

    for errors, frames, specs in run_threaded(2, _dynamic_rank):
        assert max(errors) < 1e-5, errors
        assert frames == 1
        assert len(specs) == 2 and specs[1].startswith("_gelu_mm on (tp=2): ") and "| backward" in specs[1], specs


def test_a_nested_local_map_is_part_of_the_outer_region(tp_mesh):
    """Inside a region the inputs are local tensors, so an inner ``local_map`` just calls
    its function (torch's semantics): one region per graph, the outer one."""
    inner = local_map(lambda a: a * 2, [Shard(0)], ([Shard(0)],), device_mesh=tp_mesh)

    def outer_body(a):
        return inner(a).sin()

    outer = local_map(outer_body, [Shard(0)], ([Shard(0)],), device_mesh=tp_mesh)
    x = distribute_tensor(torch.randn(8, 4), tp_mesh, [Shard(0)]).requires_grad_()
    backend = dtcompile.backend(inductor=False)
    out = torch.compile(outer, backend=backend, fullgraph=True)(x)
    out.to_local().sum().backward()
    torch.testing.assert_close(out.to_local(), (x.to_local() * 2).sin())
    torch.testing.assert_close(x.grad.to_local(), 2 * (x.to_local() * 2).cos())
    assert [str(r.spec) for record in backend.records for r in record.regions] == [
        "outer_body on (tp=4): [S(0)] -> [S(0)] | grads [S(0)] | saved 1",
        "outer_body on (tp=4): [S(0)] -> [S(0)] | grads [S(0)] | saved 1 | backward",
    ]


def test_the_report_lists_each_graphs_regions(fake_world):
    case = REGION_CASES["region_with_collective"]
    mesh = _mesh(fake_world, case)
    report = dtcompile.explain(case.make(mesh))(*case.inputs(mesh, case.global_inputs()))
    text = report.text(aot_graphs=False)
    forward = text.index("-- local_map regions of the forward graph (one op each until lowering) --")
    backward = text.index("-- local_map regions of the backward graph (one op each until lowering) --")
    assert forward < text.index(
        "gather_matmul: gather_matmul on (tp=4): [S(0), S(1)] -> [S(1)] | grads [S(0), S(1)] | saved 2 (3 ops; issues all_gather[tp] x4 192 B)"
    ) < backward
    assert "ops; issues reduce_scatter[tp] x4 192 B)" in text[backward:]


def test_local_map_call_recognises_a_region_and_nothing_else():
    from dtcompile.hops import LocalMapCall, local_map, local_map_call

    def body(x):
        return x * 2

    made = local_map(body, out_placements=[Shard(0)], in_placements=([Shard(0)],), redistribute_inputs=True)
    call = local_map_call(made)
    assert isinstance(call, LocalMapCall)
    assert call.func is body and call.out_placements == [Shard(0)] and call.in_placements == ([Shard(0)],)
    assert call.redistribute_inputs is True and call.in_grad_placements is None
    assert local_map_call(staticmethod(made)) == call  # as a class attribute
    for other in (body, staticmethod(body), made.func, None, 3):
        assert local_map_call(other) is None


# ---------------------------------------------------------------- SPMD types where placements go


def _row_parallel_region(mesh, ins, out):
    """x (rows, hidden) sharded on hidden @ w.t() sharded alike: a partial sum per rank."""
    return local_map(lambda x, w: x @ w.t(), out_placements=out, in_placements=ins, device_mesh=mesh)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_spmd_types_by_axis_name_declare_a_region_as_its_placements_do(compiled):
    """``{"dp": "S(0)", "tp": "S(1)"}`` (spmd_types' spelling, per mesh axis name) is the same
    declaration as ``(Shard(0), Shard(1))``: the same outputs and gradients on simulated ranks,
    and the single-process result; ``P`` is ``Partial()``, ``R`` and ``I`` ``Replicate()``."""
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with simulated_world(8, (2, 4), ("dp", "tp")) as mesh:
        results = _typed_and_placed(mesh, x, w, compiled)
    (t_placements, *t_values), (p_placements, *p_values) = results
    assert t_placements == p_placements == (Shard(0), Partial())
    for a, b in zip(t_values, p_values):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(t_values[0], x @ w.t())  # and the single-process result


def _typed_and_placed(dp_tp_mesh, x, w, compiled):
    typed = _row_parallel_region(
        dp_tp_mesh, ({"dp": "S(0)", "tp": "S(1)"}, {"tp": "S(1)", "dp": "I"}), {"dp": "S(0)", "tp": "P"})
    placed = _row_parallel_region(dp_tp_mesh, ((Shard(0), Shard(1)), (Replicate(), Shard(1))), (Shard(0), Partial()))
    results = []
    for region in (typed, placed):
        backend = dtcompile.backend(inductor=False)
        run = torch.compile(region, backend=backend, fullgraph=True) if compiled else region
        dx = distribute_tensor(x, dp_tp_mesh, [Shard(0), Shard(1)]).requires_grad_(True)
        dw = distribute_tensor(w, dp_tp_mesh, [Replicate(), Shard(1)]).requires_grad_(True)
        out = run(dx, dw)
        out.full_tensor().sum().backward()
        results.append((out.placements, out.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor()))
    return results


def test_a_region_declared_in_spmd_types_compiles_to_the_spec_its_placements_give(dp_tp_mesh):
    specs = []
    for ins, out in (
        (({"dp": "S(0)", "tp": "S(1)"}, {"tp": "S(1)", "dp": "I"}), {"dp": "S(0)", "tp": "P"}),
        (((Shard(0), Shard(1)), (Replicate(), Shard(1))), (Shard(0), Partial())),
    ):
        backend = dtcompile.backend(inductor=False)
        x = distribute_tensor(torch.randn(8, 16), dp_tp_mesh, [Shard(0), Shard(1)])
        w = distribute_tensor(torch.randn(4, 16), dp_tp_mesh, [Replicate(), Shard(1)])
        torch.compile(_row_parallel_region(dp_tp_mesh, ins, out), backend=backend, fullgraph=True)(x, w)
        specs.append([str(region.spec) for record in backend.records for region in record.regions])
    assert specs[0] == specs[1] and len(specs[0]) == 1, specs
    assert "[S(0)S(1), RS(1)] -> [S(0)P(sum)]" in specs[0][0], specs


@pytest.mark.parametrize(
    "ins, message",
    [
        (({"dp": "S(0)"}, {"dp": "R", "tp": "S(1)"}), r"in_placements\[0\] = \{'dp': 'S\(0\)'\}: no type for \['tp'\]"),
        (({"dp": "S(0)", "tp": "S(1)", "cp": "R"}, {"dp": "R", "tp": "S(1)"}), r"\['cp'\] are not axes of the mesh \('dp', 'tp'\)"),
        (({"dp": "S(0)", "tp": "V"}, {"dp": "R", "tp": "S(1)"}), r"'V' on axis 'tp' is V says the value varies but not which dim it shards: write S\(d\)"),
        (({"dp": "S(0)", "tp": "Shard(1)"}, {"dp": "R", "tp": "S(1)"}), r"'Shard\(1\)' on axis 'tp' is not an SPMD type"),
    ],
    ids=["missing axis", "unknown axis", "V", "not a type"],
)
def test_spmd_types_that_do_not_fit_the_mesh_name_the_entry_and_the_fix(dp_tp_mesh, ins, message):
    x = distribute_tensor(torch.randn(8, 16), dp_tp_mesh, [Shard(0), Shard(1)])
    w = distribute_tensor(torch.randn(4, 16), dp_tp_mesh, [Replicate(), Shard(1)])
    with pytest.raises(LocalMapError, match=message):
        _row_parallel_region(dp_tp_mesh, ins, {"dp": "S(0)", "tp": "P"})(x, w)
