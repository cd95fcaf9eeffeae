"""Calibrate the ``cpu_gloo`` cost profile: time gloo collectives on 2 local ranks, fit alpha-beta.

For each size, the median of ``--iters`` all-gathers and all-reduces (after a
warm-up) on 2 gloo ranks over 127.0.0.1.  Fit, per op, ``time = a + b * wire``
where ``wire`` is the bytes the cost model puts on the wire for that op (see
``dtcompile/cost_model.py``); ``1 / b`` is the bandwidth, and the intercepts of
the two ops (1 hop for all-gather, 2 for all-reduce at n = 2) give the base and
per-hop latency.  Prints the measurements, the fit and the model's error.

    python benchmarks/calibrate_gloo.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtcompile.cost_model import Link, collective_time_us
from dtcompile.testing import run_gloo

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24]  # bytes of the collective's buffer


def _rank(rank: int, iters: int) -> dict[tuple[str, int], float]:
    world = dist.get_world_size()
    times = {}
    for size in SIZES:
        numel = size // 4
        out = torch.empty(numel)
        shard = torch.ones(numel // world)
        full = torch.ones(numel)
        for op in ("all_gather", "all_reduce"):
            samples = []
            for i in range(iters + 3):
                dist.barrier()
                start = time.perf_counter()
                if op == "all_gather":
                    dist.all_gather_into_tensor(out, shard)
                else:
                    dist.all_reduce(full)
                elapsed = time.perf_counter() - start
                if i >= 3:
                    samples.append(elapsed * 1e6)
            times[(op, size)] = statistics.median(samples)
    return times


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    opts = parser.parse_args()
    times = run_gloo(2, _rank, opts.iters, timeout=600)[0]
    n = 2
    wire = {"all_gather": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    fits = {op: _fit([(size * wire[op], times[(op, size)]) for size in SIZES]) for op in wire}
    bandwidth_gbps = statistics.mean(1 / b for _, b in fits.values()) / 1e3  # bytes/us -> GB/s
    a_gather, a_reduce = fits["all_gather"][0], fits["all_reduce"][0]
    hop = max(a_reduce - a_gather, 0.0)
    base = max(a_gather - hop, 0.0)
    link = Link(bandwidth_gbps=bandwidth_gbps, hop_latency_us=hop, base_latency_us=base)
    print(f"{'op':<11} {'bytes':>9} {'measured us':>12} {'model us':>10} {'error':>7}")
    for op in wire:
        for size in SIZES:
            model = collective_time_us(op, size, n, link)
            measured = times[(op, size)]
            print(f"{op:<11} {size:>9} {measured:>12.1f} {model:>10.1f} {model / measured - 1:>+7.0%}")
    print(f"fit: bandwidth {bandwidth_gbps:.3f} GB/s, base latency {base:.1f} us, hop latency {hop:.1f} us")


if __name__ == "__main__":
    main()
