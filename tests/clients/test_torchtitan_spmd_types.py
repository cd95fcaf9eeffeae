"""torchtitan's default path: ``spmd_backend="spmd_types"``, its blocks compiled with dtcompile.

torchtitan 0.3.0 defaults to ``ParallelismConfig.spmd_backend="spmd_types"``:
``Module.parallelize`` cuts each parameter to its local shard (a plain tensor
that carries its SPMD type), and the model's activations move between
layouts through ``spmd_types``' own collectives (autograd Functions over
c10d's in-place collectives, which Dynamo turns into functional ones).  FSDP2,
applied after, turns the parameters into DTensors for storage.  So the compiled
blocks hold no DTensor: dtcompile's Dynamo support has nothing to do, its
backend (partitioner, passes, annotations, records) sees plain tensors and
functional collectives.

Llama3 and a dense Qwen3 (grouped-query attention, q/k norms), each built by
torchtitan's builders (tiny), tensor + sequence parallel on 2 ranks as threads,
``parallelize_*`` compiling every block through ``apply_compile`` with
``dtcompile.backend()`` (with and without Inductor), torchtitan's
tensor-parallel loss (compiled too), ``clip_grad_norm_`` and AdamW, 2 steps.
Checked on every rank and step: loss, gradient norm and every gradient of the
compiled run equal eager's, and eager equals the single-process model; each
rank compiles the block once and the loss once (``fullgraph=True``: a graph
break would be an error, so stock Inductor cannot break or compile fewer
frames either), nothing in step 2, with the pinned collectives.

As torchtitan's trainer does (``get_spmd_context``), each rank's steps run with
torchtitan's current SPMD mesh set (``set_current_spmd_mesh``): without it
``spmd_types``' redistributions are silently the identity.  Type checking
(``debug.spmd_typechecking``, off by default) is not covered: ``spmd_types``'
checker does not trace under Dynamo.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.titan import (
    Batches,
    Run,
    check_runs,
    collective_text,
    force_sum_reduction,
    global_batches,
    initial_weights,
    llama3_config,
    load_weights,
    optimizer,
    parallelize,
    qwen3_dense_config,
    torchtitan_on_cpu,
    train,
    train_reference,
)

import dtcompile
from dtcompile.testing import run_threaded


def _fsdp2_stores_spmd_types() -> bool:
    """Whether this torch's FSDP2 takes plain parameters that carry SPMD types.

    torchtitan 0.3.0's spmd_types path hands ``fully_shard`` such parameters; FSDP2
    turns them into DTensors from torch 2.14 (``FSDPParam._resolve_spmd_types_for_storage``).
    torch 2.13's refuses them, eagerly too ("When dp_mesh_dims is provided, all
    parameters must be DTensors on the full SPMD mesh"): torchtitan's default path
    does not run there, with any backend.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "_resolve_spmd_types_for_storage")


pytestmark = [
    pytest.mark.models,
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support"),
    pytest.mark.skipif(
        not _fsdp2_stores_spmd_types(),
        reason="torch 2.13's FSDP2 refuses the plain parameters with SPMD types that torchtitan 0.3.0's "
        "spmd_types path gives it (eagerly too); torch 2.14 and 2.15 take them",
    ),
]

WORLD_SIZE = 2
NUM_STEPS = 2
# name -> (world size, tensor parallel degree): TP + SP on 2 ranks; FSDP2 x TP + SP on 4
# (data parallel over the rest of the world, 2 x 2); TP without SP on 2.
PLANS = {"tp_sp": (2, 2), "fsdp_tp": (4, 2), "tp": (2, 2)}
DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, HIDDEN_DIM = 64, 4, 2, 2, 128
VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH = 128, 16, 4
# Adam's first update, lr * g / (|g| + 1e-8), turns a rounding difference in a
# gradient element near 1e-8 into up to lr in the weight (test_torchtitan_moe.py):
# at 1e-2 the dense Qwen3's step-2 gradients part by 4e-6 between two correct runs.
# torchtitan's debug models' 3e-4 keeps them within TOL.
LR = 3e-4
MAX_NORM = 1.0

