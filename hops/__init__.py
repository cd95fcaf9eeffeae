"""Higher-order ops that keep user regions, with their placements, through to the backend.

- :func:`local_map` (also ``dtcompile.local_map``): torch's ``local_map`` as one
  op, :data:`local_map_region`, that carries its placements (:class:`RegionSpec`)
  from Dynamo through AOTAutograd to the dtcompile backend, forward and backward.
- :func:`local_map_call`: the :class:`LocalMapCall` (function and placements) of a
  function :func:`local_map` made, ``None`` for anything else.
- :func:`check_region_outputs` / ``local_map(..., check_placements=True)``:
  verify a region's declared output placements on all simulated ranks.

Modules, bottom up: :mod:`dtcompile.hops.spec` (the placements as text, the spec, the
shared messages), :mod:`dtcompile.hops.joint` (a region's forward and backward, traced
once and partitioned), :mod:`dtcompile.hops.region_op` (the op, one implementation per
dispatch key), :mod:`dtcompile.hops.local_map` (the user API), :mod:`dtcompile.hops.check`.

Importing ``dtcompile.hops`` registers the op with torch's dispatcher (what defining a
HOP does) and changes nothing in Dynamo: the Dynamo side is
:mod:`dynamo_vars.local_map`, installed with the backend.
"""

from dtcompile.hops.check import PlacementCheckError, check_region_outputs
from dtcompile.hops.local_map import LocalMapCall, local_map, local_map_call
from dtcompile.hops.region_op import keep_regions, local_map_region, regions_kept
from dtcompile.hops.spec import LocalMapError, RegionSpec, format_placements, parse_placements

__all__ = [
    "LocalMapCall",
    "LocalMapError",
    "PlacementCheckError",
    "RegionSpec",
    "check_region_outputs",
    "format_placements",
    "keep_regions",
    "local_map",
    "local_map_call",
    "local_map_region",
    "parse_placements",
    "regions_kept",
]
