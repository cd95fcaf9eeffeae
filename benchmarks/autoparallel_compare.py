"""dtcompile's planner on meta-pytorch/autoparallel's own Llama-3 example: plan time and plan cost.

autoparallel (https://github.com/meta-pytorch/autoparallel) solves the same
problem as ``dtcompile.auto_parallel`` with an ILP over DTensor's strategies.
Its ``examples/example_llama3.py`` plans Llama-3 8B (its model file
``autoparallel/_testing/models/llama3.py``: 32 layers, dim 4096, 32 heads, 8
key/value heads, vocab 128256, ``F.scaled_dot_product_attention``, rotary
embeddings through complex ``freqs_cis``) on a fake process group of 64 ranks,
mesh ``dp=8 x tp=8``, batch ``2 * 8`` x seq ``8192``, the input ``S(0)R``, the
logits ``S(0)S(2)`` (vocab parallel), and parameter memory at most ``1/64`` of
the whole (``add_parameter_memory_constraint()``'s default).

This script builds that very model from autoparallel's file (pass its path:
the model is theirs, not a copy) on the ``meta`` device, in bfloat16 (the
example's ``MixedPrecisionPolicy(param_dtype=bfloat16)``), and plans it with
``dtcompile.auto_parallel.plan`` under the same pins and budget on the fake
process group (CPU: the trace holds the CPU flash attention, planned with
DTensor's efficient-attention strategies).  It prints where the time went and
the plan's estimated step (``h100`` profile), and the same for the hand TP + FSDP
placements (vocab-parallel embedding and head) under the same cost model.

    git clone https://github.com/meta-pytorch/autoparallel /tmp/autoparallel
    python benchmarks/autoparallel_compare.py --model-file /tmp/autoparallel/autoparallel/_testing/models/llama3.py

The costs are each planner's own estimate, in its own cost model: compare the
times to plan, and each plan against the hand plan under the same model.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def load_model_file(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("autoparallel_llama3", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"autoparallel_compare: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hand_placements(model: Any, dp: Any, tp: Any) -> dict[str, Any]:
    """TP + FSDP as torchtitan lays out Llama: column-wise ``wq wk wv w1 w3`` and the head
    ``S(0)`` over tp, row-wise ``wo w2`` ``S(1)``, the embedding vocab-parallel ``S(0)``;
    over dp every parameter sharded again on dim 0 (``_StridedShard`` where tp shards it too)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    found = {}
    for name, _ in model.named_parameters():
        leaf = name.rsplit(".", 2)[-2]
        tp_place = {"wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "w1": Shard(0), "w3": Shard(0),
                    "output": Shard(0), "tok_embeddings": Shard(0), "wo": Shard(1), "w2": Shard(1)}.get(leaf, Replicate())
        dp_place = _StridedShard(0, split_factor=tp) if tp_place == Shard(0) else Shard(0)
        found[name] = (dp_place, tp_place)
    return found


def run(module: Any, layers: int, seq: int, label: str, hand: bool) -> dict[str, Any]:
    import dtcompile
    from dtcompile.testing import fake_world

    args = module.TransformerModelArgs(
        dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_theta=500000, vocab_size=128256, max_seq_len=seq,
    )
    with torch.device("meta"):
        model = module.Transformer(args).to(torch.bfloat16)
        model.freqs_cis = model.freqs_cis.to(torch.complex64)  # as the example keeps it (a buffer, not a parameter)
    dp, tp = 8, 8
    batch = 2 * dp
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device="meta")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = total // (dp * tp)
    with fake_world(dp * tp, (dp, tp), ("dp", "tp")) as mesh:
        from torch.distributed.tensor import Replicate, Shard

        start = time.perf_counter()
        solution = dtcompile.auto_parallel.plan(
            model, mesh, (tokens,), input_placements=[(Shard(0), Replicate())],
            output_placements=[(Shard(0), Shard(2))], param_memory_budget_bytes=None if hand else budget,
            fixed=hand_placements(model, dp, tp) if hand else None, cost_profile="h100",
        )
        seconds = time.perf_counter() - start
    s = solution.problem.seconds
    return {
        "plan": label, "total s": seconds, "trace s": s.get("trace", 0.0), "strategies s": s.get("strategies", 0.0),
        "measure s": s.get("measure", 0.0), "edges s": s.get("edges", 0.0), "solve s": s.get("solve", 0.0),
        "variables": solution.result.num_variables, "nodes": len(solution.problem.nodes),
        "step us": solution.cost_us, "params B/rank": solution.param_bytes_per_rank(), "budget B/rank": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", required=True, help="autoparallel/_testing/models/llama3.py of a checkout")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8192)
    options = parser.parse_args()
    module = load_model_file(options.model_file)
    rows = [run(module, options.layers, options.seq, "auto", hand=False),
            run(module, options.layers, options.seq, "hand TP + FSDP", hand=True)]
    print(f"autoparallel's Llama-3 8B example: {options.layers} layers, batch 16 x seq {options.seq}, bf16; "
          "mesh dp=8 x tp=8 (fake PG), input S(0)R, logits S(0)S(2), h100")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" + "---:|" * (len(keys) - 1))
    for row in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    print(f"auto / hand step cost: {rows[0]['step us'] / rows[1]['step us']:.3f}")


if __name__ == "__main__":
    main()
