"""The whole training step as one graph, six ways, on gloo ranks: time, memory, collectives.

Two of the shared models (:mod:`dtcompile._testing.models`, loss ``out.pow(2).mean()``)
and torchtitan's Llama3, float32, on gloo over 127.0.0.1 (one process per rank),
AdamW (``foreach=False``, lr 1e-3) for the optimizer:

- ``fsdp``: :class:`~dtcompile._testing.models.NormMLPStack` under SimpleFSDP over
  2 ranks (4 x LayerNorm, Linear 512->2048, GELU, Linear 2048->512; 8 rows per
  rank: the gradients outweigh the activations, as in a large model's step);
- ``tp_sp``: the Llama-style block under tensor + sequence parallelism over 2 ranks;
- ``llama3_fsdp`` and ``llama3_fsdp_tp``: torchtitan 0.3.0's Llama3 from its own
  builders (dim 256, 8 heads, 4 layers, hidden 768, vocabulary 2048, as
  ``benchmarks/memory.py``'s; 2 x 128 tokens per data-parallel rank) under
  graph_trainer's SimpleFSDP over 2 ranks, and after torchtitan's tensor
  parallelism on 2 x 2 (4 ranks), torchtitan's cross-entropy loss.

The ways, each on a fresh copy of the model, built alike:

- ``eager``: ``loss.backward()``, ``optimizer.step()``, ``zero_grad``;
- ``dynamo``: the model compiled by ``torch.compile(backend=dtcompile.backend(...))``
  (forward and backward graphs), the optimizer eager;
- ``gt traced``: torchtitan graph_trainer's tracer (``minimal_fx_tracer``: forward,
  loss, backward as one graph) run as traced, the optimizer eager.  graph_trainer's
  default pass pipeline cannot run here (``graph_trainer.passes`` imports its trainer,
  which needs ``torchdata``, and ends in CUDA graphs): this is the graph it starts from;
- ``gt + dtcompile``: the same graph through the ``dtcompile`` pipeline's pass
  (:class:`dtcompile.pipeline.step_pass.StepPass`, rewrites on);
- ``compile_step``: :func:`dtcompile.compile_step` without the optimizer, which runs
  eagerly after it;
- ``compile_step + opt``: with AdamW inside the graph (its first step eager: AdamW
  makes its state there).

Per way, rank 0's numbers after two warm steps: the median step time over
``--steps`` steps, the measured peak of one step (:func:`dtcompile.testing.measure_memory`:
parameters, optimizer state and input alive before it), the estimated peak
(:mod:`dtcompile.graph.memory`, of the step graph, or of the largest Dynamo graph, plus
the optimizer state the graph does not hold), the collectives per step, and the
compile seconds (the calls that traced and compiled, less an eager step).  Every
way's losses are checked equal to eager's.  Then, for ``compile_step``, the peak the
optimizer inside saves against the full gradients' bytes and the largest
reduce-scatter bucket.

    python benchmarks/whole_step.py [--steps 5] [--inductor] [--layouts fsdp tp_sp llama3_fsdp llama3_fsdp_tp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: torchtitan's harness (CPU device, SDPA)

import dtcompile  # noqa: E402
from dtcompile.base.notation import format_bytes  # noqa: E402
from dtcompile.testing import measure_memory, run_gloo, storage_bytes  # noqa: E402

WAYS = ("eager", "dynamo", "gt traced", "gt + dtcompile", "compile_step", "compile_step + opt")
LAYOUTS = {"fsdp": 2, "tp_sp": 2, "llama3_fsdp": 2, "llama3_fsdp_tp": 4}
"""Each layout's world size."""
LR = 1e-3
LLAMA = dict(dim=256, n_heads=8, n_layers=4, hidden_dim=768, vocab_size=2048, seq_len=128)
LLAMA_BATCH = 2


