"""Options of the dtcompile backend: one frozen, hashable, validated config.

Every field is a keyword of :func:`dtcompile.backend` and a key of
``torch.compile(..., options={...})``; every field is checked by type and
range when the config is made, and a bad value is a ``ValueError`` or
``TypeError`` that names the field, what it got and what it takes.  Each field
declares, where it is declared (``_option``), its check and whether the compile
caches key on it (:meth:`DTCompileConfig.key_field_names`); the checks, the hash
and :func:`dtcompile.cache_keys.key_fields` iterate those declarations.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from dtcompile.cost import AUTO, HardwareProfile, get_profile
from dtcompile.pass_names import PASS_NAMES

__all__ = ["DTCompileConfig", "config_for", "inductor_settings"]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"dtcompile: {name} must be True or False, got {type(value).__name__} {value!r}")


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"dtcompile: {name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"dtcompile: {name} must be > 0 seconds and finite, got {value}")


def _bytes(*, minimum: int, optional: bool = False) -> Callable[[str, Any], None]:
    """The check of a number of bytes ``>= minimum`` (or ``None``, where ``optional``)."""

    def check(name: str, value: Any) -> None:
        if not (optional and value is None):
            _check_bytes(name, value, minimum=minimum)

    return check


def _check_bytes(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"dtcompile: {name} must be a number of bytes (int), got {type(value).__name__} {value!r}; "
            f"write 256 * 1024 * 1024 for 256 MiB"
        )
    if value < minimum:
        raise ValueError(f"dtcompile: {name} must be >= {minimum} bytes, got {value}")


def _string_set(field_name: str, value: Any, what: str, one: str) -> frozenset[str]:
    """``value`` as a set of strings, or a ``TypeError`` that names the field."""
    if isinstance(value, str) or not isinstance(value, (Set, list, tuple)):
        fix = f"; write {{{value!r}}} for one {one}" if isinstance(value, str) else ""
        raise TypeError(f"dtcompile: {field_name} must be a set of {what}, got {type(value).__name__} {value!r}{fix}")
    names = frozenset(value)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"dtcompile: {field_name} must hold {what} (str), got {sorted(map(repr, names))}")
    return names


def _names(field_name: str, value: Any) -> frozenset[str]:
    names = _string_set(field_name, value, "parameter or module names", "name")
    bad = sorted(repr(n) for n in names if not n or n != n.strip(".") or n != n.strip())
    if bad:
        raise ValueError(
            f"dtcompile: {field_name} must hold parameter or module names like 'layers.0.attention', got {bad}"
        )
    return names


def _pass_names(field_name: str, value: Any) -> frozenset[str]:
    names = _string_set(field_name, value, "pass names", "pass")
    known = set(PASS_NAMES)
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"dtcompile: {field_name} names unknown passes {unknown}; the passes are {sorted(known)}")
    return names


def _inductor_settings(field_name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"dtcompile: inductor_config must be a mapping of torch._inductor.config settings, "
            f"got {type(value).__name__} {value!r}"
        )
    settings = dict(value)
    if not settings:
        return types.MappingProxyType(settings)
    bad_keys = sorted(repr(k) for k in settings if not isinstance(k, str))
    if bad_keys:
        raise TypeError(f"dtcompile: inductor_config keys must be setting names (str), got {bad_keys}")
    nested = sorted(k for k, v in settings.items() if isinstance(v, Mapping))
    if nested:
        raise ValueError(
            f"dtcompile: inductor_config has nested mappings under {nested}; give nested settings by "
            "dotted name, e.g. {'triton.cudagraphs': True}"
        )
    unknown = sorted(set(settings) - inductor_settings())
    if unknown:
        raise ValueError(
            f"dtcompile: inductor_config has unknown settings {unknown}; use names from torch._inductor.config"
        )
    return types.MappingProxyType(settings)


def _check_profile(name: str, value: Any) -> None:
    if isinstance(value, HardwareProfile):
        return
    if not isinstance(value, str):
        raise TypeError(
            f"dtcompile: {name} must be a profile name (str), {AUTO!r} or a "
            f"dtcompile.cost.HardwareProfile, got {type(value).__name__} {value!r}"
        )
    if value != AUTO:
        get_profile(value)


_CHECK, _IN_KEY = "check", "in_key"


def _option(default: Any, check: Callable[[str, Any], Any], *, in_key: bool = True, factory: bool = False) -> Any:
    """A config field: its default (``factory``: a function that makes it), its
    ``check(name, value)`` (raises on a bad value; returns the value normalized, or ``None``
    to keep it as given), and whether the compile caches key on it
    (:meth:`DTCompileConfig.key_field_names`)."""
    metadata = {_CHECK: check, _IN_KEY: in_key}
    return field(default_factory=default, metadata=metadata) if factory else field(default=default, metadata=metadata)


def _hashable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, repr(v)) for k, v in value.items()))
    return value


@dataclass(kw_only=True, frozen=True)
class DTCompileConfig:
    """Options of :func:`dtcompile.backend`; every field is a keyword of that call."""

    inductor: bool = _option(True, _check_bool)
    """Lower the AOT graphs with Inductor (``compile_fx``).  ``False`` runs the
    forward and backward graphs as they are after the passes: no codegen, fast to
    compile, for tests and debugging."""

    disable_passes: frozenset[str] = _option(frozenset(), _pass_names)
    """Names of graph passes to skip (``dtcompile.pass_names.PASS_NAMES``)."""

    inductor_config: Mapping[str, Any] = _option(dict, _inductor_settings, factory=True)
    """``torch._inductor.config`` settings for this backend's compiles only,
    applied with ``config.patch`` inside the call (never globally); nested
    settings by dotted name (``"triton.cudagraphs"``).  Read-only once made."""

    bucket_cap_bytes: int = _option(256 * 1024 * 1024, _bytes(minimum=1))
    """Largest buffer (bytes per rank, > 0) the ``bucketing`` pass makes of
    several collectives; a bucket's buffer is the memory bucketing adds."""

    overlap_memory_budget_bytes: int = _option(1024 * 1024 * 1024, _bytes(minimum=0))
    """Most bytes (per rank, >= 0) of collectives the ``overlap`` pass lets be in
    flight at once when it issues them earlier."""

    force_async_tp: bool = _option(False, _check_bool)
    """Let the ``async_tp`` pass fuse every all-gather/matmul and matmul/reduce-scatter pair
    it can, whatever the fusion's price (:mod:`dtcompile.passes.async_tp`).  By default a pair
    is fused only where the graph's cost profile says it hides communication, which it never
    does on a 1-rank group (no data moves) or a profile without fused kernels; ``True`` fuses
    there too, to run and test the fused kernels (the CUDA tests on one GPU), and each such
    fusion's record says it was forced and what the price said.  Pairs the pass cannot fuse
    (shapes, users, a CUDA graph on a group other than NCCL) stay as they are.  With
    ``disable_passes={"async_tp"}`` nothing is fused."""

    memory_budget_bytes: int | None = _option(None, _bytes(minimum=1, optional=True))
    """Most bytes per rank a compiled graph may hold at its peak, as
    :mod:`dtcompile.graph.memory` estimates it (its tensors along the schedule, and for a
    backward what the caller holds meanwhile).  A training graph whose forward or
    backward peaks over it has activations recomputed in the backward instead of
    saved, the fewest that fit (:mod:`dtcompile.pipeline.recompute`, on torch's
    ``activation_memory_budget``; the forward's ``activation_budget`` record names
    them); ``bucketing`` and ``overlap`` refuse a rewrite that would pass it, and say
    so in their records.  ``None``: nothing is recomputed for memory, and each
    graph's passes keep to its peak as traced (no pass applied) plus a prefetch
    window of twice the gathered weights of its largest module (a block of a
    ``ModuleList``): one module prefetched ahead, as FSDP2 does, and the bucket it
    comes through; a graph that gathers no parameters gets twice its largest
    collective's buffer.  A budget below the least peak a graph can have is an
    error that names that peak and what is alive there."""

    reshard_after_forward: bool = _option(True, _check_bool)
    """Gather a parameter stored sharded on a data-parallel axis again in the
    backward instead of keeping its gathered copy from forward to backward, as
    FSDP2 does by default (:mod:`dtcompile.pipeline.reshard`): each rank then holds its
    shards, not the whole model, between forward and backward.  ``False`` keeps
    every gathered weight (FSDP2's ``reshard_after_forward=False``): one all-gather
    per weight per step fewer, the memory of plain data parallel."""

    keep_gathered: frozenset[str] = _option(frozenset(), _names)
    """Names of parameters, or of modules (a name prefix: ``"layers.3"``,
    ``"output"``), whose gathered weights are kept from forward to backward while the
    others are resharded (FSDP2's ``fully_shard(module, reshard_after_forward=False)``
    on those modules).  Names as ``model.named_parameters()`` gives them."""

    cost_profile: str | HardwareProfile = _option("auto", _check_profile)
    """The machine the passes price their rewrites for and the annotations and
    reports estimate times on: ``"auto"`` (the profile that follows each graph's
    devices and process groups' backend: ``cpu_gloo`` for CPU on gloo, the GPU's
    over NCCL, ``h100`` for the fake and threaded test worlds), a profile's name
    (``dtcompile.cost.PROFILES``, or one ``dtcompile.calibrate()`` saved), or a
    :class:`~dtcompile.cost.HardwareProfile`.  See :func:`dtcompile.cost.choose_profile`."""

    report: bool = _option(False, _check_bool, in_key=False)
    """Print the text report (see :func:`dtcompile.explain`) of every graph this
    backend compiles, as it compiles it."""

    trace_pass_graphs: bool = _option(False, _check_bool, in_key=False)
    """Log every graph before and after each pass as ``TORCH_TRACE`` artifacts
    (``dtcompile_<kind>_before_<pass>`` / ``..._after_<pass>``), for debugging
    a pass; off by default (a graph's text per pass)."""

    eager_fallback: bool = _option(True, _check_bool, in_key=False)
    """Where torch's AOTAutograd cannot trace a Dynamo graph over DTensor (a
    limitation of stock torch on a program eager runs), run that graph eagerly,
    with a warning, a ``backend.fallbacks`` record and a ``dtcompile_eager_fallback``
    artifact, instead of failing the compile.  ``False`` raises torch's error.
    Errors of dtcompile's own (bad input, its passes, lowering) always raise."""

    aot_cache: bool = _option(True, _check_bool, in_key=False)
    """Let AOTAutograd's cache serve this backend's graphs (with ``inductor``): a
    restarted job, or one given ``torch.compiler.load_cache_artifacts()``, then
    skips tracing, partitioning and the passes for every graph an earlier run
    compiled with the same dtcompile source and options
    (:mod:`dtcompile.cache_keys`).  A graph served so was not compiled in this
    process: it is listed in ``backend.cached``, not ``backend.records``.
    ``False`` (as :func:`dtcompile.explain`, ``report`` and ``trace_pass_graphs``
    do) compiles every graph here, to inspect it; Inductor's FX graph cache,
    keyed on each graph after the passes, serves either way."""

    check_ranks: bool = _option(True, _check_bool, in_key=False)
    """Before a compiled graph first runs, check that every rank of its process groups
    compiled the same collectives (:mod:`dtcompile.ranks.check`): ranks that differ (an
    option, the cost profile, a cache warm on some ranks only, an eager fallback) then
    stop with an error that says how, instead of gloo aborting or NCCL hanging in the
    first collective that does not pair up; where some rank runs the graph eagerly,
    every rank does.  One exchange through the process group's store per graph, at its
    first call only.  A plan of ``dtcompile.auto_parallel`` made with this config
    (``config=``) is compared the same way by the ranks that apply it
    (:mod:`dtcompile.auto_parallel.agreement`).  ``False`` skips it."""

    check_ranks_timeout_s: float = _option(600.0, _check_seconds, in_key=False)
    """Seconds (> 0) a rank waits at the check for its peers to reach the same graph:
    longer than the slowest rank takes to compile it (a cold cache beside a warm one),
    or, for a plan's comparison, to plan and apply it; a peer that does not come within
    it is named in the error."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = f.metadata[_CHECK](f.name, getattr(self, f.name))
            if value is not None:
                object.__setattr__(self, f.name, value)

    def __hash__(self) -> int:
        return hash(tuple(_hashable(getattr(self, name)) for name in self.field_names()))

    @classmethod
    def key_field_names(cls) -> tuple[str, ...]:
        """The fields that change a compiled graph (the compile caches key on them): all but
        what is shown or logged, and what happens where torch cannot trace or the ranks meet."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata[_IN_KEY])

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DTCompileConfig:
        """Builds a config from keyword options, naming the valid ones on a typo."""
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"dtcompile.backend: unknown option(s) {unknown}; valid options are {sorted(cls.field_names())}"
            )
        return cls(**options)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> DTCompileConfig:
        """A copy with ``changes`` (validated like any new config)."""
        return dataclasses.replace(self, **changes)


