"""The fuzzer's programs: inputs and steps, rendered as Python source, and their inputs built per rank.

A :class:`Program` is a mesh kind, input specs and a list of :class:`Step`s; each
step is one line of source (``t3 = torch.relu(x0)``) and, for a ``local_map``
step, a module-level region function.  :meth:`Program.source` renders the whole
program as ``def prog(mesh, x0, x1): ...``: every rank ``exec``s it, so each
program on each rank is a fresh code object (Dynamo's recompile limit counts per
code object), and a failure prints as a readable repro.

Inputs are rebuilt on every rank from a seed: the same full tensor everywhere,
plus, on a ``Partial`` mesh axis, a contribution that depends on the rank's
coordinate along that axis (so a ``Partial`` input really differs across ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MESHES",
    "Input",
    "Program",
    "Step",
    "make_input",
    "namespace",
    "parse_placement",
    "placement_text",
    "program_from_text",
]

# Mesh kinds: name -> (world size, mesh shape, mesh dim names).
MESHES: dict[str, tuple[int, tuple[int, ...], tuple[str, ...]]] = {
    "1d2": (2, (2,), ("tp",)),
    "1d4": (4, (4,), ("tp",)),
    "2d": (4, (2, 2), ("dp", "tp")),
}


@dataclass(frozen=True)
class Input:
    """One DTensor argument of ``prog``."""

    name: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    """Placement source text per mesh axis, e.g. ``("Shard(0)", "Partial('max')")``."""
    requires_grad: bool
    seed: int

    def describe(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{self.name}: f32{list(self.shape)} ({', '.join(self.placements)}){grad}, seed {self.seed}"


@dataclass(frozen=True)
class Step:
    """One line of ``prog``: ``out = code``."""

    kind: str
    """Coverage family: elementwise, reduction, view, matmul, redistribute, local, factory, local_map."""
    op: str
    """The op within its family (``relu``, ``sum_dim``, ``from_local``, ...)."""
    out: str
    args: tuple[str, ...]
    """The values the line reads, in the order of the ``{0}``, ``{1}`` fields of ``code``."""
    code: str
    """The right-hand side, with ``{0}``, ``{1}``, ... for ``args``."""
    region: str = ""
    """For a ``local_map`` step: the region function's module-level source (named by ``{region}``)."""
    rng: bool = False
    """The result depends on random numbers (compiled RNG is not eager RNG)."""

    def line(self) -> str:
        return f"{self.out} = {self.code.format(*self.args, region=f'region_{self.out}')}"

    def replace_args(self, old: str, new: str) -> Step:
        return dataclasses.replace(self, args=tuple(new if a == old else a for a in self.args))

    def region_source(self) -> str:
        return self.region.format(region=f"region_{self.out}") if self.region else ""


def _loss_term(name: str, how: str) -> str:
    return {"to_local": f"{name}.to_local().sum()", "full_tensor": f"{name}.full_tensor().sum()", "sum": f"{name}.sum()"}[how]


@dataclass(frozen=True)
class Program:
    mesh: str
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    loss: tuple[tuple[str, str], ...] = ()
    """Backward: ``(output, how)`` terms summed into ``loss`` (``how``: to_local, full_tensor, sum);
    empty for a forward-only program."""
    expect_raise: bool = False
    """The generator saw the last step raise (on simulated ranks): a program for the error paths."""

    @property
    def world_size(self) -> int:
        return MESHES[self.mesh][0]

    @property
    def rng(self) -> set[str]:
        """The values that depend on random numbers (the rng steps and everything computed from them)."""
        tainted: set[str] = set()
        for step in self.steps:
            if step.rng or tainted.intersection(step.args):
                tainted.add(step.out)
        return tainted

    def source(self) -> str:
        regions = [s.region_source() for s in self.steps if s.region]
        params = ", ".join(["mesh", *(i.name for i in self.inputs)])
        body = [f"    {s.line()}" for s in self.steps]
        if self.loss:
            body.append("    loss = " + " + ".join(_loss_term(name, how) for name, how in self.loss))
            detached = ", ".join(f"{o}.detach()" for o in self.outputs)
            body.append(f"    return ({detached},), loss")
        else:
            body.append(f"    return ({', '.join(self.outputs)},)")
        return "\n\n".join([*regions, f"def prog({params}):\n" + "\n".join(body)]) + "\n"

    def describe(self) -> str:
        """The repro: mesh, inputs, then the source."""
        world_size, shape, names = MESHES[self.mesh]
        mesh = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
        head = [f"# mesh ({mesh}), {world_size} threaded ranks"]
        head += [f"# {i.describe()}" for i in self.inputs]
        if self.expect_raise:
            head.append("# the generator saw the last step raise on simulated ranks")
        return "\n".join(head) + "\n" + self.source()

    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)


