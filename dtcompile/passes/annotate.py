"""Annotation passes: they add metadata and leave the graph's computation alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import fx

from dtcompile.annotations import annotate_aot_graph
from dtcompile.base.channels import Meta
from dtcompile.base.sizes import UNBACKED_HINT
from dtcompile.passes.context import PassContext

log = logging.getLogger(__name__)


def annotate(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """Annotates every call node (see :mod:`dtcompile.annotations`): collectives with
    their mesh axis, bytes and estimated time, other nodes with the DTensor op and
    placement they come from.  A data-dependent collective is annotated
    ``data-dependent`` and costed from its estimated size, which it records."""
    count = annotate_aot_graph(gm, ctx.kind, ctx.info)
    for node in gm.graph.nodes:
        collective = node.meta.get(Meta.COLLECTIVE)
        if collective is not None and collective.data_dependent:
            ctx.skipped(
                node.name,
                f"bytes not counted: its sizes are data-dependent; its time is estimated at {UNBACKED_HINT} per unknown size",
            )
    log.debug("annotate: %d nodes annotated", count)
    return gm
