"""Fixtures: fake worlds and meshes for graph-structure tests.

The simulated and real-rank runners live in ``dtcompile._testing.worlds`` so
that benchmarks and the demo use the same code.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dtcompile._testing.worlds import fake_world


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with empty Dynamo caches: no recompile limit carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def world4():
    with fake_world(4):
        yield 4


@pytest.fixture
def world8():
    with fake_world(8):
        yield 8


@pytest.fixture
def tp_mesh(world4):
    return init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))


@pytest.fixture
def dp_tp_mesh(world8):
    return init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
