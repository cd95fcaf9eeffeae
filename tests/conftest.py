"""Fixtures for the project's tests, built on the ``dtcompile`` pytest plugin's worlds.

``fake_world`` and ``simulated_world`` come from ``dtcompile_tools.pytest_plugin``
(the same fixtures users get); the ones here only name the meshes the tests use.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with empty Dynamo caches: no recompile limit carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def world4(fake_world):
    fake_world(4)
    return 4


@pytest.fixture
def world8(fake_world):
    fake_world(8)
    return 8


@pytest.fixture
def tp_mesh(fake_world):
    return fake_world(4, (4,), ("tp",))


@pytest.fixture
def dp_tp_mesh(fake_world):
    return fake_world(8, (2, 4), ("dp", "tp"))
