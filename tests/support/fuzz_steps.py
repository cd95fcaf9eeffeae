"""The step builders: for the values a program holds so far, draw one more line.

Each builder takes the generator state :class:`Gen` and returns a
:class:`Draft` (family, op, args, code, region source) or ``None`` when it does
not apply to the values at hand.  The generator executes every draft on
simulated ranks (``LocalTensorMode``) before keeping it: that gives the
result's placements and every rank's local shape, which the next builders read.
The builders only choose; they never need to know DTensor's sharding rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from support.fuzz_programs import placements_text

__all__ = ["BUILDERS", "Draft", "Gen", "draw_placements"]


@dataclass(frozen=True)
class Draft:
    kind: str
    op: str
    args: tuple[str, ...]
    code: str
    region: str = ""
    rng: bool = False
    uniform: bool | None = None
    """For a local result: the same values on every rank (None: uniform iff every local arg is)."""


class Gen:
    """What a program holds while it is drawn: its values, executed on simulated ranks."""

    def __init__(self, draw: Callable[..., Any], mesh: Any) -> None:
        self.draw = draw
        self.mesh = mesh
        self.env: dict[str, Any] = {}
        self.uniform: dict[str, bool] = {}

    # ---- reading the values
    def is_dtensor(self, name: str) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(self.env[name], DTensor)

    def names(self, dtensor: bool | None = None) -> list[str]:
        return [n for n in self.env if dtensor is None or self.is_dtensor(n) == dtensor]

    def shape(self, name: str) -> tuple[int, ...]:
        """Global shape of a DTensor; rank 0's shape of a local tensor."""
        v = self.env[name]
        if self.is_dtensor(name):
            return tuple(v.shape)
        return tuple(self.local_shapes(name)[0])

    def local_shapes(self, name: str) -> tuple[tuple[int, ...], ...]:
        v = self.env[name]
        if self.is_dtensor(name):
            v = v.to_local()
        tensors = getattr(v, "_local_tensors", None)
        if tensors is None:
            return (tuple(v.shape),)
        return tuple(tuple(tensors[r].shape) for r in sorted(tensors))

    def placements(self, name: str) -> tuple[Any, ...]:
        return tuple(self.env[name].placements)

    # ---- drawing
    def pick(self, names: list[str]) -> str | None:
        return self.draw(st.sampled_from(names)) if names else None

    def dim(self, ndim: int, extra: int = 0) -> int:
        return self.draw(st.integers(0, ndim - 1 + extra))

    def choice(self, options: list[Any]) -> Any:
        return self.draw(st.sampled_from(options))

    def chance(self, one_in: int) -> bool:
        return self.draw(st.integers(0, one_in - 1)) == one_in - 1


def draw_placements(g: Gen, ndim: int, *, partial: bool = False, strided: bool = False) -> list[str]:
    """One placement text per mesh axis for a tensor of ``ndim`` dims."""
    options = ["Replicate()"] + [f"Shard({d})" for d in range(ndim)]
    if partial:
        options += ["Partial()", "Partial('avg')", "Partial('max')"]
    placements = [g.choice(options) for _ in range(g.mesh.ndim)]
    if strided and ndim >= 1 and g.chance(4):
        d = g.dim(ndim)
        if g.mesh.ndim == 2:
            placements = [f"_StridedShard({d}, split_factor=2)", f"Shard({d})"]
        else:
            placements = [f"_StridedShard({d}, split_factor=2)"]
    return placements



UNARY = {
    "relu": "torch.relu({0})",
    "tanh": "torch.tanh({0})",
    "sigmoid": "torch.sigmoid({0})",
    "abs": "{0}.abs()",
    "neg": "-{0}",
    "scale": "{0} * 0.5",
    "shift": "{0} + 1.0",
    "square": "{0} * {0}",
    "gelu": "torch.nn.functional.gelu({0})",
    "clamp": "{0}.clamp(-1.0, 1.0)",
    "rsub": "2.0 - {0}",
    "exp": "torch.exp({0}.clamp(max=3.0))",
}

