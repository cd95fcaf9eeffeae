"""The compile cache's warm path, tested differentially (issue #37).

A restarted job is served by torch's compile caches (AOTAutograd's and
Inductor's, in ``TORCHINDUCTOR_CACHE_DIR``), and every rank of a node shares
that folder.  Here each suite's programs run on 2 gloo ranks twice with
dtcompile's defaults (Inductor, ``aot_cache=True``), the ranks of both runs
sharing one cache folder (:func:`dtcompile.testing.run_cold_and_warm`): a cold
run that compiles and writes every entry, then a warm one, fresh processes
served by those entries.  Both must equal eager (and the single-process model
where the suite has one), and the warm run must equal the cold one on the same
rank; the warm run must have been served by the cache (AOTAutograd hits, no
misses), or it tested nothing.  A key that let one rank load another's entry
gave wrong gradients on the warm run only.

The suites: the shared models (:data:`dtcompile._testing.cases.CASES`,
issue #37's FSDP-style stack among them), every model of the auto-parallel
zoo (planned on the ranks' 1-D mesh), the HuggingFace zoo's compiled models
(planned so too), a batch of the program fuzzer's 2-rank programs, the
torchtitan client tests' trainings, and torchtitan's Llama3 block with
``spmd_types`` types on its input (the types must reach the warm run too), and
``compile_step``'s whole-step graph with AdamW inside (Inductor's cache serves
the restart).  CI
runs five of the zoo's models and the typed block; the ``soak`` tier
(``pytest -m soak``) the others, the HF zoo's, the fuzz batch and the clients'
trainings.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from dtcompile.base.channels import parse_artifact
from dtcompile.testing import run_cold_and_warm, run_gloo

pytestmark = [pytest.mark.warm, pytest.mark.gloo, pytest.mark.inductor, pytest.mark.subprocess]

WORLD_SIZE = 2
TIMEOUT = 900.0


def _aot_counts() -> dict[str, int]:
    """AOTAutograd's cache counters (``hit``, ``miss``, ``saved``, ``bypass``) and Inductor's FX
    graph cache's (``fxgraph_hit``, ...)."""
    from torch._dynamo.utils import counters

    aot = {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}
    fx = {k.replace("_cache", ""): v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {**aot, **fx}


def _counted(call: Any) -> tuple[Any, dict[str, int]]:
    """``call()`` and what the compile caches did meanwhile (hits, misses, bypasses)."""
    before = _aot_counts()
    result = call()
    after = _aot_counts()
    return result, {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _check_served(cold: dict[str, int], warm: dict[str, int], what: str) -> None:
    """The warm run was served every graph the cold one cached: those it saved, and those it
    found cached by an earlier program of the same run (the same graph on the same rank).  A
    graph the cache cannot hold (``bypass``), or that was not saved (a graph torch could not
    trace runs eagerly), is compiled by both."""
    cached = cold.get("saved", 0) + cold.get("hit", 0)
    assert cached >= 1, f"{what}: the cold run cached nothing (caches: {cold}): the warm run tests nothing"
    unsaved = cold.get("miss", 0) - cold.get("saved", 0)
    assert (warm.get("hit", 0), warm.get("miss", 0), warm.get("bypass", 0)) == (cached, unsaved, cold.get("bypass", 0)), (
        f"{what}: caches, cold {cold}, warm {warm}"
    )


def _check_lowering_served(cold: dict[str, int], warm: dict[str, int], what: str) -> None:
    """For graphs AOTAutograd's cache refuses (torchtitan's: a custom ``autograd.Function``, a
    backend looked up by name): the warm run traced and partitioned them again, and Inductor's
    FX graph cache (keyed on the partitioned graph, baked constants included) served them.  Not
    every one: torchtitan's loss graphs (a mesh among their inputs) key differently in every
    process, with every component's hash equal (the key's pickle differs), and are lowered again."""
    lowered = cold.get("fxgraph_miss", 0)
    assert lowered >= 1, f"{what}: the cold run lowered nothing (caches: {cold})"
    assert warm.get("fxgraph_hit", 0) >= 1 and warm.get("fxgraph_hit", 0) + warm.get("fxgraph_miss", 0) == lowered, (
        f"{what}: caches, cold {cold}, warm {warm}"
    )


def _source_digest() -> str:
    """The digest of dtcompile's source that its compile key carries (:func:`dtcompile.cache_keys.source_digest`)."""
    from dtcompile.cache_keys import source_digest

    return source_digest()


def _check_same_source(cold: str, warm: str, what: str) -> None:
    """The cold and warm runs compiled with the same dtcompile source: an edit in between changes
    every compile key, and the warm run is rightly not served (a rerun, not a bug)."""
    assert cold == warm, f"{what}: dtcompile's source changed between the cold and warm runs ({cold} -> {warm})"


def _close(got: Any, want: Any, what: str, **tol: float) -> None:
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


# ---- the shared models


def _cases_rank(rank: int, names: list[str]) -> dict[str, Any]:
    from dtcompile._testing.cases import rank_eager_and_compiled

    results = {}
    for name in names:
        torch._dynamo.reset()
        results[name] = _counted(lambda n=name: rank_eager_and_compiled(rank, n, WORLD_SIZE, {}))
    return results


def test_shared_models_cold_and_warm_equal_eager_and_one_process(tmp_path):
    from dtcompile._testing.cases import CASES, assert_steps_close, reference_step

    names = list(CASES)
    cold, warm = run_cold_and_warm(WORLD_SIZE, _cases_rank, names, cache_dir=tmp_path, timeout=TIMEOUT)
    for name in names:
        case = CASES[name]
        reference = reference_step(name, WORLD_SIZE)
        for rank in range(WORLD_SIZE):
            (c_eager, c_compiled, _), c_counts = cold[rank][name]
            (w_eager, w_compiled, _), w_counts = warm[rank][name]
            _check_served(c_counts, w_counts, f"{name}, rank {rank}")
            want_out = _local_output(case, reference.output, _coordinate(case, rank))
            for run, eager, compiled in (("cold", c_eager, c_compiled), ("warm", w_eager, w_compiled)):
                what = f"{name}, rank {rank}, {run}"
                assert_steps_close(compiled, eager, f"{what}: compiled vs eager", rtol=1e-4, atol=1e-5)
                _close(eager.output, want_out, f"{what}: eager vs one process: output", rtol=1e-4, atol=1e-5)
                for param, grad in eager.grads.items():
                    _close(grad, reference.grads[param], f"{what}: eager vs one process: grad of {param}", rtol=1e-4, atol=1e-5)
            assert_steps_close(w_compiled, c_compiled, f"{name}, rank {rank}: warm vs cold", rtol=1e-6, atol=1e-6)


def _coordinate(case: Any, rank: int) -> tuple[int, ...]:
    shape = case.mesh_shape(WORLD_SIZE)
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(rank), shape))


