"""The per-rank-shapes fuzzer's cases: the shared models fed batches of each rank's own size.

Ranks of a data-parallel job legitimately see batches of their own sizes (a batch
padded to its own longest sequence, packed sequences, a short last batch), and a
decision that changes what a rank sends must not follow them (issue #66,
:mod:`dtcompile.ranks.plans`).  A :class:`Case` is one such job, small: a family of
the shared models (:data:`FAMILIES`) on its mesh, an entry (``dynamo``:
``torch.compile(model, backend=dtcompile.backend(inductor=False))``; ``step``:
:func:`dtcompile.compile_step` with AdamW inside), 2 to 4 steps, and the input
sizes of every data-parallel coordinate at every step, drawn independently (ranks
of one tensor-parallel group share their batch: the same data).  How they are
drawn is the case's :attr:`Case.pattern`, :data:`PATTERNS`: the same everywhere
(the control), the same on every rank but new each step, each rank its own,
one rank off, a short last batch, a batch padded to its own longest sequence.

:func:`draw_cases` draws them from a seed (:class:`random.Random`: the same seed,
the same cases); :mod:`support.rank_shapes_run` runs them on gloo ranks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ENTRIES", "FAMILIES", "PATTERNS", "Case", "Family", "draw_cases"]

ENTRIES = ("dynamo", "step")
PATTERNS = ("fixed", "equal", "independent", "one_differs", "short_last", "padded")
"""How a case's sizes are drawn: ``fixed`` (one size for every rank and step), ``equal``
(the ranks alike, a new size each step), ``independent`` (each data-parallel coordinate
its own size each step), ``one_differs`` (the ranks alike but one, at one step),
``short_last`` (a full batch, then the remainder of the data split over the ranks),
``padded`` (each coordinate's sequence padded to its own longest, a multiple of 8 tokens
or of the tensor-parallel degree)."""


@dataclass(frozen=True)
class Family:
    """One of the shared models as the fuzzer builds and feeds it."""

    name: str
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    data_axis: str | None
    """The mesh axis whose coordinates feed data of their own (``None``: every rank the same)."""
    sizes: tuple[str, ...]
    """The input's leading dims drawn per coordinate and step (the last dim is the model's ``dim``)."""
    seq_multiple: int = 1
    """What ``seq`` must divide by (sequence parallel shards it over the ``tp`` axis)."""

    @property
    def coordinates(self) -> int:
        """How many coordinates draw their own sizes."""
        return 1 if self.data_axis is None else self.mesh_shape[self.mesh_dim_names.index(self.data_axis)]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        # SimpleFSDP on NormMLPStack (build_norm_mlp_stack): the model of issue #66.
        Family("simple_fsdp", 2, (2,), ("dp",), "dp", ("rows",)),
        # The MLP, every parameter Shard(0) (build_fsdp_mlp).
        Family("fsdp_mlp", 2, (2,), ("dp",), "dp", ("rows",)),
        # The Llama-style block under tensor + sequence parallelism (build_block): one batch for both ranks.
        Family("tp_sp", 2, (2,), ("tp",), None, ("batch", "seq"), seq_multiple=2),
        # Experts over ep (build_moe): every rank feeds its own tokens.
        Family("moe", 2, (2,), ("ep",), "ep", ("rows",)),
        # The block under FSDP x TP on 2 x 2 (build_block_fsdp_tp): dp coordinates differ, tp peers share.
        Family("fsdp_tp", 4, (2, 2), ("dp", "tp"), "dp", ("batch", "seq"), seq_multiple=2),
    ]
}

# The share of cases per family: the MoE compiles for about twice as long as the MLPs, and
# 4 processes on 2 cores cost about three times 2.
_FAMILY_WEIGHTS = {"simple_fsdp": 0.35, "fsdp_mlp": 0.27, "tp_sp": 0.15, "moe": 0.15, "fsdp_tp": 0.08}
_PATTERN_WEIGHTS = {"fixed": 0.1, "equal": 0.15, "independent": 0.3, "one_differs": 0.15, "short_last": 0.15, "padded": 0.15}
_MAX_ROWS = 10
_MAX_BATCH = 3
_MAX_SEQ = 12
_CHECK_RANKS_OFF = 0.25
"""The share of cases run with ``check_ranks=False``: collectives that do not pair then
reach gloo (an abort, or wrong values), not dtcompile's check."""


