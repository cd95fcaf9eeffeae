"""dynamo_vars: the idiom corpus, guards and recompile reasons, structured graph breaks, install/uninstall."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor
from expecttest import assert_expected_inline
from torch._dynamo.exc import Unsupported
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters, guard_failures
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

import dtcompile
import dynamo_vars
from dtcompile._testing.idioms import IDIOMS, check_idiom, mesh_world
from dtcompile.testing.worlds import fake_world

# The Inductor path adds nothing Dynamo-level; lowering is tested in test_models.py.
BACKEND = dtcompile.backend(inductor=False)

# What stock torch 2.13, 2.14 and 2.15 (aot_eager, dynamo_vars not installed) fail on: raises,
# breaks the graph, or returns a result that differs from eager or carries a fake
# mesh.  Pinned so that a torch upgrade that fixes (or breaks) one shows up here.
STOCK_FAILURES = {
    "mesh_get_all_groups": "UnsafeScriptObjectError: Attempted to access unregistered member",
    "redistribute_shard_to_replicate": "a DTensor carries mesh <torch._library.fake_class_registry.FakeScriptObject",
    "full_tensor": "a DTensor carries mesh <torch._library.fake_class_registry.FakeScriptObject",
    "distribute_tensor_shard": "'LocalIntNode' object has no attribute 'expr'",
    "distribute_tensor_2d": "'LocalIntNode' object has no attribute 'expr'",
    "factory_ones": "Failed to convert args/kwargs to proxy",
    "factory_zeros": "Failed to convert args/kwargs to proxy",
    "factory_full": "Failed to convert args/kwargs to proxy",
    "factory_empty": "Failed to convert args/kwargs to proxy",
    "factory_default_placements": "Failed to convert args/kwargs to proxy",
    "local_shape_and_offset_strided": (
        "UnsafeScriptObjectError: Unsupported method call",  # torch 2.13
        "type object 'UserDefinedObjectVariable' has no attribute",  # 2.14
        "UnsafeScriptObjectError: call to a callable object with no traceable __call__",  # 2.15
    ),
    "implicit_replication_context": "Attempted to call function marked as skipped",
    "loss_parallel_inside": (
        "TorchRuntimeError: RuntimeError when making fake tensor call",  # torch 2.13
        "Unsupported: Observed exception",  # 2.14, 2.15: the op's error is raised inside the program
    ),
}


def test_corpus_is_large_and_covers_every_family_and_mesh():
    assert len(IDIOMS) >= 60
    assert len({i.name for i in IDIOMS}) == len(IDIOMS)
    families = {i.family for i in IDIOMS}
    assert families == {"device_mesh", "placements", "process_group", "dtensor_api"}
    assert {i.mesh for i in IDIOMS} == {"1d", "2d", "3d"}
    assert {i.world for i in IDIOMS} == {"fake", "local"}
    assert sum(i.backward for i in IDIOMS) >= 10


@pytest.mark.parametrize("item", IDIOMS, ids=lambda i: i.name)
def test_idiom_compiles_fullgraph_and_matches_eager(item):
    """One frame, no graph break, no recompile on a second call, eager's values and the user's mesh."""
    result = check_idiom(item, BACKEND)
    assert result.ok, result.error
    assert (result.num_frames, result.num_graph_breaks) == (1, 0)


@pytest.mark.subprocess
def test_stock_torch_fails_exactly_the_pinned_idioms():
    """The same corpus with stock aot_eager and dynamo_vars uninstalled: the gain, made visible.

    In a fresh process: which stock runs get a fake mesh depends on what ran before.
    """
    script = textwrap.dedent(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        from dtcompile._testing.idioms import corpus_failures
        print(json.dumps(corpus_failures("aot_eager", stock=True)))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(failures) == set(STOCK_FAILURES), failures
    for name, expected in STOCK_FAILURES.items():
        texts = (expected,) if isinstance(expected, str) else expected
        assert any(text in failures[name] for text in texts), (name, failures[name])
    assert len(IDIOMS) - len(failures) == 64


@pytest.mark.slow
def test_results_carry_the_users_mesh_after_other_programs_ran():
    """A model compiled first (its meshes are equal to the idioms' meshes) must not leak its
    mesh, real or fake, into later compiled outputs and gradients."""
    from dtcompile._testing.cases import rank_eager_and_compiled

    with fake_world(4):
        rank_eager_and_compiled(0, "tp_sp_block", 4, {"inductor": False})
    torch._dynamo.reset()
    for name in ["redistribute_shard_to_replicate", "full_tensor", "to_local_with_grad_placements"]:
        item = next(i for i in IDIOMS if i.name == name)
        result = check_idiom(item, BACKEND)
        assert result.ok, (name, result.error)


# ---------------------------------------------------------------- guards and recompile reasons


def _recompile_reasons(fn, calls):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for args in calls:
        compiled(*args)
    return counter.frame_count, "\n".join(guard_failures[fn.__code__])


def test_dtensor_placement_and_mesh_changes_recompile_with_readable_reasons(world8):
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(8, 8)

    def double(d):
        return d * 2

    frames, reasons = _recompile_reasons(
        double,
        [
            (distribute_tensor(x, tp, [Shard(0)], src_data_rank=None),),
            (distribute_tensor(x, tp, [Shard(0)], src_data_rank=None),),
            (distribute_tensor(x, tp, [Replicate()], src_data_rank=None),),
            (distribute_tensor(x, dp_tp, [Replicate(), Shard(1)], src_data_rank=None),),
        ],
    )
    assert frames == 3
    assert_expected_inline(
        reasons,
        """\
0/0: placements of arg d changed: (Shard(dim=0),) -> (Replicate(),)
0/1: mesh of arg d changed: DeviceMesh((tp=4)) -> DeviceMesh((dp=2, tp=2))
0/0: mesh of arg d changed: DeviceMesh((tp=4)) -> DeviceMesh((dp=2, tp=2))""",
    )


def test_mesh_argument_changes_recompile_with_readable_reasons(world8):
    from torch.distributed.device_mesh import DeviceMesh

    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    strided_tp = DeviceMesh("cpu", torch.tensor([0, 2, 4, 6]), mesh_dim_names=("tp",))
    x = torch.randn(4, 4)

    def wrap(t, m):
        return DTensor.from_local(t, m, [Replicate()] * m.ndim, run_check=False)

    frames, reasons = _recompile_reasons(wrap, [(x, tp), (x, tp), (x, dp_tp), (x, strided_tp)])
    assert frames == 3
    assert_expected_inline(
        reasons,
        """\
0/0: mesh changed: DeviceMesh((tp=4)) -> DeviceMesh((dp=2, tp=2)) (arg m)
0/1: mesh changed: DeviceMesh((dp=2, tp=2)) -> DeviceMesh((tp=4)) (arg m)
0/0: mesh changed: DeviceMesh((tp=4)) over ranks [0, 1, 2, 3] -> ranks [0, 2, 4, 6] (arg m)""",
    )


def _twice(d):
    return d * 2


def _compile_in_rank_order(rank: int) -> list[str]:
    """Rank 0 compiles ``_twice`` first, then rank 1 runs the same code."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    d = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
    compiled = torch.compile(_twice, backend="eager", fullgraph=True)
    reasons = []
    for turn in range(2):
        if turn == rank:
            before = len(guard_failures[_twice.__code__])
            compiled(d)
            reasons = [str(r) for r in guard_failures[_twice.__code__][before:]]
        dist.barrier()
    return reasons


def test_threaded_ranks_recompile_naming_the_rank_thread():
    """The threaded group's meshes differ by thread (DeviceMesh.__eq__): rank 1
    cannot run rank 0's program, and the reason says so instead of printing two
    equal meshes."""
    from dtcompile.testing import run_threaded

    torch._dynamo.reset()
    assert run_threaded(2, _compile_in_rank_order) == [
        [],
        ["0/0: mesh of arg d changed: DeviceMesh((tp=2)) of rank 0's thread -> of rank 1's thread (threaded process group)"],
    ]


class _TaggedPartial(Partial):
    """A user Partial that only tags its values: equal to ``Partial('sum')`` by ``==``."""

    def _reduce_value(self, tensor, mesh, mesh_dim):
        return super()._reduce_value(tensor, mesh, mesh_dim) * 10


def test_placement_argument_changes_and_user_subclass_recompile(world4):
    """A Partial subclass equal to Partial('sum') by == still gets its own graph, traced as itself."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = torch.ones(4, 4)
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return BACKEND(gm, inputs)

    def reduce(t, p):
        return DTensor.from_local(t, mesh, [p], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    torch._dynamo.reset()
    compiled = torch.compile(reduce, backend=record, fullgraph=True)
    plain = compiled(x, Partial())
    tagged = compiled(x, _TaggedPartial())
    compiled(x, Shard(0))
    # The fake PG's all_reduce leaves values as they are: the subclass's own
    # reduction (x10) is what tells the two graphs apart.
    assert plain[0, 0].item() == 1.0 and tagged[0, 0].item() == 10.0
    assert len(graphs) == 3
    placements_in_graph = [
        type(p).__name__
        for gm in graphs
        for node in gm.graph.nodes
        if node.target is DTensor.from_local
        for p in node.args[2]
    ]
    assert placements_in_graph == ["Partial", "_TaggedPartial", "Shard"]
    assert_expected_inline(
        "\n".join(guard_failures[reduce.__code__]),
        """\
0/0: placement class changed: Partial -> _TaggedPartial (equal by ==: Partial(sum)) (arg p)
0/1: placement changed: Partial(sum) -> Shard(dim=0) (arg p)
0/0: placement changed: Partial(sum) -> Shard(dim=0) (arg p)""",
    )


def test_dtensor_with_user_placement_subclass_recompiles(world4):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = torch.ones(4, 4)
    outputs = []

    def replicate(d):
        return d.redistribute(mesh, [Replicate()]).to_local()

    torch._dynamo.reset()
    compiled = torch.compile(replicate, backend=BACKEND, fullgraph=True)
    for placement in [Partial(), _TaggedPartial()]:
        outputs.append(compiled(DTensor.from_local(x, mesh, [placement], run_check=False))[0, 0].item())
    assert outputs == [1.0, 10.0]
    assert_expected_inline(
        "\n".join(guard_failures[replicate.__code__]),
        """0/0: placement classes of arg d changed: ('Partial',) -> ('_TaggedPartial',) (equal by ==: (Partial(sum),))""",
    )


def test_same_mesh_and_placements_never_recompile(world8):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    counter = CompileCounterWithBackend(BACKEND)

    def step(d, p, m):
        return DTensor.from_local(d.to_local(), m, [Replicate(), p], run_check=False) * m["tp"].size()

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for _ in range(3):
        # fresh, equal objects every call: new DTensor, new Shard(0), the same mesh
        d = distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Shard(0)], src_data_rank=None)
        compiled(d, Shard(0), mesh)
    assert counter.frame_count == 1


# ---------------------------------------------------------------- structured graph breaks


def _graph_break_text(fn, *args):
    with pytest.raises(Unsupported) as err:
        torch.compile(fn, backend=BACKEND, fullgraph=True)(*args)
    return str(err.value)


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda t: t * dist.new_group([0, 1]).size(), "dist.new_group creates a process group"),
        (lambda t: t * dist.new_subgroups(2)[0].size(), "dist.new_subgroups creates a process group"),
        (lambda t: t * init_device_mesh("cpu", (4,)).size(), "init_device_mesh creates process groups"),
    ],
    ids=["new_group", "new_subgroups", "init_device_mesh"],
)
def test_building_groups_inside_compiled_code_is_a_structured_graph_break(world4, call, expected):
    text = _graph_break_text(call, torch.ones(2))
    assert "dtcompile: " in text and "inside a compiled region" in text
    assert expected in text
    assert "Hint: Create" in text and "before the compiled function" in text


def test_new_leaf_parameters_inside_compiled_code_are_a_structured_graph_break(world4):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    text = _graph_break_text(lambda: dtensor.ones(4, 4, device_mesh=mesh, requires_grad=True))
    assert "ones(requires_grad=True) makes a new leaf tensor (a parameter)" in text
    assert "Hint: Create parameters outside the compiled function" in text
    text = _graph_break_text(lambda t: distribute_tensor(t, mesh, [Shard(0)]), torch.ones(8, 4, requires_grad=True))
    assert "distribute_tensor(requires_grad=True) makes a new leaf tensor" in text


def test_graph_break_outside_fullgraph_still_runs_correctly(world4):
    """Without fullgraph the break splits the frame and the program still gives eager's result."""
    def fn(t):
        t = t * 2
        group = dist.new_group([0, 1, 2, 3])
        return t + group.size()

    counters.clear()
    counter = CompileCounterWithBackend(BACKEND)
    out = torch.compile(fn, backend=counter)(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 6.0))
    # One break, at new_group, with dtcompile's reason: the code before it and the code after
    # it are the two frames compiled.
    (reason,) = counters["graph_break"]
    assert reason.startswith("dtcompile: torch.distributed.distributed_c10d.new_group inside a compiled region"), reason
    assert counter.frame_count == 2


