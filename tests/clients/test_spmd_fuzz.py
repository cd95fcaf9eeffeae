"""The SPMD-type fuzzer: generated tensor- and sequence-parallel programs (``tests/support/spmd_fuzz.py``)
on 2 ranks as threads, their inputs and parameters typed with ``spmd_types``, compiled with dtcompile.

Every planted program (a missing, a doubled reduction, a partial sum through a nonlinearity) is a
compile-time ``SpmdTypeCheckError`` on every rank, naming the program's line; every unplanted one
compiles with no refusal, types every node of its forward on the world's axis (no ``?``), and
computes what eager does: output and the gradients of the stream and every parameter.  200 programs (the CI run
on the newest torch), 25 per test so that the two workers share them; ``--fuzz-examples N`` runs the first N
(rounded up to 25; CI's older releases run 50, their typing rules being the same code on another torch's traces).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.pinned import require_pinned
from support.spmd_fuzz import WORLD, SpmdProgram, build, generate, run_program

import dtcompile
from dtcompile.spmd.inference import SpmdTypeCheckError
from dtcompile.testing import run_threaded

pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # funcol's *_tensor names, as torchtitan calls them

PROGRAMS, PER_TEST = 200, 25


@pytest.fixture(autouse=True)
def _spmd_types_installed() -> None:
    require_pinned("spmd_types", "0.2.3", "pip install --no-deps -r tests/clients/requirements.txt")


def _on_rank(rank: int, programs: list[SpmdProgram]) -> list[dict[str, Any]]:
    results = []
    for program in programs:
        fn = build(program)
        result: dict[str, Any] = {"eager": run_program(fn, program, rank)}
        backend = dtcompile.backend(inductor=False)
        try:
            result["compiled"] = run_program(torch.compile(fn, backend=backend, fullgraph=True), program, rank)
        except Exception as exc:  # the check's refusal, or a failure the test reports with the program
            result["error"] = exc
        result["types"] = [types for r in backend.records if r.kind == "forward" for types in r.spmd_types_traced.values()]
        results.append(result)
    return results


@pytest.mark.parametrize("chunk", range(PROGRAMS // PER_TEST))
def test_every_plant_is_refused_and_every_clean_program_compiles_equal_to_eager(chunk, fuzz_options):
    budget = fuzz_options[0] or PROGRAMS
    if chunk * PER_TEST >= budget:
        pytest.skip(f"programs {chunk * PER_TEST}-{(chunk + 1) * PER_TEST - 1}: beyond --fuzz-examples {budget}")
    programs = [generate(seed) for seed in range(chunk * PER_TEST, (chunk + 1) * PER_TEST)]
    by_rank = run_threaded(WORLD, _on_rank, programs)
    torch._dynamo.reset()  # the programs' code objects go with their cache entries
    failures = []
    for index, program in enumerate(programs):
        for rank, results in enumerate(by_rank):
            result = results[index]
            error = result.get("error")
            if program.plant is not None:
                refused = isinstance(error, SpmdTypeCheckError) or "SpmdTypeCheckError" in str(error)
                if not refused:
                    failures.append(f"rank {rank}: planted, not refused ({error!r})\n{program.describe()}")
                elif f"<spmd program {program.seed}>" not in str(error):
                    failures.append(f"rank {rank}: the refusal names no line of the program: {error}")
                continue
            if error is not None:
                failures.append(f"rank {rank}: clean, refused or failed: {type(error).__name__}: {error}\n{program.describe()}")
                continue
            unknown = [t for t in result["types"] if "?" in t.values()]
            if not result["types"] or unknown:
                failures.append(f"rank {rank}: forward not typed on every node ({len(unknown)} with ?)\n{program.describe()}")
            (out, grads), (eager_out, eager_grads) = result["compiled"], result["eager"]
            try:
                for got, want in zip([out, *grads], [eager_out, *eager_grads]):
                    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * max(1.0, want.abs().max().item()))
            except AssertionError as e:
                failures.append(f"rank {rank}: compiled differs from eager: {e}\n{program.describe()}")
    assert not failures, "\n\n".join(failures[:5]) + f"\n\n({len(failures)} failures)"


def test_the_generator_plants_half_and_covers_every_block_and_plant():
    programs = [generate(seed) for seed in range(PROGRAMS)]
    planted = [p for p in programs if p.plant]
    assert 0.35 < len(planted) / PROGRAMS < 0.65
    assert {p.plant for p in planted} == {"missing", "nonlinear", "doubled"}
    assert {b for p in programs for b in p.blocks} == {"mlp", "swiglu", "attention", "norm", "pointwise"}
    assert {p.sequence_parallel for p in programs} == {True, False}
    assert all(p.blocks[p.planted_block] in ("mlp", "swiglu", "attention") for p in planted)