def _local_output(case: Any, output: torch.Tensor, coordinate: tuple[int, ...]) -> torch.Tensor:
    """The slice of the one-process output this rank's output must equal."""
    if case.data_parallel_axis is None:
        return output
    axis = case.mesh_dim_names.index(case.data_parallel_axis)
    return output.chunk(case.mesh_shape(WORLD_SIZE)[axis])[coordinate[axis]]


# ---- the auto-parallel zoo


def _zoo_rank(rank: int, names: list[str]) -> dict[str, Any]:
    from support.ap_cases import KEEP_COLLECTIVES, step_against_reference
    from support.zoo_models import build
    from torch.distributed.device_mesh import init_device_mesh

    import dtcompile

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    results = {}
    for name in names:
        torch._dynamo.reset()
        reference, args = build(name)
        # Under 3/4 of the replicated parameter bytes: the solver must shard (half is the least on 2 ranks).
        budget = sum(p.numel() * p.element_size() for p in reference.parameters()) * 3 // 4
        solution = dtcompile.auto_parallel.plan(reference, mesh, args, param_memory_budget_bytes=budget)
        model = dtcompile.auto_parallel.parallelize(copy.deepcopy(reference), solution, mesh)
        results[name] = _counted(
            lambda: step_against_reference(rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, inductor=True)[:4]
        )
    return results


# The zoo models CI runs warm (embeddings, tied weights, a convolution, SDPA, buffers); the
# soak tier runs the rest (two of them torchtitan's, 5 min of Inductor compiles on 2 cores).
ZOO_IN_CI = ("small_lm", "tied_embeddings_lm", "groupnorm_conv", "causal_sdpa", "with_buffers")


def _zoo_names(group: str) -> list[str]:
    from support.zoo_models import ZOO

    return [name for name in ZOO if (name in ZOO_IN_CI) == (group == "ci")]


@pytest.mark.parametrize("group", ["ci", pytest.param("soak", marks=pytest.mark.soak)])
def test_zoo_cold_and_warm_equal_the_single_process_model(group, tmp_path):
    names = _zoo_names(group)
    cold, warm = run_cold_and_warm(WORLD_SIZE, _zoo_rank, names, cache_dir=tmp_path, timeout=TIMEOUT)
    for name in names:
        for rank in range(WORLD_SIZE):
            (c_out, c_grads, ref_out, ref_grads), c_counts = cold[rank][name]
            (w_out, w_grads, _, _), w_counts = warm[rank][name]
            _check_served(c_counts, w_counts, f"{name}, rank {rank}")
            for run, out, grads in (("cold", c_out, c_grads), ("warm", w_out, w_grads)):
                what = f"{name}, rank {rank}, {run}"
                _close(out, ref_out, f"{what}: output", rtol=1e-4, atol=1e-5)
                assert grads.keys() == ref_grads.keys(), what
                for param, grad in grads.items():
                    _close(grad, ref_grads[param], f"{what}: grad of {param}", rtol=1e-4, atol=1e-5)
            _close((w_out, w_grads), (c_out, c_grads), f"{name}, rank {rank}: warm vs cold", rtol=1e-6, atol=1e-6)


