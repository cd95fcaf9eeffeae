"""What one edge costs under one pair of candidates: redistributions, and bucketed parameter collectives.

A value read in another layout than it is made in goes through ``redistribute``:
forward from the producer's layout to the reader's, backward the gradient from
the reader's gradient layout to the one its producer wants (:func:`transfer`,
priced with :func:`~dtcompile.auto_parallel.measure.planned_redistribution` and the
local copies around it).  The collectives of an edge out of a parameter (its
all-gather, its gradient's reduction) wait for no activation, and dtcompile's
``bucketing`` pass merges them per kind and mesh axis into one collective (up to
``bucket_cap_bytes``): :func:`bucketed_time_us` prices such an edge by its bytes,
and the solver counts each bucket's launch latency once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dtcompile.auto_parallel.measure import planned_redistribution
from dtcompile.auto_parallel.placements import Layout, PlannedCollective, grad_layout, is_partial
from dtcompile.base.channels import GraphKind
from dtcompile.cost import HardwareProfile, collective_time_us

__all__ = ["BucketKey", "Transfer", "bucket_key", "bucketed_time_us", "launch_latency_us", "transfer"]


@dataclass(frozen=True)
class Transfer:
    """One edge under one pair of candidates: its collectives and their time."""

    collectives: tuple[PlannedCollective, ...]
    time_us: float
    passthrough: bool = False
    bucketable: tuple[bool, ...] = ()
    """Per collective, whether dtcompile's bucketing can merge it with others of its kind
    when the edge leaves a parameter (see :func:`bucketed_time_us`)."""
    """The reader takes the value as it is: no ``redistribute``, and the gradient goes back as it came."""


def transfer(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: Layout | None,
    want: Layout | None,
    read: Layout,
    grad: Layout | None,
    mesh: Any,
    profile: HardwareProfile,
    cache: dict[Any, Transfer | None],
    regather: bool = False,
) -> Transfer | None:
    """A value of layout ``out`` (whose gradient must come back as ``want``) read in layout
    ``read`` by a node that hands its gradient back as ``grad``; ``None`` where impossible.
    ``regather``: a parameter whose reader's backward reads it, compiled to reshard after
    forward (:mod:`dtcompile.pipeline.reshard`): where the forward only gathers it, the backward
    gathers it again.

    Read as it is (``read == out``) when the gradient comes back as wanted; else through
    ``redistribute``: forward ``out -> read``, backward ``grad -> grad_layout(grad, out)``,
    which must be ``want`` (so a ``Partial`` value's gradient cannot stay ``Partial``), and
    ``read`` must not make a ``Partial`` that ``out`` is not.
    """
    key = (shape, dtype, out, want, read, grad, regather)
    if key in cache:
        return cache[key]
    result: Transfer | None
    if out is None:
        result = None
    elif read == out and (grad is None or grad == want):
        result = Transfer((), 0.0, passthrough=True)
    elif any(is_partial(r) and r != o for r, o in zip(read, out)):
        result = None
    elif grad is not None and grad_layout(grad, out) != want:
        result = None
    else:
        found, copied, _ = planned_redistribution(shape, dtype, out, read, mesh, GraphKind.FORWARD)
        # Forward, only the first collective reads the parameter itself; a later one reads
        # what the one before made, ready only as the graph reaches it.
        bucketable = tuple(i == 0 for i in range(len(found)))
        if regather and found and all(c.op == "all_gather" for c in found):
            again = tuple(dataclasses.replace(c, direction=GraphKind.BACKWARD) for c in found)
            copied *= 2
            found, bucketable = found + again, bucketable + bucketable
        if grad is not None:
            backward, copied_back, read_at_once = planned_redistribution(shape, dtype, grad, want, mesh, GraphKind.BACKWARD)
            found += backward
            copied += copied_back
            # Backward, only the last collective makes the gradient itself, read at the end,
            # unless local work (a chunk, a cat) reads its result at once.
            last_ok = not read_at_once
            bucketable += tuple(last_ok and i == len(backward) - 1 for i in range(len(backward)))
        copy_us = profile.memory_time_us(copied)
        result = Transfer(found, sum(c.time_us(profile) for c in found) + copy_us, bucketable=bucketable)
    cache[key] = result
    return result


BucketKey = tuple[str, str, str, int, int]
"""``(direction, op, axis, group size, group span)``: collectives dtcompile's bucketing merges."""


def bucket_key(c: PlannedCollective) -> BucketKey:
    return (c.direction, c.op, c.axis, c.group_size, c.group_span)


def launch_latency_us(key: BucketKey, profile: HardwareProfile) -> float:
    """The part of a collective's time that does not grow with its bytes."""
    direction, op, axis, size, span = key
    return collective_time_us(op, 0, size, profile.link(span))


def bucketed_time_us(t: Transfer, profile: HardwareProfile, cap_bytes: int) -> tuple[float, tuple[BucketKey, ...]]:
    """A parameter edge's time with its collectives bucketed: each one's bytes on the wire,
    plus its share (``bytes / cap``) of one more bucket's launch; and the buckets it joins.

    The pass keeps a bucket only where no member's result is read before the last
    member's input exists, and it moves no node: of a parameter's gather in several
    steps (one per mesh axis) only the first, which reads the parameter, joins a bucket;
    of its gradient's reduction only the last, and not when local work (the chunk to
    the parameter's shard, a cat) reads its result at once.  The others keep their
    own launch latency."""
    total, keys = t.time_us, []
    for c, ok in zip(t.collectives, t.bucketable):
        if not ok:
            continue
        key = bucket_key(c)
        latency = launch_latency_us(key, profile)
        total += latency * c.bytes / cap_bytes - latency
        keys.append(key)
    return total, tuple(dict.fromkeys(keys))


