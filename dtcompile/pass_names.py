"""The names of dtcompile's graph passes, in the order they run.

Below both :mod:`dtcompile.config` (which validates ``disable_passes`` against
them) and :mod:`dtcompile.passes` (whose ``PASSES`` carry these names, in this
order; a test checks), so neither imports the other to know them.
"""

from __future__ import annotations

__all__ = ["COMMUNICATION_PASSES", "PASS_NAMES"]

PASS_NAMES: tuple[str, ...] = ("async_tp", "bucketing", "overlap", "optimizer_updates", "annotate")
"""Every pass, in the order :func:`dtcompile.passes.run_passes` runs them."""

COMMUNICATION_PASSES: frozenset[str] = frozenset({"async_tp", "bucketing", "overlap"})
"""The passes that change what collectives run, or when; ``annotate`` only describes."""
