"""The warm-cache tests import the other suites' harnesses (the auto-parallel zoo's, the HF zoo's,
the fuzzer's, the torchtitan clients'): their folders are put on ``sys.path``, as pytest does for a test
file's own folder."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for folder in (_TESTS / "auto_parallel", _TESTS / "auto_parallel" / "hf_zoo", _TESTS / "clients", _TESTS / "fuzz"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
