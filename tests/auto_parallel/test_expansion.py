"""How the planner measures faster changes no problem it builds.

:mod:`dtcompile.auto_parallel.expansion` keeps DTensor's expansion of an op's strategies, its
output metadata and its redistribution costs per what each reads;
:func:`dtcompile.auto_parallel.measure._transform_steps` keeps DTensor's redistribution steps
per layouts; and an aten op is measured on ``meta`` shards rather than fake ones
(:func:`~dtcompile.auto_parallel.measure.measure_op`): each claims DTensor's own answer.  Here
every candidate (its measured costs, gradient layouts, collectives, saved values) and every
edge price of a problem built cold with them equals the same problem built cold without any
of them, on models nobody here wrote (the zoo's, torchtitan's), on a 1-D and a 2-D mesh.
"""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
import torch
from support import zoo_models
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import dtcompile
from dtcompile.auto_parallel import expansion, measure
from dtcompile.auto_parallel import problem as problem_module
from dtcompile.auto_parallel.placements import layouts
from dtcompile.base.sharding_cache import clear_sharding_caches
from dtcompile.testing import fake_world

CASES = [
    ("rmsnorm_swiglu", (4,), ("tp",)),
    ("causal_sdpa", (2, 2), ("dp", "tp")),
    ("transformer_decoder_layer", (2, 2), ("dp", "tp")),
    ("torchtitan_llama3", (2, 2), ("dp", "tp")),
]


def _no_meta_shards(*_):
    raise RuntimeError("measured on fake shards only")


def _cold_problem(name, shape, names, monkeypatch, kept):
    """The problem of zoo model ``name``, built with nothing measured or asked before."""
    monkeypatch.setenv("DTCOMPILE_AUTO_PARALLEL_CACHE_DIR", "0")  # nothing read from disk either
    monkeypatch.setattr(problem_module, "_MEASURE_TABLES", collections.OrderedDict())
    monkeypatch.setattr(measure, "_STEPS", {})
    measure._plan_cached.cache_clear()
    if not kept:
        monkeypatch.setattr(problem_module, "kept_expansions", contextlib.nullcontext)
        monkeypatch.setattr(measure, "_meta_local", _no_meta_shards)
        monkeypatch.setattr(measure, "_transform_steps", lambda shape, dtype, src, dst, mesh, flattened:
                            measure._steps(shape, dtype, src, dst, mesh))
    clear_sharding_caches()
    model, args = zoo_models.build(name)
    world = int(np.prod(shape))
    with fake_world(world, shape, names) as mesh:
        solution = dtcompile.auto_parallel.plan(model, mesh, args)
    monkeypatch.undo()
    assert solution.problem.measurements["made"] > 0  # measured here, not read back
    return solution


def _described(solution):
    problem = solution.problem
    nodes = {name: [repr(c) for c in node.candidates] for name, node in problem.nodes.items()}
    edges = [
        (e.producer, e.index, e.consumer, e.slot, np.asarray(e.cost).tolist(), repr(e.buckets), e.regather)
        for e in problem.edges
    ]
    return nodes, edges, [(r.fanout, r.consumer, r.slot, r.ok) for r in problem.fanout_rules]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "shape", "names"), CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_problems_built_the_fast_way_equal_those_built_the_slow_way(name, shape, names, monkeypatch):
    without = _cold_problem(name, shape, names, monkeypatch, kept=False)
    kept = _cold_problem(name, shape, names, monkeypatch, kept=True)
    nodes_without, edges_without, rules_without = _described(without)
    nodes_kept, edges_kept, rules_kept = _described(kept)
    assert nodes_kept.keys() == nodes_without.keys()
    for node in nodes_without:
        assert nodes_kept[node] == nodes_without[node], node
    assert edges_kept == edges_without
    assert rules_kept == rules_without
    assert kept.result.objective_us == without.result.objective_us
    assert kept.param_placements == without.param_placements


