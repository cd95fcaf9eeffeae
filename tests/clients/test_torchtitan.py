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

What the harness adapts to CPU threads, none of it changing what is computed:

- torchtitan takes ``"cuda"`` for its device when it finds no accelerator
  (``torchtitan.tools.utils.get_device_info``); its meshes are built on ``"cpu"``.
- ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels of MoE
  expert-parallel dispatch, imported by the common decoder whether or not a
  model has experts) imports triton, which the CPU torch wheel does not ship; a
  stand-in module whose kernels raise is put in its place when triton is absent.
- torchtitan sets FSDP's gradient divide factor to 1.0, for which FSDP2
  reduce-scatters with ``PREMUL_SUM(1.0)``, an NCCL-only op: the threaded
  process group (like gloo) has only SUM and AVG
  (``multi_threaded_pg.ReduceScatter``).  ``set_force_sum_reduction_for_comms``
  makes it SUM, the same sum (times 1.0) in another op.
- torchtitan's language-model attention backends are flex and varlen;
  ``apply_compile`` refuses a FlexAttention model with any compile backend but
  ``"inductor"`` and ``"aot_eager"`` (``_maybe_regional_inductor_backend``), and
  varlen needs CUDA.  Every layer's inner attention is
  ``ScaledDotProductAttention`` (causal), as torchtitan's own graph_trainer
  tests make it (``build_decoder_config_for_backend``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import dtcompile
from dtcompile.testing import run_threaded

pytestmark = [
    pytest.mark.models,
    # init_states draws the (then overwritten) initial parameters as DTensors on a CPU mesh.
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support"),
]

TORCHTITAN_VERSION = "0.3.0"
INSTALL = "pip install --no-deps -r tests/clients/requirements.txt"

WORLD_SIZE = 2
NUM_STEPS = 2
DIM, NUM_HEADS, NUM_LAYERS, HIDDEN_DIM = 64, 4, 2, 128
VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH = 128, 16, 4
LR = 1e-2
MAX_NORM = 1.0

# float32 throughout.  The sharded matmuls and the reductions over ranks sum in
# another order than one process does (measured: at most 4.8e-7 on the losses,
# 3e-7 on the gradients); the smallest gradients (RMSNorm scales) peak at 4e-5,
# so atol is 1e-6, not 1e-5, which would pass a 25% error on them.
TOL = dict(rtol=1e-5, atol=1e-6)

# name -> tensor parallel degree; the data parallel (FSDP) degree is the rest of the world.
PLANS = {"tp_sp": 2, "fsdp": 1}
# dtcompile's options: the named backend "dtcompile" is dtcompile.backend() (Inductor).
MODES = {"aot": {"inductor": False}, "inductor": {}}

# The collectives of the graphs dtcompile compiles on each rank (sorted), op[mesh axis]
# group size and bytes per rank.  Tensor + sequence parallel, per block: the sequence
# all-gathered before attention and before the FFN, reduce-scattered after ``wo`` and
# ``w2`` (float32[4, 16, 64] gathered); the loss (vocab-parallel cross entropy):
# max, sum of exponentials and target log-probability all-reduced per token.  FSDP:
# none, its all-gathers and reduce-scatters run in its hooks, outside the graphs.
_SP = ("all_gather[tp] x2 16384 B", "reduce_scatter[tp] x2 16384 B") * 2
_LOSS = ("all_reduce[tp] x2 256 B",) * 3
GRAPHS = {
    "tp_sp": sorted([("forward", _SP)] * 2 + [("backward", _SP)] * 2 + [("forward", _LOSS), ("backward", ())]),
    "fsdp": [("backward", ())] * 2 + [("forward", ())] * 2,
}
# Frames compiled per rank: the loss, and the block, once for both blocks under FSDP,
# once per block with tensor parallel (torchtitan's parallelize gives each module its
# own forward closure, which Dynamo guards on).
NUM_FRAMES = {"tp_sp": 3, "fsdp": 2}

# Imported by torchtitan.distributed.minimal_async_ep.api from the Triton kernels module.
_EP_KERNELS = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def _require_torchtitan() -> None:
    """Fails in CI (which installs it), skips elsewhere, when torchtitan 0.3.0 is not installed."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version == TORCHTITAN_VERSION:
        return
    found = "not installed" if version is None else f"{version} installed"
    message = f"torchtitan {TORCHTITAN_VERSION} needed, {found}: {INSTALL}"
    if os.environ.get("DTCOMPILE_TEST_INSTALLED") == "1":
        pytest.fail(message + " (the README's test command does)")
    pytest.skip(message)


def _stand_in_for_ep_kernels() -> None:
    """Without triton, puts a module of kernels that raise where torchtitan imports its EP kernels."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    module = types.ModuleType(name, "Stand-in for torchtitan's Triton EP kernels (triton is not installed).")

    def kernel(kernel_name: str) -> Callable[..., Any]:
        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{kernel_name}: torchtitan's MoE expert-parallel kernels need triton")

        return unavailable

    for kernel_name in _EP_KERNELS:
        setattr(module, kernel_name, kernel(kernel_name))
    sys.modules[name] = module


@pytest.fixture(scope="module")
def torchtitan_on_cpu() -> Iterator[None]:
    """torchtitan imported and pointed at CPU for this module; what it changed in torch undone after.

    Importing ``torchtitan.distributed.compile`` replaces ``FakeTensorMode.__init__``
    (wrapped in ``torch.compiler.disable``); torchtitan's device and SPMD backend
    are module globals of its own.
    """
    _require_torchtitan()
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_tensor_mode_init = FakeTensorMode.__init__
    _stand_in_for_ep_kernels()
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3  # noqa: F401 - imports torchtitan.distributed.compile
    from torchtitan.distributed import utils as dist_utils

    spmd_backend = dist_utils.get_spmd_backend()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(parallel_dims, "device_type", "cpu")
            # DTensor for the model-parallel axes, FSDP2 for data parallel: the
            # DTensor path (torchtitan's default is spmd_types, on plain tensors).
            dist_utils.set_spmd_backend("partial_dtensor")
            yield
    finally:
        dist_utils.set_spmd_backend(spmd_backend)
        FakeTensorMode.__init__ = fake_tensor_mode_init


def _llama3_config() -> Any:
    """A tiny Llama3 from torchtitan's own builders (as its ``debugmodel``, smaller), SDPA attention."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB_SIZE,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB_SIZE, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB_SIZE, param_init=llama3._output_linear_init(DIM)
        ),
        layers=llama3._build_llama3_layers(
            n_layers=NUM_LAYERS,
            dim=DIM,
            n_heads=NUM_HEADS,
            hidden_dim=HIDDEN_DIM,
            rope=ComplexRoPE.Config(dim=DIM // NUM_HEADS, max_seq_len=SEQ_LEN, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    from torchtitan.components.optimizer import default_adamw

    (group,) = default_adamw(lr=LR).param_groups
    return torch.optim.AdamW(model.parameters(), foreach=True, **group.optimizer_kwargs)


# Per step, the global batch: token ids and next-token labels.
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _global_batches() -> Batches:
    """Token ids and next-token labels of each step's global batch."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, VOCAB_SIZE, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def _initial_weights() -> dict[str, torch.Tensor]:
    """The unsharded parameters every run starts from: torchtitan's own init, seeded."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _llama3_config().build()
        model.init_states()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@dataclass
class Run:
    """One rank's (or the single process's) training: per step, what it computed."""

    losses: list[torch.Tensor]
    """Per step, ``loss`` as torchtitan's ``CrossEntropyLoss`` returns it: the cross entropy summed
    over this data parallel rank's tokens, divided by the global batch's number of tokens."""
    grad_norms: list[torch.Tensor]
    """Per step, the total gradient norm ``clip_grad_norm_`` clipped with."""
    grads: list[dict[str, torch.Tensor]]
    """Per step, every parameter's whole gradient (``full_tensor()``), before clipping."""
    num_frames: list[int] | None = None
    """Compiled runs: frames compiled with dtcompile after each step (a recompile would add one)."""
    graphs: list[tuple[str, tuple[str, ...]]] | None = None
    """Compiled runs: each graph dtcompile compiled on this rank, its kind and its collectives."""


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _collective(c: Any) -> str:
    return f"{c.op}[{c.axis}] x{c.group_size} {c.bytes} B"