def _build(layout: str, rank: int, weights: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The model of ``layout`` on this rank, and its inputs: ``(x,)``, or a Llama's
    ``(tokens, labels, tokens in the global batch)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile._testing import models

    world = LAYOUTS[layout]
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        _, model, x = models.build_norm_mlp_stack(mesh, rows=8, dim=512, hidden=2048)
        return model, (x.chunk(world)[rank],)
    if layout == "tp_sp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        _, model, x = models.build_block(mesh, batch=4, seq=64)
        return model, (x,)
    import support.titan as _titan

    tp = 2 if layout == "llama3_fsdp_tp" else 1
    model, parallel_dims, _ = _titan.llama3_on_meta(_titan.llama3_config(**LLAMA), world, tp)
    model = _titan.simple_fsdp(model, parallel_dims)
    _titan.load_simple_fsdp_weights(model, weights)
    dp, dp_rank = world // tp, rank // tp
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH * dp, LLAMA["seq_len"] + 1), generator=generator)
    inputs, labels = tokens[:, :-1].chunk(dp)[dp_rank].contiguous(), tokens[:, 1:].chunk(dp)[dp_rank].contiguous()
    return model, (inputs, labels, torch.tensor(labels.numel() * dp))


def _loss(model: Any, *inputs: torch.Tensor) -> torch.Tensor:
    if len(inputs) == 1:
        return model(inputs[0]).pow(2).mean()
    from torchtitan.components.loss import CrossEntropyLoss

    tokens, labels, count = inputs
    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(model(tokens), labels, count)
    return loss


