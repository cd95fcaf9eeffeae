"""A corpus of DTensor idioms that real training code writes inside compiled regions, and its checker.

Each :class:`~dtcompile._testing.idiom_spec.Idiom` builds, for a mesh, a function
and its inputs.  The checker (:func:`check_idiom`) compiles the function with
``fullgraph=True`` and checks, against eager:

- values (outputs and input gradients), on the fake process group when the
  idiom does not read a collective's result, else on ``LocalTensorMode``
  (every rank simulated, real collective semantics) -- ``world="local"``;
- placements, and that every DTensor result carries the very mesh object the
  user built;
- no graph break, and no recompile on a second call with the same inputs.

Idioms that draw random numbers compare shapes, placements and dtypes only
(``values=False``): compiled RNG is not eager RNG.

This module holds :data:`IDIOMS` (every family's idioms, in this order:
``idioms_device_mesh``, ``idioms_placements``, ``idioms_process_group``,
``idioms_dtensor_api``), the checker, and :func:`corpus_failures`, which runs
the whole corpus; what an idiom is and the inputs it makes are in ``idiom_spec``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from dtcompile._testing.idiom_spec import MESHES, Idiom
from dtcompile._testing.idioms_device_mesh import DEVICE_MESH_IDIOMS
from dtcompile._testing.idioms_dtensor_api import DTENSOR_API_IDIOMS
from dtcompile._testing.idioms_placements import PLACEMENT_IDIOMS
from dtcompile._testing.idioms_process_group import PROCESS_GROUP_IDIOMS
from dtcompile.testing.asserts import per_rank, run_step
from dtcompile.testing.worlds import fake_world, simulated_world

__all__ = ["IDIOMS", "IdiomResult", "check_idiom", "corpus_failures", "mesh_world"]

IDIOMS: list[Idiom] = [*DEVICE_MESH_IDIOMS, *PLACEMENT_IDIOMS, *PROCESS_GROUP_IDIOMS, *DTENSOR_API_IDIOMS]


@contextlib.contextmanager
def mesh_world(kind: str, world: str = "fake") -> Iterator[DeviceMesh]:
    """A fake world for mesh kind ``kind`` and its mesh; with ``world="local"`` a simulated one."""
    world_size, shape, names = MESHES[kind]
    enter = simulated_world if world == "local" else fake_world
    with enter(world_size, shape, names) as mesh:
        yield mesh


@dataclass
class IdiomResult:
    """What happened to one idiom under one compiler."""

    name: str
    ok: bool
    error: str = ""
    num_frames: int = 0
    num_graph_breaks: int = 0
    notes: list[str] = field(default_factory=list)


def _plain(x: Any) -> Any:
    """A comparable value: every rank's tensor, stacked (one rank outside LocalTensorMode)."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    return torch.stack(per_rank(x, len(mode.ranks) if mode is not None else 1)) if isinstance(x, torch.Tensor) else x


def _summary(x: Any, mesh: DeviceMesh, values: bool, what: str) -> Any:
    """What is compared for one output leaf; raises if a DTensor carries another mesh."""
    if isinstance(x, DTensor):
        # Eager DTensor may hand back an earlier mesh equal to this one (its
        # sharding cache compares meshes by ==): identity is checked on compiled results.
        if what.startswith("eager"):
            if x.device_mesh != mesh and x.device_mesh._get_root_mesh() != mesh:
                raise AssertionError(f"{what}: a DTensor on mesh {x.device_mesh!r}, not on {mesh!r}")
        elif x.device_mesh is not mesh and x.device_mesh._get_root_mesh() is not mesh:
            raise AssertionError(
                f"{what}: a DTensor carries mesh {x.device_mesh!r} ({type(x.device_mesh).__name__} "
                f"at {id(x.device_mesh):#x}), not the user's mesh (at {id(mesh):#x})"
            )
        local = x.to_local()
        return ("DTensor", tuple(x.placements), tuple(x.shape), x.dtype, _plain(local) if values else tuple(local.shape))
    if isinstance(x, torch.Tensor):
        return ("Tensor", x.dtype, _plain(x) if values else tuple(x.shape))
    return x


def _run(fn: Callable, args: tuple, backward: bool, context: Callable[[], Any] | None, params: Any = None) -> tuple[Any, Any]:
    with context() if context is not None else contextlib.nullcontext():
        step = run_step(fn, args, backward, params=params)
    return step.outputs, step.grads


def _assert_same(expected: Any, actual: Any, what: str) -> None:
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if exp_spec != act_spec:
        raise AssertionError(f"{what}: structure {act_spec} != eager {exp_spec}")
    for e, a in zip(exp_leaves, act_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        elif e != a:
            raise AssertionError(f"{what}: {a!r} != eager {e!r}")


def check_idiom(item: Idiom, backend: Any) -> IdiomResult:
    """Compile ``item`` with ``backend`` (``fullgraph=True``) and compare with eager; never raises."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    result = IdiomResult(item.name, ok=False)
    try:
        with mesh_world(item.mesh, item.world) as mesh:
            fn, args, *reference = item.build(mesh)
            eager_out, eager_grads = _run(reference[0] if reference else fn, args, item.backward, item.context)
            compiled = torch.compile(fn, backend=counter, fullgraph=True)
            params = fn if isinstance(fn, nn.Module) else None
            out, grads = _run(compiled, args, item.backward, item.context, params)
            again, _ = _run(compiled, args, False, item.context, params)

            def summarize(x: Any, what: str) -> Any:
                return pytree.tree_map(lambda leaf: _summary(leaf, mesh, item.values, what), x)

            expected_out = summarize(eager_out, "eager output")
            expected_grads = summarize(eager_grads, "eager gradients")
            _assert_same(expected_out, summarize(out, "compiled output"), "compiled output")
            _assert_same(expected_out, summarize(again, "second call's output"), "second call's output")
            _assert_same(expected_grads, summarize(grads, "compiled gradients"), "compiled gradients")
        result.num_frames = counter.frame_count
        result.num_graph_breaks = sum(counters["graph_break"].values())
        if result.num_frames != 1:
            raise AssertionError(f"compiled {result.num_frames} frames (a recompile or a graph break); expected 1")
        result.ok = True
    except Exception as err:  # noqa: BLE001 - the corpus reports every failure
        first = (str(err).strip().splitlines() or [""])[0]
        result.error = f"{type(err).__name__}: {first}"[:300]
    finally:
        torch._dynamo.reset()
    return result


def corpus_failures(backend: Any, *, stock: bool = False) -> dict[str, str]:
    """Every idiom checked with ``backend``: the failed ones' names and errors.

    ``stock=True`` runs torch as users run it without dtcompile: dynamo_vars
    uninstalled, and DTensor's sharding caches left as they are between programs
    (dtcompile's worlds and backend empty them, so a fake mesh cached by one
    program would otherwise never reach the next).  Run it in a fresh process:
    which stock runs see a fake mesh depends on what ran before.
    """
    import dtcompile.base.sharding_cache
    import dynamo_vars

    clear = dtcompile.base.sharding_cache.clear_sharding_caches
    if stock:
        dtcompile.base.sharding_cache.clear_sharding_caches = lambda: None
    try:
        with dynamo_vars.enabled(not stock):
            results = [check_idiom(item, backend) for item in IDIOMS]
    finally:
        dtcompile.base.sharding_cache.clear_sharding_caches = clear
    return {r.name: r.error for r in results if not r.ok}
