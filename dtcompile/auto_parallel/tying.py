"""Repeated layers share one choice: a 32-layer model costs about one layer's variables.

Layers are the calls of submodules that sit at the same path up to an index
(``layers.0``, ``layers.1``... of an ``nn.ModuleList`` or ``nn.Sequential``): the
*instances* of that path.  Two instances are tied when their nodes, in call
order, match one to one: same op, same non-tensor arguments, same shapes and
dtypes, and the same candidates.  Tied nodes (and tied parameters) then form one
group: one set of choice variables, whose cost counts once per copy, and edges
between two groups merge into one block (:mod:`dtcompile.auto_parallel.solver`).
The first of the matching instances is the representative; the others copy its
choice, unless tying would put both ends of an edge into one group (a layer of
one op feeding the next, such as two ``LayerNorm`` layers in a row).  The
copies' *measurements* still run (each instance is traced as the model runs), but
through the builder's cache of identical op signatures.
"""

from __future__ import annotations

import re
from typing import Any

from dtcompile.auto_parallel.graph import Problem

__all__ = ["tie_repeated_layers"]

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _instance(path: str) -> tuple[str, str] | None:
    """``layers.3.attention.wq`` -> (``layers.*``, ``layers.3``): the outermost indexed prefix
    (``3.w1`` -> (``*``, ``3``) in an ``nn.Sequential``)."""
    match = _INDEX.search(path)
    if match is None:
        return None
    start, end = match.span(1)
    return path[:start] + "*", path[:end]


class _Lists:
    """A number per distinct content of candidate lists, each list object hashed once (repeated
    layers share theirs: a 32-layer model hashed each list 32 times, a tenth of a second)."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[Any, ...], int] = {}
        self._by_id: dict[int, tuple[list[Any], int]] = {}

    def number(self, candidates: list[Any]) -> int:
        found = self._by_id.get(id(candidates))
        if found is None:  # (kept with the list, so its id stays its own)
            found = self._by_id[id(candidates)] = (candidates, self._numbers.setdefault(tuple(candidates), len(self._numbers)))
        return found[1]


def _signature(problem: Problem, name: str, lists: _Lists) -> Any:
    node = problem.nodes[name]
    fx_node = node.fx_node
    args = None
    if fx_node is not None and node.kind in ("op", "constant"):
        args = repr([a if not hasattr(a, "op") else "T" for a in fx_node.args]) + repr(sorted(fx_node.kwargs.items(), key=str))
    return (node.kind, node.target if node.kind not in ("param", "input") else "", args, tuple(node.outputs),
            lists.number(node.candidates))


def tie_repeated_layers(problem: Problem) -> int:
    """Put the matching nodes of repeated layer instances into one group; returns how many nodes were tied."""
    module_of = problem.traced.module_of
    param_module = {node.name: name.rpartition(".")[0] for name, node in problem.traced.params}
    instances: dict[str, dict[str, list[str]]] = {}
    for name, node in problem.nodes.items():
        path = param_module.get(name) if node.kind == "param" else module_of.get(node.fx_node.name) if node.fx_node is not None else None
        if path is None:
            continue
        found = _instance(path)
        if found is None:
            continue
        pattern, instance = found
        instances.setdefault(pattern, {}).setdefault(instance, []).append(name)
    tied = 0
    lists = _Lists()
    for by_instance in instances.values():
        # Instances that match one another share the first one's choices (the first layer,
        # which reads the model's input, often matches no other).
        representative: dict[Any, list[str]] = {}
        for names in by_instance.values():
            key = tuple(_signature(problem, n, lists) for n in names)
            if key not in representative:
                representative[key] = names
                continue
            mapping = dict(zip(names, representative[key]))
            if _joins_an_edge(problem, mapping):
                continue  # a layer of one op feeding the next (two LayerNorms in a row): kept apart
            for copy, rep in mapping.items():
                problem.nodes[copy].group = problem.nodes[rep].group
                tied += 1
    _tie_fanouts(problem, lists)
    return tied


def _joins_an_edge(problem: Problem, mapping: dict[str, str]) -> bool:
    """Whether tying each node of ``mapping`` to its representative's group would put both ends
    of an edge into one group (one choice cannot price the edge between its two copies)."""
    def group(name: str) -> str:
        return problem.nodes[mapping[name]].group if name in mapping else problem.nodes[name].group

    return any(group(e.producer) == group(e.consumer) for e in problem.edges if e.producer in mapping or e.consumer in mapping)


def _tie_fanouts(problem: Problem, lists: _Lists) -> None:
    """A fan-out follows its producer's group, when its producer is tied and the fan-outs match."""
    by_group: dict[tuple[str, int, tuple[Any, ...]], str] = {}
    for node in problem.nodes.values():
        if node.kind != "fanout":
            continue
        producer, index = node.inputs[0]
        readers = tuple(sorted(problem.nodes[link.consumer].group for link in problem.fanout_rules if link.fanout == node.name))
        key = (problem.nodes[producer].group, index, readers, lists.number(node.candidates))
        if key in by_group:
            node.group = by_group[key]
        else:
            by_group[key] = node.group
