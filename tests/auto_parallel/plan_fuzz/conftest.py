"""The plan fuzzer's setup: ``ap_cases`` (one folder up) on the path; its options and report
are the fuzzers' fixtures of ``tests/conftest.py`` (``fuzz_options``, ``fuzz_report``)."""

from __future__ import annotations

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).resolve().parents[1])
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
