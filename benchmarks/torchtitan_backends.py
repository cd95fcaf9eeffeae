"""torchtitan's two SPMD backends, stock Inductor vs dtcompile: per-block compile time and step time.

torchtitan 0.3.0's Llama3 (dim 256, 8 heads, 4 layers, hidden 1024, vocab
2048, 4 x 128 tokens), tensor + sequence parallel over 2 ranks as threads,
built and parallelized by torchtitan (``parallelize_llama``, every block
compiled through ``apply_compile``) under each SPMD backend:
``spmd_types`` (torchtitan's default: plain local shards, spmd_types'
collectives) and ``partial_dtensor`` (DTensor).  Per backend and compiler,
the first training step (forward, torchtitan's loss, backward, AdamW; it
compiles the block once and the loss once) minus a warm step is the compile
time; the median of ``--steps`` warm steps is the step time.  Inductor's
caches are off, so each compiles from scratch.  The compilers alternate over
``--repeats`` rounds; the best compile time and the median step are kept.
Rank 0's numbers; both ranks share this machine's cores.

    python benchmarks/torchtitan_backends.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: torchtitan's harness (CPU device, SDPA, FSDP's SUM)

import support.titan as _titan  # noqa: E402

import dtcompile  # noqa: E402
from dtcompile.testing import run_threaded  # noqa: E402

WORLD_SIZE = 2
DIM, NUM_HEADS, NUM_LAYERS, HIDDEN_DIM = 256, 8, 4, 1024
VOCAB_SIZE, SEQ_LEN, BATCH = 2048, 128, 4


def _config():
    return _titan.llama3_config(
        dim=DIM, n_heads=NUM_HEADS, n_layers=NUM_LAYERS, hidden_dim=HIDDEN_DIM, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN
    )


def _rank(rank: int, spmd_backend: str, compiler: str, weights: dict, steps: int) -> tuple[float, float, list[int]]:
    """(compile seconds, median step seconds, frames compiled after each step) of one compiler on this rank."""
    import contextlib

    from torch._dynamo.testing import CompileCounterWithBackend
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.models.llama3 import parallelize_llama

    model, parallel_dims, parallelism = _titan.llama3_on_meta(_config(), WORLD_SIZE, WORLD_SIZE, spmd_backend)
    counter = CompileCounterWithBackend(dtcompile.backend() if compiler == "dtcompile" else "inductor")
    compile_config = CompileConfig(enable=True, backend=counter)
    model = _titan.parallelize(parallelize_llama, model, parallel_dims, parallelism, compile_config)
    _titan.force_sum_reduction(model)
    _titan.load_weights(model, weights)
    loss_config = CrossEntropyLoss.Config(global_vocab_size=VOCAB_SIZE) if spmd_backend == "spmd_types" else CrossEntropyLoss.Config()
    loss_fn = CrossEntropyLoss(loss_config, compile_config=compile_config)
    optim = _titan.optimizer(model, 3e-4)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN))
    labels = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN))
    mesh = set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()) if spmd_backend == "spmd_types" else contextlib.nullcontext()

    def step() -> float:
        start = time.perf_counter()
        loss, _ = loss_fn(model(tokens), labels, torch.tensor(labels.numel()))
        loss.backward()
        optim.step()
        optim.zero_grad()
        return time.perf_counter() - start

    with mesh, torch.compiler.config.patch(force_disable_caches=True):
        first = step()
        frames = [counter.frame_count]
        times = [step() for _ in range(steps)]
        frames.append(counter.frame_count)
    median = statistics.median(times)
    return max(first - median, 0.0), median, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, Llama3 dim {DIM}, {NUM_LAYERS} layers, TP + SP over {WORLD_SIZE} threaded ranks")
    print("frames: compiled after the first step / after all steps (a recompile or a graph break would add one)")
    print("| SPMD backend | compiler | frames | compile s | vs inductor | step ms | vs inductor |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spmd_backend in ("spmd_types", "partial_dtensor"):
        with _titan.torchtitan_on_cpu(spmd_backend=spmd_backend):
            weights = _titan.initial_weights(_config())
            compile_s: dict[str, list[float]] = {"inductor": [], "dtcompile": []}
            step_s: dict[str, list[float]] = {"inductor": [], "dtcompile": []}
            frames: dict[str, list[int]] = {}
            for round_ in range(args.repeats):
                order = ["inductor", "dtcompile"] if round_ % 2 == 0 else ["dtcompile", "inductor"]
                for compiler in order:
                    torch._dynamo.reset()
                    c, s, frames[compiler] = run_threaded(
                        WORLD_SIZE, _rank, spmd_backend, compiler, weights, args.steps, timeout=1200
                    )[0]
                    compile_s[compiler].append(c)
                    step_s[compiler].append(s)
        base_c, base_s = min(compile_s["inductor"]), statistics.median(step_s["inductor"])
        for compiler in ("inductor", "dtcompile"):
            c, s = min(compile_s[compiler]), statistics.median(step_s[compiler])
            f = "/".join(map(str, frames[compiler]))
            print(f"| {spmd_backend} | {compiler} | {f} | {c:.2f} | {c / base_c:.2f}x | {s * 1e3:.1f} | {s / base_s:.2f}x |")


if __name__ == "__main__":
    main()
