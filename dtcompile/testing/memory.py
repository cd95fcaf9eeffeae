"""Memory a step measurably holds: the counterpart of :mod:`dtcompile.graph.memory`'s estimates.

- :func:`measure_memory`: the peak of a step (forward and backward) as torch's
  allocator saw it, read from the profiler's memory events (``profile_memory``):
  every allocation and free on the CPU allocator, compiled code included (Inductor's
  kernels allocate through it too), in order; the peak is the bytes alive before the
  step (``alive``: the parameters and inputs the caller holds) plus the highest the
  running sum of allocations and frees reaches.  One process, one step at a time
  (the profiler is per process: not under ranks as threads).
- :func:`saved_bytes`: the bytes a forward leaves for its backward, the distinct
  storages of the tensors autograd saved (``saved_tensors_hooks``), read after the
  forward returned (FSDP2 frees its gathered weights by resizing their storage to 0
  then), parameters' own storages not counted: what FSDP is for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MeasuredMemory", "measure_memory", "saved_bytes", "storage_bytes"]


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data: a wrapper subclass's inner tensors
    (a DTensor's local shard, an ``AsyncCollectiveTensor``'s result), recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)  # a DTensor flattens its mesh too
    return [plain for value in inner if isinstance(value, torch.Tensor) for plain in _plain(value)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``tensors`` (a DTensor: its local shard) live in."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for plain in _plain(tensor):
            storage = plain.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class MeasuredMemory:
    """What one step measurably held."""

    peak_bytes: int
    """``alive_bytes`` plus the most the step allocated beyond them at once."""
    alive_bytes: int
    """The storages alive before the step that were counted (``alive``)."""
    end_bytes: int
    """What the step left allocated (the gradients, typically)."""


def measure_memory(step: Callable[[], Any], alive: Iterable[torch.Tensor] = ()) -> MeasuredMemory:
    """Runs ``step`` once under the profiler and returns its measured peak (see the module docstring).

    Run the step once before (compiling, and allocating what a first step allocates
    once), and set gradients to ``None`` between steps to measure one step as the next
    one runs."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    base = storage_bytes(alive)
    # Garbage from before the step (an earlier program's tensors in reference cycles)
    # freed during it would count as negative bytes of the step: collected first, and
    # no collection while it runs.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        if collecting:
            gc.enable()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return MeasuredMemory(base + peak, base, live)


def saved_bytes(forward: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """Bytes ``forward()`` saves for its backward (``params``' storages not counted), and its result."""
    own = {plain.untyped_storage().data_ptr() for p in params for plain in _plain(p)}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        for plain in _plain(tensor):
            storage = plain.untyped_storage()
            if storage.data_ptr() not in own:
                saved[id(storage)] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    # Read after the forward: a storage freed meanwhile (resized to 0) holds nothing.
    distinct = {s.data_ptr(): s.nbytes() for s in saved.values() if s.nbytes()}
    return sum(distinct.values()), out
