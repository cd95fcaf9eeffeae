"""Dynamo tracing time with and without dynamo_vars installed.

What is timed is Dynamo alone: the backend hands the graph back as it is, so
AOTAutograd and Inductor do not run.  Two workloads, on the fake process group:

- ``block``: the tensor + sequence parallel block (dim 256) at world 4, the
  first forward call (all its frames traced) minus a warm call;
- ``corpus``: every idiom of the corpus that stock Dynamo traces too, each
  traced once, times summed.

The two settings alternate over ``--repeats`` rounds in one process; the table
shows the median of each and the ratio of medians.

    python benchmarks/trace_overhead.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dynamo_vars
from dtcompile._testing.cases import CASES
from dtcompile._testing.idioms import IDIOMS, mesh_world
from dtcompile._testing.models import BlockArgs, build_block
from dtcompile.testing.worlds import fake_world

ARGS = BlockArgs(dim=256, n_heads=8, hidden=1024)
# Idioms stock Dynamo cannot trace are left out: only like is compared with like.
STOCK_FAILURES = {
    "mesh_get_all_groups", "distribute_tensor_shard", "distribute_tensor_2d", "factory_ones", "factory_zeros",
    "factory_full", "factory_empty", "factory_default_placements",
    "local_shape_and_offset_strided", "implicit_replication_context", "loss_parallel_inside",
}


def _dynamo_only(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    return gm.forward


def _trace_block() -> float:
    with fake_world(4):
        mesh = CASES["tp_sp_block"].mesh(4)
        _, parallel, x = build_block(mesh, batch=4, seq=128, args=ARGS)
        local_x = CASES["tp_sp_block"].local_input(x, mesh)
        torch._dynamo.reset()
        compiled = torch.compile(parallel, backend=_dynamo_only)
        with torch.no_grad():
            start = time.perf_counter()
            compiled(local_x)
            first = time.perf_counter() - start
            start = time.perf_counter()
            compiled(local_x)
            warm = time.perf_counter() - start
    return first - warm


def _trace_corpus() -> float:
    total = 0.0
    for item in IDIOMS:
        if item.name in STOCK_FAILURES:
            continue
        torch._dynamo.reset()
        context = item.context() if item.context is not None else contextlib.nullcontext()
        with mesh_world(item.mesh, item.world) as mesh, context:
            fn, args = item.build(mesh)[:2]
            fn(*args)
            compiled = torch.compile(fn, backend=_dynamo_only, fullgraph=True)
            start = time.perf_counter()
            compiled(*args)
            total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    workloads = {"block": _trace_block, "corpus": _trace_corpus}
    times: dict[tuple[str, bool], list[float]] = {(w, on): [] for w in workloads for on in (False, True)}
    for fn in workloads.values():  # warm-up: first-time imports and caches
        fn()
    for _ in range(opts.repeats):
        for name, fn in workloads.items():
            for on in (False, True):
                with dynamo_vars.enabled(on):
                    times[(name, on)].append(fn())
    print(f"Dynamo tracing time, median of {opts.repeats} alternating rounds (seconds)")
    print(f"{'workload':<10} {'stock':>10} {'dynamo_vars':>12} {'ratio':>8}")
    for name in workloads:
        stock = statistics.median(times[(name, False)])
        ours = statistics.median(times[(name, True)])
        print(f"{name:<10} {stock:>10.3f} {ours:>12.3f} {ours / stock:>8.3f}")


if __name__ == "__main__":
    main()
