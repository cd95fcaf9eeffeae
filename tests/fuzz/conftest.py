"""The fuzzer's fixtures: its budget and seed (``--fuzz-examples``, ``--fuzz-seed``, from
``tests/conftest.py``), and its report, printed in pytest's terminal summary."""

from __future__ import annotations

import pytest

_REPORTS = pytest.StashKey[list]()


@pytest.fixture
def fuzz_options(request):
    """``(examples, seed)``: ``None`` for each one not given on the command line."""
    return request.config.getoption("fuzz_examples"), request.config.getoption("fuzz_seed")


@pytest.fixture
def fuzz_report(request):
    """Call with a text: it is printed at the end of the run, also when the test passes."""
    reports = request.config.stash.setdefault(_REPORTS, [])
    return reports.append


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for text in config.stash.get(_REPORTS, []):
        terminalreporter.write_sep("=", "dtcompile fuzzer")
        terminalreporter.write_line(text)
