"""Estimated time of a collective: an alpha-beta (latency-bandwidth) model per link.

For a ring collective over ``n`` ranks moving a buffer of ``B`` bytes (the
nccl-tests "size": the output of an all-gather, the input of a reduce-scatter,
all-reduce or all-to-all)::

    time_us = base_latency_us + hops * hop_latency_us + B * factor / bandwidth

    op              hops        factor
    all_gather      n - 1       (n - 1) / n
    reduce_scatter  n - 1       (n - 1) / n
    all_to_all      n - 1       (n - 1) / n
    all_reduce      2 (n - 1)   2 (n - 1) / n
    broadcast       n - 1       1

``bandwidth`` is the bus bandwidth of the link in GB/s (what nccl-tests reports
as ``busbw``), so ``B * factor / bandwidth`` is the time the bytes take on the
wire.  These are the formulas of ``torch.distributed.tensor._collective_utils``
(``allgather_cost``, ``allreduce_cost``, ``reduce_scatter_cost``), with its
constants for the base latency (6.6 us) and the NVLink hop latency (0.6 us),
and with the bandwidth a named hardware profile gives.

A mesh axis uses the profile's intra-node link when its group's ranks fit in
one node (the span of its ranks, ``max - min + 1``, is at most
``devices_per_node``), else the inter-node link.

The profile also carries a device roofline (``matmul_tflops``,
``memory_gbps``) that :mod:`dtcompile.simulate` uses to time the compute nodes
of a graph and play it on a compute and a communication stream.  This module is
the pure formulas and the profiles: it reads no graph.

A profile also says what the passes may count on: how much of a collective's
time can run beside compute (``overlap``: 1 where a collective runs on its own
engine, as NCCL's do; what ``dtcompile.calibrate()`` measures on a CPU host,
where gloo's threads share the cores with the compute) and whether a fused
collective-matmul kernel exists (``fused_collective_matmul``).

Which profile a graph is priced with (:func:`choose_profile`): the one the
user names (``cost_profile=`` a name or a :class:`HardwareProfile`), else,
with ``"auto"`` (the default), the one that follows the graph's devices and
its process groups' backend: a CPU graph on gloo, or on no group, ``cpu_gloo``;
a CUDA graph on NCCL the profile of its GPU (``h100``, ``a100``; another GPU
``h100``, saying so); the test worlds that stand in for a job (the fake and the
threaded process groups) ``h100``, the job they simulate.  A profile that
:func:`dtcompile.calibrate` measured and saved under a name (a JSON file in
:func:`profile_dir`) is found by that name, and one saved under the name
``"auto"`` picks (``cpu_gloo``) replaces the built-in one on this machine.

To add a profile: build a :class:`HardwareProfile` and call
:func:`register_profile`, or save one with :func:`save_profile`;
``dtcompile.backend(cost_profile="name")`` then uses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AUTO",
    "PROFILES",
    "HardwareProfile",
    "Link",
    "ProfileChoice",
    "choose_profile",
    "collective_time_us",
    "get_profile",
    "load_profile",
    "profile_dir",
    "register_profile",
    "save_profile",
]

AUTO = "auto"
"""``cost_profile="auto"``: the profile follows the graph's devices and process groups."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of connection between ranks."""

    bandwidth_gbps: float
    """Bus bandwidth in GB/s (1e9 bytes per second)."""
    hop_latency_us: float
    """Latency added per ring step."""
    base_latency_us: float = 6.6
    """Fixed cost of launching a collective."""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0 or self.hop_latency_us < 0 or self.base_latency_us < 0:
            raise ValueError(f"Link: bandwidth must be positive and latencies non-negative, got {self}")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """The links of one kind of machine, and the roofline of one device, by name."""

    name: str
    description: str
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    matmul_tflops: float = 400.0
    """Dense matmul throughput of one device (TFLOP/s) for the roofline estimate."""
    memory_gbps: float = 2000.0
    """Memory bandwidth of one device (GB/s) for the roofline estimate, and of the
    copies a rewrite adds (a bucket's buffer)."""
    overlap: float = 1.0
    """Fraction (0 to 1) of a collective's time that can run beside compute; the
    rest holds the compute stream (gloo's threads on the cores the compute uses)."""
    fused_collective_matmul: bool = True
    """Whether this kind of machine has fused collective-matmul kernels (torch's
    symmetric-memory ops over NCCL); without them ``async_tp`` saves nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == AUTO:
            raise ValueError(f"HardwareProfile: name must be a non-empty str other than {AUTO!r}, got {self.name!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"HardwareProfile {self.name}: overlap must be within [0, 1], got {self.overlap}")
        if self.matmul_tflops <= 0 or self.memory_gbps <= 0 or self.devices_per_node < 1:
            raise ValueError(
                f"HardwareProfile {self.name}: matmul_tflops and memory_gbps must be positive and "
                f"devices_per_node >= 1, got {self.matmul_tflops}, {self.memory_gbps}, {self.devices_per_node}"
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HardwareProfile:
        fields = dict(data)
        for link in ("intra_node", "inter_node"):
            fields[link] = Link(**fields[link])
        return cls(**fields)

    def link(self, span: int) -> Link:
        """The link a group uses whose ranks span ``span`` consecutive ranks."""
        return self.intra_node if span <= self.devices_per_node else self.inter_node


PROFILES: dict[str, HardwareProfile] = {}


def register_profile(profile: HardwareProfile) -> HardwareProfile:
    """Make ``profile`` available by its name (replacing one of the same name)."""
    PROFILES[profile.name] = profile
    return profile


def profile_dir() -> Path:
    """Where saved profiles live: ``$DTCOMPILE_PROFILE_DIR``, else ``~/.cache/dtcompile/profiles``."""
    configured = os.environ.get("DTCOMPILE_PROFILE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "dtcompile" / "profiles"


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Writes ``profile`` as JSON (default ``profile_dir() / f"{profile.name}.json"``); returns the path.

    A saved profile is then found by name (:func:`get_profile`) in every process
    that reads the same folder, and wins over a built-in one of the same name.
    """
    target = Path(path) if path is not None else profile_dir() / f"{profile.name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(profile.to_json(), indent=2, sort_keys=True) + "\n")
    temporary.replace(target)
    return target


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """A profile :func:`save_profile` wrote; a clear error if the file is not one."""
    try:
        return HardwareProfile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"dtcompile: {path} is not a saved cost profile ({type(exc).__name__}: {exc})") from exc


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name``: saved in :func:`profile_dir`, else registered."""
    return _lookup(name)[0]


def _lookup(name: str) -> tuple[HardwareProfile, Path | None]:
    """The profile called ``name``, and the file it was loaded from (``None``: registered)."""
    saved = profile_dir() / f"{name}.json"
    if saved.is_file():
        return load_profile(saved), saved
    try:
        return PROFILES[name], None
    except KeyError:
        raise ValueError(
            f"unknown cost profile {name!r}; the profiles are {sorted(PROFILES)} and {AUTO!r} "
            f"(add one with dtcompile.cost_model.register_profile, or measure this machine's with "
            f"dtcompile.calibrate(name={name!r}), which saves it in {profile_dir()})"
        ) from None


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a graph is priced with, and why that one."""

    profile: HardwareProfile
    why: str
    """``given``, or what ``auto`` read: e.g. ``auto: cpu tensors on gloo``."""

    def __str__(self) -> str:
        return f"{self.profile.name} ({self.why})"


