"""Generated tensor- and sequence-parallel programs on plain tensors, typed with ``spmd_types``, for the
SPMD-type fuzzer (``tests/clients/test_spmd_fuzz.py``).

A program is a residual stream ``h`` (sequence 8 x hidden 8, replicated or sharded on the sequence,
``S(0)``, over the 2 ranks of the world) through 1 to 4 blocks, written as Python source so that a
failure prints the program:

- **mlp**: Megatron's pair, column-parallel then row-parallel (the hidden 16 sharded), the partial
  sum all-reduced (or reduce-scattered back to the sequence shard), a nonlinearity between;
- **swiglu**: the same with a gate (``silu(a @ w1.t()) * (a @ w3.t())``);
- **attention**: heads sharded (4 heads of 2, 2 per rank): q, k, v column-parallel, viewed as heads,
  scores, softmax, the weighted sum, the output projection row-parallel;
- **norm**: RMSNorm over the hidden dim (local on either layout), a replicated weight;
- **pointwise**: ``h * 0.5 + tanh(h)``.

Under sequence parallelism a block that reads the whole sequence all-gathers it first.  A planted
program breaks one reduction: **missing** (the partial sum added to the stream: no all-reduce, or a
local chunk instead of the reduce-scatter), **nonlinear** (a ReLU on the partial sum before it is
reduced) or **doubled** (a reduced value reduced again).  Eager runs every one of them, silently
wrong where planted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

SEQ, DIM, HIDDEN, HEADS, HEAD_DIM, WORLD = 8, 8, 16, 4, 2, 2
PLANTS = ("missing", "nonlinear", "doubled")
BLOCKS = ("mlp", "swiglu", "attention", "norm", "pointwise")
REDUCING = ("mlp", "swiglu", "attention")


@dataclass
class Weight:
    """A parameter of the program: its global shape and the dim its ranks shard (``None``: replicated)."""

    name: str
    shape: tuple[int, ...]
    shard: int | None


@dataclass
class SpmdProgram:
    seed: int
    sequence_parallel: bool
    blocks: list[str]
    plant: str | None
    """The planted bug, or ``None``."""
    planted_block: int | None
    source: str = ""
    weights: list[Weight] = field(default_factory=list)

    def describe(self) -> str:
        where = f", {self.plant} in block {self.planted_block}" if self.plant else ""
        return f"seed {self.seed}: {'SP' if self.sequence_parallel else 'TP'} {self.blocks}{where}\n{self.source}"


def _reduce(lines: list[str], y: str, sp: bool, plant: str | None) -> None:
    """Reduce partial sum ``y`` to the stream's layout (all-reduce, or reduce-scatter under SP), planted or not."""
    if plant == "nonlinear":
        lines.append(f"    {y} = torch.relu({y})")
    if plant == "missing":
        if sp:
            lines.append(f"    {y} = {y}.chunk({WORLD}, 0)[rank]")
        return
    if plant == "doubled" or not sp:
        lines.append(f"    {y} = funcol.all_reduce({y}, 'sum', group)")
    if plant == "doubled" and not sp:
        lines.append(f"    {y} = funcol.all_reduce({y}, 'sum', group)")
    if sp:
        lines.append(f"    {y} = funcol.reduce_scatter_tensor({y}, 'sum', 0, group)")


