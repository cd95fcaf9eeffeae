"""Options of the dtcompile backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DTCompileConfig"]


@dataclass(kw_only=True, frozen=True)
class DTCompileConfig:
    """Options of :func:`dtcompile.backend`; every field is a keyword of that call."""

    inductor: bool = True
    """Lower the AOT graphs with Inductor (``compile_fx``).  ``False`` runs the
    forward and backward graphs as they are after the passes: no codegen, fast to
    compile, for tests and debugging."""

    disable_passes: frozenset[str] = frozenset()
    """Names of graph passes to skip (see ``dtcompile.passes.PASSES``)."""

    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    """``torch._inductor.config`` settings for this backend's compiles only,
    applied with ``config.patch`` inside the call (never globally)."""

    bucket_cap_bytes: int = 256 * 1024 * 1024
    """Largest buffer (bytes per rank) the ``bucketing`` pass makes of several
    collectives; a bucket's buffer is the memory bucketing adds."""

    overlap_memory_budget_bytes: int = 1024 * 1024 * 1024
    """Most bytes (per rank) of collectives the ``overlap`` pass lets be in
    flight at once when it issues them earlier."""

    cost_profile: str = "h100"
    """Hardware profile for the estimated collective times in annotations and
    reports: a name in ``dtcompile.cost_model.PROFILES``."""

    report: bool = False
    """Print the text report (see :func:`dtcompile.explain`) of every graph this
    backend compiles, as it compiles it."""

    def __post_init__(self) -> None:
        # Normalise the collections so the frozen config cannot be changed behind
        # its back and compares by value.
        object.__setattr__(self, "disable_passes", frozenset(self.disable_passes))
        object.__setattr__(self, "inductor_config", dict(self.inductor_config))
        from dtcompile.passes import PASSES

        known = {p.name for p in PASSES}
        unknown = sorted(self.disable_passes - known)
        if unknown:
            raise ValueError(
                f"dtcompile: disable_passes names unknown passes {unknown}; "
                f"the passes are {sorted(known)}"
            )
        from dtcompile.cost_model import get_profile

        get_profile(self.cost_profile)
        if self.inductor_config:
            from torch._inductor import config as inductor_config

            unknown = sorted(k for k in self.inductor_config if not hasattr(inductor_config, k))
            if unknown:
                raise ValueError(
                    f"dtcompile: inductor_config has unknown settings {unknown}; "
                    "use names from torch._inductor.config"
                )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DTCompileConfig:
        """Builds a config from keyword options, naming the valid ones on a typo."""
        valid = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"dtcompile.backend: unknown option(s) {unknown}; valid options are {valid}"
            )
        return cls(**options)
