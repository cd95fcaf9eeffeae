"""Auto-parallel at Llama-3-8B size: solve time and plan cost against the hand TP + FSDP plan.

A stack of Llama-3-8B transformer layers (dim 4096, SwiGLU hidden 14336, 32
query heads and 8 key/value heads of 128, RMSNorm, causal attention through
``F.scaled_dot_product_attention`` as torchtitan writes it, or spelled out as
softmax with ``--attention softmax``),
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
    python benchmarks/auto_parallel.py --shared   # the shared test models, compiled

``--shared`` plans the shared models of ``dtcompile._testing`` under their hand
plans' parameter memory on the fake process group, compiles the solution and
the hand plan with dtcompile (no Inductor), and compares the step estimated on
the compiled graphs (``dtcompile.cost.simulate``, h100) with the solver's estimate.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

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
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, sdpa: bool = True) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.sdpa = n_heads, n_kv_heads, dim // n_heads, sdpa
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
        if self.sdpa:  # on CPU: the flash attention kernel, planned with DTensor's efficient-attention strategies
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            out = scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, n_heads: int, n_kv_heads: int, sdpa: bool = True) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, sdpa)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int = 4096, hidden: int = 14336, n_heads: int = 32, n_kv_heads: int = 8,
                 sdpa: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, hidden, n_heads, n_kv_heads, sdpa) for _ in range(layers))

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


def shared_models() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtcompile
    from dtcompile._testing.cases import CASES
    from dtcompile.cost import get_profile
    from dtcompile.cost.simulate import simulate
    from dtcompile.report import backward_from_sum
    from dtcompile.testing import fake_world

    h100 = get_profile("h100")

    def compiled_us(model: nn.Module, x: torch.Tensor) -> float:
        torch._dynamo.reset()
        backend = dtcompile.backend(inductor=False)
        backward_from_sum(torch.compile(model, backend=backend, fullgraph=True)(x))
        return sum(simulate(r.graph.graph, h100).total_us for r in backend.records)

    cases = [
        ("tp_mlp", 4, (4,), (Replicate(),)),
        ("fsdp_mlp", 4, (4,), (Shard(0),)),
        ("tp_sp_block", 4, (4,), (Replicate(),)),
        ("tp_sp_block_local_map", 4, (4,), (Replicate(),)),
        ("block_2d", 8, (2, 4), (Shard(0), Replicate())),
    ]
    def row(name: str, mesh: Any, reference: nn.Module, x: torch.Tensor, layout: Any, hand: nn.Module, hand_x: Any) -> None:
        """Plans ``reference`` under ``hand``'s parameter bytes; prints both compiled steps."""
        budget = sum(p.to_local().numel() * p.element_size() for p in hand.parameters())
        start = time.perf_counter()
        model, solution = dtcompile.auto_parallel(
            reference, mesh, (x,), input_placements=[layout], output_placements=[layout],
            param_memory_budget_bytes=budget,
        )
        seconds = time.perf_counter() - start
        auto_us = compiled_us(model, distribute_tensor(x, mesh, layout, src_data_rank=None))
        hand_us = compiled_us(hand, hand_x)
        print(f"| {name} | {tuple(mesh.shape)} | {seconds:.1f} | {solution.cost_us:.2f} | {auto_us:.2f} | "
              f"{hand_us:.2f} | {auto_us / hand_us:.3f} |")

    print("| model | mesh | plan s | solver us | auto compiled us | hand compiled us | auto / hand |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, world, shape, layout in cases:
        case = CASES[name]
        with fake_world(world, shape, case.mesh_dim_names) as mesh:
            reference, hand, x = case.build(mesh)
            row(name, mesh, reference, x, layout, hand, case.local_input(x, mesh))
    # The MLP on the 2-D mesh against three hand plans (as tests/auto_parallel/test_planned_models.py).
    import copy

    from dtcompile._testing import models

    with fake_world(8, (2, 4), ("dp", "tp")) as mesh:
        with models._plain_tensors(0) as gen:
            reference = models._init_weights(models.MLP(16, 32), gen)
            x = torch.randn(32, 16, generator=gen)
        dp_rank = mesh.get_coordinate()[0]
        rows = x[:8]

        def tp_with(shard: bool) -> nn.Module:
            return models._data_parallel(models.parallelize_mlp(copy.deepcopy(reference), mesh["tp"]), mesh, shard=shard)

        hands = [
            ("mlp vs TP + DDP", rows, (Shard(0), Replicate()), lambda: (tp_with(False), rows.chunk(2)[dp_rank])),
            ("mlp vs TP + FSDP2 (no _StridedShard offered)", rows, (Shard(0), Replicate()),
             lambda: (tp_with(True), rows.chunk(2)[dp_rank])),
            ("fsdp_mlp vs FSDP over both axes (flattened)", x, (Shard(0), Shard(0)),
             lambda: (models.parallelize_fsdp_mlp(copy.deepcopy(reference), mesh._flatten("dp_tp")),
                      x.chunk(8)[mesh.get_rank()])),
        ]
        for name, inputs, layout, make_hand in hands:
            row(name, mesh, reference, inputs, layout, *make_hand())
    # This benchmark's model, small enough to compile: the "hand" column is the hand TP + FSDP
    # parameter placements pinned, the ops chosen by the solver, compiled the same way.
    torch.manual_seed(0)
    model, x = Llama(3, dim=128, hidden=256, n_heads=8, n_kv_heads=4), torch.randn(4, 16, 128)
    layout = (Shard(0), Replicate())
    with fake_world(8, (2, 4), ("dp", "tp")) as mesh:
        pinned = hand_placements(model)
        budget = sum(
            p.numel() // math.prod(mesh.size(a) for a, q in enumerate(pinned[n]) if q.is_shard()) * p.element_size()
            for n, p in model.named_parameters()
        )
        plans = {}
        for label, options in (("auto", {"param_memory_budget_bytes": budget}), ("hand", {"fixed": pinned})):
            start = time.perf_counter()
            parallel, solution = dtcompile.auto_parallel(
                model, mesh, (x,), input_placements=[layout], output_placements=[layout], **options
            )
            seconds = time.perf_counter() - start
            plans[label] = (solution, seconds, compiled_us(parallel, distribute_tensor(x, mesh, layout, src_data_rank=None)))
        (auto, seconds, auto_us), (_, _, hand_us) = plans["auto"], plans["hand"]
        print(f"| llama_gqa x3, dim 128 (hand: TP + FSDP placements pinned) | (2, 4) | {seconds:.1f} | "
              f"{auto.cost_us:.2f} | {auto_us:.2f} | {hand_us:.2f} | {auto_us / hand_us:.3f} |")


def _peak_mib() -> float:
    """The process's peak resident memory so far (it only grows: the hand plan's row includes the auto plan's)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", action="store_true", help="the shared test models, compiled, against their hand plans")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="global batch (one sequence per dp rank)")
    parser.add_argument("--attention", choices=("sdpa", "softmax"), default="sdpa")
    args = parser.parse_args()
    if args.shared:
        shared_models()
        return

    import dtcompile
    from dtcompile.testing import fake_world

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(args.layers, sdpa=args.attention == "sdpa").to(torch.bfloat16)
        x = torch.empty(args.batch, args.seq, 4096, dtype=torch.bfloat16)
    with fake_world(64, (8, 8), ("dp", "tp")) as mesh:
        from torch.distributed.tensor import Replicate, Shard

        boundary = [(Shard(0), Replicate())]
        pinned = hand_placements(model)
        # What the hand plan keeps per rank: the auto plan's parameter memory budget.
        budget = sum(
            p.numel() // math.prod(mesh.size(a) for a, q in enumerate(pinned[n]) if q.is_shard()) * p.element_size()
            for n, p in model.named_parameters()
        )
        rows = []
        # auto first: it pays for DTensor's sharding caches being cold, not the hand plan.
        start = time.perf_counter()
        auto = dtcompile.auto_parallel.plan(
            model, mesh, (x,), input_placements=boundary, output_placements=boundary, param_memory_budget_bytes=budget
        )
        rows.append(("auto", auto, time.perf_counter() - start, _peak_mib()))
        start = time.perf_counter()
        hand = dtcompile.auto_parallel.plan(
            model, mesh, (x,), input_placements=boundary, output_placements=boundary, fixed=pinned
        )
        rows.append(("hand TP + FSDP", hand, time.perf_counter() - start, _peak_mib()))
        assert hand.param_bytes_per_rank() == budget

    print(f"{args.layers} layers, Llama-3-8B sizes, {args.attention} attention, batch {args.batch} x seq {args.seq}, bf16; "
          "mesh dp=8 x tp=8 (fake PG), h100")
    print("| plan | total s | trace s | strategies s | measure s | edges s | solve s | variables | groups | nodes | step us | params B/rank | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, solution, total, peak in rows:
        sec = solution.problem.seconds
        r = solution.result
        print(
            f"| {label} | {total:.1f} | {sec['trace']:.1f} | {sec['strategies']:.1f} | {sec['measure']:.1f} | "
            f"{sec['edges']:.1f} | {sec['solve']:.1f} | {r.num_variables} | {r.num_groups} | "
            f"{len(solution.problem.nodes)} | {solution.cost_us:.0f} | {solution.param_bytes_per_rank()} | {peak:.0f} |"
        )
    print(f"auto / hand step cost: {auto.cost_us / hand.cost_us:.3f}")
    layer0 = {n: p for n, p in auto.param_placements.items() if n.startswith("layers.1.")}
    print("auto placements, layer 1:", {n.removeprefix("layers.1."): "".join(map(str, p)) for n, p in layer0.items()})


if __name__ == "__main__":
    main()