# ---- the program fuzzer

FUZZ_PROGRAMS = 24
FUZZ_SEED = 20261125


def _fuzz_rank(rank: int, programs: list[Any]) -> list[Any]:
    import torch.distributed as dist
    from support.fuzz_programs import MESHES
    from support.fuzz_world import _mesh, _run_program

    import dtcompile

    _, shape, names = MESHES["1d2"]
    mesh = _mesh(WORLD_SIZE, shape, names)
    backend = dtcompile.backend()
    return [
        _counted(lambda k=k, p=p: _run_program(rank, k, p, mesh, backend, lambda side: dist.barrier()))
        for k, p in enumerate(programs)
    ]


# In the soak tier (59 s of a worker): CI's warm path is the shared models', the zoo's, the
# typed block's and compile_step's above, and the fuzzer's programs run cold in its batch.
@pytest.mark.fuzz
@pytest.mark.soak
def test_fuzz_batch_cold_and_warm_equal_eager(tmp_path):
    from support.fuzz_check import _compare_sides, classify
    from support.fuzz_generate import generate_programs
    from support.fuzz_world import ProgramRun

    programs = generate_programs({"1d2": FUZZ_PROGRAMS}, FUZZ_SEED)
    cold, warm = run_cold_and_warm(WORLD_SIZE, _fuzz_rank, programs, cache_dir=tmp_path, timeout=TIMEOUT)
    problems, served = [], 0
    for k, program in enumerate(programs):
        for run, ranks in (("cold", cold), ("warm", warm)):
            verdict = classify(ProgramRun(program, [ranks[r][k][0] for r in range(WORLD_SIZE)]))
            if verdict.kind not in ("ok", "both_raise"):
                problems.append(f"program {k}, {run}: {verdict.signature}\n{program.describe()}{verdict.detail[-1500:]}")
        for rank in range(WORLD_SIZE):
            c_counts, w_counts = cold[rank][k][1], warm[rank][k][1]
            if c_counts.get("saved", 0) + c_counts.get("hit", 0):  # not when it only raised, or ran eagerly
                _check_served(c_counts, w_counts, f"program {k}, rank {rank}")
                served += 1
            # The warm compiled run against the cold one: outputs, loss and gradients, rank by rank.
            found, _ = _compare_sides(program, rank, cold[rank][k][0].compiled, warm[rank][k][0].compiled)
            problems += [f"program {k}, warm vs cold: {p}" for p in found]
    assert not problems, "\n\n".join(problems)
    # Many programs compile a graph that is cached; the others raise, as eager does, or are
    # refused by torch's AOTAutograd and run eagerly (22 of 48 rank-programs were served at seed 20261125).
    assert served >= WORLD_SIZE * FUZZ_PROGRAMS // 3, f"only {served} rank-programs were served by the cache"


# ---- the torchtitan clients