BINARY = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "maximum": "torch.maximum({0}, {1})",
    "div": "{0} / ({1}.abs() + 1.0)",
    "where": "torch.where({0} > 0, {0}, {1})",
}


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    if len(b) > len(a):
        return False
    return all(y in (1, x) for x, y in zip(a[len(a) - len(b) :], b))


def unary(g: Gen) -> Draft | None:
    a = g.pick(g.names())
    op = g.choice(list(UNARY))
    return Draft("elementwise", op, (a,), UNARY[op])


def binary(g: Gen) -> Draft | None:
    a = g.pick(g.names())
    same_kind = g.names(g.is_dtensor(a))
    partners = [b for b in same_kind if _broadcasts(g.shape(a), g.shape(b))]
    if g.chance(12) and len(g.names(not g.is_dtensor(a))) > 0:
        # A DTensor with a plain tensor: eager refuses, and so must compiled code.
        partners = g.names(not g.is_dtensor(a))
    b = g.pick(partners) or a
    op = g.choice(list(BINARY))
    return Draft("elementwise", op, (a, b), BINARY[op])



REDUCE_DIM = {
    "sum_dim": "{0}.sum({d})",
    "sum_keepdim": "{0}.sum({d}, keepdim=True)",
    "mean_dim": "{0}.mean({d})",
    "amax_dim": "{0}.amax({d})",
    "softmax": "torch.softmax({0}, {d})",
    "log_softmax": "torch.log_softmax({0}, {d})",
    "cumsum": "torch.cumsum({0}, {d})",
    "logsumexp": "torch.logsumexp({0}, {d})",
    "var_dim": "{0}.var({d})",
}
REDUCE_ALL = {"sum_all": "{0}.sum()", "mean_all": "{0}.mean()", "max_all": "{0}.max()", "norm": "{0}.norm()"}


def reduction(g: Gen) -> Draft | None:
    a = g.pick(g.names())
    ndim = len(g.shape(a))
    if ndim == 0 or g.chance(5):
        op = g.choice(list(REDUCE_ALL))
        return Draft("reduction", op, (a,), REDUCE_ALL[op])
    op = g.choice(list(REDUCE_DIM))
    d = g.dim(ndim)
    if g.chance(4):
        d = d - ndim  # a negative dim
    return Draft("reduction", op, (a,), REDUCE_DIM[op].replace("{d}", str(d)))




