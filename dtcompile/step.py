"""The whole training step as one graph: :func:`compile_step`.

``torch.compile`` breaks its graph at ``loss.backward()``; :func:`compile_step`
traces forward, loss and backward (and, given an optimizer, its ``step()``) as one
graph of plain tensors and functional collectives, the way torchtitan
``graph_trainer``'s tracer does, runs dtcompile's passes on it
(:class:`~dtcompile.pipeline.step_pass.StepPass`: placements, costs, bucketing, overlap,
memory, the ranks' check, the report's artifacts) and runs it::

    step = dtcompile.compile_step(lambda x, y: F.cross_entropy(model(x), y), model=model)
    loss = step(x, y)            # the gradients are in .grad, accumulated, as after loss.backward()

    step = dtcompile.compile_step(loss_fn, model=model, optimizer=opt)
    loss = step(x, y)            # the optimizer's step ran in the same graph

How it traces:

- the model's parameters and buffers and the optimizer's state
  (``optimizer.state_dict()``) are the graph's inputs, read from the live objects at
  every call, so the graph updates them in place as eager code would;
- DTensors (parameters, state, arguments) enter the graph as their local tensors
  and are rewrapped inside it, so DTensor's own dispatch writes the collectives;
- shapes are static; a call whose arguments differ in shape, dtype, placements or
  any non-tensor value, or whose optimizer hyperparameters (a float ``lr`` a
  scheduler changed) differ, traces again (logged), never reusing a graph that
  baked in other values;
- an optimizer's state must exist before its step can be traced (AdamW creates it
  on its first ``step()``): a first call that finds none runs the step eagerly and
  traces from the next call;
- with an optimizer the gradients are consumed in the graph and not kept
  (``.grad`` stays None); parameters that already hold a ``.grad`` are refused, since
  the graph would ignore it.

What it cannot trace it refuses, naming what to use instead: FSDP2's
``fully_shard`` (its hooks run outside autograd's graph: use SimpleFSDP-style data
parallelism, torchtitan's ``graph_trainer.simple_fsdp.data_parallel``), parameter
hooks that fire on accumulation, and control flow that depends on tensor values.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx import traceback as fx_traceback

from dtcompile.base.channels import Meta
from dtcompile.base.scoped_patch import fx_tracing
from dtcompile.base.torch_compat import deferred_full_gc
from dtcompile.config import DTCompileConfig
from dtcompile.pipeline.stack_traces import StackTraces
from dtcompile.pipeline.step_pass import StepPass, TracedStep
from dtcompile.pipeline.step_reads import one_step_read, reads_steps_once, step_counts
from dtcompile.records import CompiledGraph, Stage

__all__ = ["CompiledStep", "StepNotTraceable", "compile_step"]

log = logging.getLogger(__name__)


class StepNotTraceable(RuntimeError):
    """:func:`compile_step` cannot trace this step as one graph; the message says why and what to use."""


def compile_step(
    loss_fn: Callable[..., torch.Tensor],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> CompiledStep:
    """The training step of ``loss_fn`` as one compiled graph (see the module doc).

    ``loss_fn(*args, **kwargs)`` computes a scalar loss with ``model``; the returned
    :class:`CompiledStep` takes the same arguments and returns the loss (detached:
    its backward ran in the graph).  Without ``optimizer`` the gradients are left in
    ``.grad`` as ``loss.backward()`` leaves them (added to any already there); with
    one, its ``step()`` runs in the same graph.  ``options``: dtcompile's options
    (:class:`~dtcompile.config.DTCompileConfig`), validated now."""
    if not callable(loss_fn):
        raise TypeError(f"compile_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_step: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"compile_step: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    _refuse_untraceable(model)
    return CompiledStep(loss_fn, model, optimizer, DTCompileConfig.from_options(dict(options)), options)


def _refuse_untraceable(model: nn.Module) -> None:
    """What :func:`compile_step` cannot trace, refused with what to use instead."""
    for name, module in model.named_modules():
        if any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__):
            where = f"module {name!r}" if name else "the model"
            raise StepNotTraceable(
                f"compile_step: {where} is wrapped by FSDP2's fully_shard, whose all-gathers and "
                "reduce-scatters run in module and autograd hooks outside the traced graph. Use "
                "SimpleFSDP-style data parallelism instead (torchtitan's "
                "graph_trainer.simple_fsdp.data_parallel: parameters stored as Shard(0) DTensors and "
                "gathered in forward), or torch.compile the blocks with backend='dtcompile'."
            )
    for name, param in model.named_parameters():
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise StepNotTraceable(
                f"compile_step: parameter {name!r} has a post-accumulate-grad hook, which the traced "
                "step would not run (it computes gradients with torch.autograd.grad). Remove the hook, "
                "or do its work in loss_fn or after the step."
            )


# ---------------------------------------------------------------------------
# Tensor subclasses (DTensor) in and out of the graph as their plain tensors.


@dataclass(frozen=True)
class _Layout:
    """How to rebuild one traceable wrapper subclass from its plain tensors."""

    cls: type
    attrs: tuple[str, ...]
    ctx: Any
    inner: tuple[_Layout | None, ...]
    constants: tuple[tuple[str, Any], ...]
    """Inner attributes that are not tensors (DTensor's device mesh): kept, not graph inputs."""
    size: torch.Size
    stride: tuple[int, ...]
    count: int


def _flatten_subclass(t: Any) -> tuple[list[Any], _Layout | None]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not (isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)):
        return [t], None
    attrs, ctx = t.__tensor_flatten__()
    plain: list[Any] = []
    inner, tensors, constants = [], [], []
    for attr in attrs:
        value = getattr(t, attr)
        if not isinstance(value, torch.Tensor):
            constants.append((attr, value))
            continue
        flat, layout = _flatten_subclass(value)
        plain.extend(flat)
        tensors.append(attr)
        inner.append(layout)
    return plain, _Layout(type(t), tuple(tensors), ctx, tuple(inner), tuple(constants), t.size(), t.stride(), len(plain))


