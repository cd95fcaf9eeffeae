"""The ``dtcompile`` pytest plugin (entry point ``pytest11``): fixtures, nothing autouse.

Loading it imports neither torch nor dtcompile: they are imported when a test
asks for one of its fixtures, so an unrelated project's pytest run in an
environment with dtcompile installed starts as fast as without it.

- ``fake_world``: a function ``fake_world(world_size, mesh_shape=None,
  mesh_dim_names=None, *, rank=0) -> DeviceMesh`` that enters
  :func:`dtcompile.testing.fake_world` for the rest of the test;
- ``simulated_world``: the same for :func:`dtcompile.testing.simulated_world`.

Both tear down the default process group (and the LocalTensorMode) after the
test, and reset Dynamo's caches before and after it, so that no compiled code
or recompile count leaks from one test into the next.  A test that uses
neither fixture is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def _world_fixture(enter: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    import torch

    from dtcompile.base.sharding_cache import clear_sharding_caches

    stack = contextlib.ExitStack()
    torch._dynamo.reset()
    clear_sharding_caches()

    def make(*args: Any, **kwargs: Any) -> Any:
        return stack.enter_context(enter(*args, **kwargs))

    with stack:
        yield make
    torch._dynamo.reset()
    # Sharding decisions cached under one test's mesh must not answer for the next's.
    clear_sharding_caches()


@pytest.fixture(name="fake_world")
def _fake_world() -> Iterator[Callable[..., Any]]:
    from dtcompile.testing import fake_world

    with _world_fixture(fake_world) as make:
        yield make


@pytest.fixture(name="simulated_world")
def _simulated_world() -> Iterator[Callable[..., Any]]:
    from dtcompile.testing import simulated_world

    with _world_fixture(simulated_world) as make:
        yield make
