"""torchtitan 0.3.0's own Llama3, parallelized by torchtitan, its blocks compiled with dtcompile.

Two ranks as threads (:func:`dtcompile.testing.run_threaded`), two training
steps, all of it torchtitan's code: the model is built by torchtitan's Llama3
layer builder (a tiny config); its tensor parallel plan is torchtitan's sharding
config (``set_llama3_sharding_config``, the part of
``Llama3Model.Config.update_from_config`` that does not need the trainer);
``parallelize_llama`` applies it, compiles every transformer block through
torchtitan's ``apply_compile`` (``block.compile(backend=compile_config.backend,
fullgraph=True)``, the backend ``dtcompile.backend()`` with and without
Inductor) and wraps the model with FSDP2 (``apply_fsdp_to_decoder``; under
tensor parallel its data parallel mesh has one rank, as torchtitan always
applies it).  Each step is
torchtitan's loss (``CrossEntropyLoss``, compiled too, as torchtitan compiles it
when compile is on), torchtitan's ``clip_grad_norm_`` (max norm 1.0) and AdamW
with torchtitan's default hyperparameters (``default_adamw``).

Checked on every rank and step: the loss, the gradient norm and every
parameter's gradient (``full_tensor()``) of the compiled run equal the eager
run's, and the eager run equals the single-process model with the same weights
on the same global batch; each rank compiles the pinned graphs with the pinned
collectives, and nothing more in step 2.

What the harness (``tests/support/titan.py``) adapts to CPU threads, none of it changing what
is computed, is listed in its docstring: torchtitan's device, a stand-in for
its Triton EP kernels, FSDP's reduce-scatter as SUM, SDPA attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
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
    check_runs,
    collective_text,
    force_sum_reduction,
    global_batches,
    initial_weights,
    llama3_on_meta,
    load_weights,
    optimizer,
    parallelize,
    tiny_llama3_config,
    train,
    train_reference,
)

import dtcompile
from dtcompile.base.torch_compat import compiled_blocks_recompile_for_async_outputs
from dtcompile.testing import run_threaded

pytestmark = [
    pytest.mark.models,
    # init_states draws the (then overwritten) initial parameters as DTensors on a CPU mesh.
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support"),
]

WORLD_SIZE = 2
# The tiny Llama3, its training settings and tolerance (NUM_STEPS, LR, TOL, ...) are
# support.titan's, shared with test_torchtitan_simple_fsdp, test_graph_trainer and tests/warm.

# name -> tensor parallel degree; the data parallel (FSDP) degree is the rest of the world.
PLANS = {"tp_sp": 2, "fsdp": 1}
# dtcompile's options: the named backend "dtcompile" is dtcompile.backend() (Inductor),
# here with every graph compiled on its rank: a graph that holds no mesh (FSDP's blocks:
# its gathers run in hooks) is keyed alike on every rank, so one rank's compile would
# serve the other from AOTAutograd's cache (tests/warm runs that path), and GRAPHS
# pins what each rank compiles.
MODES = {"aot": {"inductor": False}, "inductor": {"aot_cache": False}}

# The collectives of the graphs dtcompile compiles on each rank (sorted), op[mesh axis]
# group size and bytes per rank.  Tensor + sequence parallel, per block: the sequence
# all-gathered before attention and before the FFN, reduce-scattered after ``wo`` and
# ``w2`` (float32[4, 16, 64] gathered); the loss (vocab-parallel cross entropy):
# max, sum of exponentials and target log-probability all-reduced per token.  FSDP:
# none, its all-gathers and reduce-scatters run in its hooks, outside the graphs.
_SP = ("all_gather[tp] x2 16384 B", "reduce_scatter[tp] x2 16384 B") * 2
_LOSS = ("all_reduce[tp] x2 256 B",) * 3
# Frames compiled per rank: the loss, and the block, once for both blocks; with tensor
# parallel on torch 2.13 the block once more (the second block's input arrives with an
# AsyncCollectiveTensor shard, a type guard; dtcompile.base.torch_compat says when).
_TP_BLOCK_COMPILES = 2 if compiled_blocks_recompile_for_async_outputs() else 1
GRAPHS = {
    "tp_sp": sorted(
        [("forward", _SP)] * _TP_BLOCK_COMPILES
        + [("backward", _SP)] * _TP_BLOCK_COMPILES
        + [("forward", _LOSS), ("backward", ())]
    ),
    "fsdp": [("backward", ())] * 2 + [("forward", ())] * 2,
}
NUM_FRAMES = {"tp_sp": 1 + _TP_BLOCK_COMPILES, "fsdp": 2}


def _train_on_rank(
    rank: int,
    tensor_parallel_degree: int,
    options: dict[str, Any] | None,
    weights: dict[str, torch.Tensor],
    batches: Batches,
) -> Run:
    """torchtitan's parallelize and training steps on this rank; compiled with dtcompile(**options) unless None."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import parallelize_llama

    model, parallel_dims, parallelism = llama3_on_meta(tiny_llama3_config(), WORLD_SIZE, tensor_parallel_degree)

    compiled = options is not None
    backend = dtcompile.backend(**options) if compiled else None
    counter = CompileCounterWithBackend(backend) if compiled else None
    # torchtitan compiles each block with compile_config.backend (typed str, handed to torch.compile).
    compile_config = CompileConfig(enable=compiled, backend=counter if compiled else "inductor")
    model = parallelize(parallelize_llama, model, parallel_dims, parallelism, compile_config)
    force_sum_reduction(model)
    load_weights(model, weights)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=compile_config)

    # Ranks are laid out (data parallel, tensor parallel): this rank reads its data parallel slice.
    run = train(
        model,
        loss_fn,
        optimizer(model, LR),
        batches,
        num_slices=WORLD_SIZE // tensor_parallel_degree,
        data_parallel_rank=rank // tensor_parallel_degree,
        clip_grad_norm=lambda params: clip_grad_norm_(params, MAX_NORM),
        counter=counter,
    )
    if compiled:
        run.graphs = sorted((r.kind, tuple(map(collective_text, r.collectives))) for r in backend.records)
    return run


@pytest.mark.parametrize("mode", ["aot", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("plan", PLANS)
def test_torchtitan_llama3_blocks_compiled_match_eager_and_one_process(plan, mode, torchtitan_on_cpu):
    tensor_parallel_degree = PLANS[plan]
    num_slices = WORLD_SIZE // tensor_parallel_degree
    weights = initial_weights(tiny_llama3_config())
    batches = global_batches(NUM_STEPS, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)

    eager = run_threaded(WORLD_SIZE, _train_on_rank, tensor_parallel_degree, None, weights, batches)
    # apply_compile sets capture_scalar_outputs and skip_fwd_side_effects_in_bwd_under_checkpoint
    # in Dynamo's config; config set in a thread is that thread's: each rank's, gone with it.
    compiled = run_threaded(WORLD_SIZE, _train_on_rank, tensor_parallel_degree, MODES[mode], weights, batches)
    one_process = train_reference(tiny_llama3_config(), weights, batches, num_slices, LR, MAX_NORM)

    check_runs(compiled, eager, one_process, tensor_parallel_degree, **TOL)

    for rank, run in enumerate(compiled):
        frames = run.num_frames
        assert frames == [NUM_FRAMES[plan]] * NUM_STEPS, f"rank {rank}: frames compiled after each step {frames}"
        assert run.graphs == GRAPHS[plan], f"rank {rank}: {run.graphs}"