def view(g: Gen) -> Draft | None:
    a = g.pick(g.names())
    shape = g.shape(a)
    ndim = len(shape)
    ops = ["unsqueeze", "contiguous", "reshape_flat"]
    if ndim >= 1:
        ops += ["narrow", "select", "flip", "cat", "stack", "chunk"]
    if ndim >= 2:
        ops += ["transpose", "permute", "flatten", "view_merge", "t" if ndim == 2 else "transpose"]
    if any(s in (4, 6) for s in shape):
        ops.append("unflatten")
    if 1 in shape:
        ops += ["squeeze", "expand"]
    op = g.choice(ops)
    if op == "unsqueeze":
        return Draft("view", op, (a,), f"{{0}}.unsqueeze({g.dim(ndim, extra=1)})")
    if op == "contiguous":
        return Draft("view", op, (a,), "{0}.contiguous()")
    if op == "reshape_flat":
        return Draft("view", op, (a,), "{0}.reshape(-1)")
    if op in ("transpose", "t"):
        if op == "t":
            return Draft("view", op, (a,), "{0}.t()")
        d0, d1 = g.dim(ndim), g.dim(ndim)
        return Draft("view", op, (a,), f"{{0}}.transpose({d0}, {d1})")
    if op == "permute":
        perm = g.draw(st.permutations(list(range(ndim))))
        return Draft("view", op, (a,), f"{{0}}.permute({', '.join(map(str, perm))})")
    if op == "flatten":
        d = g.dim(ndim - 1)
        return Draft("view", op, (a,), f"{{0}}.flatten({d}, {d + 1})")
    if op == "view_merge":
        d = g.dim(ndim - 1)
        merged = [*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :]]
        if not g.is_dtensor(a):
            merged[0 if d > 0 else -1] = -1  # rank-agnostic: local shapes may differ
        return Draft("view", op, (a,), f"{{0}}.view({', '.join(map(str, merged))})")
    if op == "unflatten":
        d = g.choice([i for i, s in enumerate(shape) if s in (4, 6)])
        split = g.choice([(2, shape[d] // 2), (shape[d] // 2, 2)])
        return Draft("view", op, (a,), f"{{0}}.unflatten({d}, {split})")
    if op == "squeeze":
        d = g.choice([i for i, s in enumerate(shape) if s == 1])
        return Draft("view", op, (a,), f"{{0}}.squeeze({d})")
    if op == "expand":
        target = [3 if s == 1 and g.draw(st.booleans()) else -1 for s in shape]
        return Draft("view", op, (a,), f"{{0}}.expand({', '.join(map(str, target))})")
    d = g.dim(ndim)
    size = shape[d]
    if op == "narrow":
        if size == 0:
            return None
        start = g.draw(st.integers(0, size - 1))
        length = g.draw(st.integers(1, size - start))
        return Draft("view", op, (a,), f"{{0}}.narrow({d}, {start}, {length})")
    if op == "select":
        if size == 0:
            return None
        return Draft("view", op, (a,), f"{{0}}.select({d}, {g.draw(st.integers(0, size - 1))})")
    if op == "flip":
        return Draft("view", op, (a,), f"{{0}}.flip({d})")
    if op == "chunk":
        return Draft("view", op, (a,), f"{{0}}.chunk(2, {d})[0]")
    # cat / stack: with a value of the same shape (or itself)
    partners = [b for b in g.names(g.is_dtensor(a)) if g.shape(b) == shape]
    b = g.pick(partners) or a
    return Draft("view", op, (a, b), f"torch.{op}([{{0}}, {{1}}], {d})")




def matmul(g: Gen) -> Draft | None:
    a = g.pick([n for n in g.names() if len(g.shape(n)) >= 1])
    if a is None:
        return None
    sa = g.shape(a)
    same = g.names(g.is_dtensor(a))
    options: list[tuple[str, str, str | None]] = []
    # A 1-D DTensor times a matrix has shape (1, n) in eager (torch's bug, pinned in
    # test_fuzz_regressions.py); compiled code gives (n,).  Not drawn.
    vector_ok = len(sa) >= 2 or not g.is_dtensor(a)
    for b in same:
        sb = g.shape(b)
        if len(sb) == 2 and sb[0] == sa[-1] and vector_ok:
            options.append(("matmul", "{0} @ {1}", b))
            if len(sa) == 2:
                options += [("mm", "torch.mm({0}, {1})", b), ("einsum", "torch.einsum('ij,jk->ik', {0}, {1})", b)]
        if len(sb) == 1 and sb[0] == sa[-1] and len(sa) >= 1:
            options.append(("matvec", "{0} @ {1}", b))
        if len(sb) == 2 and sb[1] == sa[-1] and vector_ok:
            options.append(("linear", "torch.nn.functional.linear({0}, {1})", b))
        if len(sa) == 3 and len(sb) == 3 and sa[0] == sb[0] and sa[2] == sb[1]:
            options.append(("bmm", "torch.bmm({0}, {1})", b))
    if len(sa) >= 2:
        options += [("gram", "{0} @ {0}.transpose(-1, -2)", None), ("gram_t", "{0}.transpose(-1, -2) @ {0}", None)]
    if not options:
        return None
    op, code, b = g.choice(options)
    return Draft("matmul", op, (a,) if b is None else (a, b), code)




def redistribute(g: Gen) -> Draft | None:
    a = g.pick(g.names(dtensor=True))
    if a is None:
        return None
    op = g.choice(["redistribute", "redistribute", "redistribute_async", "full_tensor"])
    if op == "full_tensor":
        return Draft("redistribute", op, (a,), "{0}.full_tensor()", uniform=True)
    all_replicate = all(type(p).__name__ == "Replicate" for p in g.placements(a))
    target = draw_placements(g, len(g.shape(a)), partial=all_replicate or g.chance(10))
    suffix = ", async_op=True" if op == "redistribute_async" else ""
    return Draft("redistribute", op, (a,), f"{{0}}.redistribute(mesh, {'[' + ', '.join(target) + ']'}{suffix})")


def to_local(g: Gen) -> Draft | None:
    a = g.pick(g.names(dtensor=True))
    if a is None:
        return None
    uniform = all(type(p).__name__ == "Replicate" for p in g.placements(a))
    return Draft("local", "to_local", (a,), "{0}.to_local()", uniform=uniform)


def from_local(g: Gen) -> Draft | None:
    """A local value back to a DTensor, with placements its per-rank shapes allow."""
    from torch.distributed.tensor import Replicate

    l = g.pick(g.names(dtensor=False))
    if l is None:
        return None
    shapes = g.local_shapes(l)
    uniform = g.uniform.get(l, False)
    templates = [t for t in g.names(dtensor=True) if g.local_shapes(t) == shapes]
    if templates and not g.chance(3):
        t = g.pick(templates)
        ps = [p if uniform or not isinstance(p, Replicate) else _sum_partial() for p in g.placements(t)]
        shape = tuple(g.env[t].shape)
        stride = tuple(g.env[t].stride())
        return Draft("local", "from_local_shape", (l,), f"DTensor.from_local({{0}}, mesh, {placements_text(ps)}, shape={shape}, stride={stride})")
    if len(set(shapes)) != 1:
        return None
    options = ["Partial()", "Partial('max')"] + [f"Shard({d})" for d in range(len(shapes[0]))]
    if uniform:
        options.append("Replicate()")
    target = [g.choice(options) for _ in range(g.mesh.ndim)]
    return Draft("local", "from_local", (l,), f"DTensor.from_local({{0}}, mesh, [{', '.join(target)}])")


def _sum_partial() -> Any:
    from torch.distributed.tensor import Partial

    return Partial()




def factory(g: Gen) -> Draft | None:
    dts = g.names(dtensor=True)
    op = g.choice(["dt_ones", "dt_zeros", "dt_full", "ones_like", "zeros_like", "full_like", "distribute", "dt_randn"])
    if op in ("ones_like", "zeros_like", "full_like"):
        a = g.pick(g.names())
        code = {"ones_like": "torch.ones_like({0})", "zeros_like": "torch.zeros_like({0})", "full_like": "torch.full_like({0}, 2.0)"}[op]
        return Draft("factory", op, (a,), code)
    shape = g.shape(g.pick(dts)) if dts and g.draw(st.booleans()) else tuple(g.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    pl = "[" + ", ".join(draw_placements(g, len(shape))) + "]"
    shape_text = "(" + "".join(f"{s}, " for s in shape) + ")"
    if op == "distribute":
        n = 1
        for s in shape:
            n *= s
        code = f"distribute_tensor(torch.arange({n}, dtype=torch.float32).reshape{shape_text} / {n}, mesh, {pl})"
        return Draft("factory", op, (), code)
    if op == "dt_randn":
        return Draft("factory", op, (), f"dtensor.randn({shape_text}, device_mesh=mesh, placements={pl})", rng=True)
    fill = ", 0.5" if op == "dt_full" else ""
    name = op.removeprefix("dt_")
    return Draft("factory", op, (), f"dtensor.{name}({shape_text}{fill}, device_mesh=mesh, placements={pl})")



REGION_BODIES = [
    "torch.relu(a) * 2.0",
    "torch.tanh(a) + a",
    "a * a - 1.0",
    "torch.sigmoid(a) * a",
]


def local_map(g: Gen) -> Draft | None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    a = g.pick(g.names(dtensor=True))
    if a is None:
        return None
    ps = g.placements(a)
    ndim = len(g.shape(a))
    pl = placements_text(ps)
    variants = ["pointwise", "pointwise2", "replicated"]
    plain_shards = [p for p in ps if isinstance(p, Shard) and not isinstance(p, _StridedShard)]
    if plain_shards and not any(isinstance(p, (Partial, _StridedShard)) for p in ps):
        variants += ["partial_out", "all_reduce"]
    variant = g.choice(variants)
    head = "@dtcompile.local_map(out_placements={out}, in_placements={ins}{extra})\ndef {{region}}({params}):\n    return {body}"
    if variant == "pointwise":
        body = g.choice(REGION_BODIES)
        region = head.format(out=pl, ins=f"({pl},)", extra="", params="a", body=body)
        return Draft("local_map", variant, (a,), "{region}({0})", region=region)
    if variant == "pointwise2":
        partners = [b for b in g.names(dtensor=True) if g.placements(b) == ps and g.local_shapes(b) == g.local_shapes(a)]
        b = g.pick(partners) or a
        body = g.choice(["a * b + 1.0", "torch.maximum(a, b)", "a - torch.relu(b)"])
        region = head.format(out=pl, ins=f"({pl}, {pl})", extra="", params="a, b", body=body)
        return Draft("local_map", variant, (a, b), "{region}({0}, {1})", region=region)
    replicate = placements_text([Replicate()] * g.mesh.ndim)
    if variant == "replicated":
        bodies = ["torch.softmax(a, -1) * 2.0", "a.sum(0) + 1.0", "a.flip(0) * a"]
        if ndim >= 2:
            bodies.append("a @ a.transpose(-1, -2)")
        body = g.choice(bodies) if ndim >= 1 else "a * 3.0"
        region = head.format(out=replicate, ins=f"({replicate},)", extra=", redistribute_inputs=True", params="a", body=body)
        return Draft("local_map", variant, (a,), "{region}({0})", region=region)
    # partial_out / all_reduce: sum the local shard over a sharded dim.
    d = g.choice(sorted({p.dim for p in plain_shards}))
    out = []
    for p in ps:
        if isinstance(p, Shard) and p.dim == d:
            out.append(Replicate() if variant == "all_reduce" else Partial())
        elif isinstance(p, Shard):
            out.append(Shard(p.dim - 1 if p.dim > d else p.dim))
        else:
            out.append(p)
    if variant == "partial_out":
        region = head.format(out=placements_text(out), ins=f"({pl},)", extra="", params="a", body=f"a.sum({d})")
        return Draft("local_map", variant, (a,), "{region}({0})", region=region)
    axes = [axis for axis, p in enumerate(ps) if isinstance(p, Shard) and p.dim == d]
    body = f"a.sum({d})"
    for axis in axes:
        body = f"funcol.all_reduce({body}, 'sum', (mesh, {axis}))"
    region = head.format(out=placements_text(out), ins=f"({pl}, None)", extra="", params="a, mesh", body=body)
    return Draft("local_map", variant, (a,), "{region}({0}, mesh)", region=region)


# Family -> (builders, weight).
BUILDERS: dict[str, tuple[tuple[Callable[[Gen], Draft | None], ...], int]] = {
    "elementwise": ((unary, binary), 4),
    "reduction": ((reduction,), 2),
    "view": ((view,), 3),
    "matmul": ((matmul,), 2),
    "redistribute": ((redistribute,), 3),
    "local": ((to_local, from_local), 2),
    "factory": ((factory,), 1),
    "local_map": ((local_map,), 2),
}