def _rebuild(plain: Sequence[Any], layout: _Layout) -> torch.Tensor:
    values, at = dict(layout.constants), 0
    for attr, inner in zip(layout.attrs, layout.inner):
        count = 1 if inner is None else inner.count
        values[attr] = plain[at] if inner is None else _rebuild(plain[at:at + count], inner)
        at += count
    return layout.cls.__tensor_unflatten__(values, layout.ctx, layout.size, layout.stride)


def _unwrap_all(values: Sequence[Any]) -> tuple[list[Any], list[_Layout | None]]:
    flat: list[Any] = []
    layouts: list[_Layout | None] = []
    for value in values:
        plain, layout = _flatten_subclass(value)
        flat.extend(plain)
        layouts.append(layout)
    return flat, layouts


def _wrap_all(flat: Sequence[Any], layouts: Sequence[_Layout | None]) -> list[Any]:
    parts = _split(flat, layouts)
    return [part[0] if layout is None else _rebuild(part, layout) for part, layout in zip(parts, layouts)]


def _split(flat: Sequence[Any], layouts: Sequence[_Layout | None]) -> Iterator[Sequence[Any]]:
    """``flat`` cut into each value's plain tensors (one for a plain tensor)."""
    at = 0
    for layout in layouts:
        count = 1 if layout is None else layout.count
        yield flat[at:at + count]
        at += count


def _signature(value: Any, layout: _Layout | None, plain: Sequence[torch.Tensor]) -> Any:
    """What a graph traced for tensor ``value`` baked in: its type, shape, dtype, device,
    whether it requires grad and, a subclass (``layout``, its ``plain`` tensors), its layout."""
    described = (type(value).__name__, tuple(value.shape), value.dtype, str(value.device), value.requires_grad)
    if layout is not None:
        described += (
            repr(layout.ctx),
            tuple(id(constant) for _, constant in layout.constants),
            tuple((tuple(t.shape), tuple(t.stride())) for t in plain),
        )
    return described


# ---------------------------------------------------------------------------
# The step.


@dataclass
class _Traced:
    """One traced step graph and what running it needs."""

    gm: fx.GraphModule
    out_layouts: list[_Layout | None]
    out_spec: Any
    shared_step_reads: int = 0
    """The optimizer's step-count reads that took the first parameter's (:mod:`dtcompile.pipeline.step_reads`)."""


