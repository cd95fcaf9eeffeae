"""CUDA check (issue #15): the fused ops on a GPU, the TP+SP block's step time, the cost model's roofline.

Part 1 (``--parts fused``; a 1-rank NCCL group on cuda:0): whether symmetric
memory can be enabled on one GPU (and why not), torch's symm_mem kernels
called directly, and ``dtcompile::fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter`` against ``torch.matmul`` and their decomposed
path, fp32 and bf16, eagerly and inside a training step compiled by dtcompile
(its ``async_tp`` pass puts them into the forward and backward graphs, forced
with ``force_async_tp=True``: on one rank no data moves, so the priced pass
fuses nothing).  One rank: the gather and the scatter are the identity.

Part 2 (``--parts block``; the fake process group at world 8, cuda mesh): the
tensor + sequence parallel block at Llama-3-8B layer sizes (dim 4096, 32
heads, FFN hidden 14336; bf16; ``--batch`` x ``--seq``) compiled with stock
Inductor and with dtcompile, one training step (forward, ``out.pow(2).mean()``,
backward).  Collectives move no data, so this times the compute the passes
reorder.  Compile time is the first step (Inductor caches off) minus the best
warm step, best of ``--repeats`` rounds (backend order alternating); step time
is the median of ``--rounds`` x ``--steps`` warm steps (each round runs
``--steps`` consecutive steps per backend, the order rotating); GPU kernel time
per step from ``torch.profiler`` (``--profile`` steps).

Part 3 (``--parts calibrate``; same world and block): every compute node of
the forward and backward graphs stock Inductor receives, run alone on the GPU
(one aten op on random inputs of the node's shapes, strides and dtypes), against
the roofline of ``dtcompile.cost.simulate.node_time_us`` under the ``h100``
profile; the matmul TFLOP/s and memory GB/s the measurements imply.

Part 4 (``--parts memory``; the fake process group at world 8, cuda mesh; issue
#31): the stack of ``NormMLPStack`` blocks (``--mem-dim``, 4x hidden, ``--mem-layers``,
``--mem-rows`` rows per rank, fp32) under FSDP2 eagerly, and under SimpleFSDP
compiled whole with dtcompile (gathered weights resharded, and kept), and with
stock Inductor: the CUDA allocator's peak of one warm step (forward,
``out.pow(2).mean()``, backward; ``torch.cuda.max_memory_allocated``) beside
dtcompile's estimate of its graphs (:mod:`dtcompile.graph.memory`).

    python benchmarks/cuda_check.py                   # all parts
    python benchmarks/cuda_check.py --parts block --batch 1 --seq 2048
    python benchmarks/cuda_check.py --pytest          # the cuda test tier, on torch < 2.13 too

On a torch older than 2.13 (the GPU machines' 2.11) the script first lets
dtcompile import there (:func:`_compat_older_torch`): HOP fakes registered
without 2.13's ``skip_cache``.  ``dynamo_vars`` (whose guards need 2.13's
Dynamo) stays out by its own version fence, with one warning, so stock Dynamo
traces there.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import logging
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _compat_older_torch() -> list[str]:
    """dtcompile targets torch 2.13; the GPU machines carry 2.11.  What importing
    dtcompile needs there (no-op on 2.13).  Returns what it patched."""
    import inspect

    import torch._higher_order_ops.utils as hop_utils

    patched = []
    if "skip_cache" not in inspect.signature(hop_utils.register_fake).parameters:
        real = hop_utils.register_fake

        def register_fake(
            hop, fn=None, *, skip_cache=False
        ):  # 2.11 caches every HOP's fake output
            return real(hop, fn)

        hop_utils.register_fake = register_fake
        patched.append("register_fake(skip_cache=) ignored")
    from torch.fx.experimental import symbolic_shapes

    if not hasattr(symbolic_shapes, "optimization_hint"):  # 2.13's; 2.11 has size_hint on the shape env

        def optimization_hint(size, fallback=None):
            if not isinstance(size, torch.SymInt):
                return int(size)
            hint = size.node.hint
            return int(hint) if hint is not None else int(fallback if fallback is not None else 8192)

        symbolic_shapes.optimization_hint = optimization_hint
        patched.append("symbolic_shapes.optimization_hint added")
    # dynamo_vars needs torch 2.13's Dynamo: outside the tested range its install()
    # leaves Dynamo stock by itself (one warning), so stock Dynamo traces there.
    return patched


COMPAT = _compat_older_torch()

import dtcompile
from dtcompile._testing.models import BlockArgs, SequenceParallelMLP, build_block
from dtcompile.base import fused_ops as ops
from dtcompile.cost import get_profile
from dtcompile.cost.simulate import node_time_us, simulate

LLAMA_8B = BlockArgs(dim=4096, n_heads=32, hidden=14336)
WORLD = 8
MATMULS = ("mm", "addmm", "bmm", "baddbmm")
CONFIGS: dict[str, frozenset[str] | None] = {
    "inductor": None,  # stock Inductor
    "dtcompile": frozenset(),  # all passes
    "dtcompile -async_tp": frozenset({"async_tp"}),
    "dtcompile -overlap": frozenset({"overlap"}),
    "dtcompile -bucketing": frozenset({"bucketing"}),
    "dtcompile, no passes": frozenset({"async_tp", "bucketing", "overlap"}),
}
"""Backends of part 2: stock Inductor, or dtcompile with these passes switched off (``--ablate``: all)."""


def _environment() -> None:
    props = torch.cuda.get_device_properties(0)
    print(
        f"date {datetime.date.today()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
        f"NCCL {torch.cuda.nccl.version()}"
    )
    if COMPAT:
        print(
            f"torch {torch.__version__} is not 2.13: compat shims applied: {'; '.join(COMPAT)}"
        )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    scale = expected.abs().max().float().clamp_min(1e-12)
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


# ---------------------------------------------------------------- part 1: fused ops, 1-rank NCCL


class _Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _decomposed(fn):
    real = ops.symmetric_memory_available
    ops.symmetric_memory_available = lambda tensor, group_name: False
    try:
        return fn()
    finally:
        ops.symmetric_memory_available = real


def _symm_mem_probe(group: str) -> None:
    """torch's own symm_mem entry points, called directly: what works on one GPU."""
    import torch.distributed._symmetric_memory as symm_mem

    steps = [
        (
            "enable_symm_mem_for_group",
            lambda: symm_mem.enable_symm_mem_for_group(group),
        ),
        (
            "get_symm_mem_workspace (rendezvous)",
            lambda: symm_mem.get_symm_mem_workspace(group, min_size=1 << 20),
        ),
    ]
    a = _randn(4, 64, 256, dtype=torch.bfloat16, seed=0)
    b = _randn(256, 128, dtype=torch.bfloat16, seed=1)
    for dim in (0, 1):
        steps.append(
            (
                f"symm_mem.fused_all_gather_matmul(gather_dim={dim})",
                functools.partial(
                    torch.ops.symm_mem.fused_all_gather_matmul,
                    a,
                    [b],
                    dim,
                    group,
                    return_A=True,
                ),
            )
        )
        steps.append(
            (
                f"symm_mem.fused_matmul_reduce_scatter(scatter_dim={dim})",
                functools.partial(
                    torch.ops.symm_mem.fused_matmul_reduce_scatter,
                    a,
                    b,
                    "sum",
                    dim,
                    group,
                ),
            )
        )
    print(
        f"symm_mem backend: {getattr(symm_mem, 'get_backend', lambda d: '?')(torch.device('cuda', 0))}"
    )
    for name, step in steps:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                result = step()
            torch.cuda.synchronize()
            if isinstance(result, tuple):
                gathered, (out,) = result
                desc = f"ok: A {tuple(gathered.shape)} strides {gathered.stride()}, out strides {out.stride()}"
            elif isinstance(result, torch.Tensor):
                desc = f"ok: {tuple(result.shape)} strides {result.stride()} contiguous={result.is_contiguous()}"
            else:
                desc = "ok"
        except Exception as exc:  # noqa: BLE001 - reported
            desc = f"FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        print(f"  {name:<52} {desc}")


