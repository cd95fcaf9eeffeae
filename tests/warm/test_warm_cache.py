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
2-rank programs, and the torchtitan client tests' trainings.
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
    from torch._dynamo.utils import counters

    return {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}


def _counted(call: Any) -> tuple[Any, dict[str, int]]:
    """``call()`` and what AOTAutograd's cache did meanwhile (hits, misses, bypasses)."""
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
    assert cached >= 1, f"{what}: the cold run cached nothing (AOT cache {cold}): the warm run tests nothing"
    unsaved = cold.get("miss", 0) - cold.get("saved", 0)
    assert (warm.get("hit", 0), warm.get("miss", 0), warm.get("bypass", 0)) == (cached, unsaved, cold.get("bypass", 0)), (
        f"{what}: AOT cache, cold {cold}, warm {warm}"
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
        budget = sum(p.numel() * p.element_size() for p in reference.parameters()) // 2
        solution = dtcompile.auto_parallel.plan(reference, mesh, args, param_memory_budget_bytes=budget)
        model = dtcompile.auto_parallel.parallelize(copy.deepcopy(reference), solution, mesh)
        results[name] = _counted(
            lambda: step_against_reference(rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, inductor=True)[:4]
        )
    return results


def _zoo_names() -> list[str]:
    from zoo_models import ZOO

    return list(ZOO)


def test_zoo_cold_and_warm_equal_the_single_process_model(tmp_path):
    names = _zoo_names()
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
    from fuzz_check import classify
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
            if c_counts.get("miss"):
                _check_served(c_counts, w_counts, f"program {k}, rank {rank}")
                served += 1
            c_side, w_side = cold[rank][k][0].compiled, warm[rank][k][0].compiled
            if c_side.error is None:
                for a, b in zip(c_side.values, w_side.values):
                    if a.local is not None:
                        _close(b.local, a.local, f"program {k}, rank {rank}: warm vs cold", rtol=1e-6, atol=1e-6)
    assert not problems, "\n\n".join(problems)
    # Most programs compile a graph that is cached (some only raise, as eager does).
    assert served >= WORLD_SIZE * FUZZ_PROGRAMS // 2, f"only {served} rank-programs were served by the cache"


# ---- the torchtitan clients


def _titan_rank(rank: int, suite: str, variant: Any, options: dict[str, Any] | None, weights: Any, batches: Any) -> Any:
    """One client training on this rank, compiled with dtcompile(**options) unless None; with what
    AOTAutograd's cache did."""
    from _titan import deterministic_algorithms, torchtitan_on_cpu

    if suite == "llama3":
        import test_torchtitan as module

        with torchtitan_on_cpu():
            return _counted(lambda: module._train_on_rank(rank, variant, options, weights, batches))
    if suite == "spmd_types":
        import test_torchtitan_spmd_types as module

        with torchtitan_on_cpu(spmd_backend="spmd_types"):
            return _counted(lambda: module._train_on_rank(rank, variant, options, weights, batches))
    import test_torchtitan_moe as module

    with torchtitan_on_cpu(), deterministic_algorithms():
        return _counted(lambda: module._train_on_rank(rank, WORLD_SIZE, options, weights, batches)[0])


def _titan_inputs(suite: str, variant: Any) -> tuple[Any, Any]:
    from _titan import global_batches, initial_weights

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


@pytest.mark.models
@pytest.mark.parametrize("client", CLIENTS)
def test_torchtitan_cold_and_warm_equal_eager(client, tmp_path):
    from _titan import mismatches, raise_mismatches, require_torchtitan

    require_torchtitan()
    suite, variant, tol = CLIENTS[client]
    weights, batches = _titan_inputs(suite, variant)
    eager = run_gloo(WORLD_SIZE, _titan_rank, suite, variant, None, weights, batches, timeout=TIMEOUT)
    cold, warm = run_cold_and_warm(WORLD_SIZE, _titan_rank, suite, variant, {}, weights, batches, cache_dir=tmp_path, timeout=TIMEOUT)
    problems = []
    for rank in range(WORLD_SIZE):
        (c_run, c_counts), (w_run, w_counts) = cold[rank], warm[rank]
        _check_served(c_counts, w_counts, f"{client}, rank {rank}")
        problems += mismatches(c_run, eager[rank][0], f"rank {rank} cold vs eager", **tol)
        problems += mismatches(w_run, eager[rank][0], f"rank {rank} warm vs eager", **tol)
        problems += mismatches(w_run, c_run, f"rank {rank} warm vs cold", rtol=1e-6, atol=1e-6)
    raise_mismatches(problems)
