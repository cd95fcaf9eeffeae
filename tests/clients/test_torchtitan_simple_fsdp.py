"""torchtitan's compiler-first path: graph_trainer's SimpleFSDP over torchtitan's Llama3, the
whole model compiled with dtcompile, against eager and one process.

torchtitan 0.3.0's ``graph_trainer`` parallelizes with SimpleFSDP
(``simple_fsdp.data_parallel``: every parameter a DTensor stored ``Shard(0)`` on the
``fsdp`` mesh and gathered inside the model) after torchtitan's own tensor
parallelism, and compiles the whole model (:func:`support.titan.simple_fsdp`).  Here that
model is built by torchtitan's builders, FSDP 2 (ranks as threads) and FSDP x TP
2 x 2 (gloo ranks), compiled with ``dtcompile.backend(inductor=False)`` and trained two steps
(torchtitan's loss, clipping and AdamW): losses, gradients and gradient norms equal
the same model's eager steps, and eager equals one process on the whole batch.
Compiled, the gathered weights are not held from forward to backward: every one the
backward reads is resharded (gathered again there), as FSDP2 does.  The memory and
step time of this path against torchtitan's default (FSDP2 + per-block compile) and
stock Inductor are ``benchmarks/memory.py``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# test_torchtitan's tiny Llama3, training settings and tolerance (support.titan's comment says why).
from support.titan import (
    GLOBAL_BATCH,
    LR,
    MAX_NORM,
    NUM_STEPS,
    SEQ_LEN,
    TOL,
    VOCAB_SIZE,
    Batches,
    Run,
    global_batches,
    initial_weights,
    llama3_on_meta,
    load_simple_fsdp_weights,
    mismatches,
    optimizer,
    raise_mismatches,
    simple_fsdp,
    train,
    train_reference,
)
from support.titan import tiny_llama3_config as _config
from support.titan import torchtitan_on_cpu as titan_on_cpu

import dtcompile
from dtcompile.records import Action
from dtcompile.testing import run_gloo, run_threaded

# name -> (world size, tensor parallel degree); FSDP over the rest.
PLANS = {"fsdp": (2, 1), "fsdp_tp": (4, 2)}
# FSDP x TP runs on gloo processes: SimpleFSDP joins the fsdp and tp meshes
# (DeviceMesh._concatenate), whose groups ranks that are threads cannot resolve.
RUN = {"fsdp": run_threaded, "fsdp_tp": run_gloo}


def _train_on_gloo_rank(rank: int, *args: Any) -> Run:
    """:func:`_train_on_rank` in a gloo rank's own process, torchtitan pointed at CPU there."""
    with titan_on_cpu():
        return _train_on_rank(rank, *args)


def _train_on_rank(
    rank: int, world_size: int, tp: int, options: dict[str, Any] | None, weights: dict[str, torch.Tensor], batches: Batches
) -> Run:
    """SimpleFSDP's training steps on this rank: eager, or the whole model compiled with dtcompile(**options)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.utils import clip_grad_norm_

    model, parallel_dims, _ = llama3_on_meta(_config(), world_size, tp)
    model = simple_fsdp(model, parallel_dims)
    load_simple_fsdp_weights(model, weights)
    backend = dtcompile.backend(**options) if options is not None else None
    if backend is not None:
        model.compile(backend=backend)  # in place: the parameters keep their names
    run = train(
        model,
        CrossEntropyLoss(CrossEntropyLoss.Config()),
        optimizer(model, LR),
        batches,
        num_slices=world_size // tp,
        data_parallel_rank=rank // tp,
        clip_grad_norm=lambda params: clip_grad_norm_(params, MAX_NORM),
    )
    if backend is not None:
        run.graphs = [
            (r.kind, [(d.action.value, d.node) for p in r.passes if p.name == "reshard_after_forward" for d in p.decisions],
             sorted(c.op for c in r.collectives))
            for r in backend.records
        ]
    return run


# Whole torchtitan models compiled on ranks: the slow tier, as the other client tests.
pytestmark = pytest.mark.models


@pytest.mark.parametrize("plan", PLANS)
def test_simple_fsdp_llama3_whole_model_compiled_matches_eager_and_one_process(plan, torchtitan_on_cpu):
    world_size, tp = PLANS[plan]
    weights = initial_weights(_config())
    batches = global_batches(NUM_STEPS, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)

    run, train_on_rank = RUN[plan], (_train_on_rank if RUN[plan] is run_threaded else _train_on_gloo_rank)
    eager = run(world_size, train_on_rank, world_size, tp, None, weights, batches)
    compiled = run(world_size, train_on_rank, world_size, tp, {"inductor": False}, weights, batches)
    one_process = train_reference(_config(), weights, batches, world_size // tp, LR, MAX_NORM)

    problems = []
    for rank in range(world_size):
        problems += mismatches(compiled[rank], eager[rank], f"rank {rank} compiled vs eager", **TOL)
        problems += mismatches(eager[rank], one_process[rank // tp], f"rank {rank} eager vs one process", **TOL)
    raise_mismatches(problems)

    for rank, run in enumerate(compiled):
        (forward, decisions, _), (backward, _, backward_ops) = run.graphs
        assert (forward, backward) == ("forward", "backward"), f"rank {rank}: {run.graphs}"
        # Every weight the backward reads is gathered again there, none held from the forward
        # (the embedding's is not read by its backward).
        assert {action for action, _ in decisions} == {Action.RESHARDED.value}, f"rank {rank}: {decisions}"
        names = [name for _, name in decisions]
        assert "lm_head.weight" in names and "layers.0.attention.qkv_linear.wqkv.weight" in names, names
        assert "tok_embeddings.weight" not in names, names
        assert "all_gather" in backward_ops, f"rank {rank}: {backward_ops}"
