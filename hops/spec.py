"""A region's declaration as text: placement strings, :class:`RegionSpec`, and the shared messages.

A region's placements are written as short strings (``"S(0)R"``: ``Shard(0)``
on mesh axis 0, ``Replicate()`` on axis 1; ``_S(0,2)`` a ``_StridedShard``,
``P(sum)`` a ``Partial``); a :class:`RegionSpec` holds one per operand and
output, and its text (``str(spec)``) is the op's argument, so the placements
travel with the node through every pass, cache and pickle, and print with the
graph.  The messages that both the call's checks and the op raise live here
too, one each.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from dtcompile.base.notation import describe_mesh

__all__ = [
    "LocalMapError",
    "RegionSpec",
    "counted",
    "describe_mesh_ranks",
    "format_placements",
    "mismatch_error",
    "other_mesh_error",
    "output_count_error",
    "parse_placements",
    "placements_of_types",
]


class LocalMapError(ValueError):
    """A ``local_map`` call whose arguments or results do not match its declared placements."""


_SPMD_TYPE = re.compile(r"S\((\d+)\)|(R|I|P|V)")


def placements_of_types(types: Mapping[Any, Any], mesh: Any, what: str) -> tuple[Any, ...]:
    """SPMD types per mesh axis name (``{"dp": "S(0)", "tp": "R"}``; ``spmd_types``' ``S(0)``,
    ``R``, ``I``, ``P`` or dtcompile's ``SpmdType`` as values) as DTensor placements in the
    mesh's axis order: ``S(d)`` is ``Shard(d)``, ``R`` and ``I`` ``Replicate()``, ``P``
    ``Partial()``.  Raises ``ValueError`` naming ``what`` for an axis the mesh lacks or one
    left out, or ``V`` (varying, with no dim to shard)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(f"{what} gives SPMD types by mesh axis name, and {describe_mesh(mesh)} has no axis names; "
                         "build it with mesh_dim_names=(...), or give one placement per axis")
    given = {str(getattr(axis, "value", axis)): t for axis, t in types.items()}
    unknown, missing = sorted(set(given) - set(names)), [n for n in names if n not in given]
    if unknown or missing:
        raise ValueError(f"{what} = {given}: " + "; ".join(
            [f"{unknown} are not axes of the mesh {names}"] * bool(unknown) + [f"no type for {missing}"] * bool(missing))
            + "; give one type per mesh axis")
    placements = []
    for name in names:
        text = given[name] if isinstance(given[name], str) else repr(given[name])
        found = _SPMD_TYPE.fullmatch(text)
        if found is None or found[2] == "V":
            why = "V says the value varies but not which dim it shards: write S(d)" if found else \
                "not an SPMD type (S(d) with d >= 0, R, I or P)"
            raise ValueError(f"{what}: {text!r} on axis {name!r} is {why}")
        placements.append(Shard(int(found[1])) if found[1] else Partial() if found[2] == "P" else Replicate())
    return tuple(placements)


_PLACEMENT = re.compile(r"_S\((\d+),(\d+)\)|S\((\d+)\)|R|P\((\w+)\)")


def format_placements(placements: Sequence[Any] | None) -> str | None:
    """``(Shard(0), Replicate())`` -> ``"S(0)R"``; ``None`` stays ``None``.

    Raises :class:`LocalMapError` for a placement the text form cannot carry
    (only Shard, Replicate, Partial and _StridedShard can be region placements).
    """
    if placements is None:
        return None
    text = "".join(str(p).replace(" ", "") for p in placements)
    for p in placements:
        # By type as well as ``==``: a user Partial subclass equals Partial('sum').
        back = parse_placements(str(p).replace(" ", ""), strict=False)
        if (
            back is None
            or len(back) != 1
            or type(back[0]) is not type(p)
            or back[0] != p
        ):
            raise LocalMapError(
                f"local_map: placement {p!r} ({type(p).__name__}) cannot be a region placement; "
                "use Shard, Replicate, Partial or _StridedShard"
            )
    return text


@functools.lru_cache(maxsize=1024)
def parse_placements(text: str, strict: bool = True) -> tuple[Any, ...] | None:
    """The inverse of :func:`format_placements`: ``"S(0)R"`` -> ``(Shard(dim=0), Replicate())``."""
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    placements: list[Any] = []
    pos = 0
    while pos < len(text):
        m = _PLACEMENT.match(text, pos)
        if m is None:
            if strict:
                raise LocalMapError(
                    f"local_map: cannot read placements {text!r} at {text[pos:]!r}"
                )
            return None
        if m.group(1) is not None:
            placements.append(
                _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
            )
        elif m.group(3) is not None:
            placements.append(Shard(int(m.group(3))))
        elif m.group(4) is not None:
            placements.append(Partial(m.group(4)))
        else:
            placements.append(Replicate())
        pos = m.end()
    return tuple(placements)


class RegionSpec(NamedTuple):
    """What a region declares: one placement string (or ``None``) per operand and per output.

    A forward region's operands are its inputs; its outputs are the user's
    outputs followed by ``saved`` tensors kept for the backward (only in graphs
    the dtcompile backend traces).  A backward region (``backward=True``) takes
    the ``saved`` tensors, then the gradients of the outputs that need one
    (``in_placements`` are their placements), and returns the gradients of the
    inputs (``out_placements``: the declared ``in_grad_placements``).
    """

    name: str
    mesh: str
    in_placements: tuple[str | None, ...]
    out_placements: tuple[str | None, ...]
    in_grad_placements: tuple[str | None, ...]
    redistribute_inputs: bool = False
    backward: bool = False
    saved: int = 0

    def __str__(self) -> str:
        """The spec as the op's argument: ``mm on (tp=4): [S(0), R] -> [S(0)] | grads [S(0), R]``.

        ``-`` is an operand or output without placements (a plain tensor);
        ``saved k`` counts the values a forward region keeps for its backward.
        :meth:`parse` reads it back.
        """

        def side(ps: tuple[str | None, ...]) -> str:
            return "[" + ", ".join("-" if p is None else p for p in ps) + "]"

        text = (
            f"{self.name} on {self.mesh}: {side(self.in_placements)} -> {side(self.out_placements)}"
            f" | grads {side(self.in_grad_placements)}"
        )
        if self.saved:
            text += f" | saved {self.saved}"
        if self.backward:
            text += " | backward"
        if self.redistribute_inputs:
            text += " | redistribute"
        return text

    @staticmethod
    def parse(text: str) -> RegionSpec:
        return _parse_spec(text)

    @staticmethod
    def of(spec: RegionSpec | str) -> RegionSpec:
        """``spec`` as a :class:`RegionSpec` (the op's argument is its text)."""
        return spec if isinstance(spec, RegionSpec) else _parse_spec(spec)


_SPEC = re.compile(
    r"^(?P<name>\w+) on (?P<mesh>\(.*\)): \[(?P<ins>[^\]]*)\] -> \[(?P<outs>[^\]]*)\]$"
)


@functools.lru_cache(maxsize=1024)
def _parse_spec(text: str) -> RegionSpec:
    head, *parts = text.split(" | ")
    m = _SPEC.match(head)
    if m is None or not parts or not parts[0].startswith("grads ["):
        raise LocalMapError(f"local_map: not a region spec: {text!r}")

    def side(items: str) -> tuple[str | None, ...]:
        return (
            tuple(None if item == "-" else item for item in items.split(", "))
            if items
            else ()
        )

    flags = set(parts[1:])
    saved = next((int(p.split()[1]) for p in parts[1:] if p.startswith("saved ")), 0)
    return RegionSpec(
        name=m["name"],
        mesh=m["mesh"],
        in_placements=side(m["ins"]),
        out_placements=side(m["outs"]),
        in_grad_placements=side(parts[0][len("grads [") : -1]),
        redistribute_inputs="redistribute" in flags,
        backward="backward" in flags,
        saved=saved,
    )


def describe_mesh_ranks(mesh: Any) -> str:
    text = describe_mesh(mesh)
    ranks = mesh.mesh.flatten().tolist()
    return f"{text} over ranks {ranks}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def other_mesh_error(name: str, index: int, mesh: Any, region_mesh: Any) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: input {index} is a DTensor on {describe_mesh_ranks(mesh)} but the region's "
        f"device_mesh is {describe_mesh_ranks(region_mesh)}; redistribute it onto the region's mesh, or pass that mesh"
    )


def mismatch_error(name: str, index: int, have: str | None, want: str) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: input {index} has placements {have} but in_placements[{index}] is {want}; "
        "redistribute it first, or pass redistribute_inputs=True to local_map"
    )


def output_count_error(name: str, returned: int, declared: int) -> LocalMapError:
    return LocalMapError(
        f"local_map {name}: the region returned {counted(returned, 'output')} (after flattening) but "
        f"out_placements declares {declared}; give one placement tuple (None for a non-tensor) per output"
    )
