"""The activation budget: recompute activations in the backward until a graph fits ``memory_budget_bytes``.

With ``DTCompileConfig.memory_budget_bytes`` set, the partitioner
(:class:`dtcompile.pipeline.partition.Partitioner`) first splits the joint graph as
Inductor's min-cut partitioner does by default: it saves for the backward what
makes the backward cheapest.  When the forward or the backward then peaks over
the budget (:mod:`dtcompile.graph.memory`; the backward counting what the caller holds
meanwhile), :func:`fit_activation_budget` splits it again under torch's
``activation_memory_budget`` (``torch._functorch.config``: the share of the
saved activations' bytes, between saving only the graph's inputs, ``0``, and
the default choice, ``1``, that the partitioner may keep; below it, it
recomputes in the backward the activations that are cheapest to recompute for
their bytes) and searches that share for the largest one whose graphs fit: the
least recompute that fits.  The peak need not fall with the share (recomputing
the whole forward also re-gathers every weight at the backward's start and
holds them to their gradients), so shares are tried from the top down in
eighths, and the first that fits is refined upwards.  Each split is of a copy
of the joint graph.

When no share fits, it is a :class:`dtcompile.graph.memory.MemoryBudgetError`
naming the least peak found and what is alive there.  What was recomputed is the forward's
``activation_budget`` record (:meth:`ActivationChoice.record`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from dtcompile.base.channels import GraphKind
from dtcompile.base.notation import format_bytes
from dtcompile.graph.memory import MemoryEstimate, budget_below_peak, estimate_memory, held_during_backward
from dtcompile.records import Action, Outcome, PassRecord

__all__ = ["ActivationChoice", "fit_activation_budget"]

# Shares tried: 7/8, 6/8, ..., 0; then halvings towards the share above the first that fits.
_GRID = 8
_REFINE = 3

# Opaque objects a graph takes as inputs that hold none of its tensors.
_HOLD_NO_ACTIVATIONS = frozenset({"DeviceMesh", "ProcessGroup"})

Partition = Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]]


@dataclass
class _Split:
    """One partition of the joint graph and its peaks."""

    share: float
    forward: fx.GraphModule
    backward: fx.GraphModule
    held: int
    """What the caller holds while the backward runs (:func:`held_during_backward`)."""
    memory: tuple[MemoryEstimate, MemoryEstimate] = field(init=False)

    def __post_init__(self) -> None:
        self.memory = (
            estimate_memory(self.forward, GraphKind.FORWARD),
            estimate_memory(self.backward, GraphKind.BACKWARD, self.held),
        )

    @property
    def peak(self) -> MemoryEstimate:
        return max(self.memory, key=lambda m: m.peak_bytes)

    def saved(self) -> dict[str, int]:
        """The forward's results the backward takes, by name: bytes."""
        taken = {n.name for n in self.backward.graph.find_nodes(op="placeholder")}
        output = next(iter(self.forward.graph.find_nodes(op="output")))
        saved = {}
        for node in pytree.tree_leaves(output.args):
            if isinstance(node, fx.Node) and node.name in taken and node.op != "placeholder":
                span = self.memory[0].spans.get(node.name)
                saved[node.name] = span[2] if span else 0
        return saved


@dataclass(frozen=True)
class ActivationChoice:
    """What the activation budget did to one joint graph."""

    budget: int
    share: float
    """torch's ``activation_memory_budget`` the graphs were split under."""
    peak_before: int
    """The larger peak of the forward and backward as min-cut splits them by default."""
    peak_after: int
    recomputed: tuple[tuple[str, int], ...]
    """The activations the default split saves that are now recomputed: ``(name, bytes)``."""

    def record(self, forward: fx.GraphModule) -> PassRecord:
        nodes = len(forward.graph.nodes)
        freed = sum(b for _, b in self.recomputed)
        summary = Outcome(
            Action.RECOMPUTED,
            f"saving what makes the backward cheapest peaks at {format_bytes(self.peak_before)}, over "
            f"memory_budget_bytes {format_bytes(self.budget)}; {len(self.recomputed)} activations "
            f"({format_bytes(freed)}) are recomputed in the backward instead (torch's activation_memory_budget="
            f"{self.share:.3f}, the least recompute that fits): peak {format_bytes(self.peak_after)}",
        )
        each = tuple(
            Outcome(Action.RECOMPUTED, f"recomputed in the backward, not saved ({format_bytes(num)})", name)
            for name, num in self.recomputed
        )
        return PassRecord("activation_budget", True, nodes, nodes, 0, 0, (summary, *each))


