"""The auto-parallel tests' subfolders (the zoo, the HF zoo, the plan fuzzer) import this folder's
helpers (``ap_cases``) and the torchtitan client harness (``_titan``, ``tests/clients``): both
folders are put on ``sys.path``, as pytest does for a test file's own folder."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for folder in (_TESTS / "auto_parallel", _TESTS / "clients"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
