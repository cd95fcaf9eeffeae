"""The solution made into a model: DTensor parameters, and a forward that runs the chosen strategies.

:func:`parallelize` returns an :class:`AutoParallelModule`: the user's module
(a copy) with every parameter a DTensor in its chosen placements, and a forward
that is the traced forward rebuilt as an FX graph over DTensors
(``parallel_model.code`` shows it):

- each op's tensor arguments are first redistributed to the layout its chosen
  strategy reads (``x.redistribute(mesh, placements)``; its backward lands the
  gradient where the solver assumed, :func:`~dtcompile.auto_parallel.placements.grad_layout`),
  or taken as they are where the solution reads them so (same layout, gradient
  coming back as the producer wants it); once per value, so a value's readers
  share one redistribution and their gradients are summed before its backward;
- the op is the traced aten op itself, which DTensor dispatches; given inputs in
  exactly those layouts its propagation runs the chosen strategy (the
  candidates were filtered to those it does, :mod:`~dtcompile.auto_parallel.strategies`),
  and :func:`expect_layout` checks each result's placements, so a divergence is an
  error naming the node rather than silent extra communication;
- an op whose candidate runs outside DTensor's dispatch (no strategy registered) is
  called through :func:`~dtcompile.auto_parallel.local_ops.run_local` on the local shards;
- tensors made inside the model from no input (a causal mask) are made whole on
  every rank and wrapped as replicated DTensors where a DTensor op reads them.

Inputs: a DTensor argument is redistributed to the chosen layout; a plain tensor
is this rank's local shard in that layout (``DTensor.from_local``: the whole
tensor where it is replicated), as ``parallelize_module``'s input layouts are.
Outputs are DTensors in the chosen layouts.  The module runs eagerly and
compiles with ``torch.compile(..., backend="dtcompile")``; Dynamo traces the
forward like any DTensor code.
"""

from __future__ import annotations

import copy
import operator
import re
import threading
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from dtcompile.auto_parallel.agreement import compare_applied
from dtcompile.auto_parallel.local_ops import run_local
from dtcompile.auto_parallel.regions import REGION_ARGS, region_of
from dtcompile.auto_parallel.solution import Solution

__all__ = ["AutoParallelModule", "expect_layout", "parallelize"]


def expect_layout(value: Any, placements: tuple[Any, ...], node: str) -> Any:
    """``value``, after checking that DTensor gave it the placements the solution chose."""
    if tuple(value.placements) != tuple(placements):
        raise RuntimeError(
            f"auto_parallel: DTensor ran node {node} with output placements {tuple(value.placements)}, "
            f"not the solution's {tuple(placements)}; please report this (the solution was built for another torch?)"
        )
    return value


def _call_region(fn: Any, args_spec: Any, *operands: Any) -> tuple[Any, ...]:
    """A ``local_map`` function called with its arguments as traced (``operands``: their leaves),
    its outputs flat (as the traced region op returns them)."""
    return tuple(pytree.tree_leaves(fn(*pytree.tree_unflatten(list(operands), args_spec))))