# As in the DTensor test (test_torchtitan.py): float32, the sharded matmuls and the
# reductions over ranks sum in another order than one process does.
TOL = dict(rtol=1e-5, atol=1e-6)

MODELS = {
    "llama3": lambda: llama3_config(
        dim=DIM, n_heads=NUM_HEADS, n_layers=NUM_LAYERS, hidden_dim=HIDDEN_DIM, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN
    ),
    "qwen3": lambda: qwen3_dense_config(
        dim=DIM,
        n_heads=NUM_HEADS,
        n_kv_heads=NUM_KV_HEADS,
        n_layers=NUM_LAYERS,
        hidden_dim=HIDDEN_DIM,
        vocab_size=VOCAB_SIZE,
        seq_len=SEQ_LEN,
    ),
}
# Every graph compiled on its rank: these graphs hold no mesh, so they are keyed alike on
# every rank and one rank's compile could serve the other from AOTAutograd's cache
# (tests/warm runs that path); GRAPHS pins what each rank compiles.
MODES = {"aot": {"inductor": False}, "inductor": {"aot_cache": False}}

# The collectives of the graphs dtcompile compiles on each rank (sorted), op[group]
# group size and bytes per rank, the same for both models and with or without
# Inductor.  Per block: the sequence all-gathered before attention and before the
# FFN, reduce-scattered after ``wo`` and ``w2`` (float32[4, 16, 64] gathered), as on
# the DTensor path; the loss: max, sum of exponentials and target log-probability
# all-reduced per token.  spmd_types' collectives run on the default process group
# (the tensor-parallel group is the whole world of 2); dtcompile names it by the axis
# of torchtitan's current SPMD mesh with the same ranks, ``tp``.
# Under FSDP2 x TP each data parallel rank holds half the batch: half the bytes.


def _graphs(batch_per_rank: int) -> list[tuple[str, tuple[str, ...]]]:
    tokens = batch_per_rank * SEQ_LEN
    sp = (f"all_gather[tp] x2 {tokens * DIM * 4} B", f"reduce_scatter[tp] x2 {tokens * DIM * 4} B") * 2
    loss = (f"all_reduce[tp] x2 {tokens * 4} B",) * 3
    return sorted([("forward", sp), ("backward", sp), ("forward", loss), ("backward", ())])


GRAPHS = _graphs(GLOBAL_BATCH)  # float32[4, 16, 64] gathered


@pytest.fixture(scope="module")
def torchtitan_spmd_types() -> Iterator[None]:
    """torchtitan on CPU with its default SPMD backend, spmd_types, for the module."""
    with torchtitan_on_cpu(spmd_backend="spmd_types"):
        yield


