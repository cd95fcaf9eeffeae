"""What dtcompile makes of a fixed set of programs, one line each, to diff two checkouts.

A change that must not change behaviour (a refactor) is checked by running this at
both commits and diffing the output:

    python benchmarks/records_digest.py > after.txt
    git worktree add /tmp/before <commit> && cd /tmp/before
    PYTHONPATH=/tmp/before python /path/to/benchmarks/records_digest.py > before.txt
    diff before.txt after.txt

Printed, on the fake process group (4 ranks), without Inductor:

- each shared model (``dtcompile._testing.cases.CASES``) compiled with dtcompile, one
  forward and backward: per graph, its kind, a digest of its code, its collectives and
  each pass's record (ran, nodes and collectives before and after, decisions);
- each auto-parallel zoo model (the test helpers' ``zoo_models.ZOO``) planned on a 1-D
  mesh of 4 and on 2 x 2 under half the replicated parameter bytes: the objective and a
  digest of every parameter's placements and the predicted collectives;
- the idiom corpus (``dtcompile._testing.idioms``): the idioms dtcompile fails.

``--depth N`` prints instead each graph of ``benchmarks/compile_depth.py``'s dtcompile ways
(the Dynamo path, ``compile_step`` with for-loop, foreach and fused AdamW) on its Llama3 of
``N`` layers, on 2 gloo ranks, a line each: what a change to the passes' speed must leave
equal on a deep model's graphs (issue #70).

    python benchmarks/records_digest.py --depth 8

Seconds are left out (they differ run to run); everything else must be equal.

``--decisions`` (before the other arguments) leaves out the graphs' form too, their code and
each pass's node counts, and keeps their collectives and each pass's decisions: for a change
that rewrites what a pass emits (bucketing's copies in and out of a bucket as two ops of its
own) and must not change what it decides.

    python benchmarks/records_digest.py --decisions --depth 8
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path.cwd()
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "tests" / "auto_parallel"), str(ROOT / "tests" / "clients")]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def shared_models() -> None:
    import torch

    import dtcompile
    from dtcompile._testing.cases import CASES
    from dtcompile.testing import fake_world

    for name, case in CASES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        with fake_world(4, case.mesh_shape(4), case.mesh_dim_names) as mesh:
            _, parallel, x = case.build(mesh)
            backend = dtcompile.backend(inductor=False)
            out = torch.compile(parallel, backend=backend, fullgraph=True)(case.local_input(x, mesh))
            out.sum().backward()
        for r in backend.records:
            print(f"model {name} {record_line(r)}")


DECISIONS = "RECORDS_DIGEST_DECISIONS"
"""Set (to 1) by ``--decisions``: in the environment, so that the ranks ``--depth`` spawns read it too."""


def record_line(record: Any) -> str:
    """One compiled graph: its compile id and kind, a digest of its code, its collectives and
    each pass's record (ran, nodes and collectives before and after, decisions); under
    ``--decisions``, without the code and the node counts."""
    form = not os.environ.get(DECISIONS)
    passes = [(p.name, p.ran, *((p.nodes_before, p.nodes_after) if form else ()), p.collectives_before,
               p.collectives_after, [str(d) for d in p.decisions]) for p in record.passes]
    code = f" code={_digest(record.graph.code)}" if form else ""
    return (f"{record.compile_id} {record.kind}{code} "
            f"collectives={[str(c) for c in record.collectives]} passes={_digest(repr(passes))}")


def depth(layers: int) -> None:
    """``--depth N``: compile_depth.py's dtcompile ways on torchtitan's Llama3 of ``N`` layers,
    each rank's graphs (2 gloo ranks; torchtitan installed, as for compile_depth.py)."""
    import compile_depth

    from dtcompile.testing import run_gloo

    for way in compile_depth.DTCOMPILE_WAYS:
        for rank, row in enumerate(run_gloo(compile_depth.WORLD, compile_depth._way, layers, way, False, True,
                                                    timeout=3600)):
            for line in row["records"]:
                print(f"depth {layers} {way} rank {rank} {line}")


def zoo_plans() -> None:
    import torch

    import dtcompile
    from dtcompile.testing import fake_world

    try:
        from support.ap_cases import KEPT_GATHERED, predicted_collectives, sharded_budget
        from support.zoo_models import ZOO, build
    except ImportError:  # a checkout from before tests/support
        from ap_cases import KEPT_GATHERED, predicted_collectives, sharded_budget
        from zoo_models import ZOO, build
    meshes = {"1d": ((4,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}
    for name in ZOO:
        torch.manual_seed(0)
        model, args = build(name)
        for mesh_name, (shape, axes) in meshes.items():
            with fake_world(4, shape, axes) as mesh:
                solution = dtcompile.auto_parallel.plan(
                    model, mesh, args, param_memory_budget_bytes=sharded_budget(model), config=KEPT_GATHERED
                )
            placements = sorted((k, str(v)) for k, v in solution.param_placements.items())
            print(f"plan {name} {mesh_name} objective={solution.result.objective_us:.6f} "
                  f"placements={_digest(repr(placements))} collectives={_digest(repr(sorted(predicted_collectives(solution).items())))}")


def idioms() -> None:
    import dtcompile
    from dtcompile._testing.idioms import corpus_failures

    failures = corpus_failures(dtcompile.backend(inductor=False))
    print(f"idioms failing: {sorted(failures)}")


def main() -> None:
    warnings.filterwarnings("ignore")
    args = sys.argv[1:]
    if args[:1] == ["--decisions"]:
        os.environ[DECISIONS] = "1"
        args = args[1:]
    if args[:1] == ["--depth"]:
        depth(int(args[1]))
        return
    shared_models()
    zoo_plans()
    idioms()


if __name__ == "__main__":
    main()
