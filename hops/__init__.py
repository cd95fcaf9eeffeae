"""Higher-order ops that keep user regions, with their placements, through to the backend.

- :func:`local_map` (also ``dtcompile.local_map``): torch's ``local_map`` as one
  op, :data:`local_map_region`, that carries its placements (:class:`RegionSpec`)
  from Dynamo through AOTAutograd to the dtcompile backend, forward and backward.
- :func:`check_region_outputs` / ``local_map(..., check_placements=True)``:
  verify a region's declared output placements on all simulated ranks.
"""

from hops.check import PlacementCheckError, check_region_outputs
from hops.local_map import (
    LocalMapError,
    RegionSpec,
    format_placements,
    keep_regions,
    local_map,
    local_map_region,
    parse_placements,
    regions_kept,
)

__all__ = [
    "LocalMapError",
    "PlacementCheckError",
    "RegionSpec",
    "check_region_outputs",
    "format_placements",
    "keep_regions",
    "local_map",
    "local_map_region",
    "parse_placements",
    "regions_kept",
]
