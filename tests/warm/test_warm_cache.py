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
zoo (planned on the ranks' 1-D mesh), a batch of the program fuzzer's
2-rank programs, and the torchtitan client tests' trainings.  CI runs five of
the zoo's models and two of the clients; the ``soak`` tier (``pytest -m soak``)
the others.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

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
    from ap_cases import KEEP_COLLECTIVES, step_against_reference
    from torch.distributed.device_mesh import init_device_mesh
    from zoo_models import build

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
    from zoo_models import ZOO

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
    from fuzz_programs import MESHES
    from fuzz_world import _mesh, _run_program

    import dtcompile

    _, shape, names = MESHES["1d2"]
    mesh = _mesh(WORLD_SIZE, shape, names)
    backend = dtcompile.backend()
    return [
        _counted(lambda k=k, p=p: _run_program(rank, k, p, mesh, backend, lambda side: dist.barrier()))
        for k, p in enumerate(programs)
    ]


@pytest.mark.fuzz
def test_fuzz_batch_cold_and_warm_equal_eager(tmp_path):
    from fuzz_check import _compare_sides, classify
    from fuzz_generate import generate_programs
    from fuzz_world import ProgramRun

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


def _titan_rank(rank: int, suite: str, variant: Any, weights: Any, batches: Any, eager: bool) -> tuple[Any, Any, dict[str, int]]:
    """One client training on this rank eagerly (if ``eager``), then compiled with dtcompile's
    defaults: both runs, and what the compile caches did meanwhile.  (Real ranks are processes:
    eager and compiled can share one, except under spmd_types, whose second build in a process
    refuses its first build's mesh.)"""
    from _titan import deterministic_algorithms, torchtitan_on_cpu

    if suite == "llama3":
        import test_torchtitan as module

        context, train = torchtitan_on_cpu(), lambda options: module._train_on_rank(rank, variant, options, weights, batches)
    elif suite == "spmd_types":
        import test_torchtitan_spmd_types as module

        context = torchtitan_on_cpu(spmd_backend="spmd_types")
        train = lambda options: module._train_on_rank(rank, variant, options, weights, batches)
    else:
        import test_torchtitan_moe as module

        context = torchtitan_on_cpu()
        train = lambda options: module._train_on_rank(rank, WORLD_SIZE, options, weights, batches)[0]
    with context, deterministic_algorithms():
        eager_run = train(None) if eager else None
        compiled, counts = _counted(lambda: train({}))
    return eager_run, compiled, counts


def _titan_eager_rank(rank: int, suite: str, variant: Any, weights: Any, batches: Any) -> Any:
    """The eager training alone (spmd_types: a process of its own)."""
    import test_torchtitan_spmd_types as module
    from _titan import deterministic_algorithms, torchtitan_on_cpu

    assert suite == "spmd_types", suite
    with torchtitan_on_cpu(spmd_backend="spmd_types"), deterministic_algorithms():
        return module._train_on_rank(rank, variant, None, weights, batches)


def _titan_inputs(suite: str, variant: Any) -> tuple[Any, Any]:
    """The client test's initial weights and batches, made as its own test makes them."""
    from _titan import global_batches, initial_weights, torchtitan_on_cpu

    with torchtitan_on_cpu():  # torchtitan imported as on the ranks (its EP kernels stood in for)
        if suite == "llama3":
            import test_torchtitan as module

            config = module._llama3_config()
        elif suite == "spmd_types":
            import test_torchtitan_spmd_types as module

            config = module.MODELS[variant]()
        else:
            import test_torchtitan_moe as module

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
# CI runs torchtitan's two paths warm, DTensor TP + SP and its default spmd_types; the soak tier
# the other three (2 to 3 min each of Inductor compiles on 2 cores).
CLIENTS_IN_CI = ("llama3_tp_sp", "spmd_types_llama3")


@pytest.mark.models
@pytest.mark.parametrize(
    "client", [c if c in CLIENTS_IN_CI else pytest.param(c, marks=pytest.mark.soak) for c in CLIENTS]
)
def test_torchtitan_cold_and_warm_equal_eager(client, tmp_path):
    from _titan import mismatches, raise_mismatches, require_torchtitan

    require_torchtitan()
    suite, variant, tol = CLIENTS[client]
    if suite == "spmd_types":
        import test_torchtitan_spmd_types

        if not test_torchtitan_spmd_types._fsdp2_stores_spmd_types():
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