def _train_on_rank(
    rank: int,
    model_name: str,
    options: dict[str, Any] | None,
    weights: dict[str, torch.Tensor],
    batches: Batches,
    plan: str = "tp_sp",
    plant_in: str | None = None,
) -> Run:
    """torchtitan's parallelize (spmd_types) and training steps on this rank of ``plan``'s world;
    compiled with dtcompile(**options) unless None.  The tokens and labels are typed as torchtitan's
    trainer types them (``annotate_input_spmd_types``).  ``plant_in``: the name of a block whose
    FFN output reduction is dropped (:func:`_drop_ffn_reduction`)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types, set_current_spmd_mesh
    from torchtitan.distributed.utils import clip_grad_norm_

    world_size, tensor_parallel_degree = PLANS[plan]
    parallelism = ParallelismConfig(tensor_parallel_degree=tensor_parallel_degree, enable_sequence_parallel=plan != "tp")
    assert parallelism.spmd_backend == "spmd_types", "torchtitan's default SPMD backend"
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    config = MODELS[model_name]()
    if model_name == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    else:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=True, enable_ep=False)
    with torch.device("meta"):
        model = config.build()

    compiled = options is not None
    backend = dtcompile.backend(**options) if compiled else None
    counter = CompileCounterWithBackend(backend) if compiled else None
    compile_config = CompileConfig(enable=compiled, backend=counter if compiled else "inductor")
    if model_name == "llama3":
        from torchtitan.models.llama3 import parallelize_llama as parallelize_fn
    else:
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize_fn
    model = parallelize(parallelize_fn, model, parallel_dims, parallelism, compile_config)
    force_sum_reduction(model)
    load_weights(model, weights)
    if plant_in is not None:
        _drop_ffn_reduction(model.layers[plant_in])
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB_SIZE), compile_config=compile_config)
    with set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()):
        run = train(
            model,
            loss_fn,
            optimizer(model, LR),
            batches,
            # Ranks are laid out (data parallel, tensor parallel): this rank reads its data parallel slice.
            num_slices=world_size // tensor_parallel_degree,
            data_parallel_rank=rank // tensor_parallel_degree,
            clip_grad_norm=lambda params: clip_grad_norm_(params, MAX_NORM),
            counter=counter,
            prepare=lambda tokens, labels: annotate_input_spmd_types(parallel_dims, tokens, labels, {})[:2],
        )
    if compiled:
        run.graphs = sorted((r.kind, tuple(map(collective_text, r.collectives))) for r in backend.records)
        run.records = list(backend.records)
    return run


@pytest.mark.parametrize("mode", ["aot", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("model_name", MODELS)
def test_torchtitan_spmd_types_blocks_compiled_match_eager_and_one_process(model_name, mode, torchtitan_spmd_types):
    weights = initial_weights(MODELS[model_name]())
    batches = global_batches(NUM_STEPS, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)

    eager = run_threaded(WORLD_SIZE, _train_on_rank, model_name, None, weights, batches)
    compiled = run_threaded(WORLD_SIZE, _train_on_rank, model_name, MODES[mode], weights, batches)
    one_process = train_reference(MODELS[model_name](), weights, batches, 1, LR, MAX_NORM)
    check_runs(compiled, eager, one_process, WORLD_SIZE, **TOL)

    for rank, run in enumerate(compiled):
        # The block once for both blocks, the loss once; nothing more in step 2.
        assert run.num_frames == [2] * NUM_STEPS, f"rank {rank}: frames compiled after each step {run.num_frames}"
        assert run.graphs == GRAPHS, f"rank {rank}: {run.graphs}"
        check_blocks_typed(run, ("tp",), rank)


def test_torchtitan_spmd_types_fsdp2_x_tp_on_4_ranks_compiled_matches_eager_and_one_process(torchtitan_spmd_types):
    """FSDP2 x TP + SP under spmd_types, 2 x 2 ranks: FSDP2 keeps the parameters as DTensors on
    the (dp_shard, tp) mesh and gathers them in its hooks (outside the graphs); the blocks, plain
    tensors typed on tp, are compiled with dtcompile as on 2 ranks."""
    world_size, tensor_parallel_degree = PLANS["fsdp_tp"]
    num_slices = world_size // tensor_parallel_degree
    weights = initial_weights(MODELS["llama3"]())
    batches = global_batches(NUM_STEPS, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)

    eager = run_threaded(world_size, _train_on_rank, "llama3", None, weights, batches, "fsdp_tp")
    compiled = run_threaded(world_size, _train_on_rank, "llama3", MODES["aot"], weights, batches, "fsdp_tp")
    one_process = train_reference(MODELS["llama3"](), weights, batches, num_slices, LR, MAX_NORM)

    check_runs(compiled, eager, one_process, tensor_parallel_degree, **TOL)
    for rank, run in enumerate(compiled):
        assert run.num_frames == [2] * NUM_STEPS, f"rank {rank}: frames compiled after each step {run.num_frames}"
        # The tensor-parallel collectives of the 2-rank run on each tp pair, for half the batch;
        # FSDP's run in its hooks, outside the graphs.
        assert run.graphs == _graphs(GLOBAL_BATCH // num_slices), f"rank {rank}: {run.graphs}"
        check_blocks_typed(run, ("dp", "tp"), rank)


# ---- SPMD types in the compiled graphs (dtcompile.spmd.inference)


def _typed_block_on_rank(rank: int, sequence_parallel: bool, plant: bool) -> dict[str, Any]:
    """torchtitan's Llama3 (spmd_types, TP on 2 ranks) and its first block, its input typed as
    torchtitan's trainer types the model's inputs (``spmd_types.assert_type``: the residual stream
    is ``S(1)`` on tp under sequence parallel, ``R`` without); ``plant`` drops the FFN's output
    all-reduce (its ``w2`` leaves its output partial).  Returns the explain report of the block,
    or the compile error, and the block's output compiled and eager."""
    import spmd_types as spmd
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(tensor_parallel_degree=WORLD_SIZE, enable_sequence_parallel=sequence_parallel)
    parallel_dims = ParallelDims.from_config(parallelism, WORLD_SIZE)
    parallel_dims.build_mesh()
    config = MODELS["llama3"]()
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    model = parallelize(parallelize_llama, model, parallel_dims, parallelism, CompileConfig(enable=False))
    load_weights(model, initial_weights(MODELS["llama3"]()))
    block = model.layers["0"]
    if plant:
        _drop_ffn_reduction(block)
    torch.manual_seed(0)  # the same activations on both ranks: the residual stream is replicated
    x = torch.randn(2, SEQ_LEN, DIM)
    if sequence_parallel:
        x = x.chunk(WORLD_SIZE, dim=1)[rank].contiguous()
    result: dict[str, Any] = {}
    with set_current_spmd_mesh(parallel_dims.spmd_dense_mesh()):
        spmd.assert_type(x, {"tp": spmd.S(1) if sequence_parallel else spmd.R})
        result["eager"] = block(x, None).detach()
        try:
            result["report"] = dtcompile.explain(block)(x, None)
        except Exception as exc:
            result["error"] = exc
        else:
            result["compiled"] = torch.compile(block, backend=dtcompile.backend(inductor=False))(x, None).detach()
    return result


