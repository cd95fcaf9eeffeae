"""Compile time over depth: dtcompile's entries beside stock torch's, torchtitan's Llama3 at 2 to 64 layers.

torchtitan 0.3.0's Llama3 from its own builders (dim 256, 8 heads, hidden 768, vocabulary
2048, SDPA; 2 x 128 tokens per rank) under graph_trainer's SimpleFSDP on 2 gloo ranks of
this machine, issue #70's setup.  For each depth, each way runs in fresh rank processes (its
own Dynamo, its own peak RSS), the ways in turn; rank 0's seconds:

- ``aot_eager``: stock ``torch.compile(model, backend="aot_eager")``, the first forward and
  backward (Dynamo, AOTAutograd, torch's min-cut partitioner; no code generation);
- ``aot_eager_decomp_partition``: stock's backend that also traces with Inductor's
  decompositions (``select_decomp_table``), as dtcompile does with or without Inductor, so that
  its passes see the graphs Inductor lowers: stock doing the AOT work dtcompile's does;
- ``dtcompile``: ``torch.compile(model, backend=dtcompile.backend(inductor=False))``, the same
  first forward and backward (Inductor's decompositions, the min-cut partitioner with
  dtcompile's policies, its passes; no code generation);
- ``dtcompile reshard off``: the same with ``reshard_after_forward=False``. Stock keeps every
  gathered weight for the backward (nothing tags SimpleFSDP's gathers for recompute under
  ``aot_eager``); dtcompile reshards them after the forward, as FSDP2 does, and gathers them
  again in the backward, a larger backward graph to partition, trace and run.  This way
  shows what that costs the compile;
- ``inductor`` and ``dtcompile inductor``: the same first forward and backward with Inductor's
  code generation, as users run them: stock ``backend="inductor"`` and ``dtcompile.backend()``,
  each rank with an empty cache of its own (``TORCHINDUCTOR_CACHE_DIR``: a cold start);
- ``gt tracer``: graph_trainer's tracer (``minimal_fx_tracer``) over forward, loss and
  backward as one graph, no pass run;
- ``compile_step``: ``dtcompile.compile_step`` with AdamW inside (``foreach=False``: a
  for-loop over the parameters, the update the most nodes to trace), the call that traces and
  compiles (its second: the first runs eagerly to make AdamW's state);
- ``compile_step foreach``: the same with ``foreach=True``, torch's default for AdamW on
  CUDA parameters (a ``_foreach_*`` op per step of the update, over every parameter);
- ``compile_step fused``: the same with ``fused=True``, torchtitan's default
  ``optimizer.implementation``.

``vs aot_eager`` and ``vs decomp`` compare the dtcompile backend's seconds with the two stock ways';
``vs inductor``, ``dtcompile inductor``'s with stock ``inductor``'s.
``compile s``: the way's seconds less those of its next call (the same step run warm: the
graph runs, nothing compiles), what compiling added; the tracer's is its seconds (it runs
nothing).  ``vs gt tracer`` compares seconds as measured, ``(compile s)`` the compile seconds.
``CPU s``: the CPU seconds rank 0's process spent over the same first call
(``time.process_time``), the fewest over the rounds, and its ratios: what the work cost the
rank, without the seconds it waited for its peer (which compiles at the same time on the
other core) or for a core the machine gave to something else.  On a shared 2-core machine
these move less between runs than the seconds do.  ``(compile CPU s)`` compares the CPU
seconds of the first call less those of the next with the tracer's CPU seconds.

Also per way: the seconds dtcompile's passes took (the records' ``PassRecord.seconds``,
summed over the graphs), the graph's nodes, and the rank's peak RSS; then, for dtcompile's
ways, each compile stage's seconds (``CompiledGraph.stages``: Dynamo, AOTAutograd or
``compile_step``'s make_fx trace, the partitioner, the passes, the simulations, ...), and
each pass's seconds.  Every way's loss is
checked against the eager loss of the same model (1e-5).  The table's ratios are measured
side by side in one run.

``--calls`` prints instead, per dtcompile way and depth, the Python function calls made
inside the passes (counted by cProfile, so their seconds are not shown): the passes' work,
which does not change with the machine's speed or load, nor with how the interpreter's
per-call time grows with the heap.  ``--lines`` counts the lines of dtcompile's own code
run there instead (``sys.settrace``): also the steps of a loop that calls nothing, which
function calls miss.

    python benchmarks/compile_depth.py --layers 2 8 32 64
    python benchmarks/compile_depth.py --layers 8 32 --ways inductor "dtcompile inductor"
    python benchmarks/compile_depth.py --layers 8 64 --calls
    python benchmarks/compile_depth.py --layers 8 32 --lines --ways dtcompile "compile_step fused"
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: torchtitan's harness (CPU device, SDPA)

import dtcompile  # noqa: E402
from dtcompile._testing.pass_work import counting_pass_work  # noqa: E402
from dtcompile.records import Stage  # noqa: E402
from dtcompile.testing import run_gloo  # noqa: E402

STOCK = ("aot_eager", "aot_eager_decomp_partition", "inductor")
"""The stock backends, by the names torch registers them under."""
INDUCTOR = ("inductor", "dtcompile inductor")
"""The ways that generate code, each rank with an empty Inductor cache of its own."""
DTCOMPILE_WAYS = ("dtcompile", "compile_step", "compile_step foreach", "compile_step fused")
"""The ways through dtcompile's passes (each with records)."""
NO_RESHARD = "dtcompile reshard off"
"""dtcompile with ``reshard_after_forward=False``: what resharding costs the compile."""
WAYS = (*STOCK, "dtcompile", NO_RESHARD, "dtcompile inductor", "gt tracer", *DTCOMPILE_WAYS[1:])
BACKENDS = ("dtcompile", NO_RESHARD, "dtcompile inductor")
"""The ways through ``torch.compile(backend=dtcompile.backend(...))``."""
STAGES = tuple(str(stage) for stage in Stage)
WORLD = 2
LLAMA = dict(dim=256, n_heads=8, hidden_dim=768, vocab_size=2048, seq_len=128)
BATCH = 2


