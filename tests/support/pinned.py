"""Other projects' packages the tests run, at the versions they pin."""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def require_pinned(distribution: str, version: str, install: str) -> None:
    """Fails in CI (which installs it: ``DTCOMPILE_TEST_INSTALLED=1``), skips elsewhere, unless
    ``distribution`` is installed at ``version``; the message says how to install it."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == version:
        return
    what = "not installed" if found is None else f"{found} installed"
    message = f"{distribution} {version} needed, {what}: {install}"
    if os.environ.get("DTCOMPILE_TEST_INSTALLED") == "1":
        pytest.fail(message + " (the README's test command does)")
    pytest.skip(message)
