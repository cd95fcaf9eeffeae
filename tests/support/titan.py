"""The torchtitan client tests' harness: torchtitan 0.3.0 on CPU threads, its training steps, the comparisons.

A test builds a model with torchtitan's builders, parallelizes it with
torchtitan's ``parallelize_*`` (which compiles every transformer block through
``apply_compile``), and runs :func:`train` on every rank and
:func:`train_single_process` on one: each step is torchtitan's loss, its
``clip_grad_norm_`` and AdamW with torchtitan's defaults (:func:`optimizer`),
and :func:`mismatches` compares the :class:`Run` of each.

What the harness adapts to CPU threads, none of it changing what is computed:

- torchtitan takes ``"cuda"`` for its device when it finds no accelerator
  (``torchtitan.tools.utils.get_device_info``); its meshes are built on ``"cpu"``
  (:func:`torchtitan_on_cpu`).
- ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels of MoE
  expert-parallel dispatch, imported by the common decoder whether or not a
  model has experts) imports triton, which the CPU torch wheel does not ship; a
  stand-in module whose kernels raise is put in its place when triton is absent.
  The tests' MoE dispatches with torchtitan's ``"standard"`` backend
  (``all_to_all_single``), which never calls them.
- torchtitan sets FSDP's gradient divide factor to 1.0, for which FSDP2
  reduce-scatters with ``PREMUL_SUM(1.0)``, an NCCL-only op: the threaded
  process group (like gloo) has only SUM and AVG
  (``multi_threaded_pg.ReduceScatter``).  :func:`force_sum_reduction` makes it
  SUM, the same sum (times 1.0) in another op.
- torchtitan's language-model attention backends are flex and varlen;
  ``apply_compile`` refuses a FlexAttention model with any compile backend but
  ``"inductor"`` and ``"aot_eager"`` (``_maybe_regional_inductor_backend``), and
  varlen needs CUDA.  :func:`use_sdpa` makes every layer's inner attention
  ``ScaledDotProductAttention`` (causal), as torchtitan's own graph_trainer
  tests do (``build_decoder_config_for_backend``).
- torchtitan's MoE switches ``torch.use_deterministic_algorithms``, a flag of the
  whole process, on and off around each combine; ranks that are threads would see
  one another's switch.  :func:`deterministic_algorithms` holds it on instead.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from support.pinned import require_pinned

TORCHTITAN_VERSION = "0.3.0"
INSTALL = "pip install --no-deps -r tests/clients/requirements.txt"

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


def require_torchtitan() -> None:
    """Fails in CI (which installs it), skips elsewhere, when torchtitan 0.3.0 is not installed."""
    require_pinned("torchtitan", TORCHTITAN_VERSION, INSTALL)


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


@contextlib.contextmanager
def torchtitan_on_cpu(spmd_backend: str = "partial_dtensor") -> Iterator[None]:
    """torchtitan imported and pointed at CPU; what it changed in torch undone after.

    Importing ``torchtitan.distributed.compile`` replaces ``FakeTensorMode.__init__``
    (wrapped in ``torch.compiler.disable``); torchtitan's device and SPMD backend
    are module globals of its own.  ``spmd_backend``: torchtitan's process-wide
    SPMD backend for the block (``"partial_dtensor"``: DTensor for the
    model-parallel axes; ``"spmd_types"``, torchtitan's default: plain local
    tensors and explicit collectives).  Skips (or fails in CI) without torchtitan.
    """
    require_torchtitan()
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_tensor_mode_init = FakeTensorMode.__init__
    _stand_in_for_ep_kernels()
    import torchtitan.distributed.compile  # noqa: F401 - replaces FakeTensorMode.__init__
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

    before = dist_utils.get_spmd_backend()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(parallel_dims, "device_type", "cpu")
            dist_utils.set_spmd_backend(spmd_backend)
            yield
    finally:
        dist_utils.set_spmd_backend(before)
        FakeTensorMode.__init__ = fake_tensor_mode_init


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the process, as it was after.

    torchtitan's MoE combines with ``deterministic_scatter_add``, which switches this
    process-wide flag on and back off around its scatter.  Ranks that are threads
    see one another's switch: a rank that compiles while another is inside it
    records the flag on, and a compiled backward run then refuses ("This compiled
    backward function is being run with torch.use_deterministic_algorithms(True), but
    it was previously generated during the forward function while
    torch.use_deterministic_algorithms(False) was set", or the reverse); an eager
    rank's ops may take their deterministic algorithms or not by chance.  Held on
    for every run, eager, compiled and single-process, the switch changes nothing.
    Ranks that are processes each have their own flag.
    """
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def use_sdpa(config: Any) -> Any:
    """Every layer's inner attention made ``ScaledDotProductAttention`` (see the module docstring)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def llama3_config(*, dim: int, n_heads: int, n_layers: int, hidden_dim: int, vocab_size: int, seq_len: int) -> Any:
    """A tiny Llama3 from torchtitan's own builders (as its ``debugmodel``, smaller), SDPA attention."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=hidden_dim,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq_len, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    return use_sdpa(config)