def _tensor_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " = " in line and "  # " in line]


def _untyped_lines(text: str, axes: tuple[str, ...]) -> list[str]:
    """The annotated graph's tensor nodes not typed on each of ``axes``, or typed ``?`` there
    (multi-output nodes, attention and split, are typed on their ``getitem``s)."""
    lines = [line for line in _tensor_lines(text)
             if not line.split(" = ")[1].startswith(("aten._scaled_dot", "aten.split", "aten._scaled"))]
    return [line for line in lines if any(f" {axis}:" not in line or f"{axis}:?" in line for axis in axes)]


def _drop_ffn_reduction(block: torch.nn.Module) -> None:
    """The plant: ``block``'s FFN ``w2`` leaves its output partial (its output layout declared as
    the partial sum it makes, so torchtitan skips the all-reduce before the residual add; eager
    runs it and adds a partial sum on each rank)."""
    import dataclasses

    w2 = block.feed_forward.w2
    w2._sharding_config = dataclasses.replace(w2._sharding_config, out_dst_shardings=w2._sharding_config.out_src_shardings)


def check_blocks_typed(run: Run, axes: tuple[str, ...], rank: int) -> None:
    """Every tensor node of every block's forward graph is typed on each of ``axes`` (no ``?``):
    read from torchtitan's own annotations, its modules' declared layouts and the types the
    compiled blocks carry, none added by the test."""
    blocks = [r for r in run.records if r.kind == "forward" and "aten.mm" in str(r.graph.code)]
    assert blocks, f"rank {rank}: no block forward compiled"
    for record in blocks:
        text = record.annotated()
        assert _tensor_lines(text), text
        untyped = _untyped_lines(text, axes)
        assert not untyped, f"rank {rank}, {record.compile_id}: nodes not typed on {axes}:\n" + "\n".join(untyped)


