"""A training job launched with ``torchrun``, compiled with dtcompile.

A small Llama-style feed-forward stack under tensor parallelism
(``parallelize_module``: ``w1``/``w3`` column-wise, ``w2`` row-wise), trained on
synthetic data with AdamW; ``torch.compile(model, backend="dtcompile")``; a log
line per step on rank 0; a distributed checkpoint (DCP) saved and resumed.

One machine, two processes (gloo on CPU, NCCL on GPUs)::

    torchrun --standalone --nproc-per-node=2 examples/train_torchrun.py --steps 8

Two machines (here two launches on one; ``--node-rank`` 0 and 1)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=job examples/train_torchrun.py

SLURM: ``srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=8
--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=$SLURM_JOB_ID
examples/train_torchrun.py``.

``--checkpoint DIR --save-at K`` saves the model and optimizer after step K;
``--resume`` loads them from ``DIR`` and goes on from there. ``--eager`` runs
without ``torch.compile`` (the reference); ``--losses FILE`` writes every step's
loss as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class FeedForward(nn.Module):
    """SwiGLU feed-forward with a residual: ``x + w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def build(dim: int, hidden: int, layers: int, mesh) -> nn.Sequential:
    torch.manual_seed(0)  # every rank starts from the same full weights
    model = nn.Sequential(*(FeedForward(dim, hidden) for _ in range(layers)))
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    for block in model:
        parallelize_module(block, mesh, plan)
    return model


def batch(step: int, rows: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and targets: the same on every rank (tensor parallelism), two
    batches taken in turn (a dataset small enough to learn in a few steps)."""
    generator = torch.Generator().manual_seed(1000 + step % 2)
    x = torch.randn(rows, dim, generator=generator)
    return x.to(device), torch.tanh(x.flip(-1)).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="no torch.compile: the reference run")
    parser.add_argument("--inductor", action="store_true", help="lower with Inductor (default: dtcompile's graphs as they are, fast)")
    parser.add_argument("--checkpoint", default=None, help="a folder for the distributed checkpoint")
    parser.add_argument("--save-at", type=int, default=None, help="save after this step")
    parser.add_argument("--resume", action="store_true", help="load the checkpoint and go on after its step")
    parser.add_argument("--losses", default=None, help="write the losses (rank 0) as JSON here")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    model = build(args.dim, args.hidden, args.layers, mesh).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    step = 0
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.checkpoint} after step {step}", flush=True)

    import dtcompile  # noqa: F401  (installs the backend; torch finds "dtcompile" through its entry point too)

    backend = "dtcompile" if args.inductor else dtcompile.backend(inductor=False)
    forward = model if args.eager else torch.compile(model, backend=backend, fullgraph=True)
    losses = {}
    while step < args.steps:
        step += 1
        start = time.perf_counter()
        x, target = batch(step, args.rows, args.dim, device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(forward(x), target)
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        if rank == 0:
            print(f"step {step} loss {losses[step]:.6f} ({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
        if args.checkpoint and step == args.save_at:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=args.checkpoint)
            if rank == 0:
                print(f"saved {args.checkpoint} after step {step}", flush=True)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    # Every rank done before any tears its process group down: a rank that destroyed it while
    # its peer's gloo connection was still open was seen to abort at exit ("terminate called
    # without an active exception", benchmarks/RESULTS.md, soak_flakes.py).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
