"""The ordered list of FX passes dtcompile runs on every AOT graph.

Every pass has one contract, ``(gm, example_inputs, config) -> gm``, a unique
name by which ``DTCompileConfig.disable_passes`` switches it off, and logs what
it changed.  They run on the forward and backward graphs after AOTAutograd's
partitioner and before lowering; ``gm.meta["dtcompile_graph_kind"]`` says which
graph it is (``forward``, ``backward`` or ``inference``) and
``gm.meta["dtcompile_mesh_axes"]`` maps process-group names to mesh axis names,
``gm.meta["dtcompile_graph_info"]`` is the Dynamo graph's
:class:`~dtcompile.annotations.DynamoGraphInfo`.

Where each pass lives:

- ``async_tp`` (:mod:`dtcompile.passes.async_tp`): all-gather -> matmul(s) and
  matmul -> reduce-scatter become ``dtcompile::fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (:mod:`dtcompile.ops`).
- ``bucketing`` (:mod:`dtcompile.passes.bucketing`): independent all-gathers,
  reduce-scatters and all-reduces on one group become one collective, under
  ``config.bucket_cap_bytes``.
- ``overlap`` (:mod:`dtcompile.passes.overlap`): collectives issued as early
  as their inputs allow and waited on as late as their users allow, within
  ``config.overlap_memory_budget_bytes``.
- ``annotate`` (:mod:`dtcompile.passes.annotate`): every call node gets
  ``node.meta["dtcompile_annotation"]``; every functional collective also its
  :class:`~dtcompile.CollectiveInfo` in ``node.meta["dtcompile_collective"]``
  and its estimated time in ``node.meta["dtcompile_cost_us"]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import fx

from dtcompile.collectives import is_collective
from dtcompile.passes.annotate import annotate
from dtcompile.passes.async_tp import fuse_async_tp
from dtcompile.passes.bucketing import bucket_collectives
from dtcompile.passes.overlap import reorder_for_overlap

if TYPE_CHECKING:
    from dtcompile.config import DTCompileConfig

__all__ = ["PASSES", "GraphPass", "PassRecord", "run_passes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphPass:
    name: str
    fn: Callable[[fx.GraphModule, Sequence[Any], DTCompileConfig], fx.GraphModule]


@dataclass(frozen=True)
class PassRecord:
    """What one pass did to one graph."""

    name: str
    ran: bool
    """False when the pass was switched off by name."""
    nodes_before: int
    nodes_after: int
    collectives_before: int
    collectives_after: int
    decisions: tuple[str, ...] = ()
    """What the pass did, and what it left alone and why, one line each."""


# Rewrites first, then ``annotate``: it describes the graph that is lowered.
PASSES: tuple[GraphPass, ...] = (
    GraphPass("async_tp", fuse_async_tp),
    GraphPass("bucketing", bucket_collectives),
    GraphPass("overlap", reorder_for_overlap),
    GraphPass("annotate", annotate),
)


def _num_collectives(gm: fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if is_collective(node))


def run_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: DTCompileConfig
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Runs :data:`PASSES` in order, skipping those in ``config.disable_passes``."""
    records = []
    kind = gm.meta.get("dtcompile_graph_kind", "graph")
    for graph_pass in PASSES:
        nodes = len(gm.graph.nodes)
        collectives = _num_collectives(gm)
        if graph_pass.name in config.disable_passes:
            log.debug("%s: pass %s switched off", kind, graph_pass.name)
            records.append(
                PassRecord(graph_pass.name, False, nodes, nodes, collectives, collectives)
            )
            continue
        gm = graph_pass.fn(gm, example_inputs, config)
        decisions = gm.meta.get("dtcompile_decisions", {}).get(graph_pass.name, [])
        record = PassRecord(
            graph_pass.name,
            True,
            nodes,
            len(gm.graph.nodes),
            collectives,
            _num_collectives(gm),
            tuple(decisions),
        )
        for decision in decisions:
            log.info("%s: %s: %s", kind, graph_pass.name, decision)
        log.info(
            "%s: pass %s: nodes %d -> %d, collectives %d -> %d",
            kind,
            record.name,
            record.nodes_before,
            record.nodes_after,
            record.collectives_before,
            record.collectives_after,
        )
        records.append(record)
    return gm, records
