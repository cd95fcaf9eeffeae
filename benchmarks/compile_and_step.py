"""Compile time and step time: eager DTensor vs stock Inductor vs dtcompile.

The tensor + sequence parallel block, on the fake process group at world 4 (one
process) and on 2 gloo ranks (real collectives).  Compile time is the first
training step (forward + backward, compiling every graph) minus a warm step;
step time is the median of ``--steps`` warm steps.  Inductor's caches are off so
each backend compiles from scratch; the backends alternate over ``--repeats``
rounds and the best compile time of each is kept.

    python benchmarks/compile_and_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dtcompile  # noqa: E402
from dtcompile._testing.cases import CASES, run_step  # noqa: E402
from dtcompile._testing.models import BlockArgs, build_block  # noqa: E402
from dtcompile.testing.worlds import fake_world, run_gloo  # noqa: E402

ARGS = BlockArgs(dim=256, n_heads=8, hidden=1024)
BATCH, SEQ = 4, 128


def _measure(backend_name: str, world_size: int, steps: int) -> tuple[float, float]:
    """(compile seconds, median step seconds) of one backend on the live world."""
    mesh = CASES["tp_sp_block"].mesh(world_size)
    _, parallel, x = build_block(mesh, batch=BATCH, seq=SEQ, args=ARGS)
    torch._dynamo.reset()
    if backend_name == "eager":
        fn = parallel
    else:
        backend = dtcompile.backend() if backend_name == "dtcompile" else "inductor"
        fn = torch.compile(parallel, backend=backend, fullgraph=True)
    with torch.compiler.config.patch(force_disable_caches=True):
        start = time.perf_counter()
        run_step(fn, parallel, x)
        first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_step(fn, parallel, x)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return max(first - step, 0.0), step


def _rounds(world_size: int, steps: int, repeats: int) -> dict[str, tuple[float, float]]:
    names = ["eager", "inductor", "dtcompile"]
    compile_s: dict[str, list[float]] = {n: [] for n in names}
    step_s: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            c, s = _measure(name, world_size, steps)
            compile_s[name].append(c)
            step_s[name].append(s)
    return {n: (min(compile_s[n]), statistics.median(step_s[n])) for n in names}


def _gloo_rank(rank: int, world_size: int, steps: int, repeats: int) -> dict:
    return _rounds(world_size, steps, repeats)


def _table(title: str, rows: dict[str, tuple[float, float]]) -> str:
    base_compile = rows["inductor"][0]
    base_step = rows["inductor"][1]
    lines = [
        title,
        "| backend | compile s | vs inductor | step ms | vs inductor |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (c, s) in rows.items():
        c_ratio = f"{c / base_compile:.2f}x" if name != "eager" else "-"
        lines.append(f"| {name} | {c:.2f} | {c_ratio} | {s * 1e3:.2f} | {s / base_step:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"block dim={ARGS.dim} heads={ARGS.n_heads} hidden={ARGS.hidden} batch={BATCH} seq={SEQ}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with fake_world(4):
        fake = _rounds(4, args.steps, args.repeats)
    print(_table("\nfake process group, world 4 (rank 0 of 4):", fake))
    gloo = run_gloo(2, _gloo_rank, 2, args.steps, args.repeats, timeout=1200)[0]
    print(_table("\ngloo, world 2 (rank 0; both ranks on this machine):", gloo))


if __name__ == "__main__":
    main()