def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _graph_trainer(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], step_pass: Any) -> Any:
    """graph_trainer's traced step (forward, loss, backward), ``step_pass`` applied if given."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer, run_traced

    def step(*inputs: torch.Tensor) -> list[torch.Tensor]:
        loss = _loss(model, *inputs)
        params = [p for _, p in model.named_parameters(remove_duplicate=False)]
        return [loss, *torch.autograd.grad(loss, params)]

    traced = minimal_fx_tracer(step, module=model)(*inputs)
    if step_pass is not None:
        traced.gm = step_pass(traced.gm, list(traced.example_inputs))
    return run_traced(traced, module=model)


def _way(layout: str, way: str, rank: int, steps: int, options: dict[str, Any], weights: Any) -> dict[str, Any]:
    from dtcompile.pipeline.step_pass import StepPass

    model, x = _build(layout, rank, weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    records: list[Any] = []
    compiled: Any = None
    if way == "dynamo":
        backend = dtcompile.backend(**options)
        forward = torch.compile(model, backend=backend)
        records = backend.records

        def step() -> torch.Tensor:
            loss = _loss(forward, *x)
            loss.backward()
            _optimizer_step(optimizer)
            return loss.detach()
    elif way in ("gt traced", "gt + dtcompile"):
        step_pass = StepPass(options, []) if way == "gt + dtcompile" else None
        start = time.perf_counter()
        run = _graph_trainer(model, x, step_pass)
        trace_s = time.perf_counter() - start
        records = step_pass.records if step_pass is not None else []

        def step() -> torch.Tensor:
            loss, *grads = run(*x)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            _optimizer_step(optimizer)
            return loss
    elif way.startswith("compile_step"):
        inside = way.endswith("opt")
        compiled = dtcompile.compile_step(
            lambda *inputs: _loss(model, *inputs), model=model, optimizer=optimizer if inside else None, **options
        )
        records = compiled.records

        def step() -> torch.Tensor:
            loss = compiled(*x)
            if not inside:
                _optimizer_step(optimizer)
            return loss
    else:
        def step() -> torch.Tensor:
            loss = _loss(model, *x)
            loss.backward()
            _optimizer_step(optimizer)
            return loss.detach()

    warm, losses = [], []
    for _ in range(3):  # compiles (compile_step + opt: its first step is eager, the second traces)
        start = time.perf_counter()
        losses.append(step())
        warm.append(time.perf_counter() - start)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    measured = measure_memory(step, [*model.parameters(), *model.buffers(), *state, *x])
    step_s = statistics.median(times)
    compile_s = sum(warm) - len(warm) * step_s
    if way in ("gt traced", "gt + dtcompile"):
        compile_s = trace_s + sum(warm) - len(warm) * step_s
    estimate = collectives = None
    largest_bucket = 0
    if records:
        outside = 0 if way == "compile_step + opt" else storage_bytes(state)
        estimate = max(r.memory.peak_bytes for r in records) + outside
        collectives = sum(len(r.collectives) for r in records) if way == "dynamo" else len(records[-1].collectives)
        largest_bucket = max((c.bytes for r in records for c in r.collectives if c.op == "reduce_scatter"), default=0)
    elif way == "gt traced":
        collectives = None
    grads = 0
    if way == "eager":  # the full gradients' bytes: this rank's shards, as eager holds them
        loss = _loss(model, *x)
        loss.backward()
        grads = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
    return {
        "step_s": step_s,
        "peak": measured.peak_bytes,
        "estimate": estimate,
        "collectives": collectives,
        "compile_s": max(compile_s, 0.0) if way != "eager" else None,
        "losses": [float(v) for v in losses],
        "grads": grads,
        "largest_bucket": largest_bucket,
    }


def _rank(rank: int, layout: str, steps: int, options: dict[str, Any], weights: Any) -> dict[str, Any]:
    if not layout.startswith("llama3"):
        return {way: _way(layout, way, rank, steps, options, weights) for way in WAYS}
    import support.titan as _titan

    with _titan.torchtitan_on_cpu():
        return {way: _way(layout, way, rank, steps, options, weights) for way in WAYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inductor", action="store_true", help="lower the compiled ways with Inductor")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    options = {"inductor": args.inductor}
    print(f"torch {torch.__version__}, gloo ranks, options {options}, rank 0")
    for layout in args.layouts:
        weights = None
        if layout.startswith("llama3"):
            import support.titan as _titan

            with _titan.torchtitan_on_cpu():
                weights = _titan.initial_weights(_titan.llama3_config(**LLAMA))
        rows = run_gloo(LAYOUTS[layout], _rank, layout, args.steps, options, weights, timeout=1800)[0]
        base = rows["eager"]
        print()
        print(f"{layout} ({LAYOUTS[layout]} ranks):")
        print("| way | step ms | vs eager | measured peak | estimated peak | vs eager peak | collectives | compile s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for way, row in rows.items():
            close = all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(row["losses"], base["losses"], strict=True))
            if not close:
                raise SystemExit(f"{layout} {way}: losses {row['losses']} differ from eager's {base['losses']}: {rows}")
            estimate = format_bytes(row["estimate"]) if row["estimate"] is not None else "-"
            collectives = row["collectives"] if row["collectives"] is not None else "-"
            compile_s = f"{row['compile_s']:.1f}" if row["compile_s"] is not None else "-"
            print(
                f"| {way} | {row['step_s'] * 1e3:.1f} | {row['step_s'] / base['step_s']:.2f}x | {format_bytes(row['peak'])} | "
                f"{estimate} | {row['peak'] / base['peak']:.2f}x | {collectives} | {compile_s} |"
            )
        without, inside = rows["compile_step"], rows["compile_step + opt"]
        saved = without["peak"] - inside["peak"]
        wanted = base["grads"] - inside["largest_bucket"]
        print(
            f"\ncompile_step: the optimizer inside saves {format_bytes(saved)} of peak; the full gradients are "
            f"{format_bytes(base['grads'])}, the largest reduce-scatter bucket {format_bytes(inside['largest_bucket'])}: "
            f"{'at least' if saved >= wanted else 'less than'} the gradients minus one bucket ({format_bytes(wanted)})"
        )


if __name__ == "__main__":
    main()
