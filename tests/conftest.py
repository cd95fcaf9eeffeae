"""Fixtures for the project's tests, built on the ``dtcompile`` pytest plugin's worlds, and the tiers.

``fake_world`` and ``simulated_world`` come from ``dtcompile_tools.pytest_plugin``
(the same fixtures users get); the ones here only name the meshes the tests use.

Tiers (markers, registered in pyproject.toml), each carried by the test itself, never
read from its name: ``gloo`` where it runs real gloo ranks, ``inductor`` where it (or
one of its parameters, ``pytest.param(..., marks=...)``) lowers with Inductor,
``subprocess`` where it starts a fresh interpreter (or uses the fixture that starts
one, ``trace_dir``, which adds it here), ``models`` where it compiles a whole shared
model on threaded ranks (or pins one whole).  A name once put pure checks in the slow
tiers: the torch contract's Inductor names, the option validation, the pricing of
gloo, which then never ran on the older releases.  The fast
tier is ``pytest -n 2 -m "not gloo and not inductor and not subprocess and not models and not fuzz and not slow"``
(``slow``: its tests over about 2.5 s, which CI's older releases run with it)
(``fuzz``: the differential fuzzer's batch and its pinned finds, tests/fuzz; ``--fuzz-examples N`` and
``--fuzz-seed S`` run it longer or elsewhere).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    # torch's compile caches start empty for each run of the suite (in a folder of
    # its own, which subprocesses inherit): a graph an earlier run compiled would
    # otherwise be served from AOTAutograd's cache and leave no dtcompile record.
    # Tests of the caches themselves give each process its own folder.
    if not hasattr(config, "workerinput"):  # xdist workers inherit the controller's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dtcompile-tests-inductor-")
        # No profile this machine's user calibrated (~/.cache/dtcompile/profiles) changes what
        # cost_profile="auto" picks in the tests.
        os.environ["DTCOMPILE_PROFILE_DIR"] = tempfile.mkdtemp(prefix="dtcompile-tests-profiles-")
        # Nor does a plan read what this machine's earlier runs measured (its workers share one
        # folder: what one measures, the others may read, as a job's ranks would).
        os.environ["DTCOMPILE_AUTO_PARALLEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dtcompile-tests-plans-")


def pytest_addoption(parser):
    # Here, not in tests/fuzz/conftest.py: pytest reads options only from the
    # conftests it loads at startup, and `pytest tests --fuzz-examples N` would not.
    group = parser.getgroup("dtcompile fuzzer (tests/fuzz)")
    group.addoption("--fuzz-examples", type=int, default=None, help="programs the fuzzer runs (default 200 programs, 48 plan-fuzzer models: the CI budget)")
    group.addoption("--fuzz-seed", type=int, default=None, help="the fuzzer's seed (default: the fixed CI seed)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "trace_dir" in getattr(item, "fixturenames", ()):
            # tests/inspection's TORCH_TRACE comes from a fresh interpreter.
            item.add_marker(pytest.mark.subprocess)
    # The fuzzer's tests run last: they keep threaded worlds alive across many
    # programs and tear down hung ones, and a later test must not start from
    # whatever a torn-down world left behind.  The warm-cache tests (minutes each)
    # run first, so that pytest-xdist's workers do not end with one of them alone.
    items[:] = sorted(items, key=lambda item: (item.nodeid.startswith("tests/fuzz/"), item.get_closest_marker("warm") is None))


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


# The fuzzers' fixtures (tests/fuzz, tests/auto_parallel/plan_fuzz): their budget and seed
# (--fuzz-examples, --fuzz-seed) and their reports, printed in pytest's terminal summary.
_FUZZ_REPORT = "dtcompile_fuzz_report"


@pytest.fixture
def fuzz_options(request):
    """``(examples, seed)``: ``None`` for each one not given on the command line."""
    return request.config.getoption("fuzz_examples"), request.config.getoption("fuzz_seed")


@pytest.fixture
def fuzz_report(request):
    """Call with a text: it is printed at the end of the run (under the test's id), also when
    the test passes, and also from pytest-xdist's workers (it travels as a user property)."""
    return lambda text: request.node.user_properties.append((_FUZZ_REPORT, text))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            for key, text in getattr(report, "user_properties", ()):
                if key == _FUZZ_REPORT and report.when == "call":
                    terminalreporter.write_sep("=", f"dtcompile fuzzer: {report.nodeid}")
                    terminalreporter.write_line(text)