@dataclass(frozen=True)
class Case:
    """One program of the fuzzer: see the module docstring."""

    index: int
    family: str
    entry: str
    sizes: tuple[tuple[tuple[int, ...], ...], ...]
    """``sizes[step][coordinate]``: the leading dims of that coordinate's input at that step."""
    pattern: str
    dims: tuple[tuple[str, int], ...]
    """The model's sizes, keywords of its ``build_*``."""
    seed: int
    check_ranks: bool = True

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def steps(self) -> int:
        return len(self.sizes)

    @property
    def equal(self) -> bool:
        """Every coordinate fed the same size at every step (sizes may change between steps)."""
        return all(len(set(step)) == 1 for step in self.sizes)

    @property
    def dim(self) -> int:
        return dict(self.dims)["dim"]

    def describe(self) -> str:
        """One line that names everything the case is: a repro."""
        sizes = " | ".join(",".join("x".join(map(str, s)) for s in step) for step in self.sizes)
        dims = " ".join(f"{k}={v}" for k, v in self.dims)
        check = "" if self.check_ranks else " check_ranks=False"
        return f"#{self.index} {self.family} {self.entry} [{sizes}] ({self.pattern}) {dims} seed={self.seed}{check}"

    def build(self, mesh: Any) -> tuple[nn.Module, nn.Module]:
        """Two copies of the parallel model, the same weights (the same seed)."""
        dims = dict(self.dims)
        return _build(self.family, mesh, self.seed, dims)[1], _build(self.family, mesh, self.seed, dims)[1]

    def batch(self, step: int, coordinate: int) -> torch.Tensor:
        """That coordinate's input at that step, the same on every rank that feeds it."""
        gen = torch.Generator().manual_seed(self.seed * 1009 + step * 31 + coordinate)
        return torch.randn(*self.sizes[step][coordinate], self.dim, generator=gen)


def _build(family: str, mesh: Any, seed: int, d: Mapping[str, int]) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """The family's ``build_*`` with the case's sizes (its example input is not used)."""
    from dtcompile._testing import models

    if family == "simple_fsdp":
        return models.build_norm_mlp_stack(mesh, rows=1, dim=d["dim"], hidden=d["hidden"], layers=d["layers"], seed=seed)
    if family == "fsdp_mlp":
        return models.build_fsdp_mlp(mesh, batch=1, dim=d["dim"], hidden=d["hidden"], seed=seed)
    if family == "moe":
        return models.build_moe(
            mesh, tokens=1, dim=d["dim"], hidden=d["hidden"], num_experts=d["num_experts"], top_k=d["top_k"], seed=seed
        )
    args = models.BlockArgs(dim=d["dim"], n_heads=d["n_heads"], hidden=d["hidden"])
    build = models.build_block if family == "tp_sp" else models.build_block_fsdp_tp
    return build(mesh, batch=1, seq=2, args=args, seed=seed)


def _draw_dims(rng: random.Random, family: str) -> tuple[tuple[str, int], ...]:
    if family == "simple_fsdp":
        return (("dim", rng.choice([8, 16, 32])), ("hidden", rng.choice([16, 32, 64])), ("layers", rng.randint(1, 3)))
    if family == "fsdp_mlp":
        return (("dim", rng.choice([8, 16, 32])), ("hidden", rng.choice([16, 32, 64])))
    if family == "moe":
        return (
            ("dim", rng.choice([8, 16])), ("hidden", rng.choice([16, 32])),
            ("num_experts", rng.choice([2, 4])), ("top_k", rng.choice([1, 2])),
        )
    # The block: heads and hidden divide by tp = 2.
    return (("dim", rng.choice([16, 32])), ("n_heads", rng.choice([2, 4])), ("hidden", rng.choice([32, 64])))


