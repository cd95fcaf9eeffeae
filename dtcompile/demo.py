"""Demo: the tensor + sequence parallel block compiled with dtcompile on 4 simulated ranks.

Run ``python -m dtcompile.demo``.  The block's attention core is a ``local_map``
region on head-sharded q, k and v (``--model tp_sp_block`` for the plain block).
Each rank is a thread of this process with a
real-semantics process group; every rank compiles the block with
``backend="dtcompile"``, runs forward and backward, and is checked against eager
and against the single-process block.  Then rank 0's inspection report
(``dtcompile.explain``: DTensor placements node by node, the collectives each
causes with estimated times, the ``local_map`` regions, totals, graph breaks,
recompiles) is printed.

``python -m dtcompile.demo --trace DIR``: instead, a case whose pictures show what the
passes do (see :func:`trace_llama8b_block`), logged under ``TORCH_TRACE=DIR`` for
``dtcompile-report DIR``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from dtcompile._testing.cases import (
    CASES,
    StepResult,
    rank_eager_and_compiled,
    reference_step,
)
from dtcompile.testing import fake_world, run_threaded


def _max_diff(a: StepResult, b: StepResult) -> float:
    diffs = [(a.output - b.output).abs().max()]
    diffs += [(a.grads[n] - b.grads[n]).abs().max() for n in a.grads]
    return float(torch.stack(diffs).max())


def _report(case_name: str, world_size: int, inductor: bool) -> str:
    """Rank 0's inspection report (placements, communication, costs), traced on the fake PG."""
    import dtcompile

    case = CASES[case_name]
    with fake_world(world_size, case.mesh_shape(world_size), case.mesh_dim_names) as mesh:
        _, parallel, x = case.build(mesh)
        report = dtcompile.explain(parallel, inductor=inductor)(case.local_input(x, mesh))
    return report.text(aot_graphs=False)


def trace_llama8b_block(trace_dir: str) -> int:
    """The tensor + sequence parallel block at Llama-3-8B layer sizes (dim 4096, 32 heads, FFN
    14336; batch 2 x sequence 4096, bf16) on a fake world of 8 ranks, priced as an H100, compiled
    with dtcompile without Inductor, forward and backward, its structured log written to
    ``trace_dir`` (``TORCH_TRACE``, which torch reads at import: a fresh interpreter is started
    with it where it is not set).  The tensors are on the meta device: nothing is computed,
    the compile and its pictures are the point (about 30 s on 2 cores).  The passes cut the
    exposed communication: ``dtcompile-report trace_dir`` draws each graph before and after them."""
    if os.environ.get("TORCH_TRACE") != trace_dir:
        env = {**os.environ, "TORCH_TRACE": trace_dir}
        return subprocess.run([sys.executable, "-m", "dtcompile.demo", "--trace", trace_dir], env=env).returncode
    import dtcompile
    from dtcompile._testing.models import BlockArgs, build_block

    with fake_world(8, (8,), ("tp",)) as mesh:
        _, parallel, x = build_block(mesh, batch=2, seq=4096, args=BlockArgs(dim=4096, n_heads=32, hidden=14336))
        parallel, x = parallel.to(device="meta", dtype=torch.bfloat16), x.to(device="meta", dtype=torch.bfloat16)
        backend = dtcompile.backend(inductor=False, cost_profile="h100")
        torch.compile(parallel, backend=backend)(x).sum().backward()
    for record in backend.records:
        before, after = record.timeline_traced, record.timeline
        if before is not None and after is not None and record.collectives:
            print(f"{record.compile_id} {record.kind}: {len(record.collectives)} collectives; estimated "
                  f"{before.total_us:.0f} us before the passes ({before.exposed_comm_us:.0f} exposed), "
                  f"{after.total_us:.0f} us after ({after.exposed_comm_us:.0f} exposed)")
    print(f"logged to {trace_dir}; draw it with: dtcompile-report {trace_dir} -o dtcompile_report")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tp_sp_block_local_map", choices=sorted(CASES))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--no-inductor", action="store_true", help="skip Inductor lowering")
    parser.add_argument("--trace", metavar="DIR", help="instead: the Llama-3-8B-sized block on 8 fake ranks, "
                        "logged to DIR for dtcompile-report (see trace_llama8b_block)")
    args = parser.parse_args(argv)
    if args.trace:
        return trace_llama8b_block(os.path.abspath(args.trace))
    options = {"inductor": not args.no_inductor}

    print(f"dtcompile demo: {args.model} on {args.world_size} simulated ranks, {options}")
    results = run_threaded(
        args.world_size, rank_eager_and_compiled, args.model, args.world_size, options
    )
    reference = reference_step(args.model, args.world_size)
    ok = True
    tol = 1e-5
    for rank, (eager, compiled, num_graphs) in enumerate(results):
        vs_eager = _max_diff(compiled, eager)
        ok &= vs_eager <= tol and num_graphs >= 2
        print(
            f"rank {rank}: {num_graphs} graphs compiled; max |compiled - eager| "
            f"(output and gradients) = {vs_eager:.2e}"
        )
    # The reference's output and gradients are whole; rank 0 of a TP model sees all of it.
    eager0 = results[0][0]
    if CASES[args.model].data_parallel_axis is None:
        vs_reference = _max_diff(eager0, reference)
        ok &= vs_reference <= tol
        print(f"rank 0: max |eager - single-process reference| = {vs_reference:.2e}")
    print()
    print("rank 0's inspection report (dtcompile.explain; the annotated AOT graphs left out):")
    print(_report(args.model, args.world_size, options["inductor"]))
    print()
    print("OK: compiled matches eager and the reference" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