def _replicated(value: torch.Tensor, mesh: Any) -> DTensor:
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _build_graph(solution: Solution, mesh: Any) -> tuple[fx.Graph, dict[str, Any]]:
    """The forward over DTensors on ``mesh`` (see the module docstring) and the constants it reads by ``get_attr``."""
    problem = solution.problem
    traced = problem.traced
    graph = fx.Graph()
    consts: dict[str, Any] = {"mesh": mesh}
    layout_names: dict[tuple[Any, ...], str] = {}

    def layout_node(layout: tuple[Any, ...]) -> fx.Node:
        if layout not in layout_names:
            layout_names[layout] = f"layout{len(layout_names)}"
            consts[layout_names[layout]] = tuple(layout)
        return graph.get_attr(layout_names[layout])

    values: dict[tuple[str, int], fx.Node] = {}
    read: dict[tuple[str, int], fx.Node] = {}
    mesh = None
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":  # named for the parameter or input it is
            name = re.sub(r"\W", "_", solution.display_name(node.name))
            values[(node.name, 0)] = graph.placeholder(f"p_{name}" if name[0].isdigit() else name)
    mesh = graph.get_attr("mesh")

    def value(ref: tuple[str, int]) -> fx.Node:
        if ref not in values:
            base = values[(ref[0], -1)]
            values[ref] = graph.call_function(operator.getitem, (base, ref[1]))
        return values[ref]

    def reading(name: str, slot: int) -> fx.Node:
        # The edge into the reader, or into the fan-out its readers share.
        fan = solution.fanout_of(name, slot)
        edge_end, edge_slot = (fan, 0) if fan is not None else (name, slot)
        if (edge_end, edge_slot) not in read:
            ref = problem.nodes[edge_end].inputs[edge_slot]
            v = value(ref)
            if problem.nodes[ref[0]].kind == "constant":
                v = graph.call_function(_replicated, (v, mesh))
            if not solution.edge_transfer(edge_end, edge_slot).passthrough:
                layout = solution.choice(edge_end).inputs[edge_slot]
                v = graph.call_method("redistribute", (v, mesh, layout_node(layout)))
            read[(edge_end, edge_slot)] = v
        return read[(edge_end, edge_slot)]

    for node in traced.gm.graph.nodes:
        if node.op == "get_attr" and node.name in problem.nodes:  # a tensor the trace lifted from forward
            consts[f"const_{node.name}"] = getattr(traced.gm, node.target)
            values[(node.name, 0)] = graph.get_attr(f"const_{node.name}")
            continue
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        pnode = problem.nodes[node.name]
        if pnode.kind == "constant":
            new = graph.node_copy(node, lambda n: value((n.name, 0)))
        elif pnode.kind == "region":  # the local_map function itself, on the DTensors
            index = region_of(node)
            consts[f"region{index}"] = traced.regions[index].fn
            consts[f"region{index}_args"] = node.meta[REGION_ARGS]
            operands = [reading(node.name, slot) for slot in range(len(pnode.inputs))]
            new = graph.call_function(
                _call_region, (graph.get_attr(f"region{index}"), graph.get_attr(f"region{index}_args"), *operands)
            )
        else:
            slots = iter(range(len(pnode.inputs)))
            args, kwargs = pytree.tree_map_only(
                fx.Node, lambda _: reading(node.name, next(slots)), (node.args, node.kwargs)
            )
            if solution.choice(node.name).local:  # outside DTensor's dispatch, on local shards
                outs_name = f"outs_{node.name}"
                consts[outs_name] = solution.choice(node.name).outputs
                new = graph.call_function(run_local, (node.target, graph.get_attr(outs_name), *args), dict(kwargs))
            else:
                new = graph.call_function(node.target, tuple(args), dict(kwargs))
            outs = solution.choice(node.name).outputs
            if pnode.kind != "region" and len(outs) == 1 and outs[0] is not None:
                new = graph.call_function(expect_layout, (new, layout_node(outs[0]), node.name))
        multi = isinstance(node.meta.get("val"), (tuple, list))
        values[(node.name, -1 if multi else 0)] = new
    outputs = []
    for pnode in problem.nodes.values():
        if pnode.kind == "output":
            outputs.append(reading(pnode.name, 0))
    graph.output(outputs)
    return graph, consts


