"""``dtcompile.calibrate()``: measure this machine and write the cost profile the passes price with.

Run it once on every rank of a job's process group (it runs collectives on
it), e.g. at the start of a job or in a one-off script launched like the job::

    profile = dtcompile.calibrate()            # the name "auto" picks here: cpu_gloo, h100, ...
    torch.compile(model, backend=dtcompile.backend())   # "auto" now finds the calibrated one

It measures, on ``group`` and the device its backend runs on:

- **collectives**: the median of ``iters`` all-gathers and all-reduces per
  size, fitted to the alpha-beta model of :mod:`dtcompile.cost`
  (bandwidth from the slopes, base and per-hop latency from the intercepts);
- **copies**: ``memory_gbps``, from copying a 16 MiB buffer (read and write);
- **matmuls**: ``matmul_tflops``, from square matmuls;
- **overlap**: how much of an all-reduce runs beside matmuls issued while it
  is in flight: ``(compute + comm - both) / min(compute, comm)``, within
  ``[0, 1]``.  On a CPU host gloo's threads share the cores with the compute,
  and this is what says how much the passes may count on.

Every rank measures; rank 0's numbers are broadcast, so that every rank gets
the same profile (each rank's passes decide from it, and must decide alike).
The profile is registered in this process and, with ``save=True``, written
by rank 0 to :func:`dtcompile.cost.profile_dir` (``$DTCOMPILE_PROFILE_DIR``),
where every later process finds it by name.  One link is measured (that of
``group``): on a multi-node job, the profile's intra- and inter-node links are
both that one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtcompile.base.progress import Progress
from dtcompile.cost import AUTO, HardwareProfile, LinkCost, register_profile, save_profile
from dtcompile.cost.auto import profile_for_groups

__all__ = ["calibrate", "fit_link"]

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
"""Bytes of the collectives' buffers (the all-gather's output, the all-reduce's input)."""


