"""Reshard after forward: FSDP's gathered weights are gathered again in the backward.

A parameter stored sharded on a data-parallel axis and gathered inside the
compiled graph (SimpleFSDP's and torchtitan graph_trainer's ``data_parallel``,
dtcompile's own FSDP layouts, a functional ``all_gather`` of a plain parameter)
is, in the joint forward/backward graph, a chain from the parameter's
placeholder: ``all_gather_into_tensor -> wait_tensor`` with views, slices,
concatenations or casts around it, and nothing else feeding it.  The backward
reads the gathered weight (a linear's input gradient is ``grad @ W``), so the
partitioner saves it for the backward unless told otherwise: every gathered
weight of the model alive from forward to backward, the memory of plain data
parallel.

:func:`tag_reshard_after_forward` marks each such chain ``MUST_RECOMPUTE``
(torch's activation-checkpointing tag, which the partitioner honours for
collectives too): the forward frees the gathered weight after its last forward
use and the backward gathers the shard again, as FSDP2's
``reshard_after_forward=True`` does.  The gradients still leave as the
reduce-scatters DTensor traced.  ``DTCompileConfig.reshard_after_forward=False``
keeps every gathered weight, ``keep_gathered`` the named ones (FSDP2's
``fully_shard(module, reshard_after_forward=False)``).

The first ops that compute with a resharded weight (through its views) are tagged
``MUST_SAVE``: min-cut would otherwise price recomputing one (a LayerNorm's
output) from this rank's own sizes, and recomputing it moves the weight's
re-gather before reduce-scatters that a peer fed another batch size sends first.

Every rank tags the same chains: the decision reads only the graph's structure
and the parameters' names, which every rank's graph shares where shards are even.
Where they are not (:class:`dtcompile.pipeline.partition.Partitioner` keeps collectives in
the phase that traced them there) nothing is tagged, and the record says so.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from dtcompile.base.op_facts import ALL_GATHER, NO_WORK, UNSHARD_OPS, WAIT, op_name
from dtcompile.base.sizes import nbytes_hint
from dtcompile.records import Action, Outcome

__all__ = [
    "ParamNames",
    "Resharding",
    "kept_by_name",
    "module_fqn",
    "param_names",
    "reshard_step_graph",
    "resharded",
    "tag_reshard_after_forward",
]



ParamNames = Mapping[int, str]
"""The Dynamo graph's inputs that are parameters: input index -> parameter name."""


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]|\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


def _fqn(source: str) -> str:
    """``L['self']._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``
    (a parametrized parameter by the name its module reads it by)."""
    root = re.match(r"^[A-Z]\['[^']*'\]", source)
    rest = source[root.end():] if root else source
    parts = [next(g for g in m.groups() if g is not None) for m in _SOURCE_PART.finditer(rest)]
    return module_fqn(".".join(parts) if parts else source)


def module_fqn(name: str) -> str:
    """A parameter's name as its module reads it: torch.nn.utils.parametrize keeps ``w`` as
    ``parametrizations.w.original``, the user's name is ``w``."""
    return re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", name)


def param_names(gm: fx.GraphModule, example_inputs: Sequence[object]) -> dict[int, str]:
    """Which inputs of a Dynamo graph are parameters, and their names (from Dynamo's sources)."""
    names = {}
    for index, (node, value) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if not isinstance(value, torch.nn.Parameter):
            continue
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        names[index] = _fqn(source.name) if source is not None else node.name
    return names


def kept_by_name(name: str, keep: Set[str]) -> str | None:
    """The entry of ``keep`` (``DTCompileConfig.keep_gathered``) that names parameter ``name``
    or a module holding it, or ``None``."""
    return next((k for k in sorted(keep) if name == k or name.startswith(k + ".")), None)


def resharded(name: str, config: object) -> bool:
    """Whether parameter ``name``, gathered in a graph compiled with ``config``
    (a :class:`~dtcompile.config.DTCompileConfig`), is gathered again in the backward."""
    return bool(getattr(config, "reshard_after_forward", True)) and kept_by_name(
        name, getattr(config, "keep_gathered", frozenset())
    ) is None


