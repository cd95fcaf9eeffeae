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

Compute is estimated with a roofline: a matmul takes ``2 M N K`` flops at the
profile's ``matmul_tflops``, any other op reads and writes its tensors at its
``memory_gbps`` (views and metadata ops are free); :func:`node_time_us`.  A
``local_map`` region (one node until lowering) takes what its body takes, the
collectives it issues and waits for inside included: :func:`region_timeline`.

To add a profile: build a :class:`HardwareProfile` and call
:func:`register_profile`; ``dtcompile.backend(cost_profile="name")`` then uses
it.  The ``cpu_gloo`` constants come from ``benchmarks/calibrate_gloo.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PROFILES",
    "HardwareProfile",
    "Link",
    "Timeline",
    "collective_time_us",
    "get_profile",
    "node_time_us",
    "region_timeline",
    "register_profile",
    "simulate",
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
        matmul_tflops=989.0,  # bf16 dense
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
        matmul_tflops=989.0,
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


_FREE = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "slice", "select",
         "unsqueeze", "squeeze", "split", "split_with_sizes", "alias", "as_strided", "wait_tensor"}


def _tensors(value: Any) -> list[Any]:
    import torch

    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _flops_time_us(flops: float, profile: HardwareProfile) -> float:
    return flops / (profile.matmul_tflops * 1e12) * 1e6


def region_timeline(node: Any, profile: HardwareProfile) -> Timeline:
    """A ``local_map`` region node played alone: its body's :func:`simulate`.

    The region ends when its body's last node does, so its collectives (issued
    and waited for inside) hold the compute stream.
    """
    from dtcompile.regions import region_body

    return simulate(region_body(node).graph, profile)


def node_time_us(node: Any, profile: HardwareProfile) -> float:
    """Roofline estimate of one compute node of an AOT graph (0 for views, waits, non-ops;
    for a fused collective-matmul, its matmuls; for a ``local_map`` region, its body's
    whole time, inner collectives included)."""
    import torch

    from dtcompile.regions import is_region

    target = node.target
    if is_region(node):
        return region_timeline(node, profile).total_us
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0.0
    name = target._opname
    if target.namespace == "dtcompile":
        if name == "fused_all_gather_matmul":
            gathered, outs = node.meta["val"]
            return sum(_flops_time_us(2 * o.numel() * gathered.shape[-1], profile) for o in outs)
        if name == "fused_matmul_reduce_scatter":
            a, out_shape = node.args[0].meta["val"], node.args[2]
            return _flops_time_us(2 * math.prod(out_shape) * a.shape[-1], profile)
    if name in _FREE or target.namespace == "_c10d_functional":
        return 0.0
    out = _tensors(node.meta.get("val"))
    if name in ("mm", "addmm", "bmm", "baddbmm") and out:
        a = node.args[1] if name in ("addmm", "baddbmm") else node.args[0]
        k = a.meta["val"].shape[-1]
        return _flops_time_us(2 * out[0].numel() * k, profile)
    moved = sum(t.numel() * t.element_size() for t in out)
    moved += sum(t.numel() * t.element_size() for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
    return moved / (profile.memory_gbps * 1e9) * 1e6


@dataclass(frozen=True)
class Timeline:
    """Estimated run of one graph: a compute stream and a communication stream."""

    compute_us: float
    """Sum of the compute nodes' estimates."""
    comm_us: float
    """Sum of the collectives' estimates."""
    total_us: float
    """When the last node finishes."""

    @property
    def exposed_comm_us(self) -> float:
        """Communication the compute stream waits for: ``total - compute``."""
        return self.total_us - self.compute_us


def simulate(graph: Any, profile: HardwareProfile) -> Timeline:
    """Play ``graph`` on one compute and one communication stream, in graph order.

    A collective is issued when the compute stream reaches it and runs after the
    previous collective; ``wait_tensor`` holds compute until it is done; other
    nodes take their roofline time.  A fused collective-matmul over ``n`` ranks
    pipelines ``n`` chunks: it takes ``max(C, M) + min(C, M) / n`` on the compute
    stream for communication ``C`` and matmuls ``M``.  A ``local_map`` region
    takes its body's time (:func:`region_timeline`); one that issues collectives
    starts once the communication stream is free and holds both streams.
    """
    import torch

    from dtcompile.collectives import collective_info
    from dtcompile.regions import is_region

    wait = torch.ops._c10d_functional.wait_tensor.default
    clock = comm_free = compute = comm = 0.0
    done: dict[Any, float] = {}
    for node in graph.nodes:
        info = collective_info(node)
        if info is not None and info.fused:
            c = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
            m = node_time_us(node, profile)
            comm += c
            compute += m
            clock = max(clock, comm_free) + max(c, m) + min(c, m) / info.group_size
        elif info is not None:
            cost = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
            comm += cost
            comm_free = max(clock, comm_free) + cost
            done[node] = comm_free
        elif node.target is wait:
            clock = max(clock, done.get(node.args[0], clock))
        elif is_region(node):
            inner = region_timeline(node, profile)
            compute += inner.compute_us
            comm += inner.comm_us
            # Its collectives queue behind the ones in flight; it ends with its body.
            start = max(clock, comm_free) if inner.comm_us else clock
            clock = start + inner.total_us
            if inner.comm_us:
                comm_free = clock
        else:
            cost = node_time_us(node, profile)
            compute += cost
            clock += cost
    return Timeline(compute, comm, max(clock, comm_free))