class AutoParallelModule(nn.Module):
    """The user's module with DTensor parameters, run as the solution chose (see the module docstring).

    It holds the (copied) user module's own parameters, buffers and submodules under
    their own names, so ``named_parameters()``, ``named_buffers()`` and ``state_dict()``
    name everything as the user's model does (``norm.weight``, not ``module.norm.weight``):
    a checkpoint moves between the two (``torch.distributed.checkpoint.state_dict``'s
    ``get_model_state_dict`` / ``set_model_state_dict`` with ``full_state_dict=True``, or
    DCP).  The planned forward is kept outside the module tree (:attr:`code` shows it).
    """

    def __init__(self, module: nn.Module, solution: Solution, mesh: Any) -> None:
        super().__init__()
        for name, param in module._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in module._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        for name, child in module._modules.items():
            self.add_module(name, child)
        # Not a submodule: named_modules() and state_dict() stay the user's.
        object.__setattr__(self, "_plan", _planned_forward(solution, mesh))
        traced = solution.problem.traced
        self._param_names = [name for name, _ in traced.params]
        self._buffer_names = [name for name, _ in traced.buffers]
        self._input_spec = traced.input_spec
        self._output_spec = traced.output_spec
        self._input_layouts = tuple(solution.input_placements)
        self._mesh = mesh
        self.solution = solution

    @property
    def code(self) -> str:
        """The forward's Python code: one ``redistribute`` per value read in a new layout, one op per node."""
        return self._plan.code

    def forward(self, *args: Any) -> Any:
        flat, spec = pytree.tree_flatten(args)
        if spec != self._input_spec:
            raise TypeError(
                f"auto_parallel: the model was planned for inputs shaped like {self._input_spec}, got {spec}; "
                "call it with arguments structured like the example inputs"
            )
        inputs = []
        for i, (x, layout) in enumerate(zip(flat, self._input_layouts)):
            if isinstance(x, DTensor):
                inputs.append(x.redistribute(self._mesh, layout))
            elif isinstance(x, torch.Tensor):
                inputs.append(DTensor.from_local(x, self._mesh, layout, run_check=False))
            else:
                raise TypeError(f"auto_parallel: input {i} is {type(x).__name__}, not a tensor")
        params = dict(self.named_parameters(remove_duplicate=False))
        buffers = dict(self.named_buffers(remove_duplicate=False))
        states = [params[n] for n in self._param_names] + [_replicated(buffers[n], self._mesh) for n in self._buffer_names]
        outs = self._plan(*states, *inputs)
        return pytree.tree_unflatten(list(outs), self._output_spec)


# solution -> {(mesh, id(mesh)): its forward}: see _planned_forward.
_FORWARDS: weakref.WeakKeyDictionary[Solution, dict[Any, fx.GraphModule]] = weakref.WeakKeyDictionary()
_FORWARDS_LOCK = threading.Lock()


def _planned_forward(solution: Solution, mesh: Any) -> fx.GraphModule:
    """The planned forward of ``solution`` on ``mesh``, built once and shared by every model the
    plan is applied to there: each ``GraphModule`` is a class of its own, which Dynamo guards on,
    so a forward built per copy made every copy recompile (the ninth ran eagerly, past torch's
    ``recompile_limit``).  It holds no parameter or buffer (they are its arguments), only the
    constants the model made in forward, which it does not write to.  (A mesh compares equal
    before and after ``_flatten``, hence its id in the key.)"""
    key = (mesh, id(mesh))
    with _FORWARDS_LOCK:
        found = _FORWARDS.setdefault(solution, {}).get(key)
    if found is None:
        graph, consts = _build_graph(solution, mesh)
        made = fx.GraphModule(consts, graph, class_name="AutoParallelForward")
        with _FORWARDS_LOCK:
            found = _FORWARDS[solution].setdefault(key, made)
    return found


def parallelize(model: nn.Module, solution: Solution, mesh: Any = None) -> AutoParallelModule:
    """A copy of ``model`` with its parameters distributed as ``solution`` chose, and its forward.

    ``mesh`` (default: the one planned on) may be another mesh of the same shape and axis
    names: plan once, on a fake process group, and apply the plan on every real rank.
    Before a parameter is distributed, the mesh's ranks compare the plans they apply, and
    raise :class:`~dtcompile.ranks.check.RanksDisagree` on every rank where they differ
    (:mod:`~dtcompile.auto_parallel.agreement`).
    """
    planned = solution.problem.mesh
    if mesh is None:
        mesh = planned
    elif tuple(mesh.shape) != tuple(planned.shape) or mesh.mesh_dim_names != planned.mesh_dim_names:
        raise ValueError(
            f"auto_parallel: the solution was planned on mesh {tuple(planned.shape)} {planned.mesh_dim_names}, "
            f"not {tuple(mesh.shape)} {mesh.mesh_dim_names}; plan again on this mesh"
        )
    # Ranks that apply different plans would run collectives that do not pair up: they stop here.
    compare_applied(solution, mesh)
    module = copy.deepcopy(model)
    placements = solution.param_placements
    # A tied parameter (one tensor under several names) is distributed once, under its first
    # name (the one named_parameters() and the plan use), and set under every name.
    made: dict[int, nn.Parameter] = {}
    first = {id(param): name for name, param in module.named_parameters()}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            dist = distribute_tensor(param.detach(), mesh, placements[first[id(param)]])
            made[id(param)] = nn.Parameter(dist, requires_grad=param.requires_grad)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, made[id(param)])
    return AutoParallelModule(module, solution, mesh)
