"""The model's forward as aten ops on fake tensors: what the solver places.

:func:`trace_forward` runs the model once under ``make_fx`` on fake tensors
(``FakeTensorMode``: shapes and dtypes, no memory, so an 8B model traces on a
laptop; parameters on the ``meta`` device work too) with its parameters,
buffers and inputs as the graph's placeholders.  The ops are the aten ops
DTensor dispatches on (``linear`` is ``t`` + ``addmm``), each node keeps the
module it was called from (``nn_module_stack``), which is how repeated layers
are recognised (:mod:`dtcompile.auto_parallel.tying`).  A ``local_map`` region
stays one node (:mod:`dtcompile.auto_parallel.regions`).  An op DTensor has no
strategy for but that has a registered decomposition is traced as that
decomposition (``decompose``; the trace is repeated until no such op is left),
and each of its nodes remembers the op it came from (``decomposed``).

Only the forward is traced: the backward of each op is measured under each of
its strategies (:mod:`dtcompile.auto_parallel.measure`), because the model that
comes out is run by autograd over DTensor ops, and there the forward's choice
fixes what the backward does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from dtcompile.auto_parallel.regions import tracing_regions
from dtcompile.base.channels import Meta

__all__ = ["TracedModel", "source_line", "trace_forward"]


@dataclass
class TracedModel:
    gm: fx.GraphModule
    """The forward, one aten op per node; placeholders: parameters, buffers, inputs."""
    params: list[tuple[str, fx.Node]]
    """Parameter name -> its placeholder, in ``named_parameters`` order."""
    buffers: list[tuple[str, fx.Node]]
    inputs: list[fx.Node]
    """The flattened example inputs' placeholders."""
    input_spec: Any
    """The pytree spec of the example inputs (a tuple of positional arguments)."""
    output_spec: Any
    """The pytree spec of the model's output."""
    fake_mode: Any
    regions: dict[int, Any]
    """Region index -> its :class:`~dtcompile.auto_parallel.regions.Region` (``local_map`` functions)."""
    requires_grad: dict[str, bool]
    """Placeholder name -> whether that parameter or input requires grad."""
    module_of: dict[str, str]
    """Node name -> the innermost submodule (its path) whose call produced it."""
    decomposed: dict[str, str]
    """Node name -> the op (``aten.glu``) whose decomposition it is part of (traced so: DTensor has no strategy for it)."""


