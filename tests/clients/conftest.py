"""The torchtitan client tests' fixture (their harness is ``tests/support/titan.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.titan import torchtitan_on_cpu as _torchtitan_on_cpu


@pytest.fixture(scope="module")
def torchtitan_on_cpu() -> Iterator[None]:
    """torchtitan 0.3.0 imported and pointed at CPU for the module (skips, or fails in CI, without it)."""
    with _torchtitan_on_cpu():
        yield
