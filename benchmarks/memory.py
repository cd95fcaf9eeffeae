"""Memory and step time of FSDP on torchtitan's Llama3, four ways, on gloo ranks.

torchtitan 0.3.0's Llama3 from its own builders (dim 256, 8 heads, 4 layers,
hidden 768, vocab 2048; 2 x 128 tokens per data-parallel rank), float32, on
gloo over 127.0.0.1 (one process per rank), FSDP over 2 ranks (``fsdp``) and
FSDP x TP over 2 x 2 (``fsdp_tp``), trained by torchtitan's loss and AdamW:

- ``fsdp2 eager``: torchtitan's ``parallelize_llama`` (FSDP2 ``fully_shard``
  per block and the root), no compile;
- ``torchtitan default``: the same with every block compiled by ``torch.compile``
  (Inductor) through torchtitan's ``apply_compile``;
- ``simplefsdp + dtcompile``: graph_trainer's SimpleFSDP (``simple_fsdp.data_parallel``
  after torchtitan's TP), the whole model compiled with ``dtcompile.backend()``;
- ``simplefsdp + inductor``: the same with stock Inductor.

And the stack of issue #31 (:class:`dtcompile._testing.models.NormMLPStack`: 4 x
LayerNorm, Linear 256->1024, GELU, Linear 1024->256; 64 rows per rank) on 2 gloo
ranks: FSDP2 eager, and SimpleFSDP (:func:`~dtcompile._testing.models.parallelize_simple_fsdp`)
compiled whole with dtcompile and with stock Inductor (forward, ``out.pow(2).mean()``
backward, SGD).

Per way, rank 0's numbers after two warm steps: the measured peak of one step
(forward, loss, backward, optimizer step; :func:`dtcompile.testing.measure_memory`,
the allocator's events, counting the parameters, gradients and optimizer state
alive before it), the estimate beside it (dtcompile's graphs: the peak of its
compiled graphs, :mod:`dtcompile.graph.memory`, plus what the step holds outside them:
the optimizer state; stock Inductor's: the same model over the graphs it
partitions, passes off and weights kept gathered; FSDP2 eager's: torch's
``FSDPMemTracker`` over the same step on fake tensors and a fake world, and the
torchtitan-default row gets that same estimate, the tracker not seeing into
Inductor's kernels), the bytes the
forward saves for the backward (:func:`dtcompile.testing.saved_bytes`), the
median step time over ``--steps`` steps, and the collectives per step.  Every
way's losses are checked equal to FSDP2 eager's (the same weights and batches).

And, estimates only, torchtitan's Llama3 8B (its ``"8B"`` config, SDPA
attention; 1 x 8192 tokens per data-parallel rank) under SimpleFSDP x TP on a
fake world of 64 (``fsdp`` 8 x ``tp`` 8), traced on meta tensors and compiled
with ``dtcompile.backend(inductor=False)``: each graph's estimated peak per rank,
resharded and with every gathered weight kept (``--llama8b``; ``--layers``
traces fewer layers).

    python benchmarks/memory.py [--steps 5] [--llama8b [--layers 32]]
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
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: torchtitan's harness (CPU device, SDPA, FSDP's SUM)

import support.titan as _titan  # noqa: E402

import dtcompile  # noqa: E402
from dtcompile.base.notation import format_bytes  # noqa: E402
from dtcompile.compiler import DTCompileBackend  # noqa: E402
from dtcompile.testing import measure_memory, run_gloo, saved_bytes, storage_bytes  # noqa: E402

DIM, NUM_HEADS, NUM_LAYERS, HIDDEN_DIM = 256, 8, 4, 768
VOCAB_SIZE, SEQ_LEN, BATCH = 2048, 128, 2
LAYOUTS = {"fsdp": (2, 1), "fsdp_tp": (4, 2)}
WAYS = ("fsdp2 eager", "torchtitan default", "simplefsdp + dtcompile", "simplefsdp + inductor")
_PASSES_OFF = {"async_tp", "bucketing", "overlap"}


def _config() -> Any:
    return _titan.llama3_config(
        dim=DIM, n_heads=NUM_HEADS, n_layers=NUM_LAYERS, hidden_dim=HIDDEN_DIM, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN
    )


def _build(way: str, world: int, tp: int, weights: dict[str, torch.Tensor], backend: Any) -> tuple[Any, Any]:
    """``(model to call, model holding the parameters)`` for one way on this rank."""
    from torchtitan.config import CompileConfig
    from torchtitan.models.llama3 import parallelize_llama

    model, parallel_dims, parallelism = _titan.llama3_on_meta(_config(), world, tp)
    if way in ("fsdp2 eager", "torchtitan default"):
        compile_config = CompileConfig(enable=way == "torchtitan default", backend="inductor")
        model = _titan.parallelize(parallelize_llama, model, parallel_dims, parallelism, compile_config)
        _titan.force_sum_reduction(model)
        _titan.load_weights(model, weights)
        return model, model
    model = _titan.simple_fsdp(model, parallel_dims)
    _titan.load_simple_fsdp_weights(model, weights)
    return torch.compile(model, backend=backend), model


def _tracked_peak(model: torch.nn.Module, optim: torch.optim.Optimizer, step: Any, inputs: tuple[Any, ...]) -> int:
    """FSDP2 eager's step peak, estimated without running it: torch's ``FSDPMemTracker``
    over three ``step()`` calls of ``model`` on fake tensors (its peak: parameters,
    gradients, optimizer state, gathered weights, activations and temporaries).  The
    optimizer runs per tensor there: on fake tensors the tracker counts each ``foreach``
    output as a new storage (76 MiB of AdamW state for 17 MiB on the ``fsdp`` layout)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    for group in optim.param_groups:
        group["foreach"] = False
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs(inputs)
    with tracker:
        for _ in range(3):
            step()
            optim.step()
            optim.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _fsdp2_estimate(world: int, tp: int) -> int:
    """:func:`_tracked_peak` of torchtitan's FSDP2 Llama3 (``parallelize_llama``, no
    compile), its loss and AdamW, on rank 0 of a fake world."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.models.llama3 import parallelize_llama

    from dtcompile.testing import fake_world

    with _titan.torchtitan_on_cpu(), fake_world(world):
        model, parallel_dims, parallelism = _titan.llama3_on_meta(_config(), world, tp)
        model = _titan.parallelize(parallelize_llama, model, parallel_dims, parallelism, CompileConfig(enable=False))
        _titan.force_sum_reduction(model)
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta parameters made fake
            model.to_empty(device="cpu")  # values do not matter to the tracker
            loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
            inputs = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN))
            labels = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN))
            count = torch.tensor(BATCH * SEQ_LEN * world // tp)
            step = lambda: loss_fn(model(inputs), labels, count)[0].backward()  # noqa: E731
            return _tracked_peak(model, _titan.optimizer(model, 1e-3), step, (inputs, labels))


def _stack_fsdp2(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` on each layer of the stack and its root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _stack_fsdp2_estimate() -> int:
    """:func:`_tracked_peak` of the issue's stack under FSDP2 on rank 0 of a fake world of 2."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtcompile._testing import models
    from dtcompile.testing import fake_world

    with fake_world(2, (2,), ("dp",)) as mesh, FakeTensorMode():
        model = _stack_fsdp2(models.NormMLPStack(256, 1024, 4), mesh)
        x = torch.randn(64, 256)
        step = lambda: model(x).pow(2).mean().backward()  # noqa: E731
        return _tracked_peak(model, torch.optim.SGD(model.parameters(), lr=1e-3), step, (x,))


