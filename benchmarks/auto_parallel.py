"""Auto-parallel at Llama-3-8B size: solve time and plan cost against the hand TP + FSDP plan.

A stack of Llama-3-8B transformer layers (dim 4096, SwiGLU hidden 14336, 32
query heads and 8 key/value heads of 128, RMSNorm, causal softmax attention),
bfloat16, built on the ``meta`` device (no memory), planned by
``dtcompile.auto_parallel.plan`` on the fake process group, mesh 8 x 8
(``dp`` x ``tp``, world 64), ``h100`` profile.  The input and output (the
residual stream, batch ``8 x seq 2048``) are batch-sharded over ``dp`` and
replicated over ``tp``, as in the hand plan.

- **auto**: the solver chooses everything, under a parameter memory budget equal
  to what the hand plan keeps per rank;
- **hand TP + FSDP**: every parameter pinned where Megatron tensor parallelism over
  ``tp`` and FSDP over ``dp`` keep it (column-wise ``wq wk wv w1 w3``: ``S(1)S(0)``;
  row-wise ``wo w2``: ``S(0)S(1)``; norms ``S(0)R``); the solver chooses only the
  ops' strategies, so this is the hand plan's best case under the same cost model.

Both are the solver's estimate of one training step (forward + backward) under
the same cost model; the model is too big to compile on this machine.

    python benchmarks/auto_parallel.py [--layers 32] [--seq 2048]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        repeat = self.n_heads // self.n_kv_heads
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, 1, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, 1, self.head_dim)
        # Grouped-query attention: each key/value head serves `repeat` query heads.
        k = k.expand(-1, -1, -1, repeat, -1).reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.expand(-1, -1, -1, repeat, -1).reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        out = scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int = 4096, hidden: int = 14336, n_heads: int = 32, n_kv_heads: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, hidden, n_heads, n_kv_heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def hand_placements(model: nn.Module) -> dict[str, tuple]:
    """Megatron TP over ``tp`` (mesh axis 1) with FSDP over ``dp`` (axis 0)."""
    from torch.distributed.tensor import Replicate, Shard

    pinned = {}
    for name, _ in model.named_parameters():
        leaf = name.split(".")[-2]
        if leaf in ("wo", "w2"):
            pinned[name] = (Shard(0), Shard(1))
        elif leaf in ("wq", "wk", "wv", "w1", "w3"):
            # FSDP shards the other dim: (Shard(0), Shard(0)) would split each tensor
            # parallel shard across dp ranks, and gathering it over dp alone moves rows
            # between tp ranks too (torchtitan's FSDP2 uses a _StridedShard for that).
            pinned[name] = (Shard(1), Shard(0))
        else:
            pinned[name] = (Shard(0), Replicate())
    return pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="global batch (one sequence per dp rank)")
    args = parser.parse_args()

    import dtcompile
    from dtcompile.testing import fake_world

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(args.layers).to(torch.bfloat16)
        x = torch.empty(args.batch, args.seq, 4096, dtype=torch.bfloat16)
    with fake_world(64, (8, 8), ("dp", "tp")) as mesh:
        from torch.distributed.tensor import Replicate, Shard

        boundary = [(Shard(0), Replicate())]
        pinned = hand_placements(model)
        rows = []
        start = time.perf_counter()
        hand = dtcompile.auto_parallel.plan(
            model, mesh, (x,), input_placements=boundary, output_placements=boundary, fixed=pinned
        )
        rows.append(("hand TP + FSDP", hand, time.perf_counter() - start))
        budget = hand.param_bytes_per_rank()
        start = time.perf_counter()
        auto = dtcompile.auto_parallel.plan(
            model, mesh, (x,), input_placements=boundary, output_placements=boundary, param_memory_budget_bytes=budget
        )
        rows.append(("auto", auto, time.perf_counter() - start))

    print(f"{args.layers} layers, Llama-3-8B sizes, batch {args.batch} x seq {args.seq}, bf16; mesh dp=8 x tp=8 (fake PG), h100")
    print("| plan | total s | trace s | strategies s | measure s | edges s | solve s | variables | groups | nodes | step us | params B/rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, solution, total in rows:
        sec = solution.problem.seconds
        r = solution.result
        print(
            f"| {label} | {total:.1f} | {sec['trace']:.1f} | {sec['strategies']:.1f} | {sec['measure']:.1f} | "
            f"{sec['edges']:.1f} | {sec['solve']:.1f} | {r.num_variables} | {r.num_groups} | "
            f"{len(solution.problem.nodes)} | {solution.cost_us:.0f} | {solution.param_bytes_per_rank()} |"
        )
    print(f"auto / hand step cost: {auto.cost_us / hand.cost_us:.3f}")
    layer0 = {n: p for n, p in auto.param_placements.items() if n.startswith("layers.1.")}
    print("auto placements, layer 1:", {n.removeprefix("layers.1."): "".join(map(str, p)) for n, p in layer0.items()})


if __name__ == "__main__":
    main()