def _dynamo_input(placeholder: fx.Node) -> int | None:
    """The Dynamo graph input an AOT joint graph's primal came from (its AOT descriptor)."""
    desc = placeholder.meta.get("desc")
    while desc is not None and not hasattr(desc, "idx"):
        desc = getattr(desc, "base", None)
    return getattr(desc, "idx", None)


def _partitioner_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _unshard_chain(primal: fx.Node, is_backward: Callable[[fx.Node], bool] = _partitioner_backward) -> tuple[fx.Node, ...]:
    """The forward nodes computed from ``primal`` alone through ops of :data:`~dtcompile.base.op_facts.UNSHARD_OPS`
    that lead to or come from an all-gather; empty without one."""
    chain: dict[fx.Node, None] = {primal: None}
    frontier = [primal]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in chain or user.op != "call_function":
                continue
            if is_backward(user):
                continue
            if op_name(user.target) not in UNSHARD_OPS and user.target is not operator.getitem:
                continue
            if not all(arg in chain for arg in user.all_input_nodes):
                continue
            chain[user] = None
            frontier.append(user)
    gathers = [n for n in chain if n.target is ALL_GATHER]
    if not gathers:
        return ()
    related: set[fx.Node] = set()
    for gather in gathers:
        related |= _within(gather, chain, up=True) | _within(gather, chain, up=False)
    return tuple(n for n in chain if n in related and n is not primal)


def _within(start: fx.Node, chain: Mapping[fx.Node, None], *, up: bool) -> set[fx.Node]:
    seen = {start}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for other in node.all_input_nodes if up else node.users:
            if other in chain and other not in seen:
                seen.add(other)
                frontier.append(other)
    return seen


def _saved_by_backward(chain: Sequence[fx.Node], is_backward: Callable[[fx.Node], bool] = _partitioner_backward) -> bool:
    """Whether a backward node reads a value of the chain: what the partitioner would save."""
    return any(is_backward(user) for n in chain for user in n.users)


@dataclass(frozen=True)
class Resharding:
    """What :func:`tag_reshard_after_forward` found and did."""

    decisions: tuple[Outcome, ...]
    """One per gathered parameter the backward reads: resharded, or kept and why."""
    gathered: dict[str, int]
    """Every parameter gathered in the forward -> its gathered bytes."""


def _gather_chains(
    graph: fx.Graph, name_of: Callable[[int, fx.Node], str | None], is_backward: Callable[[fx.Node], bool]
) -> Iterator[tuple[str, fx.Node, tuple[fx.Node, ...], int, bool]]:
    """``(name, primal, chain, gathered bytes, whether the backward reads it)`` for every
    parameter input (``name_of(placeholder index, placeholder)`` names it, None: not a
    parameter) whose shard is gathered in the forward."""
    for index, primal in enumerate(graph.find_nodes(op="placeholder")):
        name = name_of(index, primal)
        if name is None or not isinstance(primal.meta.get("val"), torch.Tensor):
            continue
        chain = _unshard_chain(primal, is_backward)
        if chain:
            gathered = sum(nbytes_hint(n.meta["val"]) for n in chain if n.target is WAIT and "val" in n.meta)
            yield name, primal, chain, gathered, _saved_by_backward(chain, is_backward)


def _decision(name: str, gathered: int, *, enabled: bool, keep: Set[str], refused: str = "") -> Outcome:
    """Whether a gathered parameter the backward reads is resharded (``Action.RESHARDED``) or
    kept gathered, and why."""
    held = f"{gathered} B gathered"
    kept_by = kept_by_name(name, keep)
    if refused or not enabled or kept_by is not None:
        why = refused or ("reshard_after_forward=False" if not enabled else f"keep_gathered names {kept_by!r}")
        return Outcome.skipped(name, f"kept gathered ({held}): {why}")
    return Outcome(Action.RESHARDED, f"resharded after forward: gathered again in the backward, not held ({held})", name)


