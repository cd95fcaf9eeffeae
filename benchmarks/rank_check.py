"""What the ranks' check costs (issue #32): once per compiled graph, nothing after.

On the rows of ``gloo_steps.py`` (gloo ranks of this machine, ``torch.compile``
default mode, Inductor, forward + backward), two variants of dtcompile compiled
side by side in one run: ``check`` (the default: each compiled graph's first call
compares its collectives across its ranks, :mod:`dtcompile.ranks.check`) and
``no check`` (``check_ranks=False``).  Both are checked against eager first
(output and every gradient), then timed taking turns step by step.

Per row:

- ``exchange ms``: the check's own wall time on the rank that came to it last
  (its peers were already there: nothing but the exchange), summed over the
  step's graphs; ``waited ms``: the same on the rank that came first, which also
  waits for its slowest peer to finish compiling (compile skew, not the check);
- ``step ms``: median steady step of rank 0 per variant, and their ratio
  (nothing runs after the first call, so it should be 1.00 within noise);
- ``exchange / step``: the exchange over one steady step, the goal under 1%;
- ``schedule bytes``: the collectives' text one rank writes to the store per
  graph beside its digest (read back only on a disagreement), and ``peak RSS``:
  the largest rank's whole process, both variants.

    python benchmarks/rank_check.py [--rows fsdp:512x2048x512,...] [--four] [--steps 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gloo_steps import DEFAULT_ROWS, FOUR_ROWS, _input, _mesh, _threads, compile_variants, take_turns  # noqa: E402

import dtcompile  # noqa: E402
from dtcompile.testing.worlds import run_gloo  # noqa: E402

VARIANTS = {"check": {}, "no check": {"check_ranks": False}}


def _rank(rank: int, world: int, kind: str, dim: int, hidden: int, rows: int, steps: int, rounds: int) -> dict:
    torch.set_num_threads(_threads(world))
    mesh = _mesh(kind, world)
    x = _input(kind, dim, rows)
    variants = {name: (lambda o=options: dtcompile.backend(aot_cache=False, **o)) for name, options in VARIANTS.items()}
    fns, models, backends = compile_variants(kind, mesh, dim, hidden, x, variants)
    times = take_turns(fns, models, x, steps * rounds)
    checks = list(backends["check"].checks)
    assert checks and all(c.outcome == "agreed" for c in checks), [str(c) for c in checks]
    assert not backends["no check"].checks
    records = list(backends["check"].records)
    from dtcompile.ranks.schedule import scheduled_collectives

    schedule_bytes = len("\n".join(map(str, scheduled_collectives((r.kind, r.collectives) for r in records))))
    return {
        "exchange_s": sum(c.seconds for c in checks),
        "graphs": len(checks),
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        "schedule_bytes": schedule_bytes,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--four", action="store_true", help=f"also the 4-rank rows ({FOUR_ROWS})")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = args.rows.split(",") + (FOUR_ROWS.split(",") if args.four else [])
    print(f"torch {torch.__version__}")
    print(
        "| row | ranks | graphs | exchange ms | waited ms | step ms check | step ms no check | check / no check "
        "| exchange / step | schedule bytes per graph | peak RSS MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        kind, sizes = row.split(":")
        dim, hidden, n = (int(v) for v in sizes.split("x"))
        world = 4 if kind == "fsdp_tp" else 2
        results = run_gloo(world, _rank, world, kind, dim, hidden, n, args.steps, args.rounds, timeout=1800)
        exchange = min(r["exchange_s"] for r in results) * 1e3
        waited = max(r["exchange_s"] for r in results) * 1e3
        step = results[0]["step_s"]
        on, off = step["check"] * 1e3, step["no check"] * 1e3
        graphs = results[0]["graphs"]
        store = results[0]["schedule_bytes"] // max(graphs, 1)
        rss = max(r["rss_mb"] for r in results)
        print(
            f"| {row} | {world} | {graphs} | {exchange:.2f} | {waited:.1f} | {on:.1f} | {off:.1f} | {on / off:.3f} "
            f"| {exchange / on:.2%} | {store} | {rss:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
