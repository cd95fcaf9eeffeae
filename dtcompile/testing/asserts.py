"""Assertions for compiled DTensor programs: numerics against eager, graph breaks, recompiles."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dtcompile.report import backward_from_sum
from dtcompile.testing.worlds import run_threaded, wait_for_eager_on_every_rank

__all__ = [
    "Step",
    "ThreadedWorld",
    "assert_matches_eager",
    "assert_no_graph_breaks",
    "assert_no_recompiles",
    "backward_from_sum",
    "per_rank",
    "run_step",
    "threaded_world",
]

# How many mismatches a failure lists before it says how many more there are.
_MAX_LISTED = 10


@dataclass(frozen=True)
class Step:
    """One forward (and backward) of a program: named outputs and named gradients."""

    outputs: dict[str, Any]
    """``output`` path (pytree key string) -> value."""
    grads: dict[str, torch.Tensor | None]
    """``grad of <parameter name>`` / ``grad of args[i]`` -> gradient."""


def run_step(fn: Callable[..., Any], args: Sequence[Any], backward: bool = True, params: nn.Module | None = None) -> Step:
    """Run ``fn(*args)``; with ``backward``, backward from the sum of every output that
    requires grad (:func:`backward_from_sum`), then collect and clear the gradients of
    ``params`` (default: ``fn`` itself if it is a module) and of the args that require grad."""
    out = fn(*args)
    outputs = {f"output{pytree.keystr(path)}": leaf for path, leaf in pytree.tree_flatten_with_path(out)[0]}
    grads: dict[str, torch.Tensor | None] = {}
    if backward:
        backward_from_sum(out)
        module = params if params is not None else (fn if isinstance(fn, nn.Module) else None)
        named = list(module.named_parameters()) if module is not None else []
        named += [(f"args[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        for name, tensor in named:
            grads[f"grad of {_clean_name(name)}"] = tensor.grad
            tensor.grad = None
    return Step(outputs, grads)


def _clean_name(name: str) -> str:
    """``fc.parametrizations.weight.original`` -> ``fc.weight``; ``_orig_mod.`` dropped."""
    return name.replace("_orig_mod.", "").replace(".parametrizations.", ".").removesuffix(".original")


def per_rank(value: Any, world_size: int) -> list[Any]:
    """A value as each rank holds it: LocalTensors split by rank, DTensors as their local
    shard, collective results waited on; anything else is the same on every rank."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, AsyncCollectiveTensor):
        value = value.wait()
    if isinstance(value, LocalTensor):
        return [value._local_tensors[r].detach() for r in range(world_size)]
    if isinstance(value, torch.Tensor):
        return [value.detach()] * world_size
    return [value] * world_size


def _describe(value: Any) -> Any:
    """What must agree besides values: type, and a DTensor's placements and global shape."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.placements), tuple(value.shape))
    return type(value).__name__ if isinstance(value, torch.Tensor) else value


def _mismatches(
    expected: Step, actual: Step, ranks: Sequence[int], rtol: float, atol: float
) -> list[str]:
    """Every (rank, tensor) that differs, described; empty when all agree."""
    problems = []
    for kind, want, got in (("outputs", expected.outputs, actual.outputs), ("gradients", expected.grads, actual.grads)):
        if want.keys() != got.keys():
            problems.append(f"{kind}: compiled has {sorted(got)}, eager has {sorted(want)}")
            continue
        for name in want:
            w, g = want[name], got[name]
            if (w is None) != (g is None):
                problems.append(f"{name}: eager {'has none' if w is None else 'has one'}, compiled {'has none' if g is None else 'has one'}")
                continue
            if w is None:
                continue
            if _describe(w) != _describe(g):
                problems.append(f"{name}: compiled is {_describe(g)}, eager is {_describe(w)}")
                continue
            if not isinstance(w, torch.Tensor):
                continue
            num_ranks = max(ranks) + 1
            for rank in ranks:
                wr, gr = per_rank(w, num_ranks)[rank], per_rank(g, num_ranks)[rank]
                try:
                    torch.testing.assert_close(gr, wr, rtol=rtol, atol=atol)
                except AssertionError as err:
                    detail = " ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
                    problems.append(f"rank {rank}, {name}: {detail}")
    return problems


def _fail_on(problems: list[str], what: str) -> None:
    if problems:
        listed = problems[:_MAX_LISTED]
        more = f"\n... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise AssertionError(f"{what}: {len(problems)} mismatch(es)\n" + "\n".join(listed) + more)


@dataclass(frozen=True)
class ThreadedWorld:
    """``world_size`` ranks as threads of this process (real collectives); see :func:`threaded_world`."""

    world_size: int
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None


def threaded_world(
    world_size: int, mesh_shape: Sequence[int] | None = None, mesh_dim_names: Sequence[str] | None = None
) -> ThreadedWorld:
    """A world for :func:`assert_matches_eager` whose ranks are threads, each compiling its own program."""
    return ThreadedWorld(
        world_size,
        tuple(mesh_shape) if mesh_shape is not None else None,
        tuple(mesh_dim_names) if mesh_dim_names is not None else None,
    )


def _default_backend() -> Any:
    import dtcompile

    return dtcompile.backend(inductor=False)


def _eager_and_compiled(fn: Any, args: Sequence[Any], backward: bool, backend: Any) -> tuple[Step, Step]:
    from torch._dynamo.testing import CompileCounterWithBackend

    eager = run_step(fn, args, backward)
    wait_for_eager_on_every_rank()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    params = fn if isinstance(fn, nn.Module) else None
    earlier = {id(f) for f in getattr(backend, "fallbacks", ())}
    result = run_step(compiled, args, backward, params=params)
    if counter.frame_count == 0:
        raise AssertionError(
            "assert_matches_eager: nothing was compiled, Dynamo ran the function eagerly "
            "(torch._dynamo disabled, or its code skipped); the comparison would prove nothing"
        )
    fell_back = [f for f in getattr(backend, "fallbacks", ()) if id(f) not in earlier]
    if fell_back:
        raise AssertionError(
            f"assert_matches_eager: dtcompile ran {len(fell_back)} graph(s) eagerly, so the comparison "
            f"would prove nothing: {fell_back[0]}"
        )
    return eager, result


def _check_built(build: Callable[..., Any], built: Any) -> tuple[Any, Sequence[Any]]:
    """``built`` if it is what a builder returns, ``(fn_or_module, args)``; else a TypeError."""
    if isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[1], (tuple, list)):
        return built[0], built[1]
    if isinstance(built, (tuple, list)):
        found = "(" + ", ".join(type(item).__name__ for item in built) + ("," if len(built) == 1 else "") + ")"
    else:
        found = type(built).__name__
    name = getattr(build, "__qualname__", type(build).__name__)
    if getattr(build, "__module__", None):
        name = f"{build.__module__}.{name}"
    raise TypeError(
        f"assert_matches_eager: the builder {name} returned {found}; it must return "
        "(fn_or_module, args) with args a tuple of fn's arguments, e.g. `return model, (x,)`"
    )


def _threaded_rank(rank: int, world: ThreadedWorld, build: Callable[..., Any], backward: bool, backend: Any) -> tuple[Step, Step]:
    from dtcompile.testing.worlds import _mesh

    mesh = _mesh(world.world_size, world.mesh_shape, world.mesh_dim_names)
    fn, args = _check_built(build, build(mesh))
    eager, compiled = _eager_and_compiled(fn, args, backward, backend if backend is not None else _default_backend())

    def plain(step: Step) -> Step:
        """Results cross threads: this rank's plain tensors only."""
        return Step(
            {k: per_rank(v, 1)[0] for k, v in step.outputs.items()},
            {k: None if v is None else per_rank(v, 1)[0] for k, v in step.grads.items()},
        )

    return plain(eager), plain(compiled)


