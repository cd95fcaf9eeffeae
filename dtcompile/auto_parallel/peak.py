"""The training step's peak memory per rank under a plan, as linear terms the solver can bound.

A step (forward, backward, optimizer) peaks, on each rank, at one of two moments:
at the turn from forward to backward, where everything the forward saved for the
backward is alive and no gradient is made yet (:data:`TURN`), or at the end of
the backward, where every gradient is made and the saved tensors are freed
(:data:`END`); between them the backward frees saved tensors as it makes
gradients.  The plan's estimate is the larger of the two sums of what
:mod:`dtcompile.graph.memory` finds alive in a compiled step, by kind:

- **parameters** and the **optimizer state** (``states`` tensors of the parameter's
  size per parameter: :data:`OPTIMIZER_STATES`), and at the end their **gradients**
  (one per parameter that requires one, in its layout): per parameter and layout;
- the **inputs** (the batch, in its layout) and **buffers** (replicated);
- at the turn, **saved for the backward**: what each op's backward reads. An input an op's
  backward reads is kept in the layout the op reads it in, once per value (a value
  several ops read is redistributed once, by its fan-out); it is the producer's
  own tensor where no redistribution comes between (counted once, if the producer's
  backward reads it too), and a parameter's own storage where it is read in its
  stored layout (nothing more).  A parameter gathered for an op is kept gathered
  unless the compile config reshards it after forward (:mod:`dtcompile.pipeline.reshard`):
  then the backward gathers it again and the forward keeps nothing.  What an op's
  backward reads that the op made (its outputs, a norm's statistics) is measured
  with it (:attr:`~dtcompile.auto_parallel.graph.Candidate.saved_bytes`);
- the **backward's working set**: the most any one op's backward holds at once,
  the gradients of its outputs and of its inputs in their layouts (a maximum over
  the nodes: the solver bounds it with one variable, at least each node's).

Parameters and inputs are terms of a node's choice; what is saved depends on the
two ends of an edge (the layout made, the layout read), so it is a term of the
edge's pair: :class:`StepMemory`.  Each moment adds one op's backward working;
it counts a value and a view of it, both saved, twice; a tensor's size is what its shape says (no allocator
rounding), and an op's temporaries are those of the compiled step after Inductor's
fusions (without Inductor, each decomposed op's output is one more).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtcompile.auto_parallel.edges import view_origin
from dtcompile.auto_parallel.graph import Candidate, PNode, Problem
from dtcompile.auto_parallel.placements import local_numel, unstrided
from dtcompile.base.notation import format_bytes

__all__ = ["END", "MOMENTS", "OPTIMIZER_STATES", "TURN", "PeakEstimate", "StepMemory", "optimizer_states", "step_memory"]

OPTIMIZER_STATES = {
    "sgd": 0, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2,
}
"""Tensors of a parameter's size each optimizer keeps per parameter (``torch.optim``'s; SGD
without momentum, RMSprop without momentum or centering)."""


def optimizer_states(optimizer: Any) -> int:
    """The state tensors per parameter of ``optimizer``: ``None`` (no optimizer counted), a
    name of :data:`OPTIMIZER_STATES` (any case), or a ``torch.optim.Optimizer`` subclass."""
    if optimizer is None:
        return 0
    name = optimizer.__name__ if isinstance(optimizer, type) else optimizer
    if not isinstance(name, str) or name.lower() not in OPTIMIZER_STATES:
        raise ValueError(
            f"auto_parallel: optimizer={optimizer!r} is not one the peak memory model knows; give None or one of "
            f"{sorted(OPTIMIZER_STATES)} (a name or the torch.optim class)"
        )
    return OPTIMIZER_STATES[name.lower()]


def _bytes(shape: tuple[int, ...], dtype: Any, layout: Any, mesh: Any) -> int:
    return local_numel(shape, layout, mesh.shape) * dtype.itemsize


def _reads(candidate: Candidate, slot: int) -> bool:
    """Whether the backward of ``candidate`` reads its argument ``slot`` (unmeasured: yes)."""
    return not candidate.saved or candidate.saved[slot]


@dataclass
class StepMemory:
    """The step's peak per rank: the larger of two moments, each a sum of terms of the
    nodes' choices and the edges' pairs (:data:`MOMENTS`)."""

    constant: int
    """Bytes whatever the plan: buffers (replicated)."""
    held: dict[str, np.ndarray]
    """Node -> bytes per candidate alive throughout: a parameter and its optimizer state,
    an input."""
    grads: dict[str, np.ndarray]
    """Parameter node -> bytes per candidate of its gradient."""
    saved: dict[str, np.ndarray]
    """Node -> bytes per candidate its backward reads that it made."""
    edges: dict[int, np.ndarray]
    """Index in ``problem.edges`` -> bytes per (producer candidate, consumer candidate): the
    value saved for the backward in the layout it is read in."""
    working: dict[str, np.ndarray]
    """Node -> bytes per candidate its backward holds at once (its gradients in and out)."""
    states: int
    """Optimizer state tensors per parameter."""

    def terms(self, moment: str) -> list[dict[str, np.ndarray]]:
        """The per-node terms of ``moment`` (the edges count at the turn only)."""
        return [self.held, self.saved] if moment == TURN else [self.held, self.grads]

    def estimate(self, problem: Problem, choice: Mapping[str, int]) -> PeakEstimate:
        """The estimate of the plan ``choice``."""
        kinds = {"parameters": 0, "optimizer state": 0, "inputs": 0, "buffers": self.constant,
                 "saved for the backward": 0, "gradients": 0, "backward working set": 0}
        for name, sizes in problem.param_bytes.items():
            size = int(sizes[choice[name]])
            kinds["parameters"] += size
            if problem.nodes[name].requires_grad[0]:
                kinds["optimizer state"] += self.states * size
        kinds["inputs"] = sum(int(self.held[n.name][choice[n.name]]) for n in problem.nodes.values() if n.kind == "input")
        kinds["gradients"] = sum(int(sizes[choice[name]]) for name, sizes in self.grads.items())
        kinds["saved for the backward"] = sum(int(sizes[choice[name]]) for name, sizes in self.saved.items()) + sum(
            int(matrix[choice[problem.edges[i].producer], choice[problem.edges[i].consumer]])
            for i, matrix in self.edges.items()
        )
        kinds["backward working set"] = max((int(w[choice[n]]) for n, w in self.working.items()), default=0)
        always = sum(n for k, n in kinds.items() if k not in ("saved for the backward", "gradients"))
        turn, end = always + kinds["saved for the backward"], always + kinds["gradients"]
        return PeakEstimate(max(turn, end), TURN if turn >= end else END, kinds)


@dataclass(frozen=True)
class PeakEstimate:
    """A plan's estimated step peak per rank."""

    total: int
    """Bytes per rank at the larger moment."""
    at: str
    """Which moment: :data:`TURN` or :data:`END`."""
    kinds: dict[str, int]
    """Bytes per rank by kind: ``parameters``, ``optimizer state``, ``inputs``, ``buffers``,
    ``saved for the backward`` (at the turn), ``gradients`` (at the end), ``backward working set``."""

    def __str__(self) -> str:
        left_out = "gradients" if self.at == TURN else "saved for the backward"
        parts = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in self.kinds.items() if n and kind != left_out)
        return f"{format_bytes(self.total)} per rank {self.at} ({parts})"