# GPU name (as torch.cuda.get_device_name says it) -> profile.
_GPU_PROFILES = (("H100", "h100"), ("H200", "h100"), ("A100", "a100"))
# Process groups that stand in for a job: price for the job they simulate.
_TEST_BACKENDS = frozenset({"fake", "threaded"})
_SIMULATED_TARGET = "h100"


def choose_profile(
    choice: str | HardwareProfile,
    devices: Iterable[str] = (),
    backends: Iterable[str] = (),
    gpu_name: str | None = None,
) -> ProfileChoice:
    """The profile for a graph whose tensors are on ``devices`` (device types) and whose
    collectives run on groups of ``backends`` (``"gloo"``, ``"nccl"``, ``"fake"``, ...).

    ``choice`` is ``cost_profile``: a profile, a name, or :data:`AUTO`.  See the module docstring.
    """
    if isinstance(choice, HardwareProfile):
        return ProfileChoice(choice, "given")
    if choice != AUTO:
        return ProfileChoice(get_profile(choice), "given")
    devices, backends = set(devices), set(backends)
    on = f"{'/'.join(sorted(devices)) or 'no'} tensors on {'/'.join(sorted(backends)) or 'no process group'}"
    if backends & _TEST_BACKENDS:
        name = _SIMULATED_TARGET
        why = f"auto: {on}, a test world standing in for a job, priced as the {name} it simulates"
    elif "cuda" in devices:
        name = next((profile for key, profile in _GPU_PROFILES if key in (gpu_name or "")), _SIMULATED_TARGET)
        known = any(key in (gpu_name or "") for key, _ in _GPU_PROFILES)
        gpu = gpu_name or "an unnamed GPU"
        why = f"auto: {on}, {gpu}" + ("" if known else f" (no profile of its own: {name}'s; run dtcompile.calibrate())")
    elif backends <= {"gloo"}:
        name = "cpu_gloo"
        why = f"auto: {on}"
    else:
        name = _SIMULATED_TARGET
        why = f"auto: {on} (no profile for them: {name}'s; run dtcompile.calibrate())"
    profile, saved = _lookup(name)
    if saved is not None:
        why += f", calibrated on this machine ({saved})"
    return ProfileChoice(profile, why)