def test_kept_answers_are_asked_and_let_go():
    """While a plan builds, DTensor answers questions that differ only in the inputs' layouts
    from one expansion, with the answers it gives without it; once built, DTensor's own
    function is back and nothing is held."""
    import torch.distributed.tensor._ops.utils as utils
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor._collective_utils import redistribute_cost

    original = utils.expand_to_full_mesh_op_strategy
    steps = redistribute._gen_transform_infos
    propagator = DTensor._op_dispatcher.sharding_propagator
    asked = [[Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Shard(0)], [Shard(1), Shard(0)],
             [Replicate(), Partial()], [Partial(), Shard(1)]]

    def answers():
        clear_sharding_caches()
        with fake_world(4, (2, 2), ("dp", "tp")) as mesh:
            found = []
            for placements in asked:
                local = [8, 8]
                for p in placements:
                    if isinstance(p, Shard):
                        local[p.dim] //= 2
                x = DTensor.from_local(torch.randn(local), mesh, placements, run_check=False, shape=(8, 8), stride=(8, 1))
                w = DTensor.from_local(torch.randn(8, 8), mesh, [Replicate(), Replicate()], run_check=False)
                out = torch.mm(x, w) * 2
                found.append((tuple(out.placements), tuple(out.to_local().shape)))
            return found

    plain = answers()
    with expansion.kept_expansions():
        patched = utils.expand_to_full_mesh_op_strategy
        assert patched is not original and patched.__wrapped__ is original
        assert "_propagate_tensor_meta_non_cached" in vars(propagator)
        assert answers() == plain
        # Twelve questions (mm and mul, six layouts each), fewer expansions: the list is kept.
        assert 0 < len(expansion._expansions) < 12 and expansion._metas
    assert utils.expand_to_full_mesh_op_strategy is original
    assert utils.redistribute_cost is redistribute_cost and redistribute._gen_transform_infos is steps
    assert "_propagate_tensor_meta_non_cached" not in vars(propagator)
    assert not expansion._expansions and not expansion._costs and not expansion._metas
    assert not expansion._ids and not expansion._columns and not expansion._steps


def test_an_in_place_op_goes_to_dtensors_own_expansion():
    """What an in-place op may run depends on the layout its first input has: not kept."""
    with expansion.kept_expansions(), fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        clear_sharding_caches()
        for placements in ([Shard(0), Replicate()], [Replicate(), Shard(1)]):
            x = DTensor.from_local(torch.randn(4, 4), mesh, placements, run_check=False)
            x.mul_(2)
            assert x.placements == tuple(placements)
        assert not expansion._expansions


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 4)])
def test_redistribution_steps_are_the_same_for_every_shape(mesh_shape):
    """DTensor's greedy redistribution planner takes the same steps whatever the shape, which
    :func:`~dtcompile.auto_parallel.measure._transform_steps` keeps per layouts: checked on
    every pair of layouts of a 3-D tensor, for shapes of several sizes."""
    world = int(np.prod(mesh_shape))
    names = ("dp", "tp")[-len(mesh_shape):] if len(mesh_shape) == 2 else ("tp",)
    shapes = [(8, 8, 8), (16, 32, 8), (64, 8, 128)]
    with fake_world(world, mesh_shape, names) as mesh:
        options = layouts(shapes[0], mesh.shape)
        options += [tuple(Partial() if isinstance(p, Replicate) else p for p in layout) for layout in options]
        for src in dict.fromkeys(options):
            for dst in layouts(shapes[0], mesh.shape):
                steps = [
                    [(i.src_dst_placements, getattr(i, "mesh_dim", None), getattr(i, "original_mesh_dims", None))
                     for i in measure._steps(shape, torch.float32, src, dst, mesh)]
                    for shape in shapes
                ]
                assert steps[1] == steps[0] and steps[2] == steps[0], (src, dst)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 4)])
def test_kept_costs_equal_dtensors_for_every_shape(mesh_shape):
    """While a plan is built, the cost DTensor's strategy functions read (``redistribute_cost``,
    its steps kept per layouts) equals DTensor's own, for every pair of layouts of a 3-D
    tensor and shapes even, uneven and smaller than the mesh; and a redistribution run then
    (which reads each step's shapes) still gets DTensor's own steps."""
    import torch.distributed.tensor._ops.utils as utils
    from torch.distributed.tensor._collective_utils import redistribute_cost
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    world = int(np.prod(mesh_shape))
    names = ("dp", "tp")[-len(mesh_shape):] if len(mesh_shape) == 2 else ("tp",)
    shapes = [(8, 8, 8), (7, 9, 5), (1, 16, 3), (64, 8, 128)]
    with fake_world(world, mesh_shape, names) as mesh:
        options = layouts(shapes[0], mesh.shape)
        options += [tuple(Partial() if isinstance(p, Replicate) else p for p in layout) for layout in options]
        options = list(dict.fromkeys(options))

        def spec(placements, shape, dtype):
            return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), measure._global_stride(shape), dtype))

        pairs = [
            (spec(src, shape, dtype), spec(dst, shape, dtype))
            for shape in shapes for dtype in (torch.float32, torch.bfloat16) for src in options for dst in options
        ]
        clear_sharding_caches()
        plain = [redistribute_cost(a, b) for a, b in pairs]
        plain_steps = [_gen_transform_infos(a, b) for a, b in pairs[:: len(options) + 1]]
        clear_sharding_caches()
        with expansion.kept_expansions():
            kept = [utils.redistribute_cost(a, b) for a, b in pairs]
            assert 0 < len(expansion._steps) <= len(options) ** 2 < len(pairs)
            import torch.distributed.tensor._redistribute as redistribute

            kept_steps = [redistribute._gen_transform_infos(a, b) for a, b in pairs[:: len(options) + 1]]
    assert kept == plain
    assert kept_steps == plain_steps