def _device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _median_us(fn: Callable[[], Any], device: torch.device, iters: int, group: Any = None, warmup: int = 2) -> float:
    samples = []
    for i in range(iters + warmup):
        if group is not None:
            dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``y = a + b x`` fitted by least relative error (weights ``1 / y^2``), so that the
    small sizes, whose time is mostly latency, count as much as the large ones."""
    weights = [1.0 / max(y, 1e-9) ** 2 for _, y in points]
    total = sum(weights)
    mx = sum(w * x for w, (x, _) in zip(weights, points)) / total
    my = sum(w * y for w, (_, y) in zip(weights, points)) / total
    b = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(weights, points))
    b /= sum(w * (x - mx) ** 2 for w, (x, _) in zip(weights, points))
    return my - b * mx, b


def fit_link(times_us: dict[tuple[str, int], float], group_size: int) -> LinkCost:
    """The alpha-beta :class:`LinkCost` that fits ``{(op, bytes): us}`` of all-gathers and
    all-reduces over ``group_size`` ranks (the wire bytes as :mod:`~dtcompile.cost` counts them)."""
    n = group_size
    wire = {"all_gather": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    hops = {"all_gather": n - 1, "all_reduce": 2 * (n - 1)}
    fits = {op: _line([(size * wire[op], us) for (o, size), us in times_us.items() if o == op]) for op in wire}
    slopes = [b for _, b in fits.values() if b > 0]
    if not slopes:
        raise ValueError(f"dtcompile.calibrate: the collectives took no longer for more bytes ({times_us}); measure more sizes")
    bandwidth_gbps = statistics.mean(1 / b for b in slopes) / 1e3  # bytes per us -> GB/s
    (a_gather, _), (a_reduce, _) = fits["all_gather"], fits["all_reduce"]
    hop = max((a_reduce - a_gather) / (hops["all_reduce"] - hops["all_gather"]), 0.0)
    base = max(a_gather - hops["all_gather"] * hop, 0.0)
    return LinkCost(bandwidth_gbps=bandwidth_gbps, hop_latency_us=hop, base_latency_us=base)


def _collectives(group: Any, device: torch.device, iters: int, progress: Progress) -> dict[tuple[str, int], float]:
    n = dist.get_world_size(group)
    times = {}
    for size in SIZES:
        numel = size // 4 // n * n
        gathered = torch.empty(numel, device=device)
        shard = torch.ones(numel // n, device=device)
        full = torch.ones(numel, device=device)
        times[("all_gather", numel * 4)] = _median_us(
            lambda: dist.all_gather_into_tensor(gathered, shard, group=group), device, iters, group
        )
        times[("all_reduce", numel * 4)] = _median_us(lambda: dist.all_reduce(full, group=group), device, iters, group)
        progress.step(f"collectives of {size} B")
    return times


def _copy_gbps(device: torch.device, iters: int) -> float:
    source = torch.ones(1 << 22, device=device)  # 16 MiB
    target = torch.empty_like(source)
    us = _median_us(lambda: target.copy_(source), device, iters)
    return 2 * source.numel() * 4 / (us * 1e-6) / 1e9


def _matmul(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    side = 4096 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.randn(side, side, device=device, dtype=dtype), torch.randn(side, side, device=device, dtype=dtype)


def _matmul_tflops(device: torch.device, iters: int) -> float:
    a, b = _matmul(device)
    us = _median_us(lambda: a @ b, device, iters)
    return 2 * a.shape[0] ** 3 / (us * 1e-6) / 1e12


def _overlap(group: Any, device: torch.device, iters: int) -> float:
    """The fraction of an all-reduce that runs beside matmuls issued while it is in flight."""
    full = torch.ones(1 << 22, device=device)  # 16 MiB
    a, b = _matmul(device)
    comm = _median_us(lambda: dist.all_reduce(full, group=group), device, iters, group)
    one = _median_us(lambda: a @ b, device, iters)
    count = max(1, round(comm / max(one, 1e-3)))

    def compute() -> None:
        for _ in range(count):
            a @ b

    def both() -> None:
        work = dist.all_reduce(full, group=group, async_op=True)
        compute()
        work.wait()

    alone = _median_us(compute, device, iters, group)
    together = _median_us(both, device, iters, group)
    hidden = (alone + comm - together) / min(alone, comm)
    return min(max(hidden, 0.0), 1.0)


def calibrate(
    name: str | None = None,
    *,
    group: Any = None,
    iters: int = 10,
    save: bool = True,
    path: Any = None,
) -> HardwareProfile:
    """Measures this machine on ``group`` (default: the world) and returns its profile.

    ``name`` defaults to the profile ``cost_profile="auto"`` picks for this
    device and backend (``cpu_gloo`` on CPU over gloo, the GPU's over NCCL),
    so that ``auto`` uses the calibrated numbers from then on.  Call it on every
    rank of ``group``.  See the module docstring for what is measured.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dtcompile.calibrate: no process group; call torch.distributed.init_process_group() first "
            "(it times collectives on the job's own group), on every rank"
        )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"dtcompile.calibrate: iters must be a positive int, got {iters!r}")
    device = _device(group)
    backend = str(dist.get_backend(group))
    if name is None:
        name = profile_for_groups(AUTO, {device.type}, [group.group_name] if group is not None else []).profile.name
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"dtcompile.calibrate: name must be a profile name other than {AUTO!r}, got {name!r}")
    # Rank 0's numbers on every rank: each rank's passes decide from this profile.
    first = dist.get_global_rank(group, 0) if group is not None else 0
    with Progress(f"dtcompile.calibrate({name})", len(SIZES) + 3, unit="measurement", show=dist.get_rank() == first) as progress:
        link = fit_link(_collectives(group, device, iters, progress), dist.get_world_size(group))
        numbers = [link.bandwidth_gbps, link.hop_latency_us, link.base_latency_us]
        for what, measure in (("copies", _copy_gbps), ("matmuls", _matmul_tflops)):
            numbers.append(measure(device, iters))
            progress.step(what)
        numbers.append(_overlap(group, device, iters))
        progress.step("overlap")
    measured = torch.tensor(numbers, dtype=torch.float64, device=device)
    dist.broadcast(measured, src=first, group=group)
    bandwidth, hop, base, copy, tflops, overlap = measured.tolist()
    shared = LinkCost(bandwidth_gbps=bandwidth, hop_latency_us=hop, base_latency_us=base)
    profile = HardwareProfile(
        name=name,
        description=(
            f"calibrated by dtcompile.calibrate() on {dist.get_world_size(group)} {device.type} rank(s) over "
            f"{backend}, {time.strftime('%Y-%m-%d')}"
        ),
        intra_node=shared,
        inter_node=shared,
        devices_per_node=1 << 30,
        matmul_tflops=tflops,
        memory_gbps=copy,
        overlap=overlap,
        fused_collective_matmul=device.type == "cuda" and "nccl" in backend,
    )
    register_profile(profile)
    if save and dist.get_rank() == first:
        save_profile(profile, path)
    dist.barrier(group=group)
    return profile