# Frames of torch and of dtcompile itself: not the model's code.
def _fake(fake_mode: Any, value: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    with fake_mode:
        return torch.empty_strided(
            tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=device, requires_grad=requires_grad
        )


def trace_forward(
    model: nn.Module, example_inputs: Sequence[Any], device: str, decompose: Callable[[Any], Any] | None = None
) -> TracedModel:
    """Trace ``model(*example_inputs)`` on fake tensors on ``device`` (the mesh's device type);
    an op for which ``decompose(op)`` gives a function is traced as that function."""
    table: dict[Any, Any] = {}
    for _ in range(8):  # a decomposition may call ops that need one in turn
        try:
            traced = _trace(model, example_inputs, device, table)
        except Exception as error:
            if str(error).startswith("auto_parallel:"):  # (a region's own message)
                raise
            raise ValueError(_trace_failure(error)) from error
        more = {} if decompose is None else {
            n.target: fn for n in traced.gm.graph.nodes
            if n.op == "call_function" and n.target not in table and (fn := decompose(n.target)) is not None
        }
        if not more:
            traced.gm.meta[Meta.AUTOPARALLEL_RESTACK] = lambda: _stacks_from(_trace(model, example_inputs, device, table, stacks=True), traced)
            return traced
        table.update(more)
    raise ValueError(f"auto_parallel: decomposing {sorted(map(str, table))} does not end; please report this")


# Where torch keeps the fake (meta) kernels of its ops.
_FAKE_KERNELS = ("_meta_registrations.py", os.path.join("_refs", ""), os.path.join("_prims", ""))


def _trace_failure(error: Exception) -> str:
    """The message of a trace that failed inside torch: the op the model called, its line in
    the model's code, torch's own message and, where the op's fake kernel refused the inputs
    (torch 2.14's ``aten._grouped_mm`` refuses float32, which its CPU kernel runs), what that means."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from dtcompile.base.notation import is_library_file, source_of_traceback

    op, fake_kernel, user = None, False, False
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        called = tb.tb_frame.f_locals.get("self") if code.co_name == "__call__" else None
        if not is_library_file(code.co_filename):
            op, fake_kernel, user = None, False, True  # the op is the one the innermost user frame called
        elif user and op is None and isinstance(called, torch._ops.OpOverload):
            op = called
        fake_kernel |= op is not None and any(part in code.co_filename for part in _FAKE_KERNELS)
        tb = tb.tb_next
    where = f" in {op}" if op is not None else ""
    message = (
        f"auto_parallel: tracing the model on fake tensors failed{where}{source_of_traceback(error.__traceback__)}: "
        f"{type(error).__name__}: {str(error).rstrip('.')}"
    )
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        message += (
            ". The planner traces the model on fake tensors, which hold no values: a branch on a tensor's values "
            "(or an output whose shape depends on them) cannot be traced; make it depend on shapes or arguments, "
            "or keep that code out of the planned module"
        )
    elif fake_kernel:
        message += (
            f". The planner runs the model on fake tensors, and DTensor propagates every op it shards the same way: "
            f"{op}'s fake kernel on this torch ({torch.__version__}) refuses these inputs, so the model cannot be "
            "planned or run as DTensors as it is; give the op inputs the message accepts (a dtype, a shape), or use "
            "a torch release whose kernel takes them"
        )
    return message


def _stacks_from(again: TracedModel, traced: TracedModel) -> None:
    """Copy the stack traces of ``again`` (the same trace, made with them) into ``traced``'s nodes."""
    stacks = {n.name: n.meta.get("stack_trace") for n in again.gm.graph.nodes}
    for node in traced.gm.graph.nodes:
        if stacks.get(node.name):
            node.meta["stack_trace"] = stacks[node.name]


def source_line(node: fx.Node | None) -> str:
    """:func:`~dtcompile.base.notation.source_of` a node of a traced model: the model is traced
    without stack traces (a third of the trace's time on a large model), and again with them
    the first time a message needs one."""
    from dtcompile.base.notation import source_of

    if node is not None and not node.meta.get("stack_trace"):
        owner = node.graph.owning_module
        restack = owner.meta.pop(Meta.AUTOPARALLEL_RESTACK, None) if owner is not None else None
        if restack is not None:
            restack()
    return source_of(node)


def _drop_restrides(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    """Removes each ``as_strided_`` that changes nothing but the strides of dims of size 1, which
    no layout reads: ATen's ``adaptive_avg_pool2d`` to one element, a mean over the last two
    dims, gives its output channels-last strides so (``AdaptiveAvgPool1d(1)`` over a transposed
    input: Swin's pooler).  DTensor has no strategy for ``as_strided_`` (the parallel model could
    not run it), and this one computes nothing.  Its input's strides are read as they are just
    before it runs (the trace's fake tensors hold them as they were after it)."""
    restrides = {n for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided_.default}
    if not restrides:
        return
    nothing: list[fx.Node] = []

    class Before(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n in restrides:
                x, size, stride = self.env[n.args[0]], n.args[1], n.args[2]
                offset = n.args[3] if len(n.args) > 3 else None
                if (
                    tuple(x.shape) == tuple(size) and offset in (None, x.storage_offset())
                    and all(d == 1 or a == b for d, a, b in zip(size, x.stride(), stride))
                ):
                    nothing.append(n)
            return super().run_node(n)

    Before(gm).run(*args)
    for node in nothing:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


def _trace(model: nn.Module, example_inputs: Sequence[Any], device: str, table: dict[Any, Any],
           stacks: bool = False) -> TracedModel:
    import torch.fx.traceback as fx_traceback
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    flat_inputs, input_spec = pytree.tree_flatten(tuple(example_inputs))
    fake_params = [_fake(fake_mode, p, device, p.requires_grad) for _, p in params]
    fake_buffers = [_fake(fake_mode, b, device, False) for _, b in buffers]
    fake_inputs = [
        _fake(fake_mode, x, device, x.requires_grad) if isinstance(x, torch.Tensor) else x for x in flat_inputs
    ]
    names = [n for n, _ in params] + [n for n, _ in buffers]
    num_states = len(names)
    out_spec: list[Any] = []

    def forward(*flat: Any) -> list[Any]:
        states = dict(zip(names, flat[:num_states]))
        args = pytree.tree_unflatten(list(flat[num_states:]), input_spec)
        out = functional_call(model, states, args)
        leaves, spec = pytree.tree_flatten(out)
        out_spec.append(spec)
        return leaves

    # Which module made each node: hooks note the graph's length as each submodule
    # call starts and ends (make_fx's own module stack is not kept through functional_call).
    spans: list[tuple[str, int, int]] = []
    starts: list[int] = []

    def graph_len() -> int:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    handles = []
    for path, module in model.named_modules():
        if not path:
            continue
        handles.append(module.register_forward_pre_hook(lambda *_: starts.append(graph_len())))
        handles.append(module.register_forward_hook(lambda *_, path=path: spans.append((path, starts.pop(), graph_len()))))
    try:
        # Kept node meta records each node's ``original_aten``: the op a decomposition came from.
        # A lazy graph module writes its Python code only if it is run or read: the planner reads
        # the graph alone (code written twice for a 2,300-node graph: a tenth of the trace).
        with tracing_regions(model) as regions, fake_mode, fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True):
            gm = make_fx(
                forward, tracing_mode="real", decomposition_table=table or None, record_stack_traces=stacks
            )(*fake_params, *fake_buffers, *fake_inputs)
    finally:
        for handle in handles:
            handle.remove()
    with fake_mode:
        _drop_restrides(gm, [*fake_params, *fake_buffers, *fake_inputs])
    all_nodes = list(gm.graph.nodes)
    module_of: dict[str, str] = {}
    # Outer calls end after inner ones: assign outer first, inner ones overwrite.
    for path, start, end in sorted(spans, key=lambda s: (s[1], -s[2])):
        for node in all_nodes[start:end]:
            module_of[node.name] = path
    gm.graph.eliminate_dead_code()
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_nodes = list(zip([n for n, _ in params], placeholders[: len(params)]))
    buffer_nodes = list(zip([n for n, _ in buffers], placeholders[len(params) : num_states]))
    flags = [p.requires_grad for _, p in params] + [False] * len(buffers)
    flags += [isinstance(x, torch.Tensor) and x.requires_grad for x in flat_inputs]
    requires_grad = {node.name: flag for node, flag in zip(placeholders, flags)}
    # Node meta holds a copy of the op (copy.copy): compared by name.
    names = {str(op): f"{op.namespace}.{op._opname}" for op in table}
    decomposed = {
        n.name: names[str(n.meta["original_aten"])] for n in gm.graph.nodes if str(n.meta.get("original_aten")) in names
    }
    return TracedModel(
        gm, param_nodes, buffer_nodes, placeholders[num_states:], input_spec, out_spec[0], fake_mode,
        regions, requires_grad, module_of, decomposed,
    )