def _build(rank: int, layers: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    import support.titan as titan

    model, parallel_dims, _ = titan.llama3_on_meta(titan.llama3_config(n_layers=layers, **LLAMA), WORLD, 1)
    model = titan.simple_fsdp(model, parallel_dims)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    from torchtitan.experiments.graph_trainer.simple_fsdp import disable_active_parametrization

    with torch.no_grad(), disable_active_parametrization():
        model.init_states()  # the buffers (RoPE's): to_empty leaves them uninitialized
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).normal_(0, 0.02)
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, LLAMA["vocab_size"], (BATCH, LLAMA["seq_len"] + 1), generator=generator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return model, (inputs, labels, torch.tensor(labels.numel() * WORLD))


def _loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    from torchtitan.components.loss import CrossEntropyLoss

    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(model(tokens), labels, count)
    return loss


def _summed(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Each name's seconds summed, in the order the names first come."""
    totals: dict[str, float] = {}
    for name, seconds in pairs:
        totals[name] = totals.get(name, 0.0) + seconds
    return totals


def _per_pass(records: Any) -> dict[str, float]:
    """Each pass's seconds (its ``PassRecord.seconds``) summed over the way's graphs."""
    return _summed((p.name, p.seconds) for record in records for p in record.passes)


def _stages(records: Any) -> dict[str, float]:
    """Each stage's seconds (``CompiledGraph.stages``) summed over the way's graphs."""
    return _summed((str(stage), seconds) for record in records for stage, seconds in record.stages.items())


class _Clocks:
    """The seconds a span took: ``wall`` (perf_counter) and ``cpu``, the CPU seconds this
    rank's process spent in it (``time.process_time``, every thread): what the span
    cost the rank itself, without the time it waited for its peer or for a core."""

    wall = 0.0
    cpu = 0.0


@contextlib.contextmanager
def _clocks() -> Iterator[_Clocks]:
    clocks = _Clocks()
    wall, cpu = time.perf_counter(), time.process_time()
    yield clocks
    clocks.wall, clocks.cpu = time.perf_counter() - wall, time.process_time() - cpu


@contextlib.contextmanager
def _cold_inductor_cache(rank: int) -> Iterator[None]:
    """Inside: Inductor's caches (FX graphs, AOTAutograd, kernels) in an empty folder of this rank's."""
    with (
        tempfile.TemporaryDirectory(prefix=f"compile_depth_rank{rank}_") as folder,
        mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": folder}),
    ):
        yield


def _way(rank: int, layers: int, way: str, count: str = "", digest: bool = False) -> dict[str, Any]:
    import support.titan as titan

    with (
        _cold_inductor_cache(rank) if way in INDUCTOR else contextlib.nullcontext(),
        titan.torchtitan_on_cpu(),
        counting_pass_work(count) if count else contextlib.nullcontext() as work,
    ):
        model, x = _build(rank, layers)
        reference = _loss(model, *x).item()
        records: Any = ()
        nodes = 0
        if way in (*STOCK, *BACKENDS):
            if way in BACKENDS:
                backend = dtcompile.backend(inductor=way in INDUCTOR, reshard_after_forward=way != NO_RESHARD)
            else:
                backend = way
            compiled = torch.compile(model, backend=backend)
            with _clocks() as first:
                loss = _loss(compiled, *x)
                loss.backward()
            with _clocks() as again:
                _loss(compiled, *x).backward()
            if way in BACKENDS:
                records = backend.records
                nodes = sum(len(r.graph.graph.nodes) for r in records)
        elif way == "gt tracer":
            from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer, run_traced

            def step(*inputs: torch.Tensor) -> list[torch.Tensor]:
                loss = _loss(model, *inputs)
                return [loss, *torch.autograd.grad(loss, [p for _, p in model.named_parameters(remove_duplicate=False)])]

            with _clocks() as first:
                traced = minimal_fx_tracer(step, module=model)(*x)
            again = _Clocks()
            nodes = len(traced.gm.graph.nodes)
            loss = run_traced(traced, module=model)(*x)[0]
        else:
            implementation = {"compile_step fused": {"fused": True}, "compile_step foreach": {"foreach": True}}
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, **implementation.get(way, {"foreach": False}))
            compiled = dtcompile.compile_step(lambda *inputs: _loss(model, *inputs), model=model, optimizer=optimizer,
                                              inductor=False)
            compiled(*x)  # eager: AdamW's state
            with _clocks() as first:
                loss = compiled(*x)
            with _clocks() as again:
                compiled(*x)
            records = compiled.records
            nodes = sum(len(r.graph.graph.nodes) for r in records)
        got = float(loss.detach())
        if not math.isfinite(reference) or abs(got - reference) > 1e-5 * max(1.0, abs(reference)):
            raise AssertionError(f"{way} at {layers} layers: loss {got} against eager's {reference}")
    per_pass = _per_pass(records)
    lines: list[str] = []
    if digest:  # asked by records_digest.py --depth: writing each graph's code adds to the peak RSS
        from records_digest import record_line  # beside this file

        lines = [record_line(r) for r in records]
    return {
        "records": lines,
        "seconds": first.wall,
        "compile_s": first.wall - again.wall,
        "cpu_s": first.cpu,
        "compile_cpu_s": first.cpu - again.cpu,
        "passes_s": sum(per_pass.values()) if records else None,
        "stages": _stages(records),
        "per_pass": per_pass,
        "nodes": nodes,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "passes_count": (sum(work.lines.values()) if count == "lines" else work.calls) if count else 0,
    }