def _train_on_rank(
    rank: int,
    tensor_parallel_degree: int,
    options: dict[str, Any] | None,
    weights: dict[str, torch.Tensor],
    batches: Batches,
) -> Run:
    """torchtitan's parallelize and training steps on this rank; compiled with dtcompile(**options) unless None."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(
        tensor_parallel_degree=tensor_parallel_degree,
        enable_sequence_parallel=True,
        spmd_backend="partial_dtensor",
    )
    parallel_dims = ParallelDims.from_config(parallelism, WORLD_SIZE)
    parallel_dims.build_mesh()
    config = _llama3_config()
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()

    compiled = options is not None
    backend = dtcompile.backend(**options) if compiled else None
    counter = CompileCounterWithBackend(backend) if compiled else None
    # torchtitan compiles each block with compile_config.backend (typed str, handed to torch.compile).
    compile_config = CompileConfig(enable=compiled, backend=counter if compiled else "inductor")
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # see the module docstring

    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states()  # the buffers (RoPE); the parameters are set next
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), f"{name} is not sharded"
            shard = distribute_tensor(weights[name], param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=compile_config)
    optimizer = _optimizer(model)

    # Ranks are laid out (data parallel, tensor parallel): this rank reads its data parallel slice.
    num_slices, data_parallel_rank = WORLD_SIZE // tensor_parallel_degree, rank // tensor_parallel_degree
    run = Run([], [], [], [] if compiled else None)
    for tokens, labels in batches:
        global_valid_tokens = torch.tensor(labels.numel())
        tokens, labels = tokens.chunk(num_slices)[data_parallel_rank], labels.chunk(num_slices)[data_parallel_rank]
        loss, _ = loss_fn(model(tokens), labels, global_valid_tokens)
        loss.backward()
        run.losses.append(loss.detach().clone())
        run.grads.append({name: _whole(p.grad) for name, p in model.named_parameters()})
        run.grad_norms.append(_whole(clip_grad_norm_(list(model.parameters()), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        if compiled:
            run.num_frames.append(counter.frame_count)
    if compiled:
        run.graphs = sorted((record.kind, tuple(map(_collective, record.collectives))) for record in backend.records)
    return run


def _train_single_process(weights: dict[str, torch.Tensor], batches: Batches, num_slices: int) -> list[Run]:
    """The unsharded model on the whole global batch; losses split as the data parallel ranks see them."""
    from torchtitan.components.loss import CrossEntropyLoss

    model = _llama3_config().build()
    model.init_states()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    optimizer = _optimizer(model)
    runs = [Run([], [], []) for _ in range(num_slices)]
    for tokens, labels in batches:
        global_valid_tokens = torch.tensor(labels.numel())
        slices = zip(tokens.chunk(num_slices), labels.chunk(num_slices))
        losses = [loss_fn(model(t), y, global_valid_tokens)[0] for t, y in slices]
        sum(losses).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for run, loss in zip(runs, losses):
            run.losses.append(loss.detach().clone())
            run.grads.append(grads)
            run.grad_norms.append(grad_norm.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
    return runs


def _mismatches(got: Run, want: Run, what: str, **tol: float) -> list[str]:
    problems = []

    def compare(name: str, g: torch.Tensor, w: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(g, w, **tol)
        except AssertionError as err:
            detail = " ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
            problems.append(f"{what}, {name}: {detail}")

    for step in range(NUM_STEPS):
        compare(f"step {step} loss", got.losses[step], want.losses[step])
        compare(f"step {step} grad norm", got.grad_norms[step], want.grad_norms[step])
        assert got.grads[step].keys() == want.grads[step].keys(), what
        for name, grad in got.grads[step].items():
            compare(f"step {step} grad of {name}", grad, want.grads[step][name])
    return problems


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", PLANS)
def test_torchtitan_llama3_blocks_compiled_match_eager_and_one_process(plan, mode, torchtitan_on_cpu):
    tensor_parallel_degree = PLANS[plan]
    num_slices = WORLD_SIZE // tensor_parallel_degree
    weights, batches = _initial_weights(), _global_batches()

    eager = run_threaded(WORLD_SIZE, _train_on_rank, tensor_parallel_degree, None, weights, batches)
    # apply_compile sets these two Dynamo flags for the process; undone after the run.
    with torch._dynamo.config.patch(capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        compiled = run_threaded(WORLD_SIZE, _train_on_rank, tensor_parallel_degree, MODES[mode], weights, batches)
    one_process = _train_single_process(weights, batches, num_slices)

    problems = []
    for rank in range(WORLD_SIZE):
        problems += _mismatches(compiled[rank], eager[rank], f"rank {rank} compiled vs eager", **TOL)
        want = one_process[rank // tensor_parallel_degree]
        problems += _mismatches(eager[rank], want, f"rank {rank} eager vs one process", **TOL)
    if problems:
        raise AssertionError(f"{len(problems)} mismatch(es):\n" + "\n".join(problems[:20]))

    for rank, run in enumerate(compiled):
        frames = run.num_frames
        assert frames == [NUM_FRAMES[plan]] * NUM_STEPS, f"rank {rank}: frames compiled after each step {frames}"
        assert run.graphs == GRAPHS[plan], f"rank {rank}: {run.graphs}"
