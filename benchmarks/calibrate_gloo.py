"""Calibrate the ``cpu_gloo`` cost profile: ``dtcompile.calibrate()`` on 2 local gloo ranks.

Prints the measured profile (rank 0's numbers, which every rank gets) and,
per size, the collectives' measured time beside the fitted model's, so that
the fit's error shows.  The built-in ``cpu_gloo`` profile in
``dtcompile/cost/`` carries these numbers, rounded; ``--save`` also
writes the profile to ``$DTCOMPILE_PROFILE_DIR`` (default
``~/.cache/dtcompile/profiles``), where ``cost_profile="auto"`` then finds it.

    python benchmarks/calibrate_gloo.py [--iters 10] [--save]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtcompile.cost import collective_time_us  # noqa: E402
from dtcompile.cost.calibrate import _collectives, calibrate  # noqa: E402
from dtcompile.testing import run_gloo  # noqa: E402


def _rank(rank: int, iters: int, save: bool):
    profile = calibrate(iters=iters, save=save)
    times = _collectives(None, torch.device("cpu"), iters)
    return profile, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--save", action="store_true")
    opts = parser.parse_args()
    profile, times = run_gloo(2, _rank, opts.iters, opts.save, timeout=900)[0]
    link = profile.intra_node
    print(f"{'op':<11} {'bytes':>9} {'measured us':>12} {'model us':>10} {'error':>7}")
    for (op, size), measured in sorted(times.items()):
        model = collective_time_us(op, size, 2, link)
        print(f"{op:<11} {size:>9} {measured:>12.1f} {model:>10.1f} {model / measured - 1:>+7.0%}")
    print(
        f"fit: bandwidth {link.bandwidth_gbps:.3f} GB/s, base latency {link.base_latency_us:.1f} us, "
        f"hop latency {link.hop_latency_us:.1f} us; copies {profile.memory_gbps:.2f} GB/s; "
        f"matmul {profile.matmul_tflops:.3f} TFLOP/s; overlap {profile.overlap:.2f}"
    )


if __name__ == "__main__":
    main()