def namespace() -> dict[str, Any]:
    """What the generated source may name."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import dtcompile

    return {
        "torch": torch,
        "dtensor": dtensor,
        "funcol": funcol,
        "dtcompile": dtcompile,
        "DTensor": DTensor,
        "Partial": Partial,
        "Replicate": Replicate,
        "Shard": Shard,
        "_StridedShard": _StridedShard,
        "distribute_tensor": distribute_tensor,
    }


def parse_placement(text: str) -> Any:
    return eval(text, namespace())  # noqa: S307 - our own placement texts


def placement_text(p: Any) -> str:
    """A placement as source: ``Shard(0)``, ``Replicate()``, ``Partial('max')``, ``_StridedShard(0, split_factor=2)``."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return f"_StridedShard({p.dim}, split_factor={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return "Partial()" if p.reduce_op == "sum" else f"Partial({p.reduce_op!r})"
    raise TypeError(f"placement_text: no source form for {p!r}")


def placements_text(ps: Sequence[Any]) -> str:
    return "[" + ", ".join(placement_text(p) for p in ps) + "]"


def make_input(spec: Input, mesh: Any, coordinate: Sequence[int] | None) -> Any:
    """``spec`` as a DTensor on ``mesh``, built without collectives.

    ``coordinate`` is this rank's mesh coordinate (``None`` on simulated ranks,
    where values do not matter): on each ``Partial`` axis the rank adds a
    contribution seeded by its coordinate along the partial axes.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    full = torch.randn(spec.shape, generator=torch.Generator().manual_seed(spec.seed))
    placements = [parse_placement(p) for p in spec.placements]
    partial_axes = [axis for axis, p in enumerate(placements) if isinstance(p, Partial)]
    if partial_axes and coordinate is not None:
        key = sum(coordinate[axis] * 10**k for k, axis in enumerate(partial_axes))
        own = torch.Generator().manual_seed(spec.seed * 7919 + 1 + key)
        full = full + torch.randn(spec.shape, generator=own)
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = distribute_tensor(full, mesh, plain, src_data_rank=None).to_local()
    x = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return x.requires_grad_(spec.requires_grad)


def program_from_text(mesh: str, inputs: Sequence[Input], text: str, *, loss: Sequence[tuple[str, str]] = ()) -> Program:
    """A program written by hand: module-level region functions (``def region_...``) and
    ``name = expression`` lines, then ``return a, b``; for pinned regressions."""
    regions, lines, outputs = [], [], ()
    chunks = text.strip("\n").split("\n\n")
    for chunk in chunks:
        if chunk.lstrip().startswith(("@", "def ")):
            regions.append(chunk.strip("\n"))
            continue
        for line in chunk.strip("\n").splitlines():
            line = line.strip()
            if line.startswith("return "):
                outputs = tuple(name.strip() for name in line.removeprefix("return ").split(",") if name.strip())
            elif line:
                out, code = line.split(" = ", 1)
                lines.append((out.strip(), code.replace("{", "{{").replace("}", "}}")))
    region = "\n\n".join(regions).replace("{", "{{").replace("}", "}}")
    steps = tuple(
        Step("manual", "manual", out, (), code, region=region if k == 0 else "") for k, (out, code) in enumerate(lines)
    )
    return Program(mesh, tuple(inputs), steps, outputs, tuple(loss))