def _training_step_errors(group: str, dtype: torch.dtype) -> tuple[float, float, str]:
    model = SequenceParallelMLP(
        group, _randn(1024, 4096, dtype=dtype, seed=11) / 1024**0.5, _randn(4096, 1024, dtype=dtype, seed=12) / 4096**0.5
    )
    x = _randn(2048, 1024, dtype=dtype, seed=13).requires_grad_()
    x_ref, w1, w2 = (
        t.detach().clone().requires_grad_() for t in (x, model.w1, model.w2)
    )
    expected = torch.relu(torch.matmul(x_ref, w1)) @ w2
    expected.float().pow(2).mean().backward()
    torch._dynamo.reset()
    # One rank moves no data, so the priced async_tp pass would fuse nothing; no AOT
    # cache, so that the graphs are compiled here and their records read.
    backend = dtcompile.DTCompileBackend(dtcompile.DTCompileConfig(force_async_tp=True, aot_cache=False))
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.float().pow(2).mean().backward()
    fused = sorted(
        f"{r.kind[:3]}:{c.op}"
        for r in backend.records
        for c in r.collectives
        if c.fused
    )
    return (
        _relative_error(out, expected.detach()),
        max(
            _relative_error(a.grad, b.grad)
            for a, b in ((x, x_ref), (model.w1, w1), (model.w2, w2))
        ),
        " ".join(fused),
    )