# The tiny Llama3 the DTensor client tests train (test_torchtitan, test_torchtitan_simple_fsdp,
# test_graph_trainer, tests/warm), its training settings and tolerance.
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


def tiny_llama3_config() -> Any:
    """The client tests' tiny Llama3 (:func:`llama3_config` with the sizes above)."""
    return llama3_config(
        dim=DIM, n_heads=NUM_HEADS, n_layers=NUM_LAYERS, hidden_dim=HIDDEN_DIM, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN
    )


def qwen3_dense_config(
    *, dim: int, n_heads: int, n_kv_heads: int, n_layers: int, hidden_dim: int, vocab_size: int, seq_len: int
) -> Any:
    """A tiny dense Qwen3 from torchtitan's own builders (grouped-query attention, q/k norms), SDPA attention."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    head_dim = dim // n_heads
    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            hidden_dim=hidden_dim,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1000000.0),
        ),
    )
    return use_sdpa(config)


def parallelize(
    parallelize_fn: Callable[..., torch.nn.Module],
    model: torch.nn.Module,
    parallel_dims: Any,
    parallelism: Any,
    compile_config: Any,
) -> torch.nn.Module:
    """torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` as its trainer calls them:
    float32 parameters, no activation checkpointing (every block compiled through
    ``apply_compile`` when ``compile_config.enable``)."""
    from torchtitan.config import TrainingConfig

    return parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=None,
        dump_folder="",
    )


def llama3_on_meta(config: Any, world_size: int, tensor_parallel_degree: int, spmd_backend: str = "partial_dtensor") -> tuple[Any, Any, Any]:
    """``(model on meta, parallel_dims, parallelism)``: torchtitan's Llama3 of ``config`` (its
    sharding config set, sequence parallel on) and its meshes for ``world_size`` ranks,
    tensor parallel over ``tensor_parallel_degree`` and FSDP over the rest."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(
        tensor_parallel_degree=tensor_parallel_degree, enable_sequence_parallel=True, spmd_backend=spmd_backend
    )
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    return model, parallel_dims, parallelism


def simple_fsdp(model: torch.nn.Module, parallel_dims: Any) -> torch.nn.Module:
    """graph_trainer's SimpleFSDP on a torchtitan model: torchtitan's tensor parallelism
    (``model.parallelize``) where the plan has it, then ``simple_fsdp.data_parallel``
    (``fully_shard`` on the ``fsdp`` mesh, float32), as graph_trainer's
    ``parallelize_llama`` does before compiling the whole model (that module imports
    graph_trainer's trainer stack, which needs ``torchdata``: the client requirements
    leave it out)."""
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return data_parallel(model, parallel_dims.get_mesh(["fsdp"]), "fully_shard", mp_policy=policy)


def load_simple_fsdp_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """:func:`load_weights` for a :func:`simple_fsdp` model: its parameters read as stored
    (not gathered) meanwhile, as graph_trainer initializes them."""
    from torchtitan.experiments.graph_trainer.simple_fsdp import disable_active_parametrization

    with disable_active_parametrization():
        load_weights(model, weights)


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with torchtitan's default hyperparameters (``default_adamw``), at ``lr``."""
    from torchtitan.components.optimizer import default_adamw

    (group,) = default_adamw(lr=lr).param_groups
    return torch.optim.AdamW(model.parameters(), foreach=True, **group.optimizer_kwargs)


# Per step, the global batch: token ids and next-token labels.
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def global_batches(num_steps: int, vocab_size: int, seq_len: int, batch_size: int) -> Batches:
    """Token ids and next-token labels of each step's global batch."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(num_steps):
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def initial_weights(config: Any) -> dict[str, torch.Tensor]:
    """The unsharded parameters every run starts from: torchtitan's own init of ``config``'s model, seeded."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def force_sum_reduction(model: torch.nn.Module) -> None:
    """FSDP reduce-scatters with SUM, not ``PREMUL_SUM(1.0)`` (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Materializes a parallelized meta model on CPU: buffers by torchtitan's init, each parameter ``weights``' shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states()  # the buffers (RoPE, MoE counters); the parameters are set next
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), f"{name} is not sharded"
            shard = distribute_tensor(weights[name], param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())


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
    records: list[Any] | None = None
    """Compiled runs: the backend's records (:class:`dtcompile.CompiledGraph`)."""


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (``full_tensor()`` of a DTensor)."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def collective_text(c: Any) -> str:
    """``all_to_all[ep] x2 32 B``: op, mesh axis, group size, bytes per rank (or ``data-dependent``)."""
    return f"{c.op}[{c.axis}] x{c.group_size} {c.bytes_text}"


def train(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optim: torch.optim.Optimizer,
    batches: Batches,
    *,
    num_slices: int,
    data_parallel_rank: int,
    clip_grad_norm: Callable[[list[torch.nn.Parameter]], torch.Tensor],
    counter: Any = None,
    prepare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Run:
    """torchtitan's training steps on one rank, which reads slice ``data_parallel_rank`` of ``num_slices`` of each batch.

    ``counter`` (a ``CompileCounterWithBackend``) when compiled: its frame count is recorded after each step.
    ``prepare``: what the trainer does to this rank's tokens and labels before the model
    (``post_dataloading_process``: on the spmd_types path, ``annotate_input_spmd_types``).
    """
    run = Run([], [], [], [] if counter is not None else None)
    for tokens, labels in batches:
        global_valid_tokens = torch.tensor(labels.numel())
        tokens, labels = tokens.chunk(num_slices)[data_parallel_rank], labels.chunk(num_slices)[data_parallel_rank]
        if prepare is not None:
            tokens, labels = prepare(tokens, labels)
        loss, _ = loss_fn(model(tokens), labels, global_valid_tokens)
        loss.backward()
        run.losses.append(loss.detach().clone())
        run.grads.append({name: whole(p.grad) for name, p in model.named_parameters()})
        run.grad_norms.append(whole(clip_grad_norm(list(model.parameters()))))
        optim.step()
        optim.zero_grad()
        if counter is not None:
            run.num_frames.append(counter.frame_count)
    return run


def train_reference(config: Any, weights: dict[str, torch.Tensor], batches: Batches, num_slices: int, lr: float, max_norm: float) -> list[Run]:
    """The unsharded model of ``config`` from ``weights`` on the whole global batch (losses split as
    ``num_slices`` data parallel ranks see them), with torchtitan's loss, clipping and AdamW."""
    from torchtitan.components.loss import CrossEntropyLoss

    model = config.build()
    model.init_states()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return train_single_process(
        model,
        CrossEntropyLoss(CrossEntropyLoss.Config()),
        optimizer(model, lr),
        batches,
        num_slices=num_slices,
        clip_grad_norm=lambda params: torch.nn.utils.clip_grad_norm_(params, max_norm),
    )


def train_single_process(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optim: torch.optim.Optimizer,
    batches: Batches,
    *,
    num_slices: int,
    clip_grad_norm: Callable[[list[torch.nn.Parameter]], torch.Tensor],
    slices_per_call: int = 1,
) -> list[Run]:
    """The unsharded model on the whole global batch; losses split as the ``num_slices`` data parallel ranks see them.

    The model is called on ``slices_per_call`` consecutive slices at a time (the
    loss still per slice): the tokens that one call's matmuls see together.
    """
    runs = [Run([], [], []) for _ in range(num_slices)]
    for tokens, labels in batches:
        global_valid_tokens = torch.tensor(labels.numel())
        losses = []
        for t, y in zip(tokens.chunk(num_slices // slices_per_call), labels.chunk(num_slices // slices_per_call)):
            logits = model(t)
            slices = zip(logits.chunk(slices_per_call), y.chunk(slices_per_call))
            losses += [loss_fn(part, part_labels, global_valid_tokens)[0] for part, part_labels in slices]
        sum(losses).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        grad_norm = clip_grad_norm(list(model.parameters()))
        for run, loss in zip(runs, losses):
            run.losses.append(loss.detach().clone())
            run.grads.append(grads)
            run.grad_norms.append(grad_norm.detach().clone())
        optim.step()
        optim.zero_grad()
    return runs


def mismatches(
    got: Run,
    want: Run,
    what: str,
    grad_tol: Callable[[str], dict[str, float] | None] = lambda name: None,
    **tol: float,
) -> list[str]:
    """Each step's loss, gradient norm and gradients of ``got`` that are not close to ``want``'s, one line each.

    ``grad_tol(name)``: the tolerance of parameter ``name``'s gradient where it is not ``tol``.
    """
    problems = []

    def compare(name: str, g: torch.Tensor, w: torch.Tensor, tol: dict[str, float] = tol) -> None:
        try:
            torch.testing.assert_close(g, w, **tol)
        except AssertionError as err:
            detail = " ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
            problems.append(f"{what}, {name}: {detail}")

    assert len(got.losses) == len(want.losses), what
    for step in range(len(want.losses)):
        compare(f"step {step} loss", got.losses[step], want.losses[step])
        compare(f"step {step} grad norm", got.grad_norms[step], want.grad_norms[step])
        assert got.grads[step].keys() == want.grads[step].keys(), what
        for name, grad in got.grads[step].items():
            compare(f"step {step} grad of {name}", grad, want.grads[step][name], grad_tol(name) or tol)
    return problems


def check_runs(compiled: list[Run], eager: list[Run], one_process: list[Run], tensor_parallel_degree: int, **tol: float) -> None:
    """Every rank's compiled run equals its eager run, and its eager run the single-process
    run of its data parallel slice (``one_process[rank // tensor_parallel_degree]``)."""
    problems = []
    for rank in range(len(compiled)):
        problems += mismatches(compiled[rank], eager[rank], f"rank {rank} compiled vs eager", **tol)
        want = one_process[rank // tensor_parallel_degree]
        problems += mismatches(eager[rank], want, f"rank {rank} eager vs one process", **tol)
    raise_mismatches(problems)


def raise_mismatches(problems: list[str]) -> None:
    """Fails with the first 20 of ``problems``, if any."""
    if problems:
        raise AssertionError(f"{len(problems)} mismatch(es):\n" + "\n".join(problems[:20]))
