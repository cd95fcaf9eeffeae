"""SPMD types across compiled graphs: stamped on their outputs, re-checked when their inputs' change.

:mod:`dtcompile.spmd.inference` types and checks a graph when it is compiled, from
its inputs' types then.  Two things happen at run time that the compile did not see:

- **The outputs leave untyped.**  A compiled graph's outputs are new tensors with no
  ``spmd_types`` type, so the next compiled graph (torchtitan's next block) would
  start untyped.  :func:`carry_spmd_types` stamps each output with the type the
  check computed for it (``spmd_types.assert_type``, as ``spmd_types``' eager
  checker would have typed it): ``S(d)``, ``R``, ``I``, ``V`` or ``P`` per mesh
  axis, an axis the check left ``?`` not at all.
- **The same code is called with inputs typed otherwise.**  Dynamo does not guard on
  an attribute it never read, so a graph compiled for an ``R`` input runs as it is
  for a ``P`` one.  Each call compares its inputs' ``spmd_types`` annotations with
  those of the calls already checked; inputs typed otherwise are typed again, and
  the graph as traced (kept from the compile, before the passes) is checked again
  for them: a contradiction is the same :class:`~dtcompile.spmd.inference.SpmdTypeCheckError`
  the compile would have raised, before the graph runs.  The code itself does not
  depend on the types, so a graph that checks runs as compiled (its outputs typed
  for the new inputs).  Each typing of the inputs is checked once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from dtcompile.base.channels import GraphKind
from dtcompile.spmd.inference import AxisTypes, SpmdType, input_types, type_graph

__all__ = ["SpmdCarry", "carry_spmd_types", "outputs_from_json", "outputs_to_json", "traced_copy"]


def traced_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (its nodes' meta shared, not copied) that the passes do not
    rewrite: what a re-check types again."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def outputs_to_json(outputs: Sequence[AxisTypes | None]) -> list[dict[str, str] | None]:
    """The outputs' types as kept beside the compile cache (``BesideCacheFolders.SPMD_TYPES``)."""
    return [dict(t) if t is not None else None for t in outputs]


def outputs_from_json(kept: Any) -> list[AxisTypes | None] | None:
    """What :func:`outputs_to_json` kept, or None where it is not that."""
    if not isinstance(kept, list) or not all(t is None or isinstance(t, dict) for t in kept):
        return None
    return [{axis: SpmdType.of_text(text) for axis, text in t.items()} if t is not None else None for t in kept]


def _annotation(value: Any) -> Any:
    """An input's ``spmd_types`` annotation as a key (its local types and partition spec), or None."""
    import spmd_types as spmd
    from spmd_types.runtime import get_partition_spec

    if not isinstance(value, torch.Tensor):
        return None
    local = spmd.get_local_type(value)
    return (tuple(local.items()), get_partition_spec(value)) if local else None


@dataclass
class SpmdCarry:
    """A compiled graph's SPMD types, as its wrapper needs them at run time."""

    dynamo_graph: fx.GraphModule
    """The Dynamo graph (its collectives' groups name the axes of new inputs)."""
    traced: fx.GraphModule | None
    """Its forward (or inference) AOT graph as traced, before the passes (:func:`traced_copy`);
    None for a graph the compile cache served (not traced in this process)."""
    kind: GraphKind
    axes: Mapping[str, str]
    inputs: tuple[AxisTypes | None, ...]
    """The inputs' types the compile checked."""
    outputs: list[AxisTypes | None]
    """The Dynamo graph's outputs' types for those inputs."""
    axis_objects: Mapping[str, Any]
    """Mesh axis name -> ``spmd_types``' axis (what a stamp is keyed by)."""
    output_offset: int = 0
    """Where the Dynamo graph's outputs start among the AOT graph's (mutated inputs first)."""
    checked: dict[tuple[Any, ...], list[dict[Any, Any] | None]] = field(default_factory=dict)
    """Inputs' annotations already checked -> the outputs' stamps for them (:meth:`_stamps`)."""

    def stamps_for(self, args: Sequence[Any]) -> list[dict[Any, Any] | None]:
        """What each output of a call with inputs ``args`` is stamped with: its types checked, and
        made ``spmd_types``' own, once per annotation of the inputs."""
        key = tuple(_annotation(a) for a in args)
        found = self.checked.get(key)
        if found is None:
            found = self.checked[key] = self._stamps(self._check(args))
        return found

    def _check(self, args: Sequence[Any]) -> list[AxisTypes | None]:
        typed = input_types(self.dynamo_graph, args, self.axes) or (None,) * len(args)
        # An input its annotation leaves untyped keeps what the compile found for it (a module's
        # declared layout, FSDP2's saved type).
        types = tuple(t if t is not None else self.inputs[i] if i < len(self.inputs) else None for i, t in enumerate(typed))
        if types == tuple(self.inputs):
            return self.outputs
        if self.traced is None:
            warnings.warn(
                "dtcompile: a graph the compile cache served is called with inputs typed otherwise than it was "
                "compiled for; it was not traced in this process, so its SPMD types are not checked again and its "
                "outputs are left untyped for this call (clear the cache, or compile with aot_cache=False, to check it)",
                stacklevel=3,
            )
            return [None] * len(self.outputs)
        _, outputs = type_graph(self.traced, self.kind, types, self.axes)
        return outputs[self.output_offset : self.output_offset + len(self.outputs)]

    def _stamps(self, types: Sequence[AxisTypes | None]) -> list[dict[Any, Any] | None]:
        """Each output's types as ``spmd_types`` keys and types (``spmd_types.S(d)``, ``R``...), on
        its known axes; None for an output with none."""
        import spmd_types as spmd

        stamps = []
        for found in types:
            stamp = {self.axis_objects[axis]: spmd.S(t.dim) if t.dim is not None else getattr(spmd, t.local)
                     for axis, t in (found or {}).items() if t != "?" and axis in self.axis_objects}
            stamps.append(stamp or None)
        return stamps

    @staticmethod
    def stamp(outputs: Sequence[Any], stamps: Sequence[dict[Any, Any] | None]) -> None:
        """Types each output tensor that has no type yet with its stamp (:meth:`stamps_for`)."""
        import spmd_types as spmd

        for value, stamp in zip(outputs, stamps):
            if stamp is not None and isinstance(value, torch.Tensor) and not spmd.get_local_type(value):
                spmd.assert_type(value, stamp)


def carry_spmd_types(run: Callable[..., Any], carry: SpmdCarry) -> Callable[..., Any]:
    """``run`` (a compiled graph's callable), checking its inputs' types first and stamping its
    outputs' types after (see the module doc)."""

    def typed_run(*args: Any) -> Any:
        stamps = carry.stamps_for(args)
        outputs = run(*args)
        carry.stamp(outputs, stamps)
        return outputs

    return typed_run
