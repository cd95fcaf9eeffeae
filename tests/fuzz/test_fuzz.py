"""The differential fuzzer: random small DTensor programs, compiled with dtcompile, against eager.

Each program (``fuzz_programs``) is a mesh -- 1-D of 2 or 4 ranks, or 2x2 --
DTensor inputs with random placements (``Shard`` of any dim, uneven included,
``Replicate``, ``Partial`` sum/avg/max, ``_StridedShard``), and a random
sequence of elementwise, reduction, view, matmul, redistribute,
``to_local``/``from_local``, factory and ``local_map`` steps, sometimes with a
backward (``loss.backward()`` on a sum of the outputs, taken through
``to_local()`` or ``full_tensor()``).  It is written as Python source, ``def
prog(mesh, x0, ...)``, and every rank ``exec``s it: a code object of its own per
program and rank (Dynamo's recompile limit counts per code object), and a
readable repro when it fails.

How a run goes, and why (the harness: ``tests/support/fuzz_*.py``):

- Drawing (``fuzz_generate``): hypothesis draws the programs from a fixed seed,
  a fixed number per mesh, with only its generate phase, no database, and
  none of the literals it otherwise harvests from loaded modules; the same seed
  gives the same programs whatever else the session imported.  Every step is
  executed as it is drawn on simulated ranks (``LocalTensorMode``), so the
  next step knows the placements and every rank's local shape it works with.
- Running (``fuzz_world``): one long-lived threaded world per world size runs
  the whole batch -- starting a world, its meshes and its backend per program
  would cost more than the program.  Per program: eager (and backward) on
  every rank, a barrier, ``torch.compile(..., backend=dtcompile.backend(
  inductor=False), fullgraph=True)`` and run on every rank, a barrier.  A
  rank that reaches a barrier while a peer waits in a collective it never
  joined (or a barrier that times out) is a hang: the world is torn down and a
  fresh one goes on with the next program.
- Judging (``fuzz_check``): outputs, loss and input gradients per rank: kind,
  placements, global shape, dtype and local values (float32, 1e-5).  A
  program eager refuses must be refused compiled too.
- Shrinking (``fuzz_shrink``): hypothesis's shrinker would need each program to
  be its own hypothesis example run in its own world; instead the first
  program of each distinct failure is shrunk afterwards by structural
  simplification, each candidate re-run alone, and printed as the repro to pin
  in ``test_fuzz_regressions.py``.  ``fuzz_known.diagnose`` names the part of
  the compiler the failure goes away without.

The default tier (CI) runs 200 programs (about 3.5 minutes on 2 cores);
``pytest tests/fuzz --fuzz-examples 5000 [--fuzz-seed N]`` runs longer.  The
report (counts per mesh and verdict, coverage per op, the largest difference
seen, each distinct failure) is printed in pytest's terminal summary.
"""

from __future__ import annotations

import time

import pytest
from support.fuzz_check import Verdict, classify, format_summary
from support.fuzz_generate import generate_programs
from support.fuzz_known import check_program, diagnose, known_bug
from support.fuzz_shrink import shrink
from support.fuzz_world import run_programs

pytestmark = pytest.mark.fuzz

CI_EXAMPLES = 200
CI_SEED = 20261122
# The share of programs per mesh: 2-rank programs compile twice, 4-rank ones four times.
MESH_SHARES = {"1d2": 0.65, "1d4": 0.10, "2d": 0.25}
# Distinct failures shrunk per run (each shrink re-runs the program up to a few dozen times).
MAX_SHRUNK = 6


def mesh_counts(examples: int) -> dict[str, int]:
    counts = {mesh: int(examples * share) for mesh, share in MESH_SHARES.items()}
    counts["1d2"] += examples - sum(counts.values())
    return counts


def _describe_failures(runs, verdicts, culprits) -> tuple[list[str], list[str]]:
    """(new failures with their shrunk repros, known failures), one text each per distinct signature."""
    new: dict[str, list[int]] = {}
    known: dict[str, int] = {}
    for k, (run, verdict) in enumerate(zip(runs, verdicts)):
        if not verdict.is_bug:
            continue
        match = known_bug(run.program, verdict, lambda k=k: culprits(k))
        if match is not None:
            key = f"{match.name} ({match.owner}; pinned by {', '.join(match.regressions)})"
            known[key] = known.get(key, 0) + 1
        else:
            new.setdefault(verdict.signature, []).append(k)
    texts = []
    for n, (signature, ks) in enumerate(sorted(new.items(), key=lambda kv: -len(kv[1]))):
        k = min(ks, key=lambda k: (len(runs[k].program.steps), k))
        program = runs[k].program
        text = f"--- {signature} ({len(ks)} programs; first #{ks[0]}; culprit: {culprits(k)})\n"
        if n < MAX_SHRUNK:
            small, tries = shrink(program, signature, lambda p: check_program(p, barrier_timeout=20.0))
            text += f"shrunk in {tries} runs to:\n{small.describe()}{check_program(small).detail[-1500:]}\n"
        else:
            text += f"{program.describe()}{verdicts[k].detail[-1500:]}\n"
        texts.append(text)
    return texts, [f"{n} x {name}" for name, n in known.items()]


def test_fuzz_compiled_matches_eager(fuzz_options, fuzz_report):
    examples, seed = fuzz_options
    examples = CI_EXAMPLES if examples is None else examples
    seed = CI_SEED if seed is None else seed
    start = time.perf_counter()
    programs = generate_programs(mesh_counts(examples), seed)
    runs = run_programs(programs, progress=lambda done, total: print(f"fuzz: {done}/{total} programs run", flush=True))
    verdicts: list[Verdict] = [classify(run) for run in runs]
    seconds = time.perf_counter() - start
    cache: dict[str, str] = {}

    def culprit(k: int) -> str:
        """Diagnosed once per signature, on the first program that has it."""
        signature = verdicts[k].signature
        if signature not in cache:
            cache[signature] = diagnose(runs[k].program)
        return cache[signature]

    new, known = _describe_failures(runs, verdicts, culprit)
    report = format_summary(runs, verdicts, seconds, seed)
    if known:
        report += "\n  known failures (pinned, not fixed): " + "; ".join(known)
    if new:
        report += "\n\nNEW FAILURES\n" + "\n".join(new)
    fuzz_report(report)
    assert len(programs) == examples, f"drew {len(programs)} distinct programs of the {examples} asked for"
    assert not new, report