def assert_matches_eager(
    fn: Any,
    *args: Any,
    world: ThreadedWorld | None = None,
    backward: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    backend: Any = None,
) -> None:
    """Compiled ``fn`` gives eager's outputs and gradients on every rank.

    - ``world=None``: ``fn(*args)`` runs in the current world.  Inside
      :func:`~dtcompile.testing.simulated_world` every rank is checked (its
      tensors hold all ranks); on a fake or real process group, this rank.
    - ``world=threaded_world(n, mesh_shape, mesh_dim_names)``: ``fn`` is a
      builder ``fn(mesh) -> (fn_or_module, args)`` called on each of ``n`` rank
      threads; each rank compiles its own program, as real ranks do.

    Gradients are those of the module's parameters and of the args that
    require grad, from the backward of the sum of all outputs.  ``backend``
    defaults to dtcompile without Inductor lowering.  A failure lists each rank
    and tensor that differ.  A graph dtcompile ran eagerly because torch could
    not trace it (``eager_fallback``) fails the assertion too: compiled would be
    eager compared with itself.
    """
    if world is not None:
        if args:
            raise TypeError(
                "assert_matches_eager: with world=threaded_world(...), pass a builder "
                "fn(mesh) -> (fn_or_module, args) and no args; each rank builds its own"
            )
        results = run_threaded(world.world_size, _threaded_rank, world, fn, backward, backend)
        problems = []
        for rank, (eager, compiled) in enumerate(results):
            problems += _mismatches(eager, compiled, [rank], rtol, atol)
        _fail_on(problems, "compiled does not match eager")
        return
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    ranks = sorted(mode.ranks) if mode is not None else [_current_rank()]
    eager, compiled = _eager_and_compiled(fn, args, backward, backend if backend is not None else _default_backend())
    with mode.disable() if mode is not None else contextlib.nullcontext():
        _fail_on(_mismatches(eager, compiled, ranks, rtol, atol), "compiled does not match eager")


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def assert_no_graph_breaks() -> Iterator[None]:
    """Fails if Dynamo breaks a graph inside the block; the message lists each reason."""
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    yield
    new = {reason: n - before.get(reason, 0) for reason, n in counters["graph_break"].items() if n > before.get(reason, 0)}
    if new:
        listed = "\n".join(f"- {reason} (x{n})" for reason, n in new.items())
        raise AssertionError(f"{sum(new.values())} graph break(s):\n{listed}")


@contextlib.contextmanager
def assert_no_recompiles() -> Iterator[None]:
    """Fails if any compiled function recompiles inside the block; the message gives
    Dynamo's guard-failure reasons (with dynamo_vars, as mesh and placement changes)."""
    from torch._dynamo.utils import guard_failures

    before = {code: len(reasons) for code, reasons in guard_failures.items()}
    yield
    new = []
    for code, reasons in guard_failures.items():
        for reason in reasons[before.get(code, 0) :]:
            new.append(f"- {code.co_name} ({code.co_filename}:{code.co_firstlineno}): {reason}")
    if new:
        raise AssertionError(f"{len(new)} recompile(s):\n" + "\n".join(new))

