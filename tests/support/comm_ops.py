"""Communication written as custom ops, as torchcomms writes its own: ``torch.library.custom_op``,
effectful, so that AOTAutograd keeps each in a ``with_effects`` and Inductor lowers it as a
``FallbackKernel`` (an ``EffectfulKernel``) it does not know communicates.

Defined when this module is imported (the tests import it, and so does each gloo rank that
unpickles one of their functions); namespace ``commorder``:

- ``all_gather(x) -> Tensor``: ``dist.all_gather_into_tensor`` over the default group;
- ``send(x, dst) -> Tensor``: ``dist.isend``, its work kept until ``wait_sends`` (a send
  that blocked would deadlock a ring whose ranks all send first); returns an empty token;
- ``barrier(x) -> Tensor``: ``dist.barrier()``; ``wait_sends(x) -> Tensor``: waits the sends;
- ``scale_(x)``: mutates ``x`` (not effectful); ``double(x) -> Tensor``: functional, no effects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._library.effects import EffectType

_PENDING_SENDS: list[tuple[torch.Tensor, dist.Work]] = []


@torch.library.custom_op("commorder::all_gather", mutates_args=())
def all_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


@all_gather.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))


@torch.library.custom_op("commorder::send", mutates_args=())
def send(x: torch.Tensor, dst: int) -> torch.Tensor:
    x = x.contiguous()
    _PENDING_SENDS.append((x, dist.isend(x, dst)))
    return x.new_zeros(())


@send.register_fake
def _(x: torch.Tensor, dst: int) -> torch.Tensor:
    return x.new_empty(())


@torch.library.custom_op("commorder::barrier", mutates_args=())
def barrier(x: torch.Tensor) -> torch.Tensor:
    dist.barrier()
    return x.new_zeros(())


@barrier.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(())


@torch.library.custom_op("commorder::wait_sends", mutates_args=())
def wait_sends(x: torch.Tensor) -> torch.Tensor:
    while _PENDING_SENDS:
        _PENDING_SENDS.pop()[1].wait()
    return x.new_zeros(())


@wait_sends.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(())


for _op in (all_gather, send, barrier, wait_sends):
    torch.library._register_effectful_op(_op._opoverload, EffectType.ORDERED)


@torch.library.custom_op("commorder::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor) -> None:
    x.mul_(2)


@torch.library.custom_op("commorder::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