def _fused(args: argparse.Namespace) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        # One rank: its own store, on a port the kernel picks and this process holds.
        store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        group = dist.group.WORLD.group_name
        print(
            f"\nPart 1: fused ops on a 1-rank NCCL group (group {group!r}, backend {dist.get_backend()})"
        )
        reasons = _Reasons()
        logging.getLogger("dtcompile.base.fused_ops").addHandler(reasons)
        logging.getLogger("dtcompile.base.fused_ops").setLevel(logging.INFO)
        enabled = ops.symmetric_memory_available(torch.empty(1, device="cuda"), group)
        print(f"dtcompile.base.fused_ops.symmetric_memory_available: {enabled}")
        for message in reasons.messages:
            print(f"  logged: {message}")
        print("torch's symm_mem entry points called directly:")
        _symm_mem_probe(group)

        print(
            "\nrelative error (max |diff| / max |reference|); reference: torch.matmul; 'decomp': the decomposed path"
        )
        print(
            f"{'op':<40} {'dtype':<5} {'vs matmul':>10} {'vs decomp':>10} {'path':>9}"
        )
        for dtype in (torch.float32, torch.bfloat16):
            name = "fp32" if dtype == torch.float32 else "bf16"
            path = "symm_mem" if enabled else "decomp"
            for dim in (0, 1):
                a = _randn(4, 1024, 4096, dtype=dtype, seed=2)
                bs = [
                    _randn(4096, 1536, dtype=dtype, seed=3),
                    _randn(4096, 512, dtype=dtype, seed=4),
                ]

                def gather(a=a, bs=bs, dim=dim):
                    return torch.ops.dtcompile.fused_all_gather_matmul(
                        a, bs, dim, group
                    )

                (g, outs), (g_ref, outs_ref) = gather(), _decomposed(gather)
                assert torch.equal(g, a) and torch.equal(g_ref, a), (
                    "the gather on one rank is the shard"
                )
                err = max(
                    _relative_error(o, torch.matmul(a, b)) for o, b in zip(outs, bs)
                )
                dec = max(_relative_error(o, r) for o, r in zip(outs, outs_ref))
                print(
                    f"{f'fused_all_gather_matmul(gather_dim={dim})':<40} {name:<5} {err:>10.2e} {dec:>10.2e} {path:>9}"
                )

                a2 = a.view(-1, 4096)
                b = bs[0]

                def scatter(a2=a2, b=b, dim=dim):
                    return torch.ops.dtcompile.fused_matmul_reduce_scatter(
                        a2, b, [4, 1024, 1536], "sum", dim, group
                    )

                out, ref = scatter(), _decomposed(scatter)
                err = _relative_error(out, torch.matmul(a2, b).view(4, 1024, 1536))
                dec = _relative_error(out, ref)
                print(
                    f"{f'fused_matmul_reduce_scatter(scatter_dim={dim})':<40} {name:<5} {err:>10.2e} {dec:>10.2e} {path:>9}"
                )
            try:
                out_err, grad_err, fused = _training_step_errors(group, dtype)
                print(
                    f"{'dtcompile training step: output':<40} {name:<5} {out_err:>10.2e} {'':>10} {path:>9}"
                )
                print(
                    f"{'  gradients (x, w1, w2; largest)':<40} {name:<5} {grad_err:>10.2e}   fused: {fused}"
                )
            except Exception:  # noqa: BLE001 - reported, the other parts go on
                print(
                    f"dtcompile training step ({name}) FAILED:\n{traceback.format_exc()}"
                )
        for message in reasons.messages[1:]:
            print(f"  logged later: {message}")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- parts 2 and 3: the block, fake PG world 8