def tag_reshard_after_forward(
    joint: fx.GraphModule,
    params: ParamNames,
    *,
    enabled: bool,
    keep: Set[str] = frozenset(),
    refused: str = "",
) -> Resharding:
    """Tags every parameter's gather chain that the backward reads ``MUST_RECOMPUTE``.

    ``params`` are the Dynamo graph's parameter inputs (:func:`param_names`);
    ``keep`` names (or name prefixes, ``layers.3``) of parameters kept gathered;
    ``enabled`` False keeps every one; ``refused`` (why the graph cannot be
    resharded) keeps every one and says why.
    """
    outcomes = []
    gathered_bytes: dict[str, int] = {}
    group = 0
    chains = _gather_chains(joint.graph, lambda _, primal: params.get(_dynamo_input(primal)), _partitioner_backward)
    for name, _, chain, gathered, read_by_backward in chains:
        gathered_bytes[name] = gathered
        if not read_by_backward:
            continue
        outcomes.append(_decision(name, gathered, enabled=enabled, keep=keep, refused=refused))
        if outcomes[-1].action is not Action.RESHARDED:
            continue
        for node in chain:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = group
        for user in _first_computed_from(chain, _partitioner_backward):
            user.meta.setdefault("recompute", CheckpointPolicy.MUST_SAVE)
        group += 1
    return Resharding(tuple(outcomes), gathered_bytes)


def _first_computed_from(chain: Sequence[fx.Node], is_backward: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """The forward ops that first compute with a gathered weight (through its views).

    They are saved for the backward, never recomputed there: min-cut prices recomputing one
    from this rank's own sizes, and recomputing it needs the weight's re-gather before the
    backward's first use of it, among reduce-scatters its peers may send first (a rank fed 1
    row recomputed a LayerNorm's output its peers saved, and their collectives did not pair).
    """
    members = set(chain)
    found: dict[fx.Node, None] = {}
    frontier = [user for node in chain for user in node.users if user not in members]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.op != "call_function" or is_backward(node):
            continue
        seen.add(node)
        if op_name(node.target) in NO_WORK:  # a view of it: what computes with that
            frontier.extend(node.users)
        else:
            found[node] = None
    return list(found)


def reshard_step_graph(
    gm: fx.GraphModule,
    names: Sequence[str],
    forward: Set[fx.Node],
    *,
    enabled: bool,
    keep: Set[str] = frozenset(),
) -> Resharding:
    """Reshard after forward in a whole-step graph (forward and backward in one graph, no
    partitioner): each parameter's gather chain whose value the backward reads is copied
    to just before its first backward reader, which reads the copy; the forward's gathered
    weight is then freed after its last forward use.  ``names``: each graph input's name
    (a parameter's FQN; the placeholder's name where not given); ``forward``: the forward's
    nodes (what the loss is computed from).  Decisions as :func:`tag_reshard_after_forward`'s."""
    outcomes = []
    gathered_bytes: dict[str, int] = {}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}

    def is_backward(node: fx.Node) -> bool:
        return node.op == "call_function" and node not in forward

    def name_of(index: int, primal: fx.Node) -> str:
        return names[index] if index < len(names) else primal.name

    for name, primal, chain, gathered, read_by_backward in _gather_chains(gm.graph, name_of, is_backward):
        gathered_bytes[name] = gathered
        if not read_by_backward:
            continue
        outcomes.append(_decision(name, gathered, enabled=enabled, keep=keep))
        if outcomes[-1].action is not Action.RESHARDED:
            continue
        first = min((u for n in chain for u in n.users if is_backward(u)), key=order.__getitem__)
        copies: dict[fx.Node, fx.Node] = {primal: primal}
        with gm.graph.inserting_before(first):
            for node in sorted(chain, key=order.__getitem__):
                copies[node] = gm.graph.node_copy(node, copies.__getitem__)
        made = set(copies.values())
        for node in chain:
            for user in [u for u in node.users if is_backward(u) and u not in made]:
                user.replace_input_with(node, copies[node])
    if outcomes:
        gm.graph.lint()
    return Resharding(tuple(outcomes), gathered_bytes)
