"""Which ``local_map`` functions the trace keeps whole: each attribute as the module resolves it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import dtcompile
from dtcompile.auto_parallel.regions import tracing_regions


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _region() -> object:
    return dtcompile.local_map(_double, [Shard(0)], ([Shard(0)],))


class Base(nn.Module):
    core = staticmethod(_region())
    hidden = staticmethod(_region())

    @property
    def calls(self) -> int:  # a property is never called by the scan
        raise AssertionError("the scan read a property")


class Derived(Base):
    hidden = None  # hides the base class's region
    extra = staticmethod(_region())


def _found(module: nn.Module) -> dict[str, object]:
    before = dict(vars(module))
    with tracing_regions(module) as regions:
        shadowed = sorted(name for name, value in vars(module).items() if before.get(name, None) is not value)
        names = sorted(region.name for region in regions.values())
    assert vars(module) == before  # shadows removed again
    return {"shadowed": shadowed, "regions": names}


@pytest.mark.parametrize(
    ("make", "shadowed"),
    [
        (Base, ["core", "hidden"]),
        (Derived, ["core", "extra"]),
    ],
)
def test_regions_are_the_attributes_as_the_module_resolves_them(make, shadowed):
    module = make()
    assert _found(module) == {"shadowed": shadowed, "regions": ["_double"] * len(shadowed)}


def test_an_instance_attribute_hides_or_adds_a_region():
    module = Derived()
    module.core = None  # the instance's own value wins over its class's region
    module.own = _region()
    found = _found(module)
    assert found["shadowed"] == ["extra", "own"]
    assert module.core is None