def test_factory_placements_must_match_the_mesh(world8):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(Exception, match=r"DTensor factory: 1 placements \(Shard\(dim=0\),\) for a mesh with 2 axes"):
        torch.compile(lambda: dtensor.zeros(8, 8, device_mesh=mesh, placements=[Shard(0)]), backend=BACKEND, fullgraph=True)()


# ---------------------------------------------------------------- install / uninstall


def test_uninstall_restores_stock_dynamo_and_enabled_restores_the_previous_state(world8):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))

    def fn(t):
        return t * len(mesh.get_all_groups())

    assert dynamo_vars.is_installed()  # dtcompile.backend() installed it
    with dynamo_vars.enabled(False):
        assert not dynamo_vars.is_installed()
        with pytest.raises(Exception, match="unregistered member"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.ones(2))
        torch._dynamo.reset()
        with dynamo_vars.enabled():
            torch.testing.assert_close(torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
        assert not dynamo_vars.is_installed()
    assert dynamo_vars.is_installed()


@pytest.mark.parametrize("name", ["mesh_get_group", "placements_iterate_and_branch", "redistribute_2d_partial", "matmul_colwise_rowwise"])
def test_installing_does_not_change_graphs_that_already_traced(name):
    """Code stock Dynamo traces gets the very same Dynamo graph with dynamo_vars installed."""
    item = next(i for i in IDIOMS if i.name == name)

    def dynamo_graph() -> str:
        graphs = []

        def record(gm, inputs):
            graphs.append(gm.code)
            return gm.forward

        torch._dynamo.reset()
        with mesh_world(item.mesh, item.world) as mesh:
            fn, args = item.build(mesh)[:2]
            fn(*args)  # as the corpus does: LocalTensorMode cannot trace some ops on a cold start
            torch.compile(fn, backend=record, fullgraph=True)(*args)
        return "\n".join(graphs)

    with dynamo_vars.enabled(False):
        stock = dynamo_graph()
    assert stock and dynamo_graph() == stock


@pytest.mark.parametrize("name", ["factory_zeros", "distribute_tensor_2d", "implicit_replication_context"])
@pytest.mark.inductor
def test_idioms_lower_through_inductor(name):
    item = next(i for i in IDIOMS if i.name == name)
    result = check_idiom(item, dtcompile.backend())
    assert result.ok, result.error
