"""Compile caches: a job's first step, cold and restarted, stock Inductor vs dtcompile.

The tensor + sequence parallel block (dim 256, 8 heads, hidden 1024, batch 4 x
128 tokens) on the fake process group at world 4, one process per run.  Per
backend and round: a cold process (an empty ``TORCHINDUCTOR_CACHE_DIR``) and a
restarted one (the same folder), each timing its first training step (forward
+ backward, every graph compiled or loaded) and reporting torch's cache
counters.  The backends alternate over ``--repeats`` rounds; the table shows
the median of each.

    python benchmarks/compile_cache.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(backend_name: str) -> None:
    """One process: the first step, timed, and the counters, as one JSON line."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch._dynamo.utils import counters

    import dtcompile
    from dtcompile._testing.cases import CASES, run_step
    from dtcompile._testing.models import BlockArgs, build_block
    from dtcompile.testing.worlds import fake_world

    with fake_world(4):
        mesh = CASES["tp_sp_block"].mesh(4)
        _, parallel, x = build_block(mesh, batch=4, seq=128, args=BlockArgs(dim=256, n_heads=8, hidden=1024))
        backend = dtcompile.backend() if backend_name == "dtcompile" else "inductor"
        fn = torch.compile(parallel, backend=backend, fullgraph=True)
        start = time.perf_counter()
        run_step(fn, parallel, x)
        first = time.perf_counter() - start
    counts = {
        "aot": "{}/{}".format(counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["total"]),
        "fx": "{}/{}/{}".format(
            counters["inductor"]["fxgraph_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"],
            counters["inductor"]["fxgraph_cache_bypass"],
        ),
    }
    print("RESULT " + json.dumps({"first_step_s": first, **counts}), flush=True)


def _run(backend_name: str, cache_dir: str) -> dict:
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, __file__, "--child", backend_name], capture_output=True, text=True, env=env, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{backend_name} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["inductor", "dtcompile"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    import torch

    names = ["inductor", "dtcompile"]
    cold: dict[str, list[dict]] = {n: [] for n in names}
    warm: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache_dir:
                cold[name].append(_run(name, cache_dir))
                warm[name].append(_run(name, cache_dir))
    print(f"torch {torch.__version__}, TP + SP block on the fake PG (world 4), median of {args.repeats} rounds")
    print("AOTAutograd: cache hits / graphs; FX graph cache: hit / miss / bypass")
    print(f"{'backend':<10} {'cold first step':>16} {'restarted':>10} {'ratio':>6}  {'AOT (restarted)':>16} {'FX (restarted)':>15}")
    medians = {}
    for name in names:
        c = statistics.median(r["first_step_s"] for r in cold[name])
        w = statistics.median(r["first_step_s"] for r in warm[name])
        medians[name] = w
        last = warm[name][-1]
        print(f"{name:<10} {c:>15.2f}s {w:>9.2f}s {w / c:>6.2f}  {last['aot']:>16} {last['fx']:>15}")
    print(f"restarted first step, dtcompile / stock Inductor: {medians['dtcompile'] / medians['inductor']:.2f}")


if __name__ == "__main__":
    main()
