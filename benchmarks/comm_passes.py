"""Communication passes: collectives per step and estimated exposed communication; gloo step time.

Part 1 (fake PG, world 8, one process): the tensor + sequence parallel block
with Llama-3-8B layer sizes (dim 4096, 32 heads, FFN hidden 14336; batch 2 x seq
4096; bf16) at TP 8, one training step traced (forward + backward).  For the
graphs with dtcompile's passes switched off (what stock Inductor receives) and
with each configuration of passes, the table gives the collectives (count,
bytes per rank) and, under the ``h100`` cost profile, the estimated compute,
communication and *exposed* communication (what the compute stream waits for;
:func:`dtcompile.cost.simulate.simulate`).

Part 2 (2 gloo ranks, real collectives): the block at dim 256 (batch 4, seq
128), median step time of stock Inductor and of dtcompile (all passes on),
side by side in one run.  On CPU the fused ops run their decomposed
implementation, so no overlap is expected there; this measures the cost of the
rewrite.

    python benchmarks/comm_passes.py
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

import dtcompile
from dtcompile._testing.cases import run_step
from dtcompile._testing.models import BlockArgs, build_block
from dtcompile.cost import get_profile
from dtcompile.cost.simulate import simulate
from dtcompile.testing import fake_world, run_gloo

LLAMA_8B = BlockArgs(dim=4096, n_heads=32, hidden=14336)
CONFIGS = {
    "stock (no passes)": {"async_tp", "bucketing", "overlap"},
    "bucketing + overlap": {"async_tp"},
    "async_tp only": {"bucketing", "overlap"},
    "dtcompile (all passes)": set(),
}


def _estimates() -> None:
    h100 = get_profile("h100")
    print("Part 1: TP 8 block, Llama-3-8B layer sizes, bf16, fake PG world 8; h100 estimates per training step")
    print(f"{'graphs':<24} {'collectives':>11} {'MiB/rank':>9} {'compute us':>11} {'comm us':>8} {'exposed us':>11}")
    rows = {}
    with fake_world(8, (8,), ("tp",)) as mesh:
        _, parallel, x = build_block(mesh, batch=2, seq=4096, args=LLAMA_8B)
        parallel, x = parallel.to(torch.bfloat16), x.to(torch.bfloat16)
        for name, disabled in CONFIGS.items():
            torch._dynamo.reset()
            backend = dtcompile.backend(inductor=False, disable_passes=disabled)
            torch.compile(parallel, backend=backend)(x).sum().backward()
            timelines = [simulate(r.graph.graph, h100) for r in backend.records]
            count = sum(len(r.collectives) for r in backend.records)
            num_bytes = sum(c.bytes for r in backend.records for c in r.collectives)
            rows[name] = exposed = sum(t.exposed_comm_us for t in timelines)
            compute = sum(t.compute_us for t in timelines)
            comm = sum(t.comm_us for t in timelines)
            print(f"{name:<24} {count:>11} {num_bytes / 2**20:>9.0f} {compute:>11.0f} {comm:>8.0f} {exposed:>11.0f}")
    stock = rows["stock (no passes)"]
    print(f"exposed communication, dtcompile / stock: {rows['dtcompile (all passes)'] / stock:.2f}")


def _gloo_rank(rank: int, steps: int) -> dict[str, float]:
    warnings.simplefilter("ignore")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    _, parallel, x = build_block(mesh, batch=4, seq=128, args=BlockArgs(dim=256, n_heads=8, hidden=1024))
    times: dict[str, list[float]] = {"inductor": [], "dtcompile": []}
    compiled = {
        "inductor": torch.compile(parallel, backend="inductor", fullgraph=True),
        "dtcompile": torch.compile(parallel, backend=dtcompile.backend(), fullgraph=True),
    }
    for fn in compiled.values():  # compile both first (each backend has its own cache entry)
        run_step(fn, parallel, x)
    for _ in range(steps):  # alternate
        for name, fn in compiled.items():
            start = time.perf_counter()
            run_step(fn, parallel, x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    _estimates()
    result = run_gloo(2, _gloo_rank, opts.steps, timeout=1800)[0]
    print()
    print(f"Part 2: block dim 256 on 2 gloo ranks, median of {opts.steps} alternating steps (rank 0)")
    print(f"{'backend':<12} {'step ms':>8}")
    for name, seconds in result.items():
        print(f"{name:<12} {seconds * 1e3:>8.2f}")
    print(f"dtcompile / inductor: {result['dtcompile'] / result['inductor']:.2f}")


if __name__ == "__main__":
    main()