def inductor_settings() -> frozenset[str]:
    """Every setting of ``torch._inductor.config``, nested ones by dotted name."""
    from torch._inductor import config as inductor_config

    return frozenset(inductor_config.get_config_copy())


# torch.compile's modes, as Inductor spells them out (torch._inductor.list_mode_options).
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def config_for(
    config: DTCompileConfig,
    mode: str | None,
    options: Mapping[str, Any] | None,
    devices: frozenset[str] = frozenset(),
) -> tuple[DTCompileConfig, list[str]]:
    """``config`` with torch.compile's ``mode`` and ``options`` applied; also what was ignored.

    ``options`` keys that are config fields replace them; the others are Inductor
    settings, added to ``inductor_config``; an unknown key is a ``ValueError``
    listing both kinds.  ``mode`` adds Inductor's settings for that mode (under
    the ones given explicitly).  ``devices`` are the device types of the graph's
    inputs: CUDA graphs are dropped on a graph with no CUDA input, and every
    Inductor setting when ``inductor`` is False; each such drop is one line of
    the returned list.
    """
    from torch._inductor import list_mode_options

    options = dict(options or {})
    fields = set(DTCompileConfig.field_names())
    settings = {k: v for k, v in options.items() if k not in fields}
    unknown = sorted(set(settings) - inductor_settings())
    if unknown:
        raise ValueError(
            f"dtcompile: torch.compile options {unknown} are neither dtcompile options nor Inductor "
            f"settings; dtcompile's options are {sorted(fields)}, the others must be names from "
            "torch._inductor.config"
        )
    if mode is not None and mode not in _MODES:
        raise ValueError(f"dtcompile: unknown torch.compile mode {mode!r}; the modes are {list(_MODES)}")
    merged = {**list_mode_options(mode or "default"), **config.inductor_config, **settings}
    ignored = []
    if merged.get("triton.cudagraphs") and "cuda" not in devices:
        merged.pop("triton.cudagraphs")
        ignored.append(
            f"triton.cudagraphs (mode={mode!r} asks for CUDA graphs; this graph runs on "
            f"{', '.join(sorted(devices)) or 'no device'})"
        )
    own = {k: v for k, v in options.items() if k in fields}
    inductor = own.get("inductor", config.inductor)
    if not inductor and merged:
        ignored.append(f"Inductor settings {sorted(merged)} (inductor=False: the graphs are not lowered by Inductor)")
        merged = {}
    return config.replace(**own, inductor_config=merged), ignored
