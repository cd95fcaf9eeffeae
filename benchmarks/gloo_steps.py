"""Step time on real collectives: stock Inductor vs dtcompile vs dtcompile without its passes, on gloo.

Each row is one model at one size on gloo ranks of this machine,
``torch.compile`` default mode, forward + backward:

- ``fsdp``: an FSDP-style stack (4 MLP layers without bias, every weight
  ``Shard(0)``, gathered in the forward, gradients reduce-scattered), on 2 ranks;
- ``tp_sp``: Llama-style blocks under tensor + sequence parallelism, stacked, on 2 ranks;
- ``fsdp_tp``: the TP + SP block with its parameters also ``Shard``ed over a data
  axis, on 4 ranks of a 2 x 2 mesh (``--four``; 4 processes on this machine's
  2 cores).

Variants, each compiled once, checked against eager (output and every
gradient), then timed taking turns step by step, the first of each turn
rotating (median of ``steps x rounds`` steps of rank 0):
``stock`` (Inductor as the release has it), ``dtcompile`` (its passes priced
under the profile ``auto`` picks: ``cpu_gloo``), ``no passes``
(``disable_passes`` = the communication passes).

Beside them, per row: ``compute`` (the same step compiled with stock Inductor
on the fake process group, whose collectives return at once) and ``comm``
(the collectives of dtcompile's graphs without passes, replayed alone on the
same gloo ranks), so that each row shows its bound ``max(compute, comm)`` and
its serial sum.  ``predicted``: dtcompile's step over the no-passes step as
:func:`dtcompile.cost.simulate.simulate` plays their graphs under the profile
(what the passes decided from); ``measured``: the same ratio on the clock.

Each rank computes with the machine's cores shared out (``torch.set_num_threads``:
one thread per rank on two cores), as a rank has a device of its own; the
compute-alone processes likewise.

``--trace DIR`` writes a ``torch.profiler`` trace of one dtcompile step per
row (rank 0) and prints how much of the step's wall time gloo's collectives
(``gloo:``/``c10d::`` events) took, and how much of that ran beside compute.

    python benchmarks/gloo_steps.py [--rows fsdp:512x2048x512,...] [--four] [--steps 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schedule_owner import train_step  # noqa: E402  (this folder is on the path of a script run)

import dtcompile  # noqa: E402
from dtcompile._testing.models import MLP, Block, BlockArgs, _data_parallel, parallelize_block  # noqa: E402
from dtcompile.cost.simulate import simulate  # noqa: E402
from dtcompile.graph.collectives import collective_info  # noqa: E402
from dtcompile.pass_names import COMMUNICATION_PASSES  # noqa: E402
from dtcompile.testing.worlds import run_gloo  # noqa: E402

DEFAULT_ROWS = "fsdp:256x1024x2048,fsdp:512x2048x512,fsdp:1024x4096x256,tp_sp:128x512x256,tp_sp:256x1024x128"
FOUR_ROWS = "fsdp_tp:128x512x128"


def _threads(world: int) -> int:
    """Threads per rank: the machine's cores shared out, as a rank has a device of its own
    (two ranks of two threads each on two cores spin against each other)."""
    return max(1, (os.cpu_count() or 1) // world)


def _model(kind: str, mesh, dim: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "fsdp":
        return _data_parallel(nn.Sequential(*(MLP(dim, hidden, bias=False) for _ in range(4))), mesh, shard=True)
    args = BlockArgs(dim=dim, n_heads=4, hidden=hidden)
    if kind == "tp_sp":
        return nn.Sequential(*(parallelize_block(Block(args), mesh) for _ in range(2)))
    blocks = nn.Sequential(*(parallelize_block(Block(args), mesh["tp"]) for _ in range(2)))
    return _data_parallel(blocks, mesh, shard=True)


def _input(kind: str, dim: int, rows: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(rows, dim) if kind == "fsdp" else torch.randn(2, rows, dim)


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fsdp_tp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp" if kind == "fsdp" else "tp",))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]


def _variants() -> dict[str, object]:
    return {
        "stock": lambda: "inductor",
        # Compiled here, not served by AOTAutograd's cache: their records carry the graphs.
        "dtcompile": lambda: dtcompile.backend(aot_cache=False),
        "no passes": lambda: dtcompile.backend(aot_cache=False, disable_passes=COMMUNICATION_PASSES),
    }


def _simulated_us(backend) -> float:
    return sum(simulate(r.graph.graph, r.info.profile).total_us for r in backend.records)


def _replay_comm(backend, iters: int) -> float:
    """Seconds the collectives of ``backend``'s graphs take alone, issued one after the other."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    calls = []
    for record in backend.records:
        for node in record.graph.graph.nodes:
            c = collective_info(node)
            if c is None:
                continue
            group = _resolve_process_group(node.args[-1])
            n = c.group_size
            numel = max(c.bytes // 4, n) // n * n
            if c.op == "all_gather":
                out, shard = torch.empty(numel), torch.ones(numel // n)
                calls.append(lambda o=out, s=shard, g=group: dist.all_gather_into_tensor(o, s, group=g))
            elif c.op == "reduce_scatter":
                full, shard = torch.ones(numel), torch.empty(numel // n)
                calls.append(lambda f=full, s=shard, g=group: dist.reduce_scatter_tensor(s, f, group=g))
            elif c.op == "all_reduce":
                full = torch.ones(numel)
                calls.append(lambda f=full, g=group: dist.all_reduce(f, group=g))
            elif c.op == "all_to_all":
                full, out = torch.ones(numel), torch.empty(numel)
                calls.append(lambda f=full, o=out, g=group: dist.all_to_all_single(o, f, group=g))
    samples = []
    for _ in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def _profile_step(fn, model, x, path: Path) -> tuple[float, float, float]:
    """(step wall us, collective us, collective us beside compute) of one traced step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_step(fn, model, x)
        wall = (time.perf_counter() - start) * 1e6
    prof.export_chrome_trace(str(path))
    events = [e for e in prof.events() if e.time_range.elapsed_us() > 0]
    comm = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(("gloo:", "c10d::", "c10d_functional::", "_c10d_functional::"))]
    compute = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(("aten::mm", "aten::addmm", "aten::bmm", "mkl", "cpp_fused", "graph_"))]
    comm_us = _union(comm)
    beside = _union([(max(a, c), min(b, d)) for a, b in comm for c, d in compute if min(b, d) > max(a, c)])
    return wall, comm_us, beside


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def compile_variants(kind: str, mesh, dim: int, hidden: int, x: torch.Tensor, variants: dict) -> tuple[dict, dict, dict]:
    """Each variant (name -> a backend's factory) compiled on its own copy of the row's model,
    its first step's output and every gradient checked against eager's: (fns, models, backends)."""
    eager = _model(kind, mesh, dim, hidden)
    want = train_step(eager, eager, x)
    want_grads = _grads(eager)
    fns, models, backends = {}, {}, {}
    for name, make in variants.items():
        backend = make()
        model = _model(kind, mesh, dim, hidden)
        fn = torch.compile(model, backend=backend)
        got = train_step(fn, model, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: output: {m}")
        for g, w in zip(_grads(model), want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: grad: {m}")
        fns[name], models[name], backends[name] = fn, model, backend
    return fns, models, backends


def take_turns(fns: dict, models: dict, x: torch.Tensor, steps: int) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` steps per variant, the variants taking turns step by step
    (the first of each turn rotating), so that drift in the machine's load reaches every
    variant alike; the ranks meet before each step."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            train_step(fns[name], models[name], x)
            times[name].append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, kind: str, dim: int, hidden: int, rows: int, steps: int, rounds: int, trace: str | None) -> dict:
    torch.set_num_threads(_threads(world))
    mesh = _mesh(kind, world)
    x = _input(kind, dim, rows)
    fns, models, backends = compile_variants(kind, mesh, dim, hidden, x, _variants())
    for name in fns:  # warm
        train_step(fns[name], models[name], x)
    times = take_turns(fns, models, x, steps * rounds)
    result = {name: statistics.median(t) for name, t in times.items()}
    result["comm"] = _replay_comm(backends["no passes"], steps)
    result["predicted"] = _simulated_us(backends["dtcompile"]) / _simulated_us(backends["no passes"])
    records = backends["dtcompile"].records
    result["profile"] = records[0].info.profile.name if records else "?"
    result["decisions"] = [
        f"{r.kind}: {p.name}: {d}" for r in records for p in r.passes if p.name != "annotate" for d in p.decisions if d.price is not None
    ]
    if trace:  # every rank steps; each writes its own trace
        path = Path(trace) / f"{kind}_{dim}x{hidden}x{rows}_r{rank}.json"
        result["trace"] = (*_profile_step(fns["dtcompile"], models["dtcompile"], x, path), str(path))
    return result


def _compute_alone(kind: str, world: int, dim: int, hidden: int, rows: int, steps: int) -> float:
    """Rank 0's step compiled by stock Inductor on the fake process group (compute only), in
    ``world`` processes stepping together, as the gloo ranks share this machine's cores."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(world), context.Queue()
    workers = [
        context.Process(target=_compute_alone_on_one, args=(barrier, results, kind, world, dim, hidden, rows, steps))
        for _ in range(world)
    ]
    for w in workers:
        w.start()
    times = [results.get(timeout=1800) for _ in workers]
    for w in workers:
        w.join()
    return statistics.median(times)


def _compute_alone_on_one(barrier, results, kind: str, world: int, dim: int, hidden: int, rows: int, steps: int) -> None:
    from dtcompile.testing import fake_world

    # The fake group's collectives return uninitialized memory: denormals there would slow
    # the matmuls as no real step is slowed.
    torch.set_flush_denormal(True)
    torch.set_num_threads(_threads(world))
    names = ("dp",) if kind == "fsdp" else ("tp",) if kind == "tp_sp" else ("dp", "tp")
    with fake_world(world, (world,) if kind != "fsdp_tp" else (2, world // 2), names) as mesh:
        model = _model(kind, mesh, dim, hidden)
        x = _input(kind, dim, rows)
        fn = torch.compile(model, backend="inductor")
        for _ in range(2):
            train_step(fn, model, x)
        samples = []
        for _ in range(steps):
            barrier.wait()  # every process compiled, and stepping together
            start = time.perf_counter()
            train_step(fn, model, x)
            samples.append(time.perf_counter() - start)
        torch._dynamo.reset()
    results.put(statistics.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="kind:dim x hidden x rows, comma separated")
    parser.add_argument("--four", action="store_true", help=f"also the 4-rank rows ({FOUR_ROWS})")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", default=None, help="folder for torch.profiler traces of one dtcompile step per row")
    parser.add_argument("--decisions", action="store_true", help="print the passes' priced decisions per row")
    args = parser.parse_args()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    rows = args.rows.split(",") + (FOUR_ROWS.split(",") if args.four else [])
    print(f"torch {torch.__version__}; gloo ranks on this machine; median of {args.steps} x {args.rounds} steps per variant, variants taking turns step by step, rank 0")
    print("every variant's output and gradients checked against eager first\n")
    print("| row | ranks | stock ms | dtcompile ms | no passes ms | dtcompile / stock | no passes / stock "
          "| compute ms | comm ms | bound ms | serial ms | predicted dtc / no passes | measured dtc / no passes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for row in rows:
        kind, size = row.split(":")
        dim, hidden, rows_ = (int(v) for v in size.split("x"))
        world = 4 if kind == "fsdp_tp" else 2
        r = run_gloo(world, _rank, world, kind, dim, hidden, rows_, args.steps, args.rounds, args.trace, timeout=3000)[0]
        compute = _compute_alone(kind, world, dim, hidden, rows_, args.steps)
        stock, dtc, bare = r["stock"], r["dtcompile"], r["no passes"]
        print(
            f"| {row} | {world} | {stock * 1e3:.1f} | {dtc * 1e3:.1f} | {bare * 1e3:.1f} | {dtc / stock:.2f}x | {bare / stock:.2f}x "
            f"| {compute * 1e3:.1f} | {r['comm'] * 1e3:.1f} | {max(compute, r['comm']) * 1e3:.1f} | {(compute + r['comm']) * 1e3:.1f} "
            f"| {r['predicted']:.3f} | {dtc / bare:.3f} |",
            flush=True,
        )
        if args.decisions:
            notes += [f"{row} ({r['profile']}): {d}" for d in r["decisions"]]
        if "trace" in r:
            wall, comm_us, beside, path = r["trace"]
            notes.append(
                f"{row}: traced dtcompile step {wall / 1e3:.1f} ms; collectives {comm_us / 1e3:.1f} ms, "
                f"{beside / 1e3:.1f} ms of it beside compute ({path})"
            )
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