TURN = "at the turn to the backward"
"""Everything the forward saved alive, before the gradients (the backward of the last op)."""
END = "at the end of the backward"
"""Every gradient made, the saved tensors freed (the backward of the first op)."""
MOMENTS = (TURN, END)


def _held_origin(nodes: Mapping[str, PNode], name: str) -> PNode | None:
    """The parameter or input node ``name`` is, or is a view of (``t(w)``), else ``None``:
    its storage is alive throughout the step whatever reads it."""
    node = view_origin(nodes, name)
    return node if node.kind in ("param", "input") else None


def step_memory(problem: Problem, states: int) -> StepMemory:
    """The peak model of ``problem``'s step with ``states`` optimizer tensors per parameter."""
    nodes, mesh = problem.nodes, problem.mesh
    constant = 0
    held: dict[str, np.ndarray] = {}
    grads: dict[str, np.ndarray] = {}
    saved: dict[str, np.ndarray] = {}
    working: dict[str, np.ndarray] = {}
    # Repeated layers share their nodes' candidate lists: each sum is made once per list and shapes.
    made: dict[Any, Any] = {}
    for node in nodes.values():
        if node.kind in ("op", "region"):
            metas = [nodes[p].outputs[k] for p, k in node.inputs] + list(node.outputs)
            key = (id(node.candidates), tuple(metas))
            if key not in made:
                made[key] = np.array([
                    sum(_bytes(*meta, layout, mesh) for meta, layout in zip(metas, (*c.grads, *c.grad_out))
                        if meta is not None and layout is not None)
                    for c in node.candidates
                ], dtype=float)
            if made[key].any():
                working[node.name] = made[key]
        if node.kind == "buffer":
            shape, dtype = node.outputs[0]
            constant += _bytes(shape, dtype, node.candidates[0].outputs[0], mesh)
        elif node.kind == "param":
            sizes = np.asarray(problem.param_bytes[node.name], dtype=float)
            trained = node.requires_grad[0]
            held[node.name] = (1 + states * trained) * sizes
            if trained:
                grads[node.name] = sizes
        elif node.kind == "input":
            shape, dtype = node.outputs[0]
            held[node.name] = np.array([_bytes(shape, dtype, c.outputs[0], mesh) for c in node.candidates], float)
        elif any(c.saved_bytes for c in node.candidates):
            saved[node.name] = np.array([c.saved_bytes for c in node.candidates], dtype=float)
    fanout_read = {}
    for rule in problem.fanout_rules:
        reader = nodes[rule.consumer]
        read = reader.kind != "output" and any(_reads(c, rule.slot) for c in reader.candidates)
        fanout_read[rule.fanout] = fanout_read.get(rule.fanout, False) or read
    per_edge: dict[int, np.ndarray] = {}
    for index, edge in enumerate(problem.edges):
        producer, consumer = nodes[edge.producer], nodes[edge.consumer]
        if consumer.kind == "output":
            continue
        shape, dtype = producer.outputs[edge.index]
        origin = _held_origin(nodes, producer.name)
        if origin is not None and origin.name in problem.regathered:
            continue  # the backward gathers it again; the forward keeps nothing
        read_all = fanout_read.get(consumer.name, False) if consumer.kind == "fanout" else None
        key = (id(producer.candidates), edge.index, id(consumer.candidates), edge.slot, shape, dtype, origin is None,
               read_all)
        if key not in made:
            made[key] = _saved_on_edge(producer, consumer, edge.index, edge.slot, origin is not None, read_all, mesh)
        if made[key] is not None:
            per_edge[index] = made[key]
    return StepMemory(constant, held, grads, saved, per_edge, working, states)


def _saved_on_edge(producer: PNode, consumer: PNode, index: int, slot: int, held: bool, read_all: bool | None,
                   mesh: Any) -> np.ndarray | None:
    """Bytes per (producer, consumer) candidate pair the forward saves of the value on that edge
    (``None``: none); ``held``: the value is a parameter's or input's storage (or a view of one);
    ``read_all``: for a fan-out, whether any of its readers' backward reads it."""
    shape, dtype = producer.outputs[index]
    # Producer candidates whose own tensor a reader in that layout keeps: a parameter's or
    # input's storage, or an output the producer's own backward keeps.
    own: dict[Any, list[int]] = {}
    for i, pc in enumerate(producer.candidates):
        gives = pc.outputs[index]
        if gives is not None and (held or (pc.saved_outputs and pc.saved_outputs[index])):
            own.setdefault(unstrided(gives), []).append(i)
    matrix = np.zeros((len(producer.candidates), len(consumer.candidates)))
    for j, cc in enumerate(consumer.candidates):
        if read_all if read_all is not None else _reads(cc, slot):
            layout = cc.inputs[slot]
            matrix[:, j] = _bytes(shape, dtype, layout, mesh)
            matrix[own.get(layout, []), j] = 0
    return matrix if matrix.any() else None
