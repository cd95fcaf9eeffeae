"""How dtcompile splits a joint forward/backward graph into its forward and backward.

:class:`Partitioner` is the partitioner the backend gives AOTAutograd (and
Inductor, as its ``custom_partitioner_fn``): Inductor's min-cut partitioner, or,
where ranks' graphs can differ (uneven shards, or the joint graph's own padded
collectives), the default partitioner with every collective kept in the phase
that traced it (:func:`partition_keeping_collectives`): min-cut decides what to
recompute from each rank's own graph, and a rank that recomputes a collective
the others saved waits for them forever (found by the fuzzer).

Before either partitions, :func:`dtcompile.pipeline.reshard.tag_reshard_after_forward`
marks the gathers of sharded parameters to be done again in the backward
(``reshard_after_forward``); :attr:`Partitioner.resharding` says what it did, and
:attr:`Partitioner.held_during_backward` what the caller holds while the backward
runs (:mod:`dtcompile.graph.memory`).  With ``memory_budget_bytes`` set, the min-cut
split recomputes activations until the forward and backward fit it
(:mod:`dtcompile.pipeline.recompute`; :attr:`Partitioner.activations` says what).

A :class:`Partitioner` is a module-level object whose pickled state is its
settings, so Inductor's FX graph cache and AOTAutograd's cache can key on it
(:meth:`Partitioner.uuid` carries :func:`dtcompile.cache_keys.compile_key`).

Keeping collectives needs two functions of ``torch._functorch.partitioners``
changed for the call; they are replaced only while a partition that keeps
collectives runs (:func:`_rules_for_keeping`), and act only in the thread
that runs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from dtcompile.base.op_facts import WAIT
from dtcompile.base.scoped_patch import ScopedPatch
from dtcompile.graph.collectives import is_collective
from dtcompile.graph.memory import held_during_backward
from dtcompile.graph.rank_dependence import ranks_may_differ
from dtcompile.pipeline.recompute import ActivationChoice, fit_activation_budget
from dtcompile.pipeline.reshard import ParamNames, Resharding, tag_reshard_after_forward
from dtcompile.records import PassRecord

__all__ = ["Partitioner", "partition_keeping_collectives"]


class Partitioner(CustomPartitionerFn):
    """The partitioner for one Dynamo graph.

    ``uneven``: the Dynamo graph's unevenly sharded DTensors
    (:attr:`~dtcompile.annotations.DynamoGraphInfo.uneven`); where there are any, or
    DTensor padded a collective of the joint graph, ranks' graphs may differ
    (:func:`~dtcompile.graph.rank_dependence.ranks_may_differ`) and collectives are kept.  ``key``: what else decides the graphs of
    this compile (:func:`dtcompile.cache_keys.compile_key`, which carries the
    ``reshard_after_forward`` and ``keep_gathered`` options); with ``uneven`` and
    ``params`` (the Dynamo graph's parameter inputs, :func:`dtcompile.pipeline.reshard.param_names`)
    it is :meth:`uuid`, which torch's compile caches key on, and all that pickles.
    ``on_start`` (neither keyed nor pickled) is called when partitioning starts:
    AOTAutograd's trace has finished by then.  :attr:`resharding`,
    :attr:`held_during_backward` and :attr:`seconds` describe the last partition.
    """

    def __init__(
        self,
        uneven: Sequence[str],
        key: str = "",
        on_start: Callable[[], None] | None = None,
        *,
        params: ParamNames | None = None,
        reshard: bool = True,
        keep_gathered: frozenset[str] = frozenset(),
        memory_budget: int | None = None,
        name: str = "this graph",
    ) -> None:
        self.uneven = tuple(uneven)
        self.key = key
        self.params = dict(params or {})
        self.reshard = reshard
        self.keep_gathered = keep_gathered
        self.memory_budget = memory_budget
        self.name = name
        self.on_start = on_start
        self.resharding = Resharding((), {})
        self.activations: ActivationChoice | None = None
        self.held_during_backward = 0
        self.seconds = 0.0
        """Wall time of the last partition, min-cut included (:attr:`dtcompile.records.Stage.PARTITIONER`)."""

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
        if self.on_start is not None:
            self.on_start()
        start = time.perf_counter()
        try:
            return self._partition(gm, joint_inputs, **kwargs)
        finally:
            self.seconds = time.perf_counter() - start

    def _partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        keeping = bool(ranks_may_differ(self.uneven, gm))
        refused = (
            "sharded unevenly: the partition keeps every collective in the phase that traced it"
            if keeping
            else ""
        )
        self.resharding = tag_reshard_after_forward(
            gm, self.params, enabled=self.reshard, keep=self.keep_gathered, refused=refused
        )
        self.activations = None
        if keeping:
            # No activation budget: the passes keep the budget or say it is below the peak.
            kwargs.pop("compiler", None)
            forward, backward = partition_keeping_collectives(gm, joint_inputs, **kwargs)
        else:
            kwargs.setdefault("compiler", "inductor")

            def min_cut(joint: fx.GraphModule) -> Any:
                return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

            if self.memory_budget is None:
                forward, backward = min_cut(gm)
            else:
                forward, backward, self.activations = fit_activation_budget(gm, min_cut, self.memory_budget, self.name)
        self.held_during_backward = held_during_backward(forward, backward)
        return forward, backward

    def records(self, forward: fx.GraphModule) -> list[PassRecord]:
        """The partition's decisions, the first records of the ``forward`` graph: the
        ``reshard_after_forward`` decisions, and the ``activation_budget``'s where it
        recomputed activations to fit ``memory_budget_bytes``."""
        records = []
        if self.resharding.decisions:
            nodes = len(forward.graph.nodes)
            collectives = sum(1 for n in forward.graph.nodes if is_collective(n))
            decisions = self.resharding.decisions
            records.append(PassRecord("reshard_after_forward", True, nodes, nodes, collectives, collectives, decisions))
        if self.activations is not None:
            records.append(self.activations.record(forward))
        return records

    def uuid(self) -> str:
        params = ", ".join(f"{i}:{name}" for i, name in sorted(self.params.items()))
        return f"dtcompile.pipeline.partition(uneven={bool(self.uneven)}, params=[{params}], {self.key})"

    def __getstate__(self) -> dict[str, Any]:
        # What a cache key sees: the settings, never this compile's callback or findings.
        return {
            "uneven": self.uneven,
            "key": self.key,
            "params": self.params,
            "reshard": self.reshard,
            "keep_gathered": sorted(self.keep_gathered),
            "memory_budget": self.memory_budget,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.uneven = state["uneven"]
        self.key = state["key"]
        self.params = state["params"]
        self.reshard = state["reshard"]
        self.keep_gathered = frozenset(state["keep_gathered"])
        self.memory_budget = state["memory_budget"]
        self.name = "this graph"
        self.on_start = None
        self.resharding = Resharding((), {})
        self.activations = None
        self.held_during_backward = 0
        self.seconds = 0.0


_keeping = threading.local()


def _install_keeping_rules() -> Callable[[], None]:
    """Replaces ``partitioners.is_not_collective`` and ``_must_be_in_forward``; returns the undo."""
    from torch._functorch import partitioners

    originals = {}
    for name, make in (
        ("is_not_collective", _keep_collectives_in_their_phase),
        ("_must_be_in_forward", _forward_collectives_stay_forward),
    ):
        originals[name] = getattr(partitioners, name)
        setattr(partitioners, name, make(originals[name]))

    def undo() -> None:
        for name, original in originals.items():
            setattr(partitioners, name, original)

    return undo


# The rules are replaced while any thread partitions keeping collectives, the
# originals back when the last one ends.  The replacements act only where
# ``_keeping.joint`` is set, which is per thread: another thread's partition in
# the meantime gets the original rules.
_rules_for_keeping = ScopedPatch(_install_keeping_rules)


def partition_keeping_collectives(gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
    """The default partitioner, except that every collective the joint trace issued
    stays in the graph of the phase that issued it, used or not.

    The partitioner ends with a dead-code pass over each graph that removes unused
    collectives (``partitioners.is_not_collective``), which assumes every rank
    has the same graph.  Under uneven shards they need not: a rank whose share of
    a gathered result is empty computes that share as a constant, its all-gather
    is dead there and was removed, and the ranks holding rows waited in theirs
    forever (found by the fuzzer).  Here a collective traced in the forward
    (``partitioner_tag == "is_forward"``) stays in the forward graph, one traced
    in the backward stays in the backward graph; the copies the partitioner makes
    of a collective in the other graph go, as before.  A forward collective is
    never recomputed in the backward either (``partitioners._must_be_in_forward``):
    on a rank with an empty share the partitioner recomputed one there instead of
    saving its result, and the other ranks' backwards issue no such collective.
    """
    from torch._functorch import partitioners

    with _rules_for_keeping():
        _keeping.joint = gm.graph
        try:
            graphs = partitioners.default_partition(gm, joint_inputs, **kwargs)
        finally:
            _keeping.joint = None
    for module in graphs:
        _drop_dead_copies(module)
    return graphs


def _drop_dead_copies(module: fx.GraphModule) -> None:
    """Removes what is dead in a partitioned graph but what its phase traced: the
    partitioner's own dead-code pass keeps every node but a collective, so a dead copy
    of a backward collective (and the ops that feed and read it) stayed in the forward
    on a rank whose share of it is empty, and that rank issued one collective more
    than the others (a hang, found by the fuzzer's run of 5000)."""
    backward = _is_backward_graph(module.graph)

    def keep(node: fx.Node) -> bool:
        if node.op in ("placeholder", "output", "get_attr"):
            return True
        if _collective_or_wait(node):
            return _traced_in_this_phase(node, backward)
        return node.is_impure()

    if module.graph.eliminate_dead_code(is_impure_node=keep):
        module.recompile()


def _keep_collectives_in_their_phase(original: Callable[[fx.Node], bool]) -> Callable[[fx.Node], bool]:
    def is_not_collective(node: fx.Node) -> bool:
        joint = getattr(_keeping, "joint", None)
        if joint is None:
            return original(node)
        if original(node) or node.graph is joint:
            return True
        return _traced_in_this_phase(node, _is_backward_graph(node.graph))

    return is_not_collective


def _forward_collectives_stay_forward(original: Callable[[fx.Node], bool]) -> Callable[[fx.Node], bool]:
    def _must_be_in_forward(node: fx.Node) -> bool:
        if getattr(_keeping, "joint", None) is not None and _collective_or_wait(node):
            if _traced_in_this_phase(node, backward=False):
                return True
        return original(node)

    return _must_be_in_forward


def _collective_or_wait(node: fx.Node) -> bool:
    return is_collective(node) or node.target is WAIT


def _traced_in_this_phase(node: fx.Node, backward: bool) -> bool:
    """Whether the joint trace issued ``node`` in the phase of a graph that is ``backward`` or not."""
    return (node.meta.get("partitioner_tag") == "is_forward") != backward


def _is_backward_graph(graph: fx.Graph) -> bool:
    """Whether a graph the partitioner made is the backward one: it takes the tangents."""
    return any(n.op == "placeholder" and n.meta.get("partitioner_tag") == "is_backward" for n in graph.nodes)