def test_explain_types_every_tensor_node_per_axis_and_names_every_collectives_axis(torchtitan_spmd_types):
    """``dtcompile.explain`` on torchtitan's Llama3 block under spmd_types, TP + SP on 2 ranks:
    every tensor node of the forward and backward graphs carries its type on ``tp``, every
    collective names ``tp``; the row-parallel matmuls are partial sums, reduce-scattered."""
    (report, *_) = [r["report"] for r in run_threaded(WORLD_SIZE, _typed_block_on_rank, True, False)]
    for record in report.graphs:
        text = record.annotated()
        lines = _tensor_lines(text)
        assert lines, text
        untyped = _untyped_lines(text, ("tp",))
        assert not untyped, f"{record.kind} graph: nodes without a type on tp, or of unknown type:\n" + "\n".join(untyped)
        collectives = [line for line in lines if "_c10d_functional." in line and "wait_tensor" not in line]
        assert collectives and all("[tp]" in line for line in collectives), collectives
    forward = next(r for r in report.graphs if r.kind == "forward").annotated()
    # The snapshot: the sequence gathered (S(1) -> R), wo and w2 contract the sharded dim (P),
    # reduce-scattered back to the sequence shard.
    def types_of(op: str) -> list[str]:
        return [line.rsplit("tp:", 1)[1] for line in _tensor_lines(forward) if f"= {op}(" in line]

    assert types_of("_c10d_functional.all_gather_into_tensor.default") == ["R", "R"], forward
    assert types_of("_c10d_functional.reduce_scatter_tensor.default") == ["S(0)", "S(0)"], forward
    assert [t for t in types_of("aten.mm.default")] == ["S(1)", "P", "S(1)", "S(1)", "P"], forward
    assert types_of("aten.pow.Tensor_Scalar")[0] == "S(1)", forward


def test_a_planted_missing_reduction_is_a_compile_error_naming_the_node(torchtitan_spmd_types):
    """TP without sequence parallel: the FFN's ``w2`` output is a partial sum that torchtitan
    all-reduces before the residual add.  Planted: that all-reduce dropped (eager runs, and
    silently adds a partial sum to the residual on each rank).  dtcompile refuses at compile time,
    naming the add, the partial operand and the matmul it comes from; without the plant the same
    block compiles, types check, and its output equals eager."""
    planted = run_threaded(WORLD_SIZE, _typed_block_on_rank, False, True)
    for rank, result in enumerate(planted):
        error = result.get("error")
        assert error is not None, f"rank {rank}: the planted block compiled"
        text = str(error)
        assert "SpmdTypeCheckError" in text and "mesh axis 'tp'" in text, text
        assert "aten.add.Tensor" in text and "partial since mm_" in text and "aten.mm.default" in text, text
        assert "llama3/model.py" in text and "in forward: `out = h + self.feed_forward(self.ffn_norm(h))`" in text, text

    clean = run_threaded(WORLD_SIZE, _typed_block_on_rank, False, False)
    for rank, result in enumerate(clean):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        torch.testing.assert_close(result["compiled"], result["eager"], **TOL)
        # The eager planted output differs: the plant is a wrong result eager runs silently.
        assert not torch.allclose(planted[rank]["eager"], result["eager"], **TOL)


def test_a_missing_reduction_planted_in_block_2_stops_training_at_its_compile_naming_the_node_and_line(torchtitan_spmd_types):
    """torchtitan's Llama3 trained on its default path (TP without SP, per-block compile), the FFN
    output reduction dropped in its second block only: block 1 compiles and checks; block 2 differs
    in that module's layout, so Dynamo compiles it again, and the check refuses it, naming the
    residual add, the matmul whose partial sum reaches it and the model's line.  No input of the
    blocks is annotated by the test: their types come from torchtitan (the trainer's input
    annotation, the modules' declared layouts, FSDP2's saved parameter types)."""
    from dtcompile.testing import RankFailure

    weights = initial_weights(MODELS["llama3"]())
    batches = global_batches(1, VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH)
    with pytest.raises(RankFailure) as failure:
        run_threaded(WORLD_SIZE, _train_on_rank, "llama3", MODES["aot"], weights, batches, "tp", "1")
    text = str(failure.value)
    for rank in range(WORLD_SIZE):
        assert f"--- rank {rank} ---" in text, text
    assert text.count("SpmdTypeCheckError") >= WORLD_SIZE and "mesh axis 'tp'" in text, text
    assert "aten.add.Tensor" in text and "partial since mm_" in text and "aten.mm.default" in text, text
    assert "llama3/model.py" in text and "in forward: `out = h + self.feed_forward(self.ffn_norm(h))`" in text, text