def _mirror() -> Any:
    """dtcompile's memory model over the graphs stock Inductor partitions: no pass, the
    gathered weights kept (stock Inductor reshards nothing)."""
    return dtcompile.backend(inductor=False, reshard_after_forward=False, disable_passes=_PASSES_OFF)


def _graph_peak(backend: Any, outside: int = 0) -> tuple[int, int]:
    """``(estimated step peak, collectives per step)`` of ``backend``'s graphs: the peak of
    its largest graph (:mod:`dtcompile.graph.memory`) plus ``outside``, bytes the step holds
    outside them."""
    peak = max(r.memory.peak_bytes for r in backend.records)
    return peak + outside, sum(len(r.collectives) for r in backend.records)


def _measure_step(step: Any, forward: Any, model: Any, held: Any, steps: int) -> dict[str, Any]:
    """After two warm steps (compiling; the optimizer's state): one step's measured peak
    (``model``'s parameters and ``held()`` alive before it), the median time of ``steps``
    steps, and the bytes ``forward()`` saves for the backward."""
    for _ in range(2):
        step()
    measured = measure_memory(step, [*model.parameters(), *held()])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    saved, out = saved_bytes(forward, model.parameters())
    del out
    return {"peak": measured.peak_bytes, "saved": saved, "step_s": statistics.median(times)}