def _one_size(rng: random.Random, spec: Family, padded: bool = False) -> tuple[int, ...]:
    """A size for one coordinate: ``rows`` 1 to 10, or a ``batch`` of 1 to 3 and a ``seq``
    of the family's multiple, up to 12 (``padded``: the longest of a few sequences of
    lengths drawn as text is, rounded up as a collator pads)."""
    if spec.sizes == ("rows",):
        if padded:  # packed: as many sequences as fit
            return (max(1, min(_MAX_ROWS, round(rng.lognormvariate(1.3, 0.5)))),)
        return (rng.randint(1, _MAX_ROWS),)
    m = spec.seq_multiple
    if padded:
        longest = max(max(1, round(rng.lognormvariate(1.5, 0.6))) for _ in range(rng.randint(1, 3)))
        seq = min(_MAX_SEQ, m * math.ceil(longest / m))
    else:
        seq = m * rng.randint(1, _MAX_SEQ // m)
    return (rng.randint(1, _MAX_BATCH), seq)


def _draw_sizes(rng: random.Random, spec: Family, pattern: str, steps: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    n = spec.coordinates
    if pattern == "fixed":
        size = _one_size(rng, spec)
        return tuple((size,) * n for _ in range(steps))
    if pattern == "equal":
        return tuple((_one_size(rng, spec),) * n for _ in range(steps))
    if pattern in ("independent", "padded"):
        return tuple(tuple(_one_size(rng, spec, pattern == "padded") for _ in range(n)) for _ in range(steps))
    if pattern == "one_differs":
        size = _one_size(rng, spec)
        sizes = [[size] * n for _ in range(steps)]
        step, coordinate = rng.randrange(steps), rng.randrange(n)
        sizes[step][coordinate] = _one_size(rng, spec)
        return tuple(tuple(s) for s in sizes)
    assert pattern == "short_last", pattern
    full = _one_size(rng, spec)
    # The data's remainder, at least a row per coordinate, dealt out as DistributedSampler
    # does without padding (coordinate c takes the rows c, c + n, ...).
    remainder = rng.randint(n, n * full[0])
    last = tuple((len(range(c, remainder, n)), *full[1:]) for c in range(n))
    return tuple((full,) * n for _ in range(steps - 1)) + (last,)


def draw_cases(count: int, seed: int, *, families: Sequence[str] | None = None, entries: Sequence[str] = ENTRIES) -> list[Case]:
    """``count`` cases drawn from ``seed``: the same cases for the same arguments.

    Families by their share (:data:`FAMILIES`; ``families`` picks some), entries
    alike, patterns by theirs; 2 to 4 steps (3 or 4 for ``step``, whose first step
    runs eagerly to make AdamW's state); ``check_ranks=False`` for a quarter."""
    rng = random.Random(seed)
    names = list(families) if families is not None else [f for f in _FAMILY_WEIGHTS if f != "moe" or "dynamo" in entries]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise ValueError(f"draw_cases: unknown families {unknown}; the families are {sorted(FAMILIES)}")
    weights = [_FAMILY_WEIGHTS[name] for name in names]
    cases = []
    for index in range(count):
        family = rng.choices(names, weights)[0]
        spec = FAMILIES[family]
        # The shared MoE dispatches with funcol's AsyncCollectiveTensor.wait(), which a whole-step
        # trace (make_fx) does not have: compile_step cannot trace it, whatever the sizes.
        entry = "dynamo" if family == "moe" and "dynamo" in entries else rng.choice(list(entries))
        steps = rng.randint(3, 4) if entry == "step" else rng.randint(2, 4)
        pattern = rng.choices(list(_PATTERN_WEIGHTS), list(_PATTERN_WEIGHTS.values()))[0]
        if spec.coordinates == 1 and pattern in ("independent", "one_differs", "padded"):
            pattern = "equal"  # one coordinate: nothing to differ
        cases.append(Case(
            index=index,
            family=family,
            entry=entry,
            sizes=_draw_sizes(rng, spec, pattern, steps),
            pattern=pattern,
            dims=_draw_dims(rng, family),
            seed=rng.randrange(1 << 20),
            check_ranks=rng.random() >= _CHECK_RANKS_OFF,
        ))
    return cases