def _client_tests(name: str) -> Any:
    """The torchtitan client test module ``tests/clients/<name>.py``, whose training functions
    these tests restart warm: loaded from its file, once per process, under the name pytest
    imports it by (a test module, not a ``support`` helper, so not importable from here)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "clients" / f"{name}.py"
    module = sys.modules.get(name)
    if module is not None:
        assert Path(module.__file__).resolve() == path, f"{name} is {module.__file__}, not {path}"
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _titan_rank(rank: int, suite: str, variant: Any, weights: Any, batches: Any, eager: bool) -> tuple[Any, Any, dict[str, int]]:
    """One client training on this rank eagerly (if ``eager``), then compiled with dtcompile's
    defaults: both runs, and what the compile caches did meanwhile.  (Real ranks are processes:
    eager and compiled can share one, except under spmd_types, whose second build in a process
    refuses its first build's mesh.)"""
    from support.titan import deterministic_algorithms, torchtitan_on_cpu

    if suite == "llama3":
        module = _client_tests("test_torchtitan")
        context, train = torchtitan_on_cpu(), lambda options: module._train_on_rank(rank, variant, options, weights, batches)
    elif suite == "spmd_types":
        module = _client_tests("test_torchtitan_spmd_types")
        context = torchtitan_on_cpu(spmd_backend="spmd_types")
        train = lambda options: module._train_on_rank(rank, variant, options, weights, batches)
    else:
        module = _client_tests("test_torchtitan_moe")
        context = torchtitan_on_cpu()
        train = lambda options: module._train_on_rank(rank, WORLD_SIZE, options, weights, batches)[0]
    with context, deterministic_algorithms():
        eager_run = train(None) if eager else None
        compiled, counts = _counted(lambda: train({}))
    return eager_run, compiled, counts


def _titan_eager_rank(rank: int, suite: str, variant: Any, weights: Any, batches: Any) -> Any:
    """The eager training alone (spmd_types: a process of its own)."""
    from support.titan import deterministic_algorithms, torchtitan_on_cpu

    assert suite == "spmd_types", suite
    module = _client_tests("test_torchtitan_spmd_types")
    with torchtitan_on_cpu(spmd_backend="spmd_types"), deterministic_algorithms():
        return module._train_on_rank(rank, variant, None, weights, batches)


def _titan_inputs(suite: str, variant: Any) -> tuple[Any, Any]:
    """The client test's initial weights and batches, made as its own test makes them."""
    from support.titan import global_batches, initial_weights, torchtitan_on_cpu

    with torchtitan_on_cpu():  # torchtitan imported as on the ranks (its EP kernels stood in for)
        if suite == "llama3":
            import support.titan as module  # test_torchtitan's tiny Llama3 and its settings

            config = module.tiny_llama3_config()
        elif suite == "spmd_types":
            module = _client_tests("test_torchtitan_spmd_types")
            config = module.MODELS[variant]()
        else:
            module = _client_tests("test_torchtitan_moe")
            config = module._qwen3_moe_config()
        return initial_weights(config), global_batches(module.NUM_STEPS, module.VOCAB_SIZE, module.SEQ_LEN, module.GLOBAL_BATCH)


# (suite, variant, tolerance against eager): llama3's variant is the tensor parallel degree
# (2: TP + SP; 1: FSDP), spmd_types' the model.  Qwen3 MoE with Inductor computes the
# experts' bfloat16 chain without eager's intermediate roundings (test_torchtitan_moe's
# docstring): bfloat16 units on its gradients.
CLIENTS = {
    "llama3_tp_sp": ("llama3", 2, dict(rtol=1e-5, atol=1e-6)),
    "llama3_fsdp": ("llama3", 1, dict(rtol=1e-5, atol=1e-6)),
    "spmd_types_llama3": ("spmd_types", "llama3", dict(rtol=1e-5, atol=1e-6)),
    "spmd_types_qwen3": ("spmd_types", "qwen3", dict(rtol=1e-5, atol=1e-6)),
    "qwen3_moe_ep": ("moe", None, dict(rtol=1e-3, atol=1e-4)),
}
# CI runs torchtitan's default path, spmd_types, warm through its Llama3 block with its types
# (test_spmd_typed_torchtitan_block_cold_and_warm_equal_eager_with_its_types, below) and the
# carried types (test_compiled_outputs_carry_their_types_on_a_warm_cache_too), and the DTensor
# path warm through the shared models and the zoo above; the soak tier these five
# clients' trainings (1.5 to 3.5 min each of Inductor compiles on 2 cores: spmd_types_llama3
# left CI for the trainer's memory-policy tests, issue #69, to keep CI's time).
CLIENTS_IN_CI: tuple[str, ...] = ()


@pytest.mark.models
@pytest.mark.parametrize(
    "client", [c if c in CLIENTS_IN_CI else pytest.param(c, marks=pytest.mark.soak) for c in CLIENTS]
)
def test_torchtitan_cold_and_warm_equal_eager(client, tmp_path):
    from support.titan import mismatches, raise_mismatches, require_torchtitan

    require_torchtitan()
    suite, variant, tol = CLIENTS[client]
    if suite == "spmd_types":
        if not _client_tests("test_torchtitan_spmd_types")._fsdp2_stores_spmd_types():
            pytest.skip("torch 2.13's FSDP2 refuses torchtitan's spmd_types parameters, eagerly too (test_torchtitan_spmd_types)")
    weights, batches = _titan_inputs(suite, variant)
    together = suite != "spmd_types"
    cold, warm = run_cold_and_warm(
        WORLD_SIZE, _titan_rank, suite, variant, weights, batches, together, cache_dir=tmp_path, timeout=TIMEOUT
    )
    if not together:
        eager = run_gloo(WORLD_SIZE, _titan_eager_rank, suite, variant, weights, batches, timeout=TIMEOUT)
        cold = [(e, c, n) for e, (_, c, n) in zip(eager, cold)]
        warm = [(e, w, n) for e, (_, w, n) in zip(eager, warm)]
    problems = []
    for rank in range(WORLD_SIZE):
        (c_eager, c_run, c_counts), (w_eager, w_run, w_counts) = cold[rank], warm[rank]
        if c_counts.get("bypass"):
            _check_lowering_served(c_counts, w_counts, f"{client}, rank {rank}")
        else:
            _check_served(c_counts, w_counts, f"{client}, rank {rank}")
        problems += mismatches(c_run, c_eager, f"rank {rank} cold vs eager", **tol)
        problems += mismatches(w_run, w_eager, f"rank {rank} warm vs eager", **tol)
        problems += mismatches(w_run, c_run, f"rank {rank} warm vs cold", rtol=1e-6, atol=1e-6)
    raise_mismatches(problems)


# ---- the HuggingFace zoo's compiled subset

# The HF zoo's models it compiles (tests/auto_parallel/hf_zoo: a decoder with RoPE and SDPA,
# GPT-2's fused Conv1D projections, a mixture of experts, Falcon's constants built in forward,
# T5, ViT), here on the ranks' 1-D mesh: the soak tier runs them (each about 115 CPU-seconds on
# 2 cores, most of it the cold run's Inductor compiles); CI's warm path goes through the shared
# models, the zoo and the typed torchtitan block above (CI's time, benchmarks/RESULTS.md).
HF_COMPILED = ("llama", "gpt2", "mixtral", "falcon", "t5", "vit")
HF_IN_CI: tuple[str, ...] = ()


def _hf_rank(rank: int, name: str) -> tuple[Any, dict[str, int], str]:
    """The HF zoo's model ``name`` planned on this rank's 1-D mesh (gathered weights kept, as the
    zoo plans) and one compiled step with dtcompile's defaults (Inductor, the compile cache)
    against the single-process model run eagerly; what the compile caches did; the source digest."""
    from support.ap_cases import KEEP_COLLECTIVES, step_against_reference
    from support.hf_models import build, plan_hf
    from torch.distributed.device_mesh import init_device_mesh

    import dtcompile

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    reference, args = build(name)
    # Under 3/4 of the replicated parameter bytes: the solver must shard (half is the least on 2 ranks).
    budget = sum(p.numel() * p.element_size() for p in reference.parameters()) * 3 // 4
    solution = plan_hf(reference, args, mesh, param_memory_budget_bytes=budget)
    model = dtcompile.auto_parallel.parallelize(copy.deepcopy(reference), solution, mesh)
    step, counts = _counted(
        lambda: step_against_reference(
            rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, inductor=True, reshard=False
        )[:4]
    )
    return step, counts, _source_digest()


@pytest.mark.models
@pytest.mark.parametrize("name", [n if n in HF_IN_CI else pytest.param(n, marks=pytest.mark.soak) for n in HF_COMPILED])
def test_hf_zoo_compiled_cold_and_warm_equal_the_single_process_model(name, tmp_path):
    """A model as people download it from ``transformers`` (HF's modules, RoPE, SDPA, its
    config's constants), planned and compiled as the HF zoo compiles it, restarted on a warm
    cache: both runs equal the single-process eager model (output and every gradient), the warm
    one equals the cold one, and AOTAutograd's cache served every graph the cold run saved."""
    from support.hf_models import require_transformers

    require_transformers()
    cold, warm = run_cold_and_warm(WORLD_SIZE, _hf_rank, name, cache_dir=tmp_path, timeout=TIMEOUT)
    for rank in range(WORLD_SIZE):
        (c_out, c_grads, ref_out, ref_grads), c_counts, c_source = cold[rank]
        (w_out, w_grads, _, _), w_counts, w_source = warm[rank]
        _check_same_source(c_source, w_source, f"{name}, rank {rank}")
        _check_served(c_counts, w_counts, f"{name}, rank {rank}")
        for run, out, grads in (("cold", c_out, c_grads), ("warm", w_out, w_grads)):
            what = f"{name}, rank {rank}, {run}"
            _close(out, ref_out, f"{what}: output", rtol=1e-4, atol=1e-5)
            assert grads.keys() == ref_grads.keys(), what
            assert any(g is not None for g in grads.values()), f"{what}: no parameter got a gradient"
            for param, grad in grads.items():
                _close(grad, ref_grads[param], f"{what}: grad of {param}", rtol=1e-4, atol=1e-5)
        _close((w_out, w_grads), (c_out, c_grads), f"{name}, rank {rank}: warm vs cold", rtol=1e-6, atol=1e-6)


# ---- an SPMD-typed torchtitan block


class _Artifacts:
    """The ``TORCH_TRACE`` artifacts dtcompile and AOTAutograd's cache log (name -> payload, the
    last of each name), read in this process as a ``TORCH_TRACE`` log gets them."""

    def __init__(self) -> None:
        import logging

        self.logged: dict[str, str] = {}
        self.handler = logging.Handler()
        self.handler.emit = self._emit  # type: ignore[method-assign]

    def _emit(self, record: Any) -> None:
        name = (getattr(record, "metadata", {}).get("artifact") or {}).get("name", "")
        if parse_artifact(name) is not None or name.startswith("aotautograd_cache_"):
            self.logged[name] = record.payload

    def __enter__(self) -> _Artifacts:
        from torch._logging._internal import trace_log

        trace_log.addHandler(self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._logging._internal import trace_log

        trace_log.removeHandler(self.handler)


def _typed_block_rank(rank: int) -> dict[str, Any]:
    """torchtitan's Llama3 (spmd_types, TP + SP on the 2 ranks) and its first block, its input
    typed ``S(1)`` on tp as torchtitan's trainer types the model's inputs
    (``spmd_types.assert_type``; test_torchtitan_spmd_types' typed block).  One forward and
    backward eagerly, then compiled with dtcompile's defaults (Inductor, the compile cache): both
    outputs and local gradients, what the compile caches did, the backend's records and cached
    graphs, and the dtcompile artifacts logged.  Then the same input typed ``P`` (a partial sum,
    which the block's norm cannot take), compiled afresh: the error it raises."""
    import spmd_types as spmd
    from support.titan import initial_weights, load_weights, parallelize, torchtitan_on_cpu
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    import dtcompile

    module = _client_tests("test_torchtitan_spmd_types")

    def local(t: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    with torchtitan_on_cpu(spmd_backend="spmd_types"):
        parallelism = ParallelismConfig(tensor_parallel_degree=WORLD_SIZE, enable_sequence_parallel=True)
        parallel_dims = ParallelDims.from_config(parallelism, WORLD_SIZE)
        parallel_dims.build_mesh()
        config = module.MODELS["llama3"]()
        set_llama3_sharding_config(config, enable_sp=True)
        with torch.device("meta"):
            model = config.build()
        model = parallelize(parallelize_llama, model, parallel_dims, parallelism, CompileConfig(enable=False))
        load_weights(model, initial_weights(module.MODELS["llama3"]()))
        block = model.layers["0"]
        torch.manual_seed(0)  # the same activations on both ranks; each takes its sequence shard
        x = torch.randn(2, module.SEQ_LEN, module.DIM).chunk(WORLD_SIZE, dim=1)[rank].contiguous()

        def step(run: Any, typed: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            block.zero_grad(set_to_none=True)
            x_typed = x.clone()
            spmd.assert_type(x_typed, {"tp": typed})
            out = run(x_typed, None)
            out.pow(2).mean().backward()
            return out.detach(), {n: local(p.grad).clone() for n, p in block.named_parameters()}

        result: dict[str, Any] = {}
        with set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()):
            result["eager"] = step(block, spmd.S(1))
            backend = dtcompile.backend()
            with _Artifacts() as artifacts:
                compiled = torch.compile(block, backend=backend)
                result["compiled"], result["counts"] = _counted(lambda: step(compiled, spmd.S(1)))
            result["artifacts"] = artifacts.logged
            result["records"] = [(r.kind, r.info.spmd_inputs, r.annotated()) for r in backend.records]
            result["cached"] = [(c.compile_id, c.reported, str(c)) for c in backend.cached]
            torch._dynamo.reset()
            try:
                step(torch.compile(block, backend=dtcompile.backend()), spmd.P)
            except Exception as exc:  # the compile's error, as the user sees it
                result["partial"] = f"{type(exc).__name__}: {exc}"
            else:
                result["partial"] = None
    result["source"] = _source_digest()
    return result


def _typed_lines(text: str) -> list[str]:
    """The node lines of a ``dtcompile_<kind>_graph`` artifact (``name = op(...)  # ...; tp:S(1)``)."""
    return [line for line in text.splitlines() if " = " in line and "  # " in line]


@pytest.mark.models
def test_spmd_typed_torchtitan_block_cold_and_warm_equal_eager_with_its_types(tmp_path):
    """torchtitan's Llama3 block under spmd_types (plain tensors typed per mesh axis, explicit
    collectives), its input typed ``S(1)`` on tp, compiled with dtcompile's defaults and
    restarted on a warm cache.  The types are read at compile time and are part of the compile
    key (``dtcompile.cache_keys.compile_key``), so a warm run must neither lose them nor be
    served a graph checked for other types.

    Both runs equal eager (output and every local gradient), the warm one the cold one; the warm
    run was served by the caches.  AOTAutograd's cache refuses this graph (a ``bypass``:
    spmd_types' collectives are autograd Functions, traced as ``autograd_function_apply``, which
    it does not cache), so the warm run traces it again and its type check runs again, on the same
    input types, and Inductor's FX graph cache (keyed on the compile key, the types in it) serves
    both lowered graphs; were it served whole (a hit, nothing traced), the warm backend's
    ``cached`` must say the cold run's report was logged again.
    Either way the warm run's ``TORCH_TRACE`` artifacts show the types the cold run's do: the
    sequence all-gathered (``S(1)`` -> ``R``), ``wo`` and ``w2`` leaving partial sums (``P``),
    reduce-scattered, no node of unknown type.  And the same input typed ``P`` (a partial sum
    into the block's norm) is a compile-time ``SpmdTypeCheckError`` on the warm run as on the
    cold: not served the entry checked for ``S(1)``."""
    from support.titan import require_torchtitan

    from dtcompile.base.channels import Artifact, GraphKind

    require_torchtitan()
    if not _client_tests("test_torchtitan_spmd_types")._fsdp2_stores_spmd_types():
        pytest.skip("torch 2.13's FSDP2 refuses torchtitan's spmd_types parameters (test_torchtitan_spmd_types)")
    cold, warm = run_cold_and_warm(WORLD_SIZE, _typed_block_rank, cache_dir=tmp_path, timeout=TIMEOUT)
    forward, backward = Artifact.graph(GraphKind.FORWARD), Artifact.graph(GraphKind.BACKWARD)
    for rank in range(WORLD_SIZE):
        c, w = cold[rank], warm[rank]
        for run, result in (("cold", c), ("warm", w)):
            what = f"rank {rank}, {run}"
            (out, grads), (eager_out, eager_grads) = result["compiled"], result["eager"]
            _close(out, eager_out, f"{what}: output vs eager", rtol=1e-5, atol=1e-6)
            assert grads.keys() == eager_grads.keys() and grads, what
            for param, grad in grads.items():
                _close(grad, eager_grads[param], f"{what}: grad of {param} vs eager", rtol=1e-5, atol=1e-6)
            partial = result["partial"]
            assert partial is not None, f"{what}: the block compiled with its input typed P"
            assert "SpmdTypeCheckError" in partial and "mesh axis 'tp'" in partial, f"{what}: {partial}"
            assert "aten.pow.Tensor_Scalar" in partial and "non-linear" in partial, f"{what}: {partial}"
        _close(w["compiled"], c["compiled"], f"rank {rank}: warm vs cold", rtol=1e-6, atol=1e-6)

        c_counts, w_counts = c["counts"], w["counts"]
        what = f"rank {rank}: caches, cold {c_counts}, warm {w_counts}"
        _check_same_source(c["source"], w["source"], f"rank {rank}")
        # Every input typed on tp, read alike on both runs (the activation S(1), the weights R or S(d)).
        (c_forward,) = [types for kind, types, _ in c["records"] if kind == GraphKind.FORWARD]
        assert c_forward and c_forward[0] == {"tp": "S(1)"} and all(c_forward), c_forward
        if c_counts.get("bypass"):
            reason = json.loads(c["artifacts"].get("aotautograd_cache_bypass", "{}")).get("cache_bypass_reason")
            # Every graph the cold run lowered (or found lowered by the other rank) is served lowered.
            lowered = c_counts.get("fxgraph_miss", 0) + c_counts.get("fxgraph_hit", 0)
            assert lowered >= 2 and w_counts == {"bypass": 1, "fxgraph_hit": lowered}, f"{what}; bypassed: {reason}"
            # Traced again: the type check ran again, on the same types.
            typed = {run: [r[:2] for r in result["records"]] for run, result in (("cold", c), ("warm", w))}
            assert typed["warm"] == typed["cold"], f"rank {rank}: graphs and their inputs' types: {typed}"
            assert not w["cached"], what
        else:
            _check_served(c_counts, w_counts, f"rank {rank}")
            assert not w["records"] and w["cached"], what
            assert all(reported for _, reported, _ in w["cached"]), f"rank {rank}: {w['cached']}"
        # What a TORCH_TRACE of the warm run shows: the cold run's typed graphs.
        for name in (forward, backward):
            assert w["artifacts"].get(name) == c["artifacts"].get(name), f"rank {rank}: {name} differs warm vs cold"
            lines = _typed_lines(w["artifacts"][name])
            assert lines and not [line for line in lines if "tp:?" in line], f"rank {rank}: {name}:\n{w['artifacts'][name]}"

        def types_of(op: str, text: str = w["artifacts"][forward]) -> list[str]:
            return [line.rsplit("tp:", 1)[1] for line in _typed_lines(text) if f"= {op}(" in line]

        assert types_of("aten.mm.default") == ["S(1)", "P", "S(1)", "S(1)", "P"], w["artifacts"][forward]
        assert types_of("_c10d_functional.all_gather_into_tensor.default") == ["R", "R"], w["artifacts"][forward]
        assert types_of("_c10d_functional.reduce_scatter_tensor.default") == ["S(0)", "S(0)"], w["artifacts"][forward]


def _carried_rank(rank: int) -> dict[str, Any]:
    """test_spmd_carry's chain on a gloo rank, with dtcompile's defaults (Inductor, the compile
    cache): a row-parallel matmul compiled on its own, its output all-reduced (``R``) or left a
    partial sum (``P``), then a bias add compiled on its own that takes it with no annotation."""
    import spmd_types as spmd
    import torch.distributed as dist

    import dtcompile

    module = _client_tests("test_spmd_carry")
    x, w, b = module._inputs(rank)
    result: dict[str, Any] = {}
    for reduce in (True, False):
        backend = dtcompile.backend()
        first = torch.compile(module._row_parallel, backend=backend, fullgraph=True)
        second = torch.compile(module._add_bias, backend=backend, fullgraph=True)
        y, _ = first(x, w, reduce)
        entry: dict[str, Any] = {"y": {str(a): repr(t) for a, t in spmd.get_local_type(y).items()},
                                 "served": len(backend.cached)}
        try:
            entry["out"] = second(y, b)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        result[reduce] = entry
        torch._dynamo.reset()
    dist.barrier()
    return result


def test_compiled_outputs_carry_their_types_on_a_warm_cache_too(tmp_path):
    """A graph the compile cache serves is not traced, so the types its outputs carry come from
    beside the cache (``BesideCacheFolders.SPMD_TYPES``): the warm run stamps what the cold one
    did, and the next graph is typed and checked alike, a partial sum refused on both runs."""
    pytest.importorskip("spmd_types")
    cold, warm = run_cold_and_warm(WORLD_SIZE, _carried_rank, cache_dir=tmp_path, timeout=TIMEOUT)
    for rank in range(WORLD_SIZE):
        c, w = cold[rank], warm[rank]
        assert w[True]["served"] >= 1, f"rank {rank}: the warm run served nothing from the cache: {w}"
        for run, result in (("cold", c), ("warm", w)):
            what = f"rank {rank}, {run}"
            (reduced_axis_type,) = result[True]["y"].values()
            (partial_axis_type,) = result[False]["y"].values()
            assert (reduced_axis_type, partial_axis_type) == ("R", "P"), f"{what}: {result}"
            assert "error" not in result[True], f"{what}: {result[True]['error']}"
            error = result[False].get("error")
            assert error is not None and "SpmdTypeCheckError" in error and "in _add_bias" in error, f"{what}: {error}"
        torch.testing.assert_close(w[True]["out"], c[True]["out"])


def _step_rank(rank: int) -> dict[str, Any]:
    """``compile_step`` with AdamW inside, Inductor-lowered, on the SimpleFSDP stack: 3 steps
    (the first eager, creating AdamW's state) against the same model stepped eagerly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dtcompile
    from dtcompile._testing import models

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    built = [models.build_norm_mlp_stack(mesh, rows=4, dim=16, hidden=32, layers=2) for _ in range(2)]
    (_, model, x), (_, eager, _) = built
    batches = [(x + 0.5 * i).chunk(WORLD_SIZE)[rank] for i in range(3)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=0.01, foreach=False)
    step = dtcompile.compile_step(lambda x: model(x).pow(2).mean(), model=model, optimizer=optimizer)
    losses, eager_losses = [], []
    caches: dict[str, int] = {}
    for batch in batches:
        loss, counted = _counted(lambda: step(batch))
        losses.append(loss)
        caches = {k: caches.get(k, 0) + counted.get(k, 0) for k in {*caches, *counted}}
        eager_loss = eager(batch).pow(2).mean()
        eager_loss.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad(set_to_none=True)
        eager_losses.append(eager_loss.detach())
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    eager_full = [p.full_tensor() if isinstance(p, DTensor) else p for p in eager.parameters()]
    return {"losses": losses, "eager_losses": eager_losses, "params": full, "eager_params": eager_full,
            "caches": caches, "traces": step.traces, "source": _source_digest()}


def test_compile_step_cold_and_warm_equal_eager(tmp_path):
    cold, warm = run_cold_and_warm(WORLD_SIZE, _step_rank, cache_dir=tmp_path / "cache", timeout=TIMEOUT)
    for rank, (c, w) in enumerate(zip(cold, warm, strict=True)):
        what = f"compile_step rank {rank}"
        _check_same_source(c["source"], w["source"], what)
        for run in (c, w):
            assert run["traces"] == 1, what
            _close(run["losses"], run["eager_losses"], what, rtol=1e-5, atol=1e-6)
            _close(run["params"], run["eager_params"], what, rtol=1e-5, atol=1e-6)
        # The restart computes what the first run did, served by Inductor's cache.
        assert all(torch.equal(a, b) for a, b in zip(c["params"], w["params"], strict=True)), what
        _check_lowering_served(c["caches"], w["caches"], what)
