"""SPMD types of a compiled graph's untyped inputs, read from the layouts its modules declare.

torchtitan's modules declare, per ``forward()`` argument, the layout each input
arrives in (``module._sharding_config.in_src_shardings``: name -> ``SpmdLayout``,
its ``per_axis_spmd_types()`` a type per mesh axis name).  Its ``spmd_types``
path asserts them only under ``spmd_types``' eager checker, which is off by
default and does not run under Dynamo, so a block compiled on its own receives
the residual stream untyped: the embedding that made it ran eagerly, and eager
ops leave no types.

:func:`declared_input_types` reads them instead.  A Dynamo graph input (not a
parameter or buffer) that a module receives is typed as that module declares its
inputs, where the module declares them all alike (the one tensor a norm takes,
the ``x`` of a block's attention): the outermost such module on the path of each
node that reads the input, all of them agreeing.  Modules are found where Dynamo
names them, ``node.meta["nn_module_stack"]``'s sources (``L['self'].attention_norm``),
on the frame Dynamo is translating; outside a Dynamo compile nothing is read.
A declaration that does not fit (modules disagreeing, a module with inputs
declared otherwise) leaves the input untyped: nothing is guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from dtcompile.spmd.inference import AxisTypes, SpmdType

__all__ = ["declared_input_types", "with_declared_types"]

# One step of a Dynamo source: ``.name``, ``[0]`` or ``['key']``.
_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(-?\d+)\]|\['([^']*)'\]")


def _resolve(source: str, frame_locals: Mapping[str, Any]) -> Any:
    """The object a Dynamo source over the frame's locals names (``L['self'].ffn_norm``), or None."""
    if not source.startswith("L["):
        return None
    steps = _STEP.findall(source[1:])
    if "".join(f".{a}" if a else f"[{i}]" if i else f"['{k}']" for a, i, k in steps) != source[1:]:
        return None  # a source this reader does not take apart (a call, a global)
    value: Any = frame_locals
    try:
        for attr, index, key in steps:
            value = getattr(value, attr) if attr else value[int(index)] if index else value[key]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return value


def _translating_frame_locals() -> Mapping[str, Any] | None:
    """The locals of the frame Dynamo is translating (this thread's), or None outside one."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = getattr(InstructionTranslator, "current_tx", lambda: None)()
    return getattr(tx, "f_locals", None)


def _declared(module: Any) -> Any:
    """The one layout ``module`` declares for every input it names, or None."""
    config = getattr(module, "_sharding_config", None)
    layouts = list((getattr(config, "in_src_shardings", None) or {}).values())
    if not layouts or any(not hasattr(layout, "per_axis_spmd_types") for layout in layouts):
        return None
    try:
        first = layouts[0].per_axis_spmd_types()
        alike = all(layout.per_axis_spmd_types() == first for layout in layouts[1:])
    except (TypeError, ValueError):  # a declaration torchtitan's own reader refuses: nothing is read
        return None
    return layouts[0] if alike else None


def _module_paths(node: fx.Node) -> Iterator[str]:
    """The sources of the modules ``node`` runs in, outermost first."""
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
            yield entry[0]


def _an_argument(placeholder: fx.Node, frame_locals: Mapping[str, Any]) -> bool:
    """Whether a Dynamo graph input is one of the frame's arguments (``L['x']``, ``L['args'][0]``),
    not a module's parameter, buffer or attribute (``L['self']._parameters['weight']``)."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    match = re.match(r"L\['([^']*)'\]", name or "")
    return match is not None and not isinstance(frame_locals.get(match.group(1)), torch.nn.Module)


def _as_types(layout: Any, ndim: int, axes: set[str]) -> AxisTypes:
    found: AxisTypes = {}
    for axis, t in layout.per_axis_spmd_types().items():
        name = str(getattr(axis, "value", axis))
        if name not in axes:
            continue
        dim = getattr(t, "dim", None)
        found[name] = SpmdType.shard(dim % ndim) if isinstance(dim, int) and ndim else SpmdType(repr(t))
    return found


def declared_input_types(gm: fx.GraphModule, example_inputs: Sequence[Any], untyped: Sequence[int],
                         axes: set[str]) -> dict[int, AxisTypes]:
    """Input index -> its type on ``axes`` as the modules reading it declare, for each of
    ``untyped`` (indices of ``gm``'s inputs) a module's declaration types."""
    frame_locals = _translating_frame_locals()
    if frame_locals is None or not axes:
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    modules: dict[str, Any] = {}
    found: dict[int, AxisTypes] = {}
    for index in untyped:
        value = example_inputs[index] if index < len(example_inputs) else None
        if index >= len(placeholders) or not isinstance(value, torch.Tensor) or not _an_argument(placeholders[index], frame_locals):
            continue
        layouts = []
        for user in placeholders[index].users:
            for path in _module_paths(user):
                if path not in modules:
                    modules[path] = _declared(_resolve(path, frame_locals))
                if modules[path] is not None:
                    layouts.append(modules[path])
                    break
        types = [_as_types(layout, value.dim(), axes) for layout in layouts]
        if types and all(t == types[0] for t in types[1:]) and set(types[0]) == axes:
            found[index] = types[0]
    return found


def with_declared_types(gm: fx.GraphModule, example_inputs: Sequence[Any],
                        types: tuple[AxisTypes | None, ...]) -> tuple[AxisTypes | None, ...]:
    """``types`` (:func:`dtcompile.spmd.inference.input_types`) with the untyped inputs its modules
    declare typed (:func:`declared_input_types`), on the axes the typed inputs have."""
    axes = {axis for t in types if t for axis in t}
    untyped = [i for i, t in enumerate(types) if t is None]
    declared = declared_input_types(gm, example_inputs, untyped, axes) if untyped else {}
    return tuple(declared.get(i, t) for i, t in enumerate(types))