class CompiledStep:
    """A training step traced and compiled as one graph (made by :func:`compile_step`)."""

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: DTCompileConfig,
        options: dict[str, Any],
    ) -> None:
        self.loss_fn = loss_fn
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.step_pass = StepPass(options, _meshes_of(model))
        self._graphs: dict[Any, _Traced] = {}
        self.traces = 0
        """How many step graphs were traced (a new shape, placement or hyperparameter traces again)."""
        self.eager_steps = 0
        """Calls run eagerly (an optimizer's first step, which creates its state)."""
        self.shared_step_reads = 0
        """In the graph the last call ran: how many reads of the optimizer's step counts took the
        first read's value (:mod:`dtcompile.pipeline.step_reads`; one a parameter for a for-loop
        update, two for a foreach one; 0 where each read its own)."""

    def __repr__(self) -> str:
        with_optimizer = f", optimizer={type(self.optimizer).__name__}" if self.optimizer is not None else ""
        return f"CompiledStep({getattr(self.loss_fn, '__name__', 'loss_fn')}{with_optimizer}, {self.config})"

    @property
    def records(self) -> list[CompiledGraph]:
        """One :class:`~dtcompile.records.CompiledGraph` per traced step graph, oldest first."""
        return self.step_pass.records

    def explain(self) -> str:
        """Every traced step graph as dtcompile describes a graph: each node with the part
        of the step (forward, backward, optimizer) and the code it comes from, each
        collective with its mesh axis, bytes and estimated time, what every pass did and
        why, the estimated memory and the simulated timeline; then each one's compile
        seconds per stage (its trace, the passes, Inductor...)."""
        from dtcompile.artifacts import compile_seconds_table, format_compiled_graph

        if not self.records:
            return "compile_step: no step graph traced yet (call the step first)"
        sections = [format_compiled_graph(record) for record in self.records]
        return "\n\n".join([*sections, "\n".join(["== compile seconds ==", *compile_seconds_table(self.records)])])

    @property
    def graph(self) -> fx.GraphModule | None:
        """The step graph the last call ran (after dtcompile's passes), None before one was traced."""
        return self.step_pass.records[-1].graph if self.step_pass.records else None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.optimizer is not None and not _state_ready(self.optimizer):
            return self._eager_step(args, kwargs)
        self._refuse_held_grads()
        state = self._state()
        state_leaves, state_spec = pytree.tree_flatten(state)
        user_flat, user_spec = pytree.tree_flatten((args, kwargs))
        # The graph's inputs: the state's tensors, then the arguments', subclasses unwrapped, once a call.
        tensors = [v for v in [*state_leaves, *user_flat] if isinstance(v, torch.Tensor)]
        flat, layouts = _unwrap_all(tensors)
        # Whether the optimizer's step counts are read once (dtcompile.pipeline.step_reads):
        # a graph traced so holds only while every parameter's count is the same.
        shared = reads_steps_once(self.optimizer)
        key = (
            shared,
            state_spec,
            user_spec,
            tuple((type(v).__name__, repr(v)) for v in [*state_leaves, *user_flat] if not isinstance(v, torch.Tensor)),
            tuple(_signature(t, layout, plain) for t, layout, plain in zip(tensors, layouts, _split(flat, layouts))),
        )
        traced = self._graphs.get(key)
        if traced is None:
            with deferred_full_gc():  # as torch's own compile: see the function
                traced = self._trace(state_leaves, state_spec, user_flat, user_spec, flat, layouts, shared)
            self._graphs[key] = traced
        self.shared_step_reads = traced.shared_step_reads
        with torch.no_grad():
            outputs = traced.gm(*flat)
        loss, grads = pytree.tree_unflatten(_wrap_all(outputs, traced.out_layouts), traced.out_spec)
        if self.optimizer is None:
            self._accumulate(grads)
        return loss

    # -- state ----------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        model_state = {**dict(self.model.named_parameters(remove_duplicate=False)),
                       **dict(self.model.named_buffers(remove_duplicate=False))}
        optim_state = self.optimizer.state_dict() if self.optimizer is not None else {}
        return {"model": model_state, "optim": optim_state}

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _refuse_held_grads(self) -> None:
        if self.optimizer is None:
            return
        held = [name for name, p in self._trainable() if p.grad is not None]
        if held:
            raise ValueError(
                f"compile_step: parameter {held[0]!r} (and {len(held) - 1} more) holds a .grad, which the "
                "step graph with the optimizer inside would ignore (it consumes the gradients it computes). "
                "Call optimizer.zero_grad(set_to_none=True) before the step, or compile the step without "
                "the optimizer to accumulate gradients."
            )

    def _eager_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The optimizer has no state yet: this step runs eagerly and creates it."""
        assert self.optimizer is not None
        self._refuse_held_grads()
        log.info(
            "compile_step: %s has no state yet (it creates it on its first step): this step runs "
            "eagerly, the graph is traced from the next call", type(self.optimizer).__name__,
        )
        loss = self.loss_fn(*args, **kwargs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.eager_steps += 1
        self.shared_step_reads = 0
        return loss.detach()

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for (_, param), grad in zip(self._trainable(), grads, strict=True):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    # -- tracing --------------------------------------------------------------

    def _trace(
        self,
        state_leaves: list[Any],
        state_spec: Any,
        user_flat: list[Any],
        user_spec: Any,
        flat: list[torch.Tensor],
        in_layouts: list[_Layout | None],
        shared_steps: bool = False,
    ) -> _Traced:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

        state_at = [i for i, v in enumerate(state_leaves) if isinstance(v, torch.Tensor)]
        tensor_at = [i for i, v in enumerate(user_flat) if isinstance(v, torch.Tensor)]
        trainable = [name for name, _ in self._trainable()]
        out: dict[str, Any] = {}

        traces = StackTraces()

        def step(*plain: Any) -> list[Any]:
            with traces.recording(get_proxy_mode().tracer):
                return traced_step(*plain)

        def traced_step(*plain: Any) -> list[Any]:
            values = _wrap_all(plain, in_layouts)
            state_values = list(state_leaves)
            for i, value in zip(state_at, values):
                state_values[i] = value
            user_values = list(user_flat)
            for i, value in zip(tensor_at, values[len(state_at):]):
                user_values[i] = value
            traced_state = pytree.tree_unflatten(state_values, state_spec)
            args, kwargs = pytree.tree_unflatten(user_values, user_spec)
            with self._reparametrized(traced_state):
                loss = self.loss_fn(*args, **kwargs)
                _check_loss(loss, self.loss_fn)
                params = [traced_state["model"][name] for name in trainable]
                grads = list(torch.autograd.grad(loss, params, allow_unused=True))
                if self.optimizer is not None:
                    for param, grad in zip(params, grads):
                        param.grad = grad
                    counts = step_counts(traced_state["optim"].get("state", {})) if shared_steps else []
                    with (
                        fx_traceback.annotate({Meta.OPTIMIZER: type(self.optimizer).__name__}),
                        traces.off(),
                        one_step_read(counts) as read,
                    ):
                        self.optimizer.step()
                    out["shared_reads"] = read.shared if read is not None else 0
                    out["scalars_reused"] = read.scalars.reused if read is not None and read.scalars else 0
                    for param in params:
                        param.grad = None
                    grads = []
            result = (loss.detach(), grads)
            outputs, out["spec"] = pytree.tree_flatten(result)
            plain_out, out["layouts"] = _unwrap_all(outputs)
            return plain_out

        start = time.perf_counter()
        gm = _make_graph(make_fx, step, flat, self.loss_fn)
        trace_seconds = time.perf_counter() - start
        state = pytree.tree_unflatten(state_leaves, state_spec)
        self.traces += 1
        if self.traces > 1:
            log.info("compile_step: traced the step again (%d graphs): a new shape, placement or hyperparameter", self.traces)
        example = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        names = _input_names(state, tensor_at, in_layouts)
        record = self.step_pass.compile(
            TracedStep(gm, example, names, self.step_pass.meshes, trace_seconds), lowered_after=self.config.inductor
        )
        run = self._lower(record, example) if self.config.inductor else record.graph
        if out.get("shared_reads"):
            log.info("compile_step: %s's step counts read once, %d more reads given that value (every count equal); "
                     "%d scalar computations on it took one traced before",
                     type(self.optimizer).__name__, out["shared_reads"], out["scalars_reused"])
        return _Traced(run, out["layouts"], out["spec"], out.get("shared_reads", 0))

    def _lower(self, record: CompiledGraph, example: Sequence[Any]) -> Callable[..., Any]:
        """``record``'s step graph after the passes, through Inductor (``compile_fx``: AOTAutograd
        functionalizes its in-place updates, Inductor generates the code; its caches serve
        a restarted job).  Inductor leaves the collectives where dtcompile's passes put them
        when those moved any (as for the Dynamo path).  Its seconds are the record's
        :attr:`~dtcompile.records.Stage.INDUCTOR` stage, logged again with the others."""
        from torch._inductor.compile_fx import compile_fx

        from dtcompile.pipeline.graph_compile import schedule_owned_by_dtcompile

        patches = {**self.config.inductor_config, **schedule_owned_by_dtcompile(self.config, record.passes, record.graph.graph)}
        # Inputs as values: the graph already holds its backward; nothing here needs a gradient.
        inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example]
        start = time.perf_counter()
        compiled = compile_fx(record.graph, inputs, config_patches=patches)
        record.stages.add(Stage.INDUCTOR, time.perf_counter() - start)
        self.step_pass.log.finished(record)
        return compiled

    @contextlib.contextmanager
    def _reparametrized(self, traced_state: dict[str, Any]) -> Iterator[None]:
        from torch.nn.utils.stateless import _reparametrize_module

        with contextlib.ExitStack() as stack:
            if self.optimizer is not None:
                by_id = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
                # The optimizer's parameters by name, in its param_groups' flat order.
                names = [by_id.get(id(p)) for g in self.optimizer.param_groups for p in g["params"]]
                if None in names:
                    raise ValueError(
                        f"compile_step: the optimizer holds {names.count(None)} tensor(s) that are not parameters "
                        "of model (its param_groups must hold the model's own parameters)"
                    )
                if self.optimizer.state:
                    params = {name: traced_state["model"][name] for name in names}
                    stack.enter_context(
                        torch.optim.swap_in_optimizer_params_and_state(self.optimizer, params, traced_state["optim"])
                    )
                else:  # a stateless optimizer (plain SGD): only its parameters swapped in
                    stack.enter_context(_params_swapped(self.optimizer, [traced_state["model"][n] for n in names]))
            stack.enter_context(_reparametrize_module(self.model, traced_state["model"]))
            yield


@contextlib.contextmanager
def _params_swapped(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    """The optimizer's ``param_groups`` hold ``params`` (in their flat order) until exit."""
    kept = [group["params"] for group in optimizer.param_groups]
    at = 0
    for group in optimizer.param_groups:
        group["params"] = params[at:at + len(group["params"])]
        at += len(group["params"])
    try:
        yield
    finally:
        for group, own in zip(optimizer.param_groups, kept):
            group["params"] = own


