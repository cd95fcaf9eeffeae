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
``memory_gbps``) that :mod:`dtcompile.cost.simulate` uses to time the compute nodes
of a graph and play it on a compute and a communication stream.  This module is
the pure formulas and the profile's fields: it reads no graph and no file.

A profile also says what the passes may count on: how much of a collective's
time can run beside compute (``overlap``: 1 where a collective runs on its own
engine, as NCCL's do; what ``dtcompile.calibrate()`` measures on a CPU host,
where gloo's threads share the cores with the compute) and whether a fused
collective-matmul kernel exists (``fused_collective_matmul``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO", "HardwareProfile", "LinkCost", "collective_time_us"]

AUTO = "auto"
"""``cost_profile="auto"``: the profile follows the graph's devices and process groups
(:func:`dtcompile.cost.auto.choose_profile`); no profile may take the name."""


@dataclass(frozen=True, kw_only=True)
class LinkCost:
    """One kind of connection between ranks."""

    bandwidth_gbps: float
    """Bus bandwidth in GB/s (1e9 bytes per second)."""
    hop_latency_us: float
    """Latency added per ring step."""
    base_latency_us: float = 6.6
    """Fixed cost of launching a collective."""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0 or self.hop_latency_us < 0 or self.base_latency_us < 0:
            raise ValueError(f"LinkCost: bandwidth must be positive and latencies non-negative, got {self}")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """The links of one kind of machine, and the roofline of one device, by name."""

    name: str
    description: str
    intra_node: LinkCost
    inter_node: LinkCost
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
            fields[link] = LinkCost(**fields[link])
        return cls(**fields)

    def compute_time_us(self, flops: float) -> float:
        """Microseconds of ``flops`` of dense matmul on one device, at the roofline."""
        return flops / (self.matmul_tflops * 1e12) * 1e6

    def memory_time_us(self, num_bytes: float) -> float:
        """Microseconds to move ``num_bytes`` through one device's memory (read plus write
        counted by the caller): an elementwise op, a copy into or out of a buffer."""
        return num_bytes / (self.memory_gbps * 1e9) * 1e6

    def link(self, span: int) -> LinkCost:
        """The link a group uses whose ranks span ``span`` consecutive ranks."""
        return self.intra_node if span <= self.devices_per_node else self.inter_node


_RING: dict[str, tuple[int, int]] = {
    # op -> (hops per (n - 1), bytes on the wire per (n - 1) / n); broadcast handled apart
    "all_gather": (1, 1),
    "reduce_scatter": (1, 1),
    "all_to_all": (1, 1),
    "all_reduce": (2, 2),
}


def collective_time_us(op: str, num_bytes: int, group_size: int, link: LinkCost) -> float:
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
