"""The plan fuzzer's fixtures: ``ap_cases`` (one folder up) on the path, the fuzzer options of
``tests/conftest.py`` (``--fuzz-examples``, ``--fuzz-seed``), and a report printed in pytest's
terminal summary, as ``tests/fuzz`` has them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HELPERS = str(Path(__file__).resolve().parents[1])
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)

_REPORTS = pytest.StashKey[list]()


@pytest.fixture
def plan_fuzz_options(request):
    """``(examples, seed)``: ``None`` for each one not given on the command line."""
    return request.config.getoption("fuzz_examples"), request.config.getoption("fuzz_seed")


@pytest.fixture
def plan_fuzz_report(request):
    """Call with a text: it is printed at the end of the run, also when the test passes."""
    return request.config.stash.setdefault(_REPORTS, []).append


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for text in config.stash.get(_REPORTS, []):
        terminalreporter.write_sep("=", "dtcompile plan fuzzer")
        terminalreporter.write_line(text)
