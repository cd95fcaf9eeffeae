"""Which profile a graph is priced with (:func:`choose_profile`): the one the
user names (``cost_profile=`` a name or a :class:`HardwareProfile`), else,
with ``"auto"`` (the default), the one that follows the graph's devices and
its process groups' backend: a CPU graph on gloo, or on no group, ``cpu_gloo``;
a CUDA graph on NCCL the profile of its GPU (``h100``, ``a100``; another GPU
``h100``, saying so); the test worlds that stand in for a job (the fake and the
threaded process groups) ``h100``, the job they simulate.  A profile that
:func:`dtcompile.calibrate` measured and saved under a name (a JSON file in
:func:`profile_dir`) is found by that name, and one saved under the name
``"auto"`` picks (``cpu_gloo``) replaces the built-in one on this machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from dtcompile.cost.formulas import AUTO, HardwareProfile
from dtcompile.cost.profiles import get_profile, lookup_profile

__all__ = ["ProfileChoice", "choose_profile", "devices_of", "group_backends", "profile_for_groups"]


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
    profile, saved = lookup_profile(name)
    if saved is not None:
        why += f", calibrated on this machine ({saved})"
    return ProfileChoice(profile, why)


def devices_of(example_inputs: Sequence[Any]) -> frozenset[str]:
    """The device types of a graph's tensor inputs."""
    return frozenset(x.device.type for x in example_inputs if isinstance(x, torch.Tensor))


def group_backends(group_names: Sequence[str]) -> set[str]:
    """The backends (``gloo``, ``nccl``, ``fake``, ...) of the named process groups, or of
    the default group when none is named; empty without an initialized process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return set()
    from torch.distributed.distributed_c10d import _resolve_process_group

    groups = [_resolve_process_group(name) for name in group_names] or [None]
    return {str(dist.get_backend(group)) for group in groups}


def profile_for_groups(choice: str | HardwareProfile, devices: Set[str], group_names: Sequence[str]) -> ProfileChoice:
    """The cost profile for work on ``devices`` (device types) whose collectives run on the
    named groups (the default group's when none is named): :func:`choose_profile`
    given those groups' backends and, on CUDA, this process's GPU.  The backend reads a
    graph so, ``auto_parallel`` a mesh, and ``calibrate`` its group."""
    gpu = torch.cuda.get_device_name() if "cuda" in devices and torch.cuda.is_available() else None
    return choose_profile(choice, devices, group_backends(group_names), gpu)