# NVLink numbers: nccl-tests bus bandwidth of large all-reduces on 8-GPU nodes;
# IB: 8 x 400 Gb/s NDR per node, about 45 GB/s of bus bandwidth per GPU.
register_profile(
    HardwareProfile(
        name="h100",
        description="8x H100 SXM per node, NVLink 4 (~360 GB/s busbw), 400G InfiniBand between nodes",
        intra_node=Link(bandwidth_gbps=360.0, hop_latency_us=0.6),
        inter_node=Link(bandwidth_gbps=45.0, hop_latency_us=2.7),
        devices_per_node=8,
        # Measured (benchmarks/cuda_check.py, RESULTS.md "CUDA check"): the block's bf16
        # matmuls ran at 590-620 TFLOP/s on an H100 SXM, not the 989 of the data sheet;
        # large contiguous elementwise ops at 2840-3020 GB/s, within 20% of 3350.
        matmul_tflops=600.0,
        memory_gbps=3350.0,
    )
)
register_profile(
    HardwareProfile(
        name="a100",
        description="8x A100 SXM per node, NVLink 3 (~230 GB/s busbw), 200G InfiniBand between nodes",
        intra_node=Link(bandwidth_gbps=230.0, hop_latency_us=0.6),
        inter_node=Link(bandwidth_gbps=22.6, hop_latency_us=2.7),
        devices_per_node=8,
        matmul_tflops=312.0,  # bf16 dense
        memory_gbps=2039.0,
    )
)
register_profile(
    HardwareProfile(
        name="inter_node_ib",
        description="one GPU per node: every collective crosses 400G InfiniBand",
        intra_node=Link(bandwidth_gbps=45.0, hop_latency_us=2.7),
        inter_node=Link(bandwidth_gbps=45.0, hop_latency_us=2.7),
        devices_per_node=1,
        matmul_tflops=600.0,  # the h100 profile's measured roofline
        memory_gbps=3350.0,
    )
)
# Measured by dtcompile.calibrate() on 2 gloo ranks of the 2-core CI machine
# (benchmarks/calibrate_gloo.py; RESULTS.md "calibrate_gloo.py").
register_profile(
    HardwareProfile(
        name="cpu_gloo",
        description="ranks as processes on one CPU host, gloo over loopback TCP (calibrated on 2 cores)",
        intra_node=Link(bandwidth_gbps=0.9, hop_latency_us=72.0, base_latency_us=380.0),
        inter_node=Link(bandwidth_gbps=0.9, hop_latency_us=72.0, base_latency_us=380.0),
        devices_per_node=1 << 30,
        matmul_tflops=0.05,  # fp32, while the other rank computes too
        memory_gbps=11.0,
        overlap=0.0,  # gloo's threads share the two cores: nothing measured runs beside compute
        fused_collective_matmul=False,
    )
)

_RING: dict[str, tuple[int, int]] = {
    # op -> (hops per (n - 1), bytes on the wire per (n - 1) / n); broadcast handled apart
    "all_gather": (1, 1),
    "reduce_scatter": (1, 1),
    "all_to_all": (1, 1),
    "all_reduce": (2, 2),
}


def collective_time_us(op: str, num_bytes: int, group_size: int, link: Link) -> float:
    """Estimated microseconds for collective ``op`` moving ``num_bytes`` over ``group_size`` ranks."""
    if group_size <= 1:
        return 0.0
    steps = group_size - 1
    if op == "broadcast":
        hops, wire = steps, 1.0
    elif op in _RING:
        hop_factor, byte_factor = _RING[op]
        hops, wire = hop_factor * steps, byte_factor * steps / group_size
    else:
        raise ValueError(f"collective_time_us: unknown collective {op!r}; known: {sorted([*_RING, 'broadcast'])}")
    seconds_on_wire = num_bytes * wire / (link.bandwidth_gbps * 1e9)
    return link.base_latency_us + hops * link.hop_latency_us + seconds_on_wire * 1e6