def _print_counts(args: argparse.Namespace, what: str) -> None:
    """``--calls`` / ``--lines``: the passes' function calls or lines run, per way and depth,
    against the first depth's."""
    ways = [w for w in args.ways if w in DTCOMPILE_WAYS]
    counted = {"calls": "Python function calls", "lines": "lines of dtcompile's code run"}[what]
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, rank 0: {counted} inside dtcompile's passes")
    print(f"| layers | way | nodes | passes {what} | {what} per node | {what} x | nodes x |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    first: dict[str, dict[str, Any]] = {}
    for layers in args.layers:
        for way in ways:
            row = run_gloo(WORLD, _way, layers, way, what, timeout=3600)[0]
            base = first.setdefault(way, row)
            print(f"| {layers} | {way} | {row['nodes']} | {row['passes_count']} | {row['passes_count'] / row['nodes']:.0f} | "
                  f"{row['passes_count'] / base['passes_count']:.2f} | {row['nodes'] / base['nodes']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--rounds", type=int, default=1, help="the ways in turn this many times; each row its fastest")
    parser.add_argument("--calls", action="store_true",
                        help="instead of seconds, count the Python function calls inside the passes (under cProfile)")
    parser.add_argument("--lines", action="store_true",
                        help="instead of seconds, count the lines of dtcompile's code run inside the passes (sys.settrace)")
    args = parser.parse_args()
    if args.calls or args.lines:
        _print_counts(args, "lines" if args.lines else "calls")
        return
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, rank 0's seconds (the fastest of {args.rounds} rounds)")
    print("| layers | way | seconds | compile s | vs aot_eager | vs decomp | vs gt tracer | (compile s) | CPU s | "
          "vs aot_eager (CPU) | vs decomp (CPU) | vs gt tracer (CPU) | (compile CPU s) | vs inductor | vs inductor (CPU) | passes s | "
          "nodes | peak RSS MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    stages: list[tuple[int, str, dict[str, float]]] = []
    per_pass: list[tuple[int, str, dict[str, float]]] = []
    for layers in args.layers:
        rows: dict[str, dict[str, Any]] = {}
        cpu: dict[str, float] = {}  # each way's fewest CPU seconds over the rounds
        compile_cpu: dict[str, float] = {}  # and fewest CPU seconds compiling
        for _ in range(args.rounds):
            for way in args.ways:
                row = run_gloo(WORLD, _way, layers, way, timeout=3600)[0]
                if way not in rows or row["seconds"] < rows[way]["seconds"]:
                    rows[way] = row
                cpu[way] = min(cpu.get(way, math.inf), row["cpu_s"])
                compile_cpu[way] = min(compile_cpu.get(way, math.inf), row["compile_cpu_s"])
        walls = {w: r["seconds"] for w, r in rows.items()}
        for way, row in rows.items():
            step = way.startswith("compile_step")
            without_code = way in BACKENDS and way not in INDUCTOR  # against the stock ways without code generation
            vs_stock = _ratio(row["seconds"], walls, "aot_eager", without_code)
            vs_decomp = _ratio(row["seconds"], walls, "aot_eager_decomp_partition", without_code)
            vs_inductor = _ratio(row["seconds"], walls, "inductor", way == "dtcompile inductor")
            cpu_inductor = _ratio(cpu[way], cpu, "inductor", way == "dtcompile inductor")
            vs_tracer = _ratio(row["seconds"], walls, "gt tracer", step)
            vs_tracer_compile = _ratio(row["compile_s"], walls, "gt tracer", step)
            cpu_stock = _ratio(cpu[way], cpu, "aot_eager", without_code)
            cpu_decomp = _ratio(cpu[way], cpu, "aot_eager_decomp_partition", without_code)
            cpu_tracer = _ratio(cpu[way], cpu, "gt tracer", step)
            cpu_tracer_compile = _ratio(compile_cpu[way], cpu, "gt tracer", step)
            passes = f"{row['passes_s']:.2f}" if row["passes_s"] is not None else "-"
            print(f"| {layers} | {way} | {row['seconds']:.1f} | {row['compile_s']:.1f} | {vs_stock} | {vs_decomp} | {vs_tracer} | "
                  f"{vs_tracer_compile} | {cpu[way]:.1f} | {cpu_stock} | {cpu_decomp} | {cpu_tracer} | {cpu_tracer_compile} | "
                  f"{vs_inductor} | {cpu_inductor} | {passes} | "
                  f"{row['nodes'] or '-'} | {row['rss_mib']:.0f} |", flush=True)
            if row["stages"]:
                stages.append((layers, way, row["stages"]))
                per_pass.append((layers, way, row["per_pass"]))
    _print_seconds("Per stage, rank 0's seconds summed over its graphs (the records' StageSeconds):", STAGES, stages, 2)
    passes = tuple(dict.fromkeys(name for _, _, seconds in per_pass for name in seconds))
    _print_seconds("Per pass, rank 0's seconds summed over its graphs (the records' PassRecord.seconds):",
                   passes, per_pass, 3)


def _ratio(value: float, of: dict[str, float], base: str, applies: bool) -> str:
    """``value`` over way ``base``'s entry in ``of``, where the column ``applies`` and that way ran."""
    return f"{value / of[base]:.2f}x" if applies and of.get(base) else "-"


def _print_seconds(title: str, columns: tuple[str, ...], rows: list[tuple[int, str, dict[str, float]]], digits: int) -> None:
    print(f"\n{title}")
    print("| layers | way | " + " | ".join(columns) + " |")
    print("|---:|---|" + "---:|" * len(columns))
    for layers, way, seconds in rows:
        cells = [f"{seconds[c]:.{digits}f}" if c in seconds else "-" for c in columns]
        print(f"| {layers} | {way} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