def _fake_cuda_world() -> object:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    return init_device_mesh("cuda", (WORLD,), mesh_dim_names=("tp",))


def _build(
    mesh: object, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.Tensor]:
    _, parallel, x = build_block(mesh, batch=args.batch, seq=args.seq, args=LLAMA_8B)
    return parallel.to(torch.bfloat16), x.to("cuda", torch.bfloat16)


def _step(fn, params: list[torch.nn.Parameter], x: torch.Tensor) -> float:
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _first_step(
    name: str, parallel: torch.nn.Module, params: list, x: torch.Tensor
) -> tuple[object, object, float]:
    """(backend, compiled module, seconds of the first step, which compiles)."""
    disabled = CONFIGS[name]
    backend = "inductor" if disabled is None else dtcompile.backend(disable_passes=disabled)
    fn = torch.compile(parallel, backend=backend, fullgraph=True)
    with torch.compiler.config.patch(force_disable_caches=True):
        return backend, fn, _step(fn, params, x)


def _kernel_ms(
    name: str, fn, params: list, x: torch.Tensor, args: argparse.Namespace
) -> tuple[float, float]:
    """GPU kernel time and kernel launches per step (torch.profiler, ``args.profile`` steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile):
            _step(fn, params, x)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    if args.profile_dir:
        table = averages.table(
            sort_by="self_device_time_total", row_limit=40, max_name_column_width=90
        )
        out = (
            Path(args.profile_dir)
            / f"kernels_{name.replace(' ', '_').replace('(', '').replace(')', '')}.txt"
        )
        out.write_text(table)
    return total_us / args.profile / 1e3, sum(e.count for e in kernels) / args.profile


def _block(
    args: argparse.Namespace, parallel: torch.nn.Module, x: torch.Tensor
) -> dict[str, float]:
    print(
        f"\nPart 2: TP+SP block, Llama-3-8B layer sizes, bf16, batch {args.batch} x seq {args.seq}, "
        f"fake PG world {WORLD} (rank 0), cuda"
    )
    params = list(parallel.parameters())
    # Start Inductor's compile workers and CUDA libraries before anything is timed.
    torch.compile(lambda t: (t * 2).sin(), backend="inductor")(
        torch.ones(8, device="cuda")
    )
    names = list(CONFIGS) if args.ablate else ["inductor", "dtcompile"]
    compile_s: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        torch._dynamo.reset()
        compiled, backends = {}, {}
        for name in names if round_ % 2 == 0 else names[::-1]:
            backends[name], compiled[name], first = _first_step(
                name, parallel, params, x
            )
            warm = min(_step(compiled[name], params, x) for _ in range(args.warmup))
            compile_s[name].append(first - warm)
    # Rounds of --steps consecutive steps per backend, the order rotating each round:
    # a backend's steps reuse its own cached blocks, and none always follows another.
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            times[name].extend(
                _step(compiled[name], params, x) for _ in range(args.steps)
            )
    medians = {name: statistics.median(t) for name, t in times.items()}
    dtc = backends["dtcompile"]
    if isinstance(dtc, dtcompile.DTCompileBackend):
        fused = collections.Counter(
            f"{r.kind}:{c.op}" for r in dtc.records for c in r.collectives if c.fused
        )
        print(
            f"dtcompile graphs: {len(dtc.records)}; fused collective-matmuls: {dict(fused)}"
        )
    kernels = (
        {name: _kernel_ms(name, compiled[name], params, x, args) for name in names}
        if args.profile
        else {}
    )
    best = {name: min(c) for name, c in compile_s.items()}
    head = f"| backend | compile s (best of {args.repeats}) | step ms (median of {args.rounds} x {args.steps}) | min ms | max ms | vs inductor |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if kernels:
        head += (
            f" GPU kernel ms per step ({args.profile} profiled) | kernels per step |"
        )
        rule += "---:|---:|"
    print(head)
    print(rule)
    for name in names:
        row = (
            f"| {name} | {best[name]:.1f} | {medians[name] * 1e3:.2f} | {min(times[name]) * 1e3:.2f} | "
            f"{max(times[name]) * 1e3:.2f} | {medians[name] / medians['inductor']:.3f}x |"
        )
        if kernels:
            row += f" {kernels[name][0]:.2f} | {kernels[name][1]:.0f} |"
        print(row)
    print(
        f"compile s per round: { {n: [round(c, 1) for c in cs] for n, cs in compile_s.items()} }"
    )
    print(
        f"dtcompile / inductor: compile {best['dtcompile'] / best['inductor']:.2f}x, "
        f"step {medians['dtcompile'] / medians['inductor']:.3f}x"
    )
    print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return medians


def _capture_graphs(
    parallel: torch.nn.Module, x: torch.Tensor
) -> list[tuple[str, torch.fx.GraphModule]]:
    """The forward and backward graphs stock Inductor receives (Inductor's decompositions and partitioner)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    graphs = []

    def compiler(kind):
        def compile_graph(gm, inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(
            min_cut_rematerialization_partition, compiler="inductor"
        ),
    )
    torch._dynamo.reset()
    _step(
        torch.compile(parallel, backend=backend, fullgraph=True),
        list(parallel.parameters()),
        x,
    )
    return graphs


def _materialize(value: object) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    # One buffer as large as the strides reach (expanded dims have stride 0), viewed with them.
    numel = 1 + sum(
        (size - 1) * stride
        for size, stride in zip(value.shape, value.stride())
        if size > 0
    )
    buffer = torch.empty(numel, dtype=value.dtype, device="cuda")
    if buffer.is_floating_point():
        buffer.normal_()
    else:
        buffer.zero_()
    return buffer.as_strided(tuple(value.shape), tuple(value.stride()))


def _time_us(fn, reps: int = 10, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    samples = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def _describe(node: torch.fx.Node) -> str:
    shapes = []
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            transposed = (
                "T"
                if value.dim() >= 2 and value.stride(-2) == 1 and value.stride(-1) != 1
                else ""
            )
            shapes.append("x".join(map(str, value.shape)) + transposed)
    return f"{node.target._opname}({', '.join(shapes)})"


def _calibrate(
    args: argparse.Namespace,
    parallel: torch.nn.Module,
    x: torch.Tensor,
    step_s: float | None,
) -> None:
    from torch.fx.node import map_aggregate

    h100 = get_profile("h100")
    graphs = _capture_graphs(parallel, x)
    print(
        f"\nPart 3: compute roofline (h100: matmul {h100.matmul_tflops:g} TFLOP/s, memory {h100.memory_gbps:g} GB/s) "
        f"vs each compute node of the {len(graphs)} stock graphs run alone on the GPU"
    )
    rows: dict[tuple, dict] = {}
    failed = collections.Counter()
    for kind, gm in graphs:
        for node in gm.graph.nodes:
            roofline = node_time_us(node, h100)
            if roofline <= 0 or node.op != "call_function":
                continue
            vals = map_aggregate(
                node.args,
                lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
            )
            key = (
                str(node.target),
                repr(
                    map_aggregate(
                        vals,
                        lambda v: (
                            (tuple(v.shape), v.stride(), v.dtype)
                            if isinstance(v, torch.Tensor)
                            else v
                        ),
                    )
                ),
            )
            if key in rows:
                rows[key]["count"] += 1
                continue
            kw = map_aggregate(
                node.kwargs,
                lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
            )
            try:
                inputs, kwargs = (
                    map_aggregate(vals, _materialize),
                    map_aggregate(kw, _materialize),
                )
                measured = _time_us(functools.partial(node.target, *inputs, **kwargs))
                del inputs, kwargs
            except Exception as exc:  # noqa: BLE001 - counted, reported
                failed[f"{node.target}: {type(exc).__name__}"] += 1
                continue
            is_mm = node.target._opname in MATMULS
            out = node.meta["val"]
            moved = sum(
                t.numel() * t.element_size()
                for t in (out, *(a.meta["val"] for a in node.all_input_nodes))
            )
            if is_mm:
                work = roofline * 1e-6 * h100.matmul_tflops * 1e12  # flops
            else:
                work = roofline * 1e-6 * h100.memory_gbps * 1e9  # bytes
            rows[key] = {
                "kind": kind,
                "desc": _describe(node),
                "is_mm": is_mm,
                "roofline": roofline,
                "measured": measured,
                "work": work,
                "count": 1,
                "bytes_us": moved / (h100.memory_gbps * 1e9) * 1e6,
                "dtype": str(getattr(out, "dtype", "")).removeprefix("torch."),
            }
    if failed:
        print(f"not measured (could not run on random inputs): {dict(failed)}")

    mm_rows = sorted(
        (r for r in rows.values() if r["is_mm"]),
        key=lambda r: -r["measured"] * r["count"],
    )
    print(
        f"\nmatmuls ({len(mm_rows)} distinct shapes, {sum(r['count'] for r in mm_rows)} nodes):"
    )
    print(
        "| graph | op (shapes; T = transposed operand) | n | roofline us | measured us | measured / roofline | TFLOP/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in mm_rows:
        print(
            f"| {r['kind']} | {r['desc']} | {r['count']} | {r['roofline']:.1f} | {r['measured']:.1f} | "
            f"{r['measured'] / r['roofline']:.2f} | {r['work'] / r['measured'] / 1e6:.0f} |"
        )
    mem_rows = sorted(
        (r for r in rows.values() if not r["is_mm"]),
        key=lambda r: -r["measured"] * r["count"],
    )
    big = [r for r in mem_rows if r["work"] >= args.big_mib * 2**20]
    print(
        f"\nmemory-bound ops ({len(mem_rows)} distinct, {sum(r['count'] for r in mem_rows)} nodes); "
        f"the {min(len(mem_rows), args.top)} that take longest in total:"
    )
    print(
        "| graph | op | n | dtype | MiB moved | roofline us | measured us | measured / roofline | GB/s |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in mem_rows[: args.top]:
        print(
            f"| {r['kind']} | {r['desc']} | {r['count']} | {r['dtype']} | {r['work'] / 2**20:.0f} | {r['roofline']:.1f} | "
            f"{r['measured']:.1f} | {r['measured'] / r['roofline']:.2f} | {r['work'] / r['measured'] / 1e3:.0f} |"
        )

    def total(rs, field):
        return sum(r[field] * r["count"] for r in rs)

    print(
        "\nsummary (node-count weighted totals over one training step's forward + backward graphs):"
    )
    print(
        "| class | nodes | roofline us | measured us | measured / roofline | implied constant |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, rs, unit, scale in (
        ("matmul", mm_rows, "TFLOP/s", 1e6),
        ("memory-bound, all", mem_rows, "GB/s", 1e3),
        (f"memory-bound, >= {args.big_mib} MiB moved", big, "GB/s", 1e3),
    ):
        if not rs:
            continue
        roof, meas = total(rs, "roofline"), total(rs, "measured")
        print(
            f"| {label} | {sum(r['count'] for r in rs)} | {roof:.0f} | {meas:.0f} | {meas / roof:.2f} | "
            f"{total(rs, 'work') / meas / scale:.0f} {unit} |"
        )
    roof = sum(max(r["roofline"], r["bytes_us"]) * r["count"] for r in mm_rows)
    meas = total(mm_rows, "measured")
    print(
        f"| matmul, roofline max(flops, bytes) | {sum(r['count'] for r in mm_rows)} | {roof:.0f} | {meas:.0f} | "
        f"{meas / roof:.2f} | |"
    )
    ratios = sorted((r["measured"] / r["roofline"], r["count"]) for r in big)
    if ratios:
        half, seen = sum(c for _, c in ratios) / 2, 0
        median = next(ratio for ratio, c in ratios if (seen := seen + c) >= half)
        print(
            f"memory-bound ops >= {args.big_mib} MiB: median measured / roofline {median:.2f} "
            f"(implied {h100.memory_gbps / median:.0f} GB/s)"
        )
    estimate = sum(simulate(gm.graph, h100).compute_us for _, gm in graphs)
    measured = total(mm_rows, "measured") + total(mem_rows, "measured")
    print(
        f"\ncost model's compute for one step (simulate, h100): {estimate / 1e3:.2f} ms; "
        f"sum of the nodes run alone: {measured / 1e3:.2f} ms"
        + (
            f"; stock Inductor's compiled step (part 2): {step_s * 1e3:.2f} ms"
            if step_s
            else ""
        )
    )


def _memory(args: argparse.Namespace) -> None:
    """Part 4: measured CUDA peaks against dtcompile's estimates (see the module docstring)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dtcompile._testing.models import build_norm_mlp_stack

    mesh = init_device_mesh("cuda", (WORLD,), mesh_dim_names=("dp",))
    dim = args.mem_dim
    print(f"\n== memory: NormMLPStack dim {dim}, hidden {4 * dim}, {args.mem_layers} layers, {args.mem_rows} rows per rank, "
          f"fp32, fake world {WORLD} (cuda) ==")
    print("| way | measured peak MiB | estimated peak MiB | estimate / measured | vs fsdp2 eager |")
    print("|---|---:|---:|---:|---:|")
    rows = {}
    for way in ("fsdp2 eager", "dtcompile", "dtcompile, weights kept", "inductor"):
        torch._dynamo.reset()
        reference, parallel, x = build_norm_mlp_stack(mesh, rows=args.mem_rows, dim=dim, hidden=4 * dim, layers=args.mem_layers)
        x = x.chunk(WORLD)[0].cuda()
        backend = None
        if way == "fsdp2 eager":
            model = copy.deepcopy(reference).cuda()
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fn = model = fully_shard(model, mesh=mesh)
        else:
            model = parallel.cuda()
            if way.startswith("dtcompile"):
                backend = dtcompile.backend(reshard_after_forward=way == "dtcompile")
            fn = torch.compile(model, backend=backend or "inductor")
        params = list(model.parameters())
        for _ in range(2):
            _step(fn, params, x)
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, params, x)
        peak = torch.cuda.max_memory_allocated()
        estimate = max(r.memory.peak_bytes for r in backend.records) if backend is not None else None
        rows[way] = (peak, estimate)
        del fn, model, parallel, reference
    base = rows["fsdp2 eager"][0]
    for way, (peak, estimate) in rows.items():
        est = f"{estimate / 2**20:.1f}" if estimate is not None else "-"
        ratio = f"{estimate / peak:.2f}" if estimate is not None else "-"
        print(f"| {way} | {peak / 2**20:.1f} | {est} | {ratio} | {peak / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pytest",
        action="store_true",
        help="run the cuda test tier (tests/cuda) here, with the compat shims, and exit",
    )
    parser.add_argument(
        "--parts",
        default="fused,block,calibrate,memory",
        help="comma-separated: fused, block, calibrate, memory",
    )
    parser.add_argument("--mem-dim", type=int, default=1024, help="part memory: the stack's dim")
    parser.add_argument("--mem-layers", type=int, default=8, help="part memory: the stack's layers")
    parser.add_argument("--mem-rows", type=int, default=2048, help="part memory: rows per rank")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="timed consecutive steps per backend and round",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds (backend order rotates)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="compile rounds (backend order alternates); best kept",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="part 2 also times dtcompile with each pass off",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=3,
        help="steps profiled per backend for GPU kernel time (0: off)",
    )
    parser.add_argument(
        "--profile-dir",
        help="write each backend's top kernels (torch.profiler table) here",
    )
    parser.add_argument("--top", type=int, default=15, help="memory-bound ops listed")
    parser.add_argument(
        "--big-mib",
        type=int,
        default=16,
        help="the 'large' memory-bound ops move at least this",
    )
    args = parser.parse_args()
    if args.pytest:
        import pytest

        tests = Path(__file__).resolve().parent.parent / "tests" / "cuda"
        # -rsP: the skips' reasons and what the passing tests print (symmetric memory's state);
        # their captured log records from INFO up (torch's DEBUG records are noise there).
        sys.exit(pytest.main([str(tests), "-q", "-rsP", "-p", "no:cacheprovider", "-o", "log_level=INFO"]))
    parts = set(args.parts.split(","))
    if unknown := parts - {"fused", "block", "calibrate", "memory"}:
        parser.error(f"unknown parts {sorted(unknown)}")
    if not torch.cuda.is_available():
        sys.exit("cuda_check.py needs a CUDA GPU")
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _environment()
    failed = []

    def run_part(name, *part_args):
        """The part's result, or None with its traceback printed: the other parts go on."""
        try:
            return PARTS[name](*part_args)
        except Exception:  # noqa: BLE001 - reported
            failed.append(name)
            traceback.print_exc()
            return None

    if "fused" in parts:
        run_part("fused", args)
    if parts & {"block", "calibrate", "memory"}:
        mesh = _fake_cuda_world()
        try:
            if "memory" in parts:
                run_part("memory", args)
            if parts & {"block", "calibrate"}:
                parallel, x = _build(mesh, args)
                step = None
                if "block" in parts:
                    timings = run_part("block", args, parallel, x)
                    step = timings["inductor"] if timings else None
                if "calibrate" in parts:
                    _calibrate(args, parallel, x, step)
        finally:
            dist.destroy_process_group()
    if failed:
        sys.exit(f"parts that failed: {failed}")


# The parts main() runs, each reported on its own when it fails.
PARTS = {"fused": _fused, "memory": _memory, "block": _block}


if __name__ == "__main__":
    main()