def generate(seed: int) -> SpmdProgram:
    rng = random.Random(seed)
    sp = rng.random() < 0.5
    blocks = [rng.choice(BLOCKS) for _ in range(rng.randint(1, 4))]
    plant = rng.choice(PLANTS) if rng.random() < 0.5 else None
    planted = None
    if plant is not None:
        reducing = [i for i, b in enumerate(blocks) if b in REDUCING]
        if not reducing:
            blocks.append(rng.choice(REDUCING))
            reducing = [len(blocks) - 1]
        planted = rng.choice(reducing)
    program = SpmdProgram(seed, sp, blocks, plant, planted)
    lines = ["def program(h, weights, rank, group):"]
    weights = program.weights

    def weight(name: str, shape: tuple[int, ...], shard: int | None) -> str:
        weights.append(Weight(name, shape, shard))
        return f"weights[{len(weights) - 1}]"

    for i, kind in enumerate(blocks):
        block_plant = plant if i == planted else None
        whole = f"a{i}"
        if kind in REDUCING:
            lines.append(f"    {whole} = funcol.all_gather_tensor(h, 0, group)" if sp else f"    {whole} = h")
        if kind in ("mlp", "swiglu"):
            w1 = weight(f"w{i}_1", (HIDDEN, DIM), 0)
            w2 = weight(f"w{i}_2", (DIM, HIDDEN), 1)
            act = rng.choice(("torch.nn.functional.gelu", "torch.relu", "torch.nn.functional.silu", "torch.tanh"))
            if kind == "mlp":
                lines.append(f"    u{i} = {act}({whole} @ {w1}.t())")
            else:
                w3 = weight(f"w{i}_3", (HIDDEN, DIM), 0)
                lines.append(f"    u{i} = torch.nn.functional.silu({whole} @ {w1}.t()) * ({whole} @ {w3}.t())")
            lines.append(f"    y{i} = u{i} @ {w2}.t()")
            _reduce(lines, f"y{i}", sp, block_plant)
            lines.append(f"    h = h + y{i}")
        elif kind == "attention":
            wq, wk, wv = (weight(f"w{i}_{n}", (DIM, DIM), 0) for n in "qkv")
            wo = weight(f"w{i}_o", (DIM, DIM), 1)
            local_heads = HEADS // WORLD
            for n, w in (("q", wq), ("k", wk), ("v", wv)):
                lines.append(f"    {n}{i} = ({whole} @ {w}.t()).view({SEQ}, {local_heads}, {HEAD_DIM}).transpose(0, 1)")
            lines.append(f"    s{i} = torch.softmax(q{i} @ k{i}.transpose(1, 2) * {HEAD_DIM ** -0.5}, dim=-1)")
            lines.append(f"    o{i} = (s{i} @ v{i}).transpose(0, 1).reshape({SEQ}, {local_heads * HEAD_DIM})")
            lines.append(f"    y{i} = o{i} @ {wo}.t()")
            _reduce(lines, f"y{i}", sp, block_plant)
            lines.append(f"    h = h + y{i}")
        elif kind == "norm":
            nw = weight(f"n{i}", (DIM,), None)
            lines.append(f"    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * {nw}")
        else:
            lines.append("    h = h * 0.5 + torch.tanh(h)")
    lines.append("    return h")
    program.source = "\n".join(lines)
    return program


def build(program: SpmdProgram):
    """The program's function (compiled from its source)."""
    import linecache

    import torch
    import torch.distributed._functional_collectives as funcol

    scope = {"torch": torch, "funcol": funcol}
    filename = f"<spmd program {program.seed}>"
    # Kept where tracebacks (and dtcompile's messages) read a line's code from.
    linecache.cache[filename] = (len(program.source), None, program.source.splitlines(True), filename)
    code = compile(program.source, filename, "exec")
    exec(code, scope)
    return scope["program"]


def _inputs(program: SpmdProgram, rank: int) -> tuple[Any, list[Any]]:
    """This rank's shard of the stream and of each weight (the same global values on every rank),
    typed as spmd_types types them."""
    import spmd_types as spmd
    import torch
    import torch.distributed as dist

    # A generator of its own: the ranks' threads share torch's global one.  Float64: a program of
    # four blocks grows its values to 1e5, and float32's reordered sums differ there by 1e-4.
    generator = torch.Generator().manual_seed(program.seed)
    h = torch.randn(SEQ, DIM, generator=generator, dtype=torch.float64)
    weights = [torch.randn(w.shape, generator=generator, dtype=torch.float64) * 0.5 for w in program.weights]
    axis = dist.group.WORLD
    if program.sequence_parallel:
        h = h.chunk(WORLD, 0)[rank].contiguous()
    h.requires_grad_(True)
    spmd.assert_type(h, {axis: spmd.S(0) if program.sequence_parallel else spmd.R})
    local = []
    for spec, value in zip(program.weights, weights):
        if spec.shard is not None:
            value = value.chunk(WORLD, spec.shard)[rank].contiguous()
        value.requires_grad_(True)
        spmd.assert_type(value, {axis: spmd.S(spec.shard) if spec.shard is not None else spmd.R})
        local.append(value)
    return h, local


def run_program(fn: Any, program: SpmdProgram, rank: int) -> tuple[Any, list[Any]]:
    """Runs ``fn`` on this rank's inputs and the backward of its output's squares: the output and the
    gradients of the stream and every weight."""
    import torch.distributed as dist

    h, weights = _inputs(program, rank)
    out = fn(h, weights, rank, dist.group.WORLD)
    out.pow(2).sum().backward()
    return out.detach(), [h.grad] + [w.grad for w in weights]
