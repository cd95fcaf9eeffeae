"""Annotation passes: they add metadata and leave the graph's computation alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import fx

from dtcompile.collectives import collective_info

log = logging.getLogger(__name__)


def annotate_collectives(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any
) -> fx.GraphModule:
    """Stores each collective's :class:`CollectiveInfo` in ``node.meta["dtcompile_collective"]``."""
    count = 0
    axes = gm.meta.get("dtcompile_mesh_axes")
    for node in gm.graph.nodes:
        info = collective_info(node, axes)
        if info is not None:
            node.meta["dtcompile_collective"] = info
            count += 1
    log.debug("annotate_collectives: %d collectives annotated", count)
    return gm
