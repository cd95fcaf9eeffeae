"""torchtitan's ``graph_trainer``: a whole training step traced as one graph, dtcompile's pass on it.

graph_trainer (torchtitan 0.3.0) traces forward, loss and backward of a SimpleFSDP
model as one ``make_fx`` graph (``make_fx_tracer.minimal_fx_tracer``) and applies the
pass pipeline its config names; :mod:`dtcompile.integrations.torchtitan` registers
one named ``dtcompile``, graph_trainer's default passes with dtcompile's
:class:`~dtcompile.integrations.torchtitan.StepPass` first.  Here a SimpleFSDP stack
of norm + MLP blocks on 2 gloo ranks is traced once, the step pass is applied through
graph_trainer's own ``apply_graph_passes``, and the traced step trains 3 steps against
the same model's eager steps: loss and every gradient bitwise equal, with dtcompile's
rewrites switched off (the graph unchanged) and on (bucketing rewrites it).  The
record describes the step graph (its collectives, their costs, memory, timeline,
its ``TORCH_TRACE`` artifacts), and ranks whose step graphs would not pair up stop
with ``RanksDisagree`` when the pass runs.

Only dtcompile's pass is applied: graph_trainer's default pipeline
(``graph_trainer.passes``) cannot be imported in this environment (its
``configs`` import torchtitan's trainer, which needs ``torchdata``), and its
default passes end in regional Inductor and CUDA graphs.  The registered pipeline is
checked with a stand-in for that module.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from support.pinned import require_pinned
from support.titan import INSTALL, TORCHTITAN_VERSION
from torch import nn

from dtcompile.base.channels import Artifact, GraphKind
from dtcompile.testing import run_gloo

pytestmark = pytest.mark.gloo

DIM, LAYERS, BATCH, STEPS, LR = 64, 2, 8, 3, 0.1
WORLD = 2
# dtcompile's rewrites switched off: the step graph as graph_trainer traced it.
UNCHANGED = {"inductor": False, "disable_passes": {"async_tp", "bucketing", "overlap"}, "reshard_after_forward": False}
REWRITTEN = {"inductor": False}
# Per block: norm weight and bias, up weight and bias, down weight and bias.
PARAMS = 6 * LAYERS


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _simple_fsdp(mesh: Any, layers: int = LAYERS) -> nn.Module:
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    torch.manual_seed(0)  # every rank, and the eager and traced models, alike
    return data_parallel(Stack(DIM, layers), device_mesh=mesh, mode="fully_shard")


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _trace(model: nn.Module, x: torch.Tensor) -> Any:
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        loss = _loss(model, x)
        params = [p for _, p in model.named_parameters(remove_duplicate=False)]
        return [loss, *torch.autograd.grad(loss, params)]

    return minimal_fx_tracer(step, module=model)(x)


def _sgd(model: nn.Module, grads: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.sub_(LR * g)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _describe(step_pass: Any, emitted: list[str]) -> dict[str, Any]:
    """What the test reads of a step pass's record (picklable)."""
    from dtcompile.artifacts import collectives_json
    from dtcompile.base.channels import Meta

    (record,) = step_pass.records
    data = collectives_json(record)
    costs = [n.meta.get(Meta.COST_US) for n in record.graph.graph.nodes if n.meta.get(Meta.COLLECTIVE) is not None]
    return {
        "records": len(step_pass.records),
        "kind": str(record.kind),
        "ops": [c.op for c in record.collectives],
        "axes": sorted({c.axis for c in record.collectives}),
        "costs_us": costs,
        "total_us": data["totals"]["estimated_us"],
        "profile": data["cost_profile"],
        "peak_bytes": record.memory.peak_bytes if record.memory is not None else None,
        "traced_peak_bytes": record.memory_traced.peak_bytes if record.memory_traced is not None else None,
        "timeline_us": record.timeline.total_us if record.timeline is not None else None,
        "passes": {p.name: (p.ran, p.collectives_before, p.collectives_after, [d.action.value for d in p.decisions])
                   for p in record.passes},
        "checks": [c.outcome for c in step_pass.checks],
        "decisions": [str(d) for p in record.passes if p.name == "bucketing" for d in p.decisions],
        "emitted": emitted,
    }


