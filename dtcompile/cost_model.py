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

To add a profile: build a :class:`HardwareProfile` and call
:func:`register_profile`; ``dtcompile.backend(cost_profile="name")`` then uses
it.  The ``cpu_gloo`` constants come from ``benchmarks/calibrate_gloo.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PROFILES",
    "HardwareProfile",
    "Link",
    "collective_time_us",
    "get_profile",
    "register_profile",
]


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
    """Memory bandwidth of one device (GB/s) for the roofline estimate."""

    def link(self, span: int) -> Link:
        """The link a group uses whose ranks span ``span`` consecutive ranks."""
        return self.intra_node if span <= self.devices_per_node else self.inter_node


PROFILES: dict[str, HardwareProfile] = {}


def register_profile(profile: HardwareProfile) -> HardwareProfile:
    """Make ``profile`` available by its name (replacing one of the same name)."""
    PROFILES[profile.name] = profile
    return profile


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown cost profile {name!r}; the profiles are {sorted(PROFILES)} "
            "(add one with dtcompile.cost_model.register_profile)"
        ) from None


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
# Fitted by benchmarks/calibrate_gloo.py on the 2-core CI machine (see RESULTS.md).
register_profile(
    HardwareProfile(
        name="cpu_gloo",
        description="ranks as processes on one CPU host, gloo over loopback TCP (calibrated)",
        intra_node=Link(bandwidth_gbps=1.13, hop_latency_us=0.0, base_latency_us=280.0),
        inter_node=Link(bandwidth_gbps=1.13, hop_latency_us=0.0, base_latency_us=280.0),
        devices_per_node=1 << 30,
        matmul_tflops=0.1,  # two cores, fp32
        memory_gbps=10.0,
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