def _input_names(state: dict[str, Any], tensor_at: Sequence[int], layouts: Sequence[_Layout | None]) -> list[str]:
    """The step graph's inputs' names: parameters and buffers by their FQN (a parametrized
    one by the name its module reads it by), the optimizer's state and the arguments by place."""
    from dtcompile.pipeline.reshard import module_fqn

    names = [module_fqn(name) for name, v in state["model"].items() if isinstance(v, torch.Tensor)]
    names += [f"optimizer state {i}" for i, v in enumerate(pytree.tree_leaves(state["optim"])) if isinstance(v, torch.Tensor)]
    names += [f"argument {i}" for i in tensor_at]
    flat_names = []
    for name, layout in zip(names, layouts, strict=True):
        flat_names += [name] * (1 if layout is None else layout.count)
    return flat_names


def _check_loss(loss: Any, loss_fn: Callable[..., Any]) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(
            f"compile_step: loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return a scalar loss "
            f"tensor, got {what} (reduce it, e.g. .mean(), inside loss_fn)"
        )


def _make_graph(make_fx: Any, step: Callable[..., Any], flat: list[Any], loss_fn: Callable[..., Any]) -> fx.GraphModule:
    """``step`` traced by ``make_fx`` on fake copies of ``flat`` (static shapes; values read
    from tensors become symbols, so a branch on one is refused)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
    from torch.fx.traceback import preserve_node_meta

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fake = [fake_mode.from_tensor(t, static_shapes=True) for t in flat]
    try:
        with (
            fx_tracing(),  # (ranks run as threads trace one at a time)
            # Its code generated once, when it first runs, after the passes (as Dynamo's graphs):
            # not here too, for a graph the passes rewrite.  Inside the lock: the flag is global.
            _use_lazy_graph_module(True),
            fake_mode,
            tracing(TracingContext(fake_mode)),
            preserve_node_meta(),
            torch.autograd.set_multithreading_enabled(False),
        ):
            return make_fx(step)(*fake)  # the stack traces: StackTraces, in step
    except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as exc:
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        raise StepNotTraceable(
            f"compile_step: the step of {name!r} depends on a tensor's value ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}), which one traced graph cannot hold. Move "
            "the value-dependent part (an .item(), a branch on a tensor, a data-dependent shape) out of "
            "loss_fn, use torch.cond for the branch, or torch.compile the model with backend='dtcompile'."
        ) from exc


def _state_ready(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter the optimizer steps has its state (stateless ones, plain SGD, always do)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and not optimizer.state.get(param) and _makes_state(optimizer, group):
                return False
    return True


def _makes_state(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``optimizer`` creates per-parameter state on its first step (SGD only with momentum)."""
    if isinstance(optimizer, torch.optim.SGD):
        return bool(group.get("momentum", 0))
    return True


def _meshes_of(model: nn.Module) -> list[Any]:
    """The device meshes of the model's DTensor parameters and buffers, each once."""
    from torch.distributed.tensor import DTensor

    meshes: list[Any] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if isinstance(tensor, DTensor) and all(tensor.device_mesh is not m for m in meshes):
            meshes.append(tensor.device_mesh)
    return meshes
