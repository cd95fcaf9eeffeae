"""``hops.local_map``: one op from Dynamo to the backend, with its placements; numerics; bad input."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile._testing.regions import REGION_CASES
from dtcompile.regions import format_with_regions
from dtcompile.testing import simulated_world
from hops import LocalMapError, PlacementCheckError, RegionSpec, local_map, parse_placements


def _mesh(fake_world, case):
    return fake_world(4, case.mesh_shape, case.mesh_names)


def _graphs(case_name, mesh):
    """The Dynamo graph and dtcompile's forward and backward AOT graphs as the passes saw
    them (regions not yet inlined), after one compiled step with backward."""
    case = REGION_CASES[case_name]
    backend = dtcompile.backend(inductor=False)
    dynamo = []

    def capture(gm, example_inputs):
        dynamo.append(format_with_regions(gm))
        return backend(gm, example_inputs)

    inputs = case.inputs(mesh, case.global_inputs())
    out = torch.compile(case.make(mesh), backend=capture, fullgraph=True)(*inputs)
    out.to_local().sum().backward()
    (forward,) = [r for r in backend.records if r.kind == "forward"]
    (backward,) = [r for r in backend.records if r.kind == "backward"]
    assert len(dynamo) == 1
    return dynamo[0], forward, backward
