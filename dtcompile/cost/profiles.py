"""The named hardware profiles: the built-in ones, those registered, those saved on disk.

To add a profile: build a :class:`HardwareProfile` and call
:func:`register_profile`, or save one with :func:`save_profile`;
``dtcompile.backend(cost_profile="name")`` then uses it.  A profile saved in
:func:`profile_dir` wins over a registered one of the same name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dtcompile.cost.formulas import AUTO, HardwareProfile, LinkCost

__all__ = ["PROFILES", "get_profile", "load_profile", "lookup_profile", "profile_dir", "register_profile", "save_profile"]


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
    return lookup_profile(name)[0]


def lookup_profile(name: str) -> tuple[HardwareProfile, Path | None]:
    """The profile called ``name``, and the file it was loaded from (``None``: registered)."""
    saved = profile_dir() / f"{name}.json"
    if saved.is_file():
        return load_profile(saved), saved
    try:
        return PROFILES[name], None
    except KeyError:
        raise ValueError(
            f"unknown cost profile {name!r}; the profiles are {sorted(PROFILES)} and {AUTO!r} "
            f"(add one with dtcompile.cost.register_profile, or measure this machine's with "
            f"dtcompile.calibrate(name={name!r}), which saves it in {profile_dir()})"
        ) from None


# NVLink numbers: nccl-tests bus bandwidth of large all-reduces on 8-GPU nodes;
# IB: 8 x 400 Gb/s NDR per node, about 45 GB/s of bus bandwidth per GPU.
register_profile(
    HardwareProfile(
        name="h100",
        description="8x H100 SXM per node, NVLink 4 (~360 GB/s busbw), 400G InfiniBand between nodes",
        intra_node=LinkCost(bandwidth_gbps=360.0, hop_latency_us=0.6),
        inter_node=LinkCost(bandwidth_gbps=45.0, hop_latency_us=2.7),
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
        intra_node=LinkCost(bandwidth_gbps=230.0, hop_latency_us=0.6),
        inter_node=LinkCost(bandwidth_gbps=22.6, hop_latency_us=2.7),
        devices_per_node=8,
        matmul_tflops=312.0,  # bf16 dense
        memory_gbps=2039.0,
    )
)
register_profile(
    HardwareProfile(
        name="inter_node_ib",
        description="one GPU per node: every collective crosses 400G InfiniBand",
        intra_node=LinkCost(bandwidth_gbps=45.0, hop_latency_us=2.7),
        inter_node=LinkCost(bandwidth_gbps=45.0, hop_latency_us=2.7),
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
        intra_node=LinkCost(bandwidth_gbps=0.9, hop_latency_us=72.0, base_latency_us=380.0),
        inter_node=LinkCost(bandwidth_gbps=0.9, hop_latency_us=72.0, base_latency_us=380.0),
        devices_per_node=1 << 30,
        matmul_tflops=0.05,  # fp32, while the other rank computes too
        memory_gbps=11.0,
        overlap=0.0,  # gloo's threads share the two cores: nothing measured runs beside compute
        fused_collective_matmul=False,
    )
)
