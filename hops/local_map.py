"""``local_map`` as a higher-order op: a user region on local shards, kept as one op.

A region is ``local_map_region(body, spec, *operands)``:

- ``body`` is a callable (a ``GraphModule`` once traced) that takes the local
  shards and returns a flat tuple of local tensors;
- ``spec`` is a :class:`RegionSpec`: the region's name, its mesh and its
  placements, written as short placement strings (``"S(0)R"``: ``Shard(0)`` on
  mesh axis 0, ``Replicate()`` on axis 1).  The placements are an argument of
  the op, so they travel with the node through every pass and cache, and print
  with the graph;
- ``operands`` are tensors: DTensors (checked against, or redistributed to, the
  declared input placements and handed to ``body`` as their local shards) or
  plain tensors (handed over as they are, as ``local_map`` does).

One implementation per dispatch key:

- Autograd: DTensor operands are unwrapped here (``to_local`` with the declared
  gradient placements, outputs wrapped with ``from_local``), so DTensor's own
  autograd handles the global/local boundary.  On plain tensors: outside
  :func:`keep_regions` the region is simply run (inlined into whatever traces
  it, which is what ``aot_eager`` and ``inductor`` get); inside it (the dtcompile
  backend), the region's forward and backward are traced and partitioned once,
  and the forward and the backward are each one ``local_map_region`` call, the
  backward's spec saying ``backward=True``.
- Functionalization: unwrap, run the functionalized body, wrap.
- FakeTensorMode: run the body on fake tensors.
- ProxyTorchDispatchMode: trace the body into a subgraph of the traced module
  and record one call node.
- CompositeExplicitAutograd (eager, real tensors): run the body.

:func:`local_map` is the user API: the signature and eager semantics of
``torch.distributed.tensor.experimental.local_map``, plus ``check_placements``
(run on all simulated ranks of a ``LocalTensorMode`` and verify that outputs
declared ``Replicate()`` agree across their mesh axis and ``Shard`` outputs have
consistent shapes).  Under ``torch.compile`` with dynamo_vars installed a call
becomes one region node (see :mod:`dynamo_vars.local_map`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._higher_order_ops.utils import (
    reenter_make_fx,
    register_fake,
    unique_graph_id,
)
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, track_tensor_tree

__all__ = [
    "LocalMapError",
    "RegionSpec",
    "format_placements",
    "keep_regions",
    "local_map",
    "local_map_region",
    "parse_placements",
    "regions_kept",
]


class LocalMapError(ValueError):
    """A ``local_map`` call whose arguments or results do not match its declared placements."""


# ---------------------------------------------------------------- placements as text

_PLACEMENT = re.compile(r"_S\((\d+),(\d+)\)|S\((\d+)\)|R|P\((\w+)\)")


def format_placements(placements: Sequence[Any] | None) -> str | None:
    """``(Shard(0), Replicate())`` -> ``"S(0)R"``; ``None`` stays ``None``.

    Raises :class:`LocalMapError` for a placement the text form cannot carry
    (only Shard, Replicate, Partial and _StridedShard can be region placements).
    """
    if placements is None:
        return None
    text = "".join(str(p).replace(" ", "") for p in placements)
    for p in placements:
        # By type as well as ``==``: a user Partial subclass equals Partial('sum').
        back = parse_placements(str(p).replace(" ", ""), strict=False)
        if (
            back is None
            or len(back) != 1
            or type(back[0]) is not type(p)
            or back[0] != p
        ):
            raise LocalMapError(
                f"local_map: placement {p!r} ({type(p).__name__}) cannot be a region placement; "
                "use Shard, Replicate, Partial or _StridedShard"
            )
    return text


@functools.lru_cache(maxsize=1024)
def parse_placements(text: str, strict: bool = True) -> tuple[Any, ...] | None:
    """The inverse of :func:`format_placements`: ``"S(0)R"`` -> ``(Shard(dim=0), Replicate())``."""
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    placements: list[Any] = []
    pos = 0
    while pos < len(text):
        m = _PLACEMENT.match(text, pos)
        if m is None:
            if strict:
                raise LocalMapError(
                    f"local_map: cannot read placements {text!r} at {text[pos:]!r}"
                )
            return None
        if m.group(1) is not None:
            placements.append(
                _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
            )
        elif m.group(3) is not None:
            placements.append(Shard(int(m.group(3))))
        elif m.group(4) is not None:
            placements.append(Partial(m.group(4)))
        else:
            placements.append(Replicate())
        pos = m.end()
    return tuple(placements)


class RegionSpec(NamedTuple):
    """What a region declares: one placement string (or ``None``) per operand and per output.

    A forward region's operands are its inputs; its outputs are the user's
    outputs followed by ``saved`` tensors kept for the backward (only in graphs
    the dtcompile backend traces).  A backward region (``backward=True``) takes
    the ``saved`` tensors, then the gradients of the outputs that need one
    (``in_placements`` are their placements), and returns the gradients of the
    inputs (``out_placements``: the declared ``in_grad_placements``).
    """

    name: str
    mesh: str
    in_placements: tuple[str | None, ...]
    out_placements: tuple[str | None, ...]
    in_grad_placements: tuple[str | None, ...]
    redistribute_inputs: bool = False
    backward: bool = False
    saved: int = 0

    def __str__(self) -> str:
        """The spec as the op's argument: ``mm on (tp=4): [S(0), R] -> [S(0)] | grads [S(0), R]``.

        ``-`` is an operand or output without placements (a plain tensor);
        ``saved k`` counts the values a forward region keeps for its backward.
        :meth:`parse` reads it back.
        """

        def side(ps: tuple[str | None, ...]) -> str:
            return "[" + ", ".join("-" if p is None else p for p in ps) + "]"

        text = (
            f"{self.name} on {self.mesh}: {side(self.in_placements)} -> {side(self.out_placements)}"
            f" | grads {side(self.in_grad_placements)}"
        )
        if self.saved:
            text += f" | saved {self.saved}"
        if self.backward:
            text += " | backward"
        if self.redistribute_inputs:
            text += " | redistribute"
        return text

    @staticmethod
    def parse(text: str) -> RegionSpec:
        return _parse_spec(text)


_SPEC = re.compile(
    r"^(?P<name>\w+) on (?P<mesh>\(.*\)): \[(?P<ins>[^\]]*)\] -> \[(?P<outs>[^\]]*)\]$"
)


@functools.lru_cache(maxsize=1024)
def _parse_spec(text: str) -> RegionSpec:
    head, *parts = text.split(" | ")
    m = _SPEC.match(head)
    if m is None or not parts or not parts[0].startswith("grads ["):
        raise LocalMapError(f"local_map: not a region spec: {text!r}")

    def side(items: str) -> tuple[str | None, ...]:
        return (
            tuple(None if item == "-" else item for item in items.split(", "))
            if items
            else ()
        )

    flags = set(parts[1:])
    saved = next((int(p.split()[1]) for p in parts[1:] if p.startswith("saved ")), 0)
    return RegionSpec(
        name=m["name"],
        mesh=m["mesh"],
        in_placements=side(m["ins"]),
        out_placements=side(m["outs"]),
        in_grad_placements=side(parts[0][len("grads [") : -1]),
        redistribute_inputs="redistribute" in flags,
        backward="backward" in flags,
        saved=saved,
    )


# ---------------------------------------------------------------- keeping regions


_state = threading.local()


@contextlib.contextmanager
def keep_regions(flag: bool = True) -> Iterator[None]:
    """Inside the block, traced regions (and their backward) stay ``local_map_region`` nodes.

    Outside it a region is inlined into whatever traces it, so any backend gets
    plain ops.  The dtcompile backend turns it on while AOTAutograd traces, and
    inlines the regions itself just before lowering.
    """
    with _swapped_state("keep", flag):
        yield


@contextlib.contextmanager
def _swapped_state(name: str, value: Any) -> Iterator[None]:
    """This thread's ``_state.<name>`` is ``value`` inside the block, and as it was after."""
    missing = object()
    before = getattr(_state, name, missing)
    setattr(_state, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(_state, name)
        else:
            setattr(_state, name, before)


def regions_kept() -> bool:
    return getattr(_state, "keep", False)


# ---------------------------------------------------------------- the op


class LocalMapRegion(HigherOrderOperator):
    """``local_map_region(body, spec, *operands) -> tuple of tensors``.

    ``spec`` is a :class:`RegionSpec` or its text; the op's argument is the text
    (a string survives every FX pass, pickle and cache key as it is).
    """

    def __init__(self) -> None:
        super().__init__("dtcompile_local_map")

    def __call__(
        self, body: Callable[..., Any], spec: RegionSpec | str, *operands: Any
    ) -> tuple[Any, ...]:
        return super().__call__(body, str(spec), *operands)


def _spec(spec: RegionSpec | str) -> RegionSpec:
    return spec if isinstance(spec, RegionSpec) else _parse_spec(spec)


local_map_region = LocalMapRegion()


def _call_body(body: Callable[..., Any], operands: Sequence[Any]) -> tuple[Any, ...]:
    out = body(*operands)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _dtensor_boundary(
    body: Callable[..., Any], spec: RegionSpec | str, operands: Sequence[Any]
) -> tuple[Any, ...]:
    """DTensor operands in, DTensor outputs out: the region itself runs on local shards."""
    spec = _spec(spec)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    mesh = None
    local = []
    for i, x in enumerate(operands):
        if not isinstance(x, DTensor):
            local.append(x)
            continue
        if mesh is None:
            mesh = x.device_mesh
        elif x.device_mesh != mesh:
            raise _other_mesh(spec.name, i, x.device_mesh, mesh)
        want = spec.in_placements[i]
        x = _to_placements(x, want, spec, i)
        grad = spec.in_grad_placements[i]
        y = x.to_local(
            grad_placements=parse_placements(grad) if grad is not None else None
        )
        if isinstance(y, AsyncCollectiveTensor):
            y = y.wait()
        local.append(y)
    outs = local_map_region(body, spec, *local)
    if mesh is None:
        return outs
    return _wrap_outputs(outs, spec, mesh)


def _wrap_outputs(outs: Sequence[Any], spec: RegionSpec, mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    if len(outs) != len(spec.out_placements):
        raise _output_count(spec.name, len(outs), len(spec.out_placements))
    for i, out in enumerate(outs):
        if isinstance(out, DTensor):
            raise LocalMapError(
                f"local_map {spec.name}: output {i} is a DTensor; the region must return local "
                "tensors (call .to_local() inside it, or return the tensor it was made from)"
            )
    check_output_kinds(
        spec.name, [isinstance(out, torch.Tensor) for out in outs], spec.out_placements
    )
    return tuple(
        out
        if p is None
        else DTensor.from_local(out, mesh, parse_placements(p), run_check=False)
        for out, p in zip(outs, spec.out_placements)
    )


def check_output_kinds(
    name: str, is_tensor: Sequence[bool], out_placements: Sequence[str | None]
) -> None:
    """Placements for every tensor output and ``None`` for every other one (eager and trace time)."""
    for i, (tensor, p) in enumerate(zip(is_tensor, out_placements)):
        if tensor and p is None:
            raise LocalMapError(
                f"local_map {name}: output {i} is a tensor but out_placements[{i}] is None; give its placements"
            )
        if not tensor and p is not None:
            raise LocalMapError(
                f"local_map {name}: output {i} is not a tensor but out_placements[{i}] is {p}; "
                "give None for non-tensor outputs"
            )


def _to_placements(x: Any, want: str | None, spec: RegionSpec, index: int) -> Any:
    if want is None:
        return x
    placements = parse_placements(want)
    if tuple(x.placements) == placements:
        return x
    if spec.redistribute_inputs:
        return x.redistribute(placements=placements)
    raise _mismatch(spec.name, index, format_placements(x.placements), want)


def _has_dtensor(operands: Sequence[Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(x, DTensor) for x in operands)


@local_map_region.py_impl(DispatchKey.Autograd)
def _autograd(
    body: Callable[..., Any], spec: RegionSpec | str, *operands: Any
) -> tuple[Any, ...]:
    spec = _spec(spec)
    if _has_dtensor(operands):
        return _dtensor_boundary(body, spec, operands)
    if not regions_kept() or _has_local_tensor(operands):
        # LocalTensor (simulated ranks) runs every op on all ranks at once, collectives
        # included: the region runs op by op, inlined, and only values are simulated.
        return _call_body(body, operands)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in operands
    )
    if not needs_grad:
        with torch._C._AutoDispatchBelowAutograd():
            return local_map_region(body, spec, *operands)
    return _RegionFunction.apply(body, spec, *operands)


@local_map_region.py_functionalize_impl
def _functionalize(
    ctx: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    unwrapped = ctx.unwrap_tensors(operands)
    with ctx.redispatch_to_next():
        out = local_map_region(ctx.functionalize(body), spec, *unwrapped)
    return ctx.wrap_tensors(out)


@register_fake(local_map_region, skip_cache=True)
def _fake(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return _call_body(body, operands)


@local_map_region.py_impl(ProxyTorchDispatchMode)
def _proxy(
    mode: ProxyTorchDispatchMode,
    body: Callable[..., Any],
    spec: RegionSpec | str,
    *operands: Any,
) -> tuple[Any, ...]:
    spec = _spec(spec)
    graph = reenter_make_fx(body)(*operands)
    _, name = unique_graph_id(
        mode, prefix="local_map_body" if not spec.backward else "local_map_backward"
    )
    mode.tracer.root.register_module(name, graph)
    with torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing():
        example = local_map_region(graph, spec, *operands)
    proxy_args = pytree.tree_map(
        mode.tracer.unwrap_proxy, (graph, str(spec), *operands)
    )
    out = mode.tracer.create_proxy(
        "call_function", local_map_region, proxy_args, {}, name=spec.name
    )
    seq_nr = getattr(_state, "forward_seq_nr", None)
    if seq_nr is not None and not spec.backward:
        # Pairs it with its backward region (AOTAutograd and dtcompile match nodes by it).
        out.node.meta["seq_nr"] = seq_nr
    return track_tensor_tree(example, out, constant=None, tracer=mode.tracer)


@local_map_region.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return _call_body(body, operands)


def _dtensor_key(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return _dtensor_boundary(body, spec, operands)


def _local_tensor_mode_key(
    mode: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    with mode:
        return _call_body(body, operands)


def _has_local_tensor(operands: Sequence[Any]) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed._local_tensor import LocalTensor

    return any(isinstance(x, LocalTensor) for x in operands)


def _register_subclass_keys() -> None:
    # Reached below autograd (``inference_mode``, or inside another op's forward).
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor

    local_map_region.py_impl(DTensor)(_dtensor_key)
    # LocalTensor runs every op on all ranks: the body runs as it is (see _autograd).
    local_map_region.py_impl(LocalTensor)(_eager)
    local_map_region.py_impl(LocalTensorMode)(_local_tensor_mode_key)


if torch.distributed.is_available():
    _register_subclass_keys()


# ---------------------------------------------------------------- forward and backward of a region


class _Joint(NamedTuple):
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    forward_spec: RegionSpec
    backward_spec: RegionSpec
    num_outputs: int
    grad_outputs: tuple[int, ...]
    """Indices of the outputs that get a gradient (the backward's tangents, in order)."""
    grad_inputs: tuple[int, ...]
    """Indices of the operands that get one (the backward returns these, in order)."""


def _joint_graphs(
    body: Callable[..., Any], spec: RegionSpec | str, operands: Sequence[Any]
) -> _Joint:
    """Traces the region's forward and backward together and partitions them.

    The forward returns the outputs and then what the backward saves; the backward
    takes the saved values and the outputs' gradients and returns the inputs'.
    """
    spec = _spec(spec)
    from torch._dispatch.python import suspend_functionalization
    from torch._functorch.partitioners import default_partition
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

    with (
        suspend_functionalization(),
        disable_functional_mode(),
        disable_proxy_modes_tracing(),
    ):
        fake_mode = detect_fake_mode(operands) or FakeTensorMode(
            allow_non_fake_inputs=True
        )
        with fake_mode, torch.enable_grad():
            # Non-tensor operands (the sizes Dynamo lifts under dynamic shapes) pass as they are.
            primals = [
                torch.empty_strided(
                    x.shape,
                    x.stride(),
                    dtype=x.dtype,
                    device=x.device,
                    requires_grad=x.requires_grad,
                )
                if isinstance(x, torch.Tensor)
                else x
                for x in operands
            ]
            outs = _call_body(body, primals)
        grad_inputs = tuple(
            i for i, x in enumerate(primals) if isinstance(x, torch.Tensor) and x.requires_grad
        )
        grad_outputs = tuple(
            i
            for i, y in enumerate(outs)
            if isinstance(y, torch.Tensor) and y.requires_grad
        )
        with fake_mode:
            tangents = [
                torch.empty_like(outs[i], requires_grad=False) for i in grad_outputs
            ]
            primals = [_detach(p) for p in primals]

        num_primals, num_outputs = len(primals), len(outs)

        def joint(*primals_and_tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
            inputs = primals_and_tangents[:num_primals]
            with torch.enable_grad():
                outs = _call_body(body, inputs)
                grads = torch.autograd.grad(
                    [outs[i] for i in grad_outputs],
                    [inputs[i] for i in grad_inputs],
                    list(primals_and_tangents[num_primals:]),
                    allow_unused=True,
                )
            grads = tuple(
                g if g is not None else torch.zeros_like(inputs[i])
                for g, i in zip(grads, grad_inputs)
            )
            return (*outs, *grads)

        # Traced with autograd (the region may hold ops, like funcol's collectives,
        # whose autograd formulas functorch cannot transform), then functionalized.
        with fake_mode:
            for i in grad_inputs:
                primals[i].requires_grad_(True)
            traced = make_fx(joint, decomposition_table=select_decomp_table())(
                *primals, *tangents
            )
            primals = [_detach(p) for p in primals]
            joint_gm = make_fx(
                torch.func.functionalize(traced, remove="mutations_and_views")
            )(*primals, *tangents)
        _prepare_for_partition(joint_gm, num_primals, num_outputs)
        forward, backward = default_partition(joint_gm, [], num_fwd_outputs=num_outputs)
        _save_in_backward_order(forward, backward, num_outputs)

    num_saved = len(forward.graph.find_nodes(op="output")[0].args[0]) - num_outputs
    forward_spec = spec._replace(saved=num_saved)
    backward_spec = spec._replace(
        backward=True,
        saved=num_saved,
        in_placements=tuple(spec.out_placements[i] for i in grad_outputs),
        out_placements=tuple(spec.in_grad_placements[i] for i in grad_inputs),
    )
    return _Joint(
        forward,
        backward,
        forward_spec,
        backward_spec,
        num_outputs,
        grad_outputs,
        grad_inputs,
    )


def _save_in_backward_order(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_outputs: int
) -> None:
    """Reorders what ``forward`` saves to the order of ``backward``'s inputs.

    The partitioner returns saved tensors before saved sizes (SymInts, under
    dynamic shapes) but the backward takes the sizes first; the region's
    backward call passes the saved values in the order the forward returned them.
    """
    output = forward.graph.find_nodes(op="output")[0]
    results, saved = output.args[0][:num_outputs], output.args[0][num_outputs:]
    by_name = {node.name: node for node in saved}
    wanted = [node.name for node in backward.graph.find_nodes(op="placeholder")[: len(saved)]]
    if sorted(wanted) != sorted(by_name):
        raise AssertionError(f"region backward reads {wanted} but its forward saves {sorted(by_name)}")
    output.args = ((*results, *(by_name[name] for name in wanted)),)
    forward.recompile()


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _prepare_for_partition(
    gm: torch.fx.GraphModule, num_primals: int, num_outputs: int
) -> None:
    """Names placeholders ``primals_i``/``tangents_i`` and tags what the outputs need as
    forward: the partitioner reads both (an untagged node counts as backward and is
    recomputed there)."""
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        node.name = node.target = (
            f"primals_{i + 1}" if i < num_primals else f"tangents_{i - num_primals + 1}"
        )
    outputs = gm.graph.find_nodes(op="output")[0].args[0][:num_outputs]
    needed = set()
    stack = [n for n in outputs if isinstance(n, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    # The partitioner cuts after the last forward node: move the forward ahead of
    # anything the tangents feed (it depends on primals only, so order is kept).
    anchor = gm.graph.find_nodes(op="placeholder")[-1]
    for node in list(gm.graph.nodes):
        if node in needed and node.op == "call_function":
            node.meta["partitioner_tag"] = "is_forward"
            anchor.append(node)
            anchor = node
    gm.recompile()


class _RegionFunction(torch.autograd.Function):
    """The region's forward and backward, each one ``local_map_region`` call."""

    @staticmethod
    def forward(
        ctx: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
    ) -> tuple[Any, ...]:
        # This Function's autograd node, whose number the backward region's node gets:
        # the forward region's node gets it too (tracing the joint numbers more nodes).
        seq_nr = torch.autograd._get_sequence_nr() - 1
        joint = _joint_graphs(body, spec, operands)
        with torch._C._AutoDispatchBelowAutograd(), _swapped_state("forward_seq_nr", seq_nr):
            outs = local_map_region(joint.forward, joint.forward_spec, *operands)
        ctx.joint = joint
        ctx.num_operands = len(operands)
        # What the backward reads: tensors through autograd's saving, sizes (SymInts) as they are.
        saved = outs[joint.num_outputs :]
        ctx.save_for_backward(*(x for x in saved if isinstance(x, torch.Tensor)))
        ctx.saved_sizes = [None if isinstance(x, torch.Tensor) else x for x in saved]
        results = outs[: joint.num_outputs]
        ctx.mark_non_differentiable(
            *(r for i, r in enumerate(results) if i not in joint.grad_outputs)
        )
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        joint: _Joint = ctx.joint
        # Autograd materializes the gradient of an unused output as zeros: none is None.
        tangents = [grads[i].contiguous() for i in joint.grad_outputs]
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if x is None else x for x in ctx.saved_sizes]
        with torch._C._AutoDispatchBelowAutograd():
            grad_inputs = local_map_region(
                joint.backward, joint.backward_spec, *saved, *tangents
            )
        result: list[Any] = [None] * ctx.num_operands
        for i, g in zip(joint.grad_inputs, grad_inputs):
            result[i] = g
        return (None, None, *result)


# ---------------------------------------------------------------- the user API


def _mesh_text(mesh: Any) -> str:
    from dynamo_vars.guards import describe_mesh

    return describe_mesh(mesh)[len("DeviceMesh(") : -1]


def _region_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    return re.sub(r"\W", "_", name) or "region"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


# The errors that both the call's checks (make_spec, also at trace time) and the
# op itself (a region node run on other inputs) raise: one message each.


def _other_mesh(name: str, index: int, mesh: Any, region_mesh: Any) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: input {index} is a DTensor on {_describe(mesh)} but the region's "
        f"device_mesh is {_describe(region_mesh)}; redistribute it onto the region's mesh, or pass that mesh"
    )


def _mismatch(name: str, index: int, have: str | None, want: str) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: input {index} has placements {have} but in_placements[{index}] is {want}; "
        "redistribute it first, or pass redistribute_inputs=True to local_map"
    )


def _output_count(name: str, returned: int, declared: int) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: the region returned {_count(returned, 'output')} (after flattening) but "
        f"out_placements declares {declared}; give one placement tuple (None for a non-tensor) per output"
    )


def _placements_arg(
    name: str, value: Any, what: str, count: int, ndim: int
) -> tuple[str | None, ...]:
    """One placement string (or None) per flat input/output, checked against the mesh's ndim."""
    noun = "output" if what == "out_placements" else "input"
    if len(value) != count:
        raise LocalMapError(
            f"local_map {name}: {what} has {_count(len(value), 'entry', 'entries')} but the "
            f"region has {_count(count, noun)} (after flattening the arguments with pytree); give one "
            f"placement tuple per {noun} (None for a non-tensor)"
        )
    texts = []
    for i, ps in enumerate(value):
        if ps is None:
            texts.append(None)
            continue
        ps = tuple(ps)
        if len(ps) != ndim:
            raise LocalMapError(
                f"local_map {name}: {what}[{i}] = {ps} has {_count(len(ps), 'placement')} but the mesh has "
                f"{_count(ndim, 'axis', 'axes')}; give one placement per mesh axis"
            )
        try:
            texts.append(format_placements(ps))
        except LocalMapError as e:
            raise LocalMapError(
                f"local_map {name}: {what}[{i}]: {str(e).removeprefix('local_map: ')}"
            ) from None
    return tuple(texts)


def _out_placements_tuple(out_placements: Any) -> tuple[Any, ...]:
    """``out_placements`` per flat output: a single PlacementType means one output."""
    from torch.distributed.tensor.placement_types import Placement

    if out_placements is None:
        return (None,)
    if isinstance(out_placements, tuple) and (
        not out_placements
        or all(p is None or not isinstance(p, Placement) for p in out_placements)
    ):
        return out_placements
    return (out_placements,)


def make_spec(
    name: str,
    mesh: Any,
    flat_args: Sequence[Any],
    in_placements: Sequence[Any] | None,
    in_grad_placements: Sequence[Any] | None,
    out_placements: Any,
    num_outputs: int | None,
    redistribute_inputs: bool,
) -> RegionSpec:
    """Checks a call's placements against its flat inputs and the mesh, and writes them as a spec.

    ``flat_args`` are the flat inputs (DTensors, tensors and other values; at
    trace time their fake values).  Placements not given are the DTensor inputs'
    own; ``in_grad_placements`` default to the input placements.  Only the
    tensor inputs' entries are kept: they are the region's operands.
    """
    from torch.distributed.tensor import DTensor

    ndim = mesh.ndim
    if in_placements is None:
        in_texts = tuple(
            format_placements(a.placements) if isinstance(a, DTensor) else None
            for a in flat_args
        )
    else:
        in_texts = _placements_arg(
            name, in_placements, "in_placements", len(flat_args), ndim
        )
    grad_texts = (
        in_texts
        if in_grad_placements is None
        else _placements_arg(
            name, in_grad_placements, "in_grad_placements", len(flat_args), ndim
        )
    )
    for i, a in enumerate(flat_args):
        if isinstance(a, DTensor):
            if a.device_mesh != mesh:
                raise _other_mesh(name, i, a.device_mesh, mesh)
            if in_texts[i] is None:
                raise LocalMapError(
                    f"local_map {name}: input {i} is a DTensor but in_placements[{i}] is None; "
                    f"give its placements, e.g. {tuple(a.placements)}"
                )
            have = format_placements(a.placements)
            if have != in_texts[i] and not redistribute_inputs:
                raise _mismatch(name, i, have, in_texts[i])
            if grad_texts[i] is None:
                raise LocalMapError(
                    f"local_map {name}: input {i} is a DTensor but in_grad_placements[{i}] is None; "
                    "give its gradient's placements"
                )
        elif not isinstance(a, torch.Tensor) and in_texts[i] is not None:
            raise LocalMapError(
                f"local_map {name}: input {i} is a {type(a).__name__}, not a tensor, but in_placements[{i}] "
                f"is {in_texts[i]}; give None for non-tensor inputs"
            )
    outs = _out_placements_tuple(out_placements)
    if num_outputs is not None and len(outs) != num_outputs:
        raise _output_count(name, num_outputs, len(outs))
    out_texts = _placements_arg(name, outs, "out_placements", len(outs), ndim)
    tensor = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
    return RegionSpec(
        name=name,
        mesh=_mesh_text(mesh),
        in_placements=tuple(in_texts[i] for i in tensor),
        out_placements=out_texts,
        in_grad_placements=tuple(grad_texts[i] for i in tensor),
        redistribute_inputs=bool(redistribute_inputs),
    )


def _describe(mesh: Any) -> str:
    from dynamo_vars.guards import describe_mesh

    text = describe_mesh(mesh)
    ranks = mesh.mesh.flatten().tolist()
    return f"{text} over ranks {ranks}"


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: Any = None,
    in_placements: Any = None,
    in_grad_placements: Any = None,
    device_mesh: Any = None,
    *,
    redistribute_inputs: bool = False,
    check_placements: bool = False,
) -> Any:
    """``torch.distributed.tensor.experimental.local_map``, as one op that keeps its placements.

    Same signature and eager semantics as torch's (decorator and call forms):
    ``func`` runs on the local shards of the DTensor inputs (flattened with
    pytree; plain tensors and other values are passed as they are) and its
    flat outputs become DTensors placed per ``out_placements``.  In compiled
    code (dynamo_vars installed, e.g. by ``dtcompile.backend()``) the call is one
    ``local_map_region`` node whose arguments carry the placements.

    ``check_placements=True`` (eager, for debugging) verifies the outputs on all
    ranks of a ``LocalTensorMode``: each ``Replicate()`` output must be equal on
    every rank of its mesh axis (a forgotten all-reduce shows up here) and each
    ``Shard(d)`` output must agree in shape across ranks except along ``d``.
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
            check_placements=check_placements,
        )
    return functools.partial(
        _local_map_call,
        func,
        out_placements,
        in_placements,
        in_grad_placements,
        device_mesh,
        redistribute_inputs,
        check_placements,
    )


def _local_map_call(
    func: Callable[..., Any],
    out_placements: Any,
    in_placements: Any,
    in_grad_placements: Any,
    device_mesh: Any,
    redistribute_inputs: bool,
    check_placements: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    from torch.distributed.tensor import DTensor

    flat_args, args_spec = pytree.tree_flatten(args)
    name = _region_name(func)
    mesh = device_mesh
    if mesh is None:
        mesh = next((a.device_mesh for a in flat_args if isinstance(a, DTensor)), None)
    if mesh is None or not any(isinstance(a, DTensor) for a in flat_args):
        # No DTensor input: torch's local_map calls func as it is.
        return func(*args, **kwargs)
    spec = make_spec(
        name,
        mesh,
        flat_args,
        in_placements,
        in_grad_placements,
        out_placements,
        None,
        redistribute_inputs,
    )
    tensor_at = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
    structure: list[Any] = []

    def body(*tensors: Any) -> tuple[Any, ...]:
        leaves = list(flat_args)
        for i, t in zip(tensor_at, tensors):
            leaves[i] = t
        out = func(*pytree.tree_unflatten(leaves, args_spec), **kwargs)
        flat_out, out_spec = pytree.tree_flatten(out)
        structure[:] = [out_spec]
        if check_placements:
            # On the local results, before from_local: a shard shape that differs
            # where it must not is what the check is for, and would not wrap.
            from hops.check import check_region_outputs

            check_region_outputs(spec, mesh, flat_out)
        return tuple(flat_out)

    outs = local_map_region(body, spec, *[flat_args[i] for i in tensor_at])
    return pytree.tree_unflatten(list(outs), structure[0])