def _rank(rank: int, world: int, tp: int, way: str, weights: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    from torchtitan.components.loss import CrossEntropyLoss

    with _titan.torchtitan_on_cpu():
        backend = None
        if way == "simplefsdp + dtcompile":
            backend = dtcompile.backend()
        elif way == "simplefsdp + inductor":
            backend = "inductor"
        forward, model = _build(way, world, tp, weights, backend)
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
        optim = _titan.optimizer(model, 1e-3)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB_SIZE, (BATCH * world // tp, SEQ_LEN + 1), generator=generator)
        dp_rank = rank // tp
        inputs, labels = tokens[:, :-1].chunk(world // tp)[dp_rank].contiguous(), tokens[:, 1:].chunk(world // tp)[dp_rank].contiguous()
        count = torch.tensor(BATCH * SEQ_LEN * world // tp)
        losses = []

        def step() -> None:
            loss, _ = loss_fn(forward(inputs), labels, count)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())

        def state() -> list[torch.Tensor]:
            return [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

        numbers = _measure_step(step, lambda: forward(inputs), model, state, steps)
        held = [*model.parameters(), *state()]
        estimate = collectives = None
        outside = storage_bytes(held) - storage_bytes(model.parameters())  # the optimizer's state
        if isinstance(backend, DTCompileBackend):
            estimate, collectives = _graph_peak(backend, outside)
        elif backend == "inductor":
            torch._dynamo.reset()
            mirror = _mirror()
            shadow, _ = _build(way, world, tp, weights, mirror)
            loss_fn(shadow(inputs), labels, count)[0].backward()
            estimate, collectives = _graph_peak(mirror, outside)
        return {**numbers, "estimate": estimate, "collectives": collectives, "losses": [float(x) for x in losses[:3]]}


STACK_WAYS = ("fsdp2 eager", "simplefsdp + dtcompile", "simplefsdp + inductor")


def _stack_rank(rank: int, way: str, steps: int) -> dict[str, Any]:
    """The issue's stack on this rank, one way: the same numbers as :func:`_rank`."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile._testing import models

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference, parallel, x = models.build_norm_mlp_stack(mesh)
    x = x.chunk(2)[rank]
    backend = None
    if way == "fsdp2 eager":
        forward = model = _stack_fsdp2(copy.deepcopy(reference), mesh)
    else:
        backend = dtcompile.backend() if way == "simplefsdp + dtcompile" else "inductor"
        model, forward = parallel, torch.compile(parallel, backend=backend)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []

    def step() -> None:
        loss = forward(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss))

    numbers = _measure_step(step, lambda: forward(x), model, lambda: [x], steps)
    estimate = collectives = None
    if isinstance(backend, DTCompileBackend):
        estimate, collectives = _graph_peak(backend)
    elif backend == "inductor":
        torch._dynamo.reset()
        mirror = _mirror()
        torch.compile(parallel, backend=mirror)(x).pow(2).mean().backward()
        estimate, collectives = _graph_peak(mirror)
    return {**numbers, "estimate": estimate, "collectives": collectives, "losses": losses[:3]}


def _stack_table(steps: int) -> None:
    print()
    print("Issue #31's stack (4 x LayerNorm, Linear 256->1024, GELU, Linear 1024->256; 64 rows per rank), 2 gloo ranks, rank 0")
    print("| way | measured peak | estimated peak | vs fsdp2 eager | saved for backward | vs fsdp2 eager | step ms | vs inductor | collectives |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {way: run_gloo(2, _stack_rank, way, steps, timeout=1200)[0] for way in STACK_WAYS}
    rows["fsdp2 eager"]["estimate"] = _stack_fsdp2_estimate()
    base, inductor = rows["fsdp2 eager"], rows["simplefsdp + inductor"]
    for way, row in rows.items():
        _check_losses("stack", way, row, base)
        estimate = format_bytes(row["estimate"]) if row["estimate"] is not None else "-"
        comm = row["collectives"] if row["collectives"] is not None else "-"
        print(
            f"| {way} | {format_bytes(row['peak'])} | {estimate} | {row['peak'] / base['peak']:.2f}x | "
            f"{format_bytes(row['saved'])} | {row['saved'] / base['saved']:.2f}x | {row['step_s'] * 1e3:.1f} | "
            f"{row['step_s'] / inductor['step_s']:.2f}x | {comm} |"
        )


def _llama8b_estimates(layers: int, tokens: int = 8192) -> None:
    """Per-rank estimated peaks of the 8B on a fake world of 64 (see the module docstring)."""
    import torchtitan.models.llama3 as llama3

    from dtcompile.testing import fake_world

    print()
    print(f"Llama3 8B ({layers} of its 32 layers traced), SimpleFSDP 8 x TP 8 on a fake world of 64, "
          f"1 x {tokens} tokens per data-parallel rank; dtcompile's estimates per rank (meta tensors)")
    print("| gathered weights | graph | estimated peak | before the passes | budget | alive at the peak (largest) |")
    print("|---|---|---:|---:|---:|---|")
    for label, options in (("resharded", {}), ("kept", {"reshard_after_forward": False})):
        with _titan.torchtitan_on_cpu(), fake_world(64):
            config = _titan.use_sdpa(llama3.llama3_configs["8B"](attn_backend="flex"))
            config.layers = config.layers[:layers]
            model, parallel_dims, _ = _titan.llama3_on_meta(config, 64, 8)
            model = _titan.simple_fsdp(model, parallel_dims)
            backend = dtcompile.backend(inductor=False, **options)
            torch._dynamo.reset()
            inputs = torch.empty(1, tokens, dtype=torch.long, device="meta")
            torch.compile(model, backend=backend)(inputs).float().sum().backward()
            for record in backend.records:
                memory, traced = record.memory, record.memory_traced
                print(
                    f"| {label} | {record.kind} | {format_bytes(memory.peak_bytes)} | {format_bytes(traced.peak_bytes)} | "
                    f"{format_bytes(record.memory_budget[0])} | {memory.largest(3)} |"
                )


def _check_losses(layout: str, way: str, row: dict[str, Any], base: dict[str, Any]) -> None:
    """Every way computes what FSDP2 eager computes (the same weights and batches)."""
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(row["losses"], base["losses"]))
    assert close and len(row["losses"]) == len(base["losses"]), f"{layout} {way}: losses {row['losses']} vs fsdp2 eager {base['losses']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--no-stack", action="store_true", help="leave out the issue's stack")
    parser.add_argument("--llama8b", action="store_true", help="only the 8B's estimates on a fake world of 64")
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B traced (--llama8b)")
    args = parser.parse_args()
    if args.llama8b:
        _llama8b_estimates(args.layers)
        return
    print(f"torch {torch.__version__}; Llama3 dim {DIM}, {NUM_LAYERS} layers, hidden {HIDDEN_DIM}, vocab {VOCAB_SIZE}, "
          f"{BATCH} x {SEQ_LEN} tokens per data-parallel rank; gloo, rank 0")
    print("| layout | way | measured peak | estimated peak | vs fsdp2 eager | saved for backward | step ms | vs torchtitan default | collectives |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with _titan.torchtitan_on_cpu():
        weights = _titan.initial_weights(_config())
    for layout in args.layouts:
        world, tp = LAYOUTS[layout]
        rows = {}
        for way in WAYS:
            rows[way] = run_gloo(world, _rank, world, tp, way, weights, args.steps, timeout=1800)[0]
        # No dtcompile graph in the FSDP2 rows: torch's FSDPMemTracker on fake tensors; the
        # torchtitan-default row gets FSDP2 eager's (the tracker does not see into Inductor's kernels).
        rows["fsdp2 eager"]["estimate"] = rows["torchtitan default"]["estimate"] = _fsdp2_estimate(world, tp)
        base, default = rows["fsdp2 eager"], rows["torchtitan default"]
        for way, row in rows.items():
            _check_losses(layout, way, row, base)
            estimate = format_bytes(row["estimate"]) if row["estimate"] is not None else "-"
            comm = row["collectives"] if row["collectives"] is not None else "-"
            print(
                f"| {layout} | {way} | {format_bytes(row['peak'])} | {estimate} | {row['peak'] / base['peak']:.2f}x | "
                f"{format_bytes(row['saved'])} | {row['step_s'] * 1e3:.0f} | {row['step_s'] / default['step_s']:.2f}x | {comm} |"
            )
    if not args.no_stack:
        _stack_table(args.steps)


if __name__ == "__main__":
    main()