def _train_on_rank(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    """3 steps of the traced step (dtcompile's pass applied by graph_trainer's ``apply_graph_passes``)
    against 3 eager steps of the same model: whether loss and gradients are bitwise equal, and the record."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer.make_fx_tracer import run_traced

    import dtcompile.artifacts
    from dtcompile.integrations.torchtitan import StepPass

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    eager, stepped = _simple_fsdp(mesh), _simple_fsdp(mesh)
    traced = _trace(stepped, _batch(rank, 0))
    traced_nodes = len(traced.gm.graph.nodes)
    step_pass = StepPass(options, [mesh])
    # The TORCH_TRACE artifacts the pass logs, by name (this rank's process only).
    emitted: list[str] = []
    emit = dtcompile.artifacts._artifact
    dtcompile.artifacts._artifact = lambda name, encoding, payload: (emitted.append(name), emit(name, encoding, payload))
    try:
        traced.gm = _apply_graph_passes(traced.gm, traced.example_inputs, [step_pass])
    finally:
        dtcompile.artifacts._artifact = emit
    run = run_traced(traced, module=stepped)

    equal = []
    for step in range(STEPS):
        x = _batch(rank, step)
        loss = _loss(eager, x)
        loss.backward()
        grads = [p.grad for p in eager.parameters()]
        out = run(x)
        equal.append([torch.equal(out[0], loss)] + [
            torch.equal(g.to_local(), ref.to_local()) for g, ref in zip(out[1:], grads, strict=True)
        ])
        _sgd(eager, grads)
        eager.zero_grad(set_to_none=True)
        _sgd(stepped, list(out[1:]))
    described = _describe(step_pass, emitted)
    described.update(equal=equal, traced_nodes=traced_nodes, nodes=len(traced.gm.graph.nodes), grads=len(out) - 1)
    return described


def _apply_graph_passes(gm: Any, example_inputs: Any, passes: list[Any]) -> Any:
    """graph_trainer's ``apply_graph_passes``, which lives in ``graph_trainer.passes``: that module
    imports torchtitan's trainer (``torchdata``, not installed here), so its loop, verbatim in
    what it does to a pass (``pass_fn(gm, example_inputs)``, a GraphModule back), where it cannot be imported."""
    try:
        from torchtitan.experiments.graph_trainer.passes import apply_graph_passes
    except ImportError:
        for pass_fn in passes:
            gm = pass_fn(gm, list(example_inputs))
            assert isinstance(gm, torch.fx.GraphModule)
        return gm
    return apply_graph_passes(gm, example_inputs, passes)


@pytest.fixture(scope="module")
def titan() -> None:
    require_pinned("torchtitan", TORCHTITAN_VERSION, INSTALL)


def test_step_graph_matches_eager_described_and_checked(titan, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRACE", str(tmp_path))  # the ranks' processes log there
    runs = run_gloo(WORLD, _train_on_rank_both)
    for rank, (unchanged, rewritten) in enumerate(runs):
        for name, run in (("unchanged", unchanged), ("rewritten", rewritten)):
            where = f"rank {rank} {name}"
            # Loss and every gradient bitwise equal eager, every step.
            assert run["grads"] == PARAMS, where
            assert len(run["equal"]) == STEPS and all(all(step) for step in run["equal"]), f"{where}: {run['equal']}"
            # One graph for the whole step, described as such.
            assert (run["records"], run["kind"]) == (1, GraphKind.STEP), where
            assert run["axes"] == ["fsdp"], where
            assert all(c is not None and c > 0 for c in run["costs_us"]), f"{where}: {run['costs_us']}"
            assert len(run["costs_us"]) == len(run["ops"]) and run["total_us"] > 0, where
            assert run["profile"] == "cpu_gloo", where
            assert run["peak_bytes"] > 0 and run["traced_peak_bytes"] > 0 and run["timeline_us"] > 0, where
            assert {Artifact.graph(GraphKind.STEP), Artifact.collectives(GraphKind.STEP)} <= set(run["emitted"]), where
            # The ranks compared the step graph's collectives, and agreed.
            assert run["checks"] == ["agreed"], f"{where}: {run['checks']}"
        # Forward gathers and backward reduce-scatters, in one graph: one of each per parameter.
        assert unchanged["ops"] == ["all_gather"] * PARAMS + ["reduce_scatter"] * PARAMS, unchanged["ops"]
        assert unchanged["nodes"] == unchanged["traced_nodes"], "rewrites off: the graph is as traced"
        assert unchanged["passes"]["bucketing"][0] is False and unchanged["passes"]["annotate"][0] is True
        # FSDP's re-gather: each weight the backward reads (the linears' and norms', 8) is gathered
        # again there, not held from the forward.
        assert rewritten["passes"]["reshard_after_forward"][:3] == (True, 2 * PARAMS, 2 * PARAMS + 8)
        assert set(rewritten["passes"]["reshard_after_forward"][3]) == {"resharded"}
        # Bucketing rewrites the whole-step graph: gathers and reduce-scatters merged, under the
        # memory budget (the forward's gathers per module, FSDP's prefetch window).
        assert rewritten["passes"]["bucketing"][:3] == (True, 2 * PARAMS + 8, 12), rewritten["passes"]["bucketing"][:3]
        assert "bucketed" in rewritten["passes"]["bucketing"][3]
        assert rewritten["ops"] == [*["all_gather"] * 5, "reduce_scatter", "all_gather", "reduce_scatter",
                                    *["all_gather"] * 3, "reduce_scatter"], rewritten["ops"]
        assert rewritten["total_us"] < unchanged["total_us"], (rewritten["total_us"], unchanged["total_us"])
    # Every rank bucketed alike (the check compared them; here the test does too).
    assert runs[0][1]["ops"] == runs[1][1]["ops"] and runs[0][1]["passes"] == runs[1][1]["passes"]

    # dtcompile-report reads the step graphs' artifacts.  Logged outside a Dynamo compile, they
    # carry no compile id of torch's: each rank's two step graphs are keyed by their own
    # (step/0, the second one's pass's too: "step/0 (2)"), the rewritten one's 12 collectives.
    from dtcompile_tools.report import read_trace, render_html

    trace = read_trace(tmp_path)
    assert sorted(trace.ranks) == list(range(WORLD)) and not trace.warnings, trace.warnings
    for rank, ranked in trace.ranks.items():
        assert sorted(ranked.compiles) == ["step/0", "step/0 (2)"], f"rank {rank}: {sorted(ranked.compiles)}"
        counts = [ranked.compiles[key].collectives[GraphKind.STEP]["totals"]["count"] for key in ("step/0", "step/0 (2)")]
        assert counts == [2 * PARAMS, 12], f"rank {rank}: {counts}"
        for record in ranked.compiles.values():
            assert "reduce_scatter_tensor" in record.graphs[GraphKind.STEP], f"rank {rank}"
    assert "step graph" in render_html(trace)


def _train_on_rank_both(rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train_on_rank(rank, UNCHANGED), _train_on_rank(rank, REWRITTEN)


def _check_with_options(rank: int, options_by_rank: list[dict[str, Any]]) -> str:
    """Rank ``rank`` traces the step and applies dtcompile's pass with its own options; what happened."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile.integrations.torchtitan import StepPass
    from dtcompile.ranks.check import RanksDisagree

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    model = _simple_fsdp(mesh)
    traced = _trace(model, _batch(rank, 0))
    step_pass = StepPass({**options_by_rank[rank], "check_ranks_timeout_s": 60.0}, [mesh])
    try:
        _apply_graph_passes(traced.gm, traced.example_inputs, [step_pass])
    except RanksDisagree as exc:
        return f"RanksDisagree: {exc}"
    return f"ran: {[str(c.outcome) for c in step_pass.checks]}"


def test_ranks_with_different_options_stop_at_the_pass(titan):
    # Rank 1 buckets smaller: its step graph's collectives would not pair up with rank 0's.
    outcomes = run_gloo(WORLD, _check_with_options, [REWRITTEN, {**REWRITTEN, "bucket_cap_bytes": 4096}])
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("RanksDisagree: "), f"rank {rank}: {outcome}"
        assert "ranks compiled graph step/0 differently" in outcome, outcome
        assert "bucket_cap_bytes" in outcome, outcome


def test_registered_pipeline_puts_dtcompile_first(titan, monkeypatch):
    """Importing the integration registers the ``dtcompile`` pipeline: graph_trainer's default
    passes (here a stand-in for ``graph_trainer.passes``, which needs ``torchdata``) after dtcompile's."""
    import importlib

    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    seen = []

    def default_passes(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Any]:
        seen.append((traced_result, config, parallel_dims))
        return ["default"]

    stand_in = types.ModuleType("torchtitan.experiments.graph_trainer.passes")
    stand_in.construct_default_graph_passes = default_passes
    try:
        importlib.import_module("torchtitan.experiments.graph_trainer.passes")
    except ImportError:
        monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    else:
        monkeypatch.setattr(sys.modules[stand_in.__name__], "construct_default_graph_passes", default_passes)
    monkeypatch.delitem(PASS_PIPELINE_REGISTRY, "dtcompile", raising=False)
    monkeypatch.delitem(sys.modules, "dtcompile.integrations.torchtitan", raising=False)
    integration = importlib.import_module("dtcompile.integrations.torchtitan")
    assert PASS_PIPELINE_REGISTRY["dtcompile"] is integration.step_pipeline

    passes = PASS_PIPELINE_REGISTRY["dtcompile"]("traced", "config", parallel_dims=None)
    # By default dtcompile rewrites (graph_trainer's memory policy decides the re-gathers); a
    # list without graph_trainer's bucketing pass or memory policy gets dtcompile's pass first.
    assert passes[0].config.disable_passes == set(), passes[0].config
    assert passes[0].config.reshard_after_forward is False
    integration.configure(inductor=False, bucket_cap_bytes=1 << 20, disable_passes=integration.REWRITES)
    passes = PASS_PIPELINE_REGISTRY["dtcompile"]("traced", "config", parallel_dims=None)
    assert passes[0].config.disable_passes == {"async_tp", "bucketing", "overlap"}, passes[0].config
    assert len(passes) == 2 and passes[1] == "default", passes
    assert isinstance(passes[0], integration.StepPass) and passes[0].config.bucket_cap_bytes == 1 << 20
    assert passes[0].__name__ == "dtcompile_step_pass"  # graph_trainer names passes by it
    assert seen == [("traced", "config", None)] * 2
    with pytest.raises(ValueError, match="not_an_option"):
        integration.configure(not_an_option=1)
    integration.configure()  # the defaults back, for whoever imports it next in this process


def test_the_pipeline_puts_dtcompile_in_the_place_of_graph_trainers_bucketing(titan, monkeypatch, caplog):
    """graph_trainer's default passes keep their order; dtcompile's pass stands where the
    transformer-block bucketing stood (after the memory policy), and the dense-region
    scheduling of the same collectives goes; one INFO line says so."""
    import functools
    import logging

    def named(name: str) -> Any:
        def graph_pass(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            return gm

        graph_pass.__name__ = name
        return graph_pass

    order = ["eliminate_dead_code_pass", "tag_with_memory_policy_pass", "apply_cpu_offload_pass",
             "selective_activation_remat_pass", "joint_transformer_block_bucketing_reordering_pass",
             "schedule_fsdp_comms_to_dense_regions_pass", "regional_inductor_pass", "cudagraph_pass"]
    # graph_trainer hands some as functools.partial (it names those by their function).
    defaults = [functools.partial(named(n), setting=1) if "bucketing" in n else named(n) for n in order]
    stand_in = types.ModuleType("torchtitan.experiments.graph_trainer.passes")
    stand_in.construct_default_graph_passes = lambda traced_result, config, *, parallel_dims=None: list(defaults)
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    import dtcompile.integrations.torchtitan as integration

    with caplog.at_level(logging.INFO, logger="dtcompile.integrations.torchtitan"):
        passes = integration.step_pipeline("traced", types.SimpleNamespace(compile=types.SimpleNamespace()))
    names = [integration._pass_name(p) for p in passes]
    assert names == ["eliminate_dead_code_pass", "tag_with_memory_policy_pass", "apply_cpu_offload_pass",
                     "selective_activation_remat_pass", "dtcompile_step_pass", "regional_inductor_pass", "cudagraph_pass"]
    assert passes[4].config.disable_passes == set() and passes[4].config.reshard_after_forward is False
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dtcompile.integrations.torchtitan"]
    assert "dtcompile_step_pass at pass 5 of 7, in place of joint_transformer_block_bucketing_reordering_pass, " \
        "schedule_fsdp_comms_to_dense_regions_pass" in line, line
    # A run that loads a precompiled artifact keeps its passes: its graph was rewritten when precompiled.
    precompiled = types.SimpleNamespace(compile=types.SimpleNamespace(precompile_artifact_dir="/artifact"))
    assert integration.step_pipeline("traced", precompiled) == defaults


# ---------------------------------------------------------------------------
# torchtitan's Llama3, from its own builders, under graph_trainer's SimpleFSDP (and TP),
# traced by graph_trainer's tracer, the registered ``dtcompile`` pipeline applied.

LLAMA_PLANS = {"fsdp": (2, 1), "fsdp_tp": (4, 2)}


def _llama_step_on_rank(rank: int, world_size: int, tp: int, rewrite: bool, weights: Any, batches: Any) -> dict[str, Any]:
    """3 steps of the traced Llama3 step against 3 eager steps of the same model, built alike:
    losses and gradients, bitwise; the step graph's collectives and what dtcompile did."""
    from support.titan import llama3_on_meta, load_simple_fsdp_weights, simple_fsdp, tiny_llama3_config
    from support.titan import torchtitan_on_cpu as titan_on_cpu
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer, run_traced

    with titan_on_cpu():
        import dtcompile.integrations.torchtitan as integration

        def build() -> tuple[Any, Any]:
            model, parallel_dims, _ = llama3_on_meta(tiny_llama3_config(), world_size, tp)
            model = simple_fsdp(model, parallel_dims)
            load_simple_fsdp_weights(model, weights)
            return model, parallel_dims

        (eager, _), (model, parallel_dims) = build(), build()
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
        dp_rank, dp = rank // tp, world_size // tp

        def local(batch: Any) -> tuple[Any, Any, Any]:
            """This rank's slice of the batch, and the tokens of the whole batch (torchtitan's loss scale)."""
            tokens, labels = batch
            return tokens.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], torch.tensor(labels.numel())

        def step(tokens: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
            loss, _ = loss_fn(model(tokens), labels, valid)
            params = [p for _, p in model.named_parameters(remove_duplicate=False)]
            return [loss, *torch.autograd.grad(loss, params)]

        traced = minimal_fx_tracer(step, module=model)(*local(batches[0]))
        # Described only: dtcompile's rewrites off (by default the pipeline rewrites).
        rewrites = {"disable_passes": set(), "reshard_after_forward": True} if rewrite else {"disable_passes": integration.REWRITES}
        integration.configure(inductor=False, **rewrites)
        passes = integration.step_pipeline(traced, None, parallel_dims=parallel_dims)
        traced.gm = _apply_graph_passes(traced.gm, traced.example_inputs, passes)
        integration.configure()
        run = run_traced(traced, module=model)
        (step_pass,) = (p for p in passes if isinstance(p, integration.StepPass))
        equal, losses = [], []
        for batch in batches:
            tokens, labels, valid = local(batch)
            loss, _ = loss_fn(eager(tokens), labels, valid)
            loss.backward()
            grads = [p.grad for p in eager.parameters()]
            out = run(tokens, labels, valid)
            equal.append([torch.equal(out[0], loss)] + [
                torch.equal(g.full_tensor(), ref.full_tensor()) for g, ref in zip(out[1:], grads, strict=True)
            ])
            losses.append(loss.item())
            _sgd(eager, grads)
            eager.zero_grad(set_to_none=True)
            _sgd(model, list(out[1:]))
        (record,) = step_pass.records
        return {
            "equal": equal,
            "losses": losses,
            "ops": [c.op for c in record.collectives],
            "axes": sorted({c.axis for c in record.collectives}),
            "bucketing": [str(d) for p in record.passes if p.name == "bucketing" for d in p.decisions],
            "bucketed": [(p.collectives_before, p.collectives_after) for p in record.passes if p.name == "bucketing"],
            "resharded": [d.node for p in record.passes if p.name == "reshard_after_forward" for d in p.decisions
                          if d.action.value == "resharded"],
            "checks": [c.outcome for c in step_pass.checks],
            "graphs": len(step_pass.records),
        }


def _graph_trainer_passes_stand_in(monkeypatch: Any) -> None:
    """graph_trainer's default passes (``graph_trainer.passes``, which needs ``torchdata``) as none:
    the ``dtcompile`` pipeline is then dtcompile's pass alone."""
    try:
        import torchtitan.experiments.graph_trainer.passes  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("torchtitan.experiments.graph_trainer.passes")
        stand_in.construct_default_graph_passes = lambda traced_result, config, *, parallel_dims=None: []
        monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)


@pytest.mark.models
@pytest.mark.parametrize("plan", LLAMA_PLANS)
def test_llama3_step_graph_with_the_dtcompile_pipeline_matches_eager(plan, titan, torchtitan_on_cpu, monkeypatch):
    from support.titan import GLOBAL_BATCH, SEQ_LEN, VOCAB_SIZE, global_batches, initial_weights, tiny_llama3_config

    _graph_trainer_passes_stand_in(monkeypatch)
    world_size, tp = LLAMA_PLANS[plan]
    weights = initial_weights(tiny_llama3_config())
    batches = global_batches(STEPS, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)
    # The gloo ranks' processes import the stand-in too (it is not in their sys.modules).
    runs = run_gloo(world_size, _llama_on_rank_both, world_size, tp, weights, batches)
    for rank, (described, rewritten) in enumerate(runs):
        for name, run in (("described", described), ("rewritten", rewritten)):
            where = f"{plan} rank {rank} {name}"
            # One graph for the whole step, equal to eager bitwise, loss and every gradient, 3 steps.
            assert run["graphs"] == 1, where
            assert len(run["equal"]) == STEPS and all(all(s) for s in run["equal"]), f"{where}: {run['equal']}"
            assert run["checks"] == ["agreed"], f"{where}: {run['checks']}"
            assert run["axes"] == (["fsdp"] if tp == 1 else ["fsdp", "tp"]), f"{where}: {run['axes']}"
        assert described["losses"] == rewritten["losses"], f"{plan} rank {rank}"
        assert not described["bucketing"] and not described["resharded"], f"{plan} rank {rank}"
        # Rewritten: FSDP's gathered weights gathered again in the backward (not held from the
        # forward), and the step's collectives bucketed.
        assert "lm_head.weight" in rewritten["resharded"], f"{plan} rank {rank}: {rewritten['resharded']}"
        (before, after), = rewritten["bucketed"]
        assert after < before, f"{plan} rank {rank}: {rewritten['bucketing']}"
    # The step graph's collectives as traced, pinned: SimpleFSDP's gathers and reduce-scatters
    # (tensor parallel's too on 2 x 2), every rank the same.
    ops = {op: runs[0][0]["ops"].count(op) for op in sorted(set(runs[0][0]["ops"]))}
    assert ops == PINNED_LLAMA_OPS[plan], ops
    assert all(run[0]["ops"] == runs[0][0]["ops"] for run in runs)


def _llama_on_rank_both(rank: int, world_size: int, tp: int, weights: Any, batches: Any) -> tuple[Any, Any]:
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as monkeypatch:
        _graph_trainer_passes_stand_in(monkeypatch)
        return (
            _llama_step_on_rank(rank, world_size, tp, False, weights, batches),
            _llama_step_on_rank(rank, world_size, tp, True, weights, batches),
        )


PINNED_LLAMA_OPS: dict[str, dict[str, int]] = {"fsdp": {"all_gather": 18, "reduce_scatter": 17}, "fsdp_tp": {"all_gather": 28, "all_reduce": 8, "reduce_scatter": 27}}
