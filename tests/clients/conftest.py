"""The torchtitan client tests' fixture (their harness is ``_titan.py``); the HuggingFace
client test builds its models from the HF zoo (``tests/auto_parallel/hf_zoo``, put on ``sys.path``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _titan import torchtitan_on_cpu as _torchtitan_on_cpu

_HF_ZOO = str(Path(__file__).resolve().parents[1] / "auto_parallel" / "hf_zoo")
if _HF_ZOO not in sys.path:
    sys.path.insert(0, _HF_ZOO)


@pytest.fixture(scope="module")
def torchtitan_on_cpu() -> Iterator[None]:
    """torchtitan 0.3.0 imported and pointed at CPU for the module (skips, or fails in CI, without it)."""
    with _torchtitan_on_cpu():
        yield