def fit_activation_budget(
    joint: fx.GraphModule, partition: Partition, budget: int, graph: str
) -> tuple[fx.GraphModule, fx.GraphModule, ActivationChoice | None]:
    """``(forward, backward, choice)``: ``partition`` (min-cut, called on a copy of
    ``joint`` under each share tried) under the largest activation share whose forward
    and backward both peak within ``budget``; ``choice`` is ``None`` when the default split
    fits.  ``graph`` names the graph in the error when nothing fits."""

    def split(share: float) -> _Split:
        graphs = partition_at(joint, partition, share)
        return _Split(share, *graphs, held_during_backward(*graphs))

    default = split(1.0)
    if default.peak.peak_bytes <= budget:
        return default.forward, default.backward, None
    # The peak need not fall as the share does: recomputing everything from the inputs also
    # recomputes the gathers of every weight at the backward's start.  So the shares are
    # tried from the top down, and the first that fits is refined upwards.
    least, fits = default, None
    for step in range(_GRID - 1, -1, -1):
        tried = split(step / _GRID)
        if tried.peak.peak_bytes <= budget:
            fits = tried
            break
        least = min(least, tried, key=lambda s: s.peak.peak_bytes)
    if fits is None:
        how = (
            f"in its {least.peak.kind}, the least of every share of its activations recomputed in the backward "
            f"(torch's activation_memory_budget={least.share:.3g})"
        )
        raise budget_below_peak(budget, graph, least.peak, how)
    over = fits.share + 1 / _GRID
    for _ in range(_REFINE):
        candidate = split((fits.share + over) / 2)
        if candidate.peak.peak_bytes <= budget:
            fits = candidate
        else:
            over = candidate.share
    saved = fits.saved()
    recomputed = tuple((name, num) for name, num in default.saved().items() if name not in saved)
    choice = ActivationChoice(budget, fits.share, default.peak.peak_bytes, fits.peak.peak_bytes, recomputed)
    return fits.forward, fits.backward, choice


def partition_at(joint: fx.GraphModule, partition: Partition, share: float) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``partition`` of a copy of ``joint`` under torch's ``activation_memory_budget=share``
    (the partitioner tags and prunes the graph it is given)."""
    graph = copy.deepcopy(joint.graph)
    twin = fx.GraphModule(joint, graph)
    twin.meta.update(joint.meta)
    # Under a share the partitioner sizes every saved value; a mesh or a process group (an
    # opaque object among the graph's inputs) holds no tensor of the graph's.
    meshes_only = _script_objects(joint) <= _HOLD_NO_ACTIVATIONS
    with torch._functorch.config.patch(activation_memory_budget=share, unsafe_treat_script_objects_as_zero_size=meshes_only):
        return partition(twin)


def _script_objects(joint: fx.GraphModule) -> set[str]:
    """The class names (``DeviceMesh``, ``ProcessGroup``) of the opaque objects among ``joint``'s inputs."""
    from torch._library.fake_class_registry import FakeScriptObject

    names = set()
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, FakeScriptObject):
            names.add(value.script_class_name.rsplit(".", 1)[-1])
        elif isinstance(value, torch.ScriptObject):
            names.add(value._type().qualified_name().rsplit(".", 1)[-1])
    return names
