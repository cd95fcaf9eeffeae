"""Who orders the collectives: dtcompile's overlap pass or Inductor's ``simple_overlap``.

From torch 2.14 Inductor reorders collectives itself (``simple_overlap``, on by
default).  Where dtcompile's ``overlap`` or ``async_tp`` pass runs, dtcompile
owns the schedule and switches Inductor's pass off inside its compiles.  This
measures that choice on real collectives: an FSDP-style stack (4 MLP layers,
every weight ``Shard(0)`` over 2 gloo ranks, gathered in the forward,
gradients reduce-scattered), ``torch.compile`` default mode, median step
(forward + backward) of each variant, the variants alternating over rounds:

- ``stock``: stock Inductor (its own schedule, as the release defaults);
- ``dtcompile``: every pass on, dtcompile's schedule (Inductor's pass off);
- ``dtcompile, Inductor schedules``: ``overlap`` and ``async_tp`` off, so
  Inductor's ``simple_overlap`` orders what ``bucketing`` left;
- ``dtcompile + simple_overlap``: every pass on and Inductor's pass forced on
  as well (both reorder the same graph; it must still equal eager);
- ``dtcompile, no passes``: every communication pass off.

On a torch without ``simple_overlap`` (2.13) the variants that need it are left out.

    python benchmarks/schedule_owner.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dtcompile  # noqa: E402
from dtcompile._testing.models import MLP, _data_parallel  # noqa: E402
from dtcompile.base.torch_compat import INDUCTOR_SIMPLE_OVERLAP, inductor_reorders_collectives  # noqa: E402
from dtcompile.testing.worlds import run_gloo  # noqa: E402

COMM_PASSES = frozenset({"async_tp", "bucketing", "overlap"})


def _variants() -> dict[str, object]:
    variants: dict[str, object] = {
        "stock": lambda: "inductor",
        "dtcompile": lambda: dtcompile.backend(),
        "dtcompile, no passes": lambda: dtcompile.backend(disable_passes=COMM_PASSES),
    }
    if inductor_reorders_collectives():
        variants["dtcompile, Inductor schedules"] = lambda: dtcompile.backend(disable_passes={"overlap", "async_tp"})
        variants["dtcompile + simple_overlap"] = lambda: dtcompile.backend(inductor_config={INDUCTOR_SIMPLE_OVERLAP: True})
    return variants


def _stack(mesh, dim: int, hidden: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*(MLP(dim, hidden, bias=False) for _ in range(4)))
    return _data_parallel(model, mesh, shard=True)


def train_step(fn, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward (``fn``) and backward of ``model`` from ``x``, gradients reset first; the output."""
    for p in model.parameters():
        p.grad = None
    out = fn(x)
    out.pow(2).mean().backward()
    return out.detach()


def _rank(rank: int, world_size: int, dim: int, hidden: int, rows: int, steps: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(1)
    x = torch.randn(rows, dim)
    eager_model = _stack(mesh, dim, hidden)
    want = train_step(eager_model, eager_model, x)
    want_grads = [p.grad.full_tensor() for p in eager_model.parameters()]
    variants = _variants()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats):
        order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
        for name in order:
            torch._dynamo.reset()
            model = _stack(mesh, dim, hidden)
            fn = torch.compile(model, backend=variants[name]())
            got = train_step(fn, model, x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: output: {m}")
            for p, g in zip(model.parameters(), want_grads):
                torch.testing.assert_close(p.grad.full_tensor(), g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: grad: {m}")
            for _ in range(2):
                train_step(fn, model, x)
            for _ in range(steps):
                torch.distributed.barrier()
                start = time.perf_counter()
                train_step(fn, model, x)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512x2048x512,1024x4096x256", help="dim x hidden x rows, comma separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks on this machine, median step of {args.steps} x {args.repeats} rounds (rank 0)")
    print("every variant's output and gradients checked against eager first")
    for size in args.sizes.split(","):
        dim, hidden, rows = (int(v) for v in size.split("x"))
        medians = run_gloo(2, _rank, 2, dim, hidden, rows, args.steps, args.repeats, timeout=1800)[0]
        base = medians["stock"]
        print(f"\ndim {dim}, hidden {hidden}, rows {rows}")
        print("| variant | step ms | vs stock |\n|---|---:|---:|")
        for name, t in medians.items():
            print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
