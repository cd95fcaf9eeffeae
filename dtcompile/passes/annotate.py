"""Annotation passes: they add metadata and leave the graph's computation alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import fx

from dtcompile.annotations import annotate_aot_graph

log = logging.getLogger(__name__)


def annotate(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> fx.GraphModule:
    """Annotates every call node (see :mod:`dtcompile.annotations`): collectives with
    their mesh axis, bytes and estimated time, other nodes with the DTensor op and
    placement they come from."""
    info = gm.meta["dtcompile_graph_info"]
    count = annotate_aot_graph(gm, gm.meta.get("dtcompile_graph_kind", "forward"), info)
    log.debug("annotate: %d nodes annotated", count)
    return gm
