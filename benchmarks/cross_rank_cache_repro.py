"""Stock torch serves one rank's compiled backward to another rank (for an upstream report).

Two gloo ranks over 127.0.0.1 share one ``TORCHINDUCTOR_CACHE_DIR`` (torch's
default folder is per user, so every rank of a node shares it).  Each runs one
training step of a 4-layer FSDP-style stack: every weight is a DTensor stored
``Shard(0)`` on a 1-D mesh and gathered in the forward with
``w.redistribute(placements=[Replicate()]).to_local()``.  The backward of
``to_local()`` (its gradient placement defaults to ``Replicate``) is taken back
to ``Shard(0)`` by slicing this rank's chunk: the traced backward bakes in the
compiling rank's offset.  AOTAutograd's cache keys the graph on what both ranks
share, so the second process (the "warm" run: a restarted job) serves every
rank the entry one of them wrote.

The script runs the step compiled with ``torch.compile(backend=...)`` in a cold
process and then in a warm one (a fresh process, the same cache folder), and
prints, per run and rank, whether AOTAutograd's cache served the graphs and the
largest difference from eager of the output and of each gradient.

    python benchmarks/cross_rank_cache_repro.py                 # stock Inductor
    python benchmarks/cross_rank_cache_repro.py --backend dtcompile

Exit status 1 when a run differs from eager (the bug), 0 when every run equals
it.  Only torch is needed for ``--backend inductor`` (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORLD_SIZE = 2
LAYERS = 4


def _rank(rank: int, port: int, backend: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # The launching process serves the store (on a port it holds): the ranks join it.
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        torch.manual_seed(0)
        full = [(torch.randn(128, 64), torch.randn(64, 128)) for _ in range(LAYERS)]
        x = torch.randn(32, 64)

        def make_params() -> list[torch.nn.Parameter]:
            return [
                torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
                for pair in full for w in pair
            ]

        def step(params, x):
            for w1, w2 in zip(params[::2], params[1::2]):
                g1 = w1.redistribute(placements=[Replicate()]).to_local()
                g2 = w2.redistribute(placements=[Replicate()]).to_local()
                x = x + torch.relu(x @ g1.t()) @ g2.t()
            return x

        def run(fn):
            params = make_params()
            out = fn(params, x)
            out.sum().backward()
            return out.detach(), [p.grad.to_local() for p in params]

        eager_out, eager_grads = run(step)
        compiler = backend
        if backend == "dtcompile":
            import dtcompile

            compiler = dtcompile.backend()
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        out, grads = run(torch.compile(step, backend=compiler, fullgraph=True))
        result = {
            "rank": rank,
            "aot_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
            "output_diff": (out - eager_out).abs().max().item(),
            "grad_diffs": [(g - e).abs().max().item() for g, e in zip(grads, eager_grads)],
        }
        with open(result_path, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _run_world(backend: str, cache_dir: str, workdir: str, label: str) -> list[dict]:
    """One run: ``WORLD_SIZE`` fresh processes sharing ``cache_dir``; their results.  This
    process serves their rendezvous store on a port the kernel picks, held until they end
    (a port picked free and bound later by a rank can be taken in between)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False)
    port = store.port
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    procs, paths = [], []
    for rank in range(WORLD_SIZE):
        path = os.path.join(workdir, f"{label}-{rank}.json")
        paths.append(path)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--backend", backend,
             "--result", path],
            env=env,
        ))
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"{label}: a rank exited with status {proc.returncode}")
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend: inductor (stock) or dtcompile")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.port, args.backend, args.result)
        return 0

    import torch

    print(f"torch {torch.__version__}, backend {args.backend}, {WORLD_SIZE} gloo ranks sharing one cache folder")
    wrong = False
    with tempfile.TemporaryDirectory() as workdir:
        cache_dir = os.path.join(workdir, "inductor-cache")
        for label in ("cold", "warm"):
            for r in _run_world(args.backend, cache_dir, workdir, label):
                bad = [i for i, d in enumerate(r["grad_diffs"]) if d > 1e-3]
                wrong |= bool(bad) or r["output_diff"] > 1e-3
                print(
                    f"{label} rank {r['rank']}: AOT cache hit {r['aot_cache_hit']} miss {r['aot_cache_miss']}; "
                    f"output diff {r['output_diff']:.3g}; "
                    f"{len(bad)} of {len(r['grad_diffs'])} gradients wrong"
                    + (f" (max diff {max(r['grad_diffs']):.4g})" if bad else "")
                )
    print("RESULT: " + ("WRONG gradients (a rank was served another rank's graph)" if wrong else "every run equals eager"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
