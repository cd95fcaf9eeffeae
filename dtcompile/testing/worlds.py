"""Worlds of N ranks for tests: fake, simulated in one process, and real gloo ranks.

- :func:`fake_world`: the fake process group.  One process plays rank ``rank``
  of ``world_size``; collectives move no data.  For graph structure, at any
  world size (the shapes a rank sees are local).
- :func:`simulated_world`: the fake process group plus
  ``LocalTensorMode(world_size)``: every tensor holds all ranks' values and
  collectives have real semantics.  Stock torch 2.13 compiles only simple
  programs on it (see docs/limits.md).
- :func:`run_threaded`: every rank a thread of this process with torch's
  threaded process group: real collective semantics, and each rank compiles
  its own program as a real rank would.  For compiled numerics in one process.
- :func:`run_gloo`: every rank a process, gloo over 127.0.0.1.  The ground truth.

The two runners take ``fn(rank, *args)`` and return the ranks' results in rank
order; a rank that raises fails the run with that rank's traceback, and no
rank is left waiting when another dies.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import multiprocessing
import os
import pickle
import queue
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "RankFailure",
    "fake_world",
    "run_cold_and_warm",
    "run_gloo",
    "reset_dynamo_on_every_rank",
    "run_threaded",
    "simulated_world",
    "wait_for_eager_on_every_rank",
]

R = TypeVar("R")


class RankFailure(RuntimeError):
    """A rank of a simulated or real world raised, or did not finish in time."""


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _mesh(world_size: int, mesh_shape: Sequence[int] | None, mesh_dim_names: Sequence[str] | None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh_shape {shape} has {math.prod(shape)} ranks but world_size is {world_size}; "
            "give a shape whose product is the world size"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {len(shape)}-D mesh_shape {shape}")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@contextlib.contextmanager
def fake_world(
    world_size: int,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    rank: int = 0,
) -> Iterator[Any]:
    """The fake process group as the default group for the block; yields a cpu mesh.

    The mesh has ``mesh_shape`` (default: one axis over all ranks) and
    ``mesh_dim_names``.  This process plays ``rank``; collectives move no data.
    The default group is destroyed on exit, also when the block raises, and
    DTensor's sharding caches are emptied on entry and exit: a decision cached
    for one world's mesh must not answer for the next one's.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtcompile.base.sharding_cache import clear_sharding_caches

    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: a default process group is already initialized; "
            "destroy it first (dist.destroy_process_group())"
        )
    clear_sharding_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield _mesh(world_size, mesh_shape, mesh_dim_names)
    finally:
        _destroy_default_group()
        clear_sharding_caches()


@contextlib.contextmanager
def simulated_world(
    world_size: int,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
) -> Iterator[Any]:
    """All ``world_size`` ranks in this process: a fake world plus ``LocalTensorMode``.

    Every tensor holds one value per rank and collectives have their real
    semantics.  Yields the mesh; the mode is ``torch.distributed._local_tensor``'s
    current mode (``LocalTensorMode.current()``) inside the block.
    """
    from torch.distributed._local_tensor import LocalTensorMode

    with fake_world(world_size, mesh_shape, mesh_dim_names) as mesh, LocalTensorMode(world_size):
        yield mesh


def _failure(what: str, failures: Sequence[tuple[int, str]]) -> RankFailure:
    details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures))
    ranks = sorted(rank for rank, _ in failures)
    return RankFailure(f"{what}: rank(s) {ranks} failed\n{details}")


_rank_thread = threading.local()
"""On a :func:`run_threaded` rank thread: ``rank``, the rank it plays, and ``reset``, Dynamo's
own reset (``torch._dynamo.reset`` refuses there); unset on any other thread."""


def _reset_refused_on_rank_threads(reset: Callable[[], None]) -> Callable[[], None]:
    """``torch._dynamo.reset`` while a threaded world runs: as before on any thread but its
    rank threads, which it refuses with what to do instead."""

    def refusing() -> None:
        rank = getattr(_rank_thread, "rank", None)
        if rank is not None:
            raise RuntimeError(
                f"torch._dynamo.reset() on rank {rank}'s thread of run_threaded: the ranks are threads "
                "of one process and share Dynamo's caches, so a reset frees the compiled code and "
                "guards the other ranks are running (the process can crash). Reset before "
                "run_threaded, or call dtcompile.testing.reset_dynamo_on_every_rank() on every rank "
                "(one resets while the others wait); to compile a function again, compile it with a "
                "new backend (torch.compile(fn, backend=dtcompile.backend(...))), which Dynamo "
                "compiles anew"
            )
        reset()

    refusing.__doc__ = reset.__doc__
    return refusing


def reset_dynamo_on_every_rank() -> None:
    """``torch._dynamo.reset()`` in code every rank runs, called by every rank at the same point.

    Where ranks are processes, each resets its own Dynamo.  Ranks that are threads of
    :func:`run_threaded` share one, and a reset frees the code the others run (there
    ``torch._dynamo.reset()`` raises): the ranks meet, rank 0 resets while the others
    wait, and they meet again.
    """
    rank = getattr(_rank_thread, "rank", None)
    if rank is None:
        torch._dynamo.reset()
        return
    dist.barrier()
    if rank == 0:
        _rank_thread.reset()
    dist.barrier()


class _ReduceScatter:
    """The threaded group's reduce-scatter with every reduction its all-reduce has.

    torch's (``multi_threaded_pg.ReduceScatter``) takes sum and avg only, and
    DTensor reduce-scatters a ``Partial("max")`` tensor with max: a program that
    runs on gloo and NCCL raised ``NotImplementedError`` here.
    """

    def __init__(self, op: Any) -> None:
        from torch.testing._internal.distributed.multi_threaded_pg import _reduce_ops

        if op.op not in _reduce_ops:
            raise NotImplementedError(f"reduce-scatter with {op.op} is not supported by the threaded group")
        self.reduce = _reduce_ops[op.op]

    @torch.no_grad()
    def work(self, data: Sequence[Any]) -> None:
        # data[rank] = ([output], [[input chunk for each rank]])
        for rank, (outputs, inputs) in enumerate(data):
            if len(outputs) != 1 or len(inputs) != 1:
                raise AssertionError("the threaded group reduce-scatters one tensor at a time")
            (output,) = outputs
            chunks = [their_inputs[0][rank].to(output.device) for _, their_inputs in data]
            # Written through .detach(): the threaded group hides its writes from autograd.
            output.detach().copy_(self.reduce(chunks))


def run_threaded(
    world_size: int,
    fn: Callable[..., R],
    *args: Any,
    timeout: float = 300.0,
) -> list[R]:
    """Runs ``fn(rank, *args)`` on ``world_size`` ranks, each a thread of this process.

    Ranks talk through torch's threaded process group (real collective
    semantics).  ``torch.compile`` inside ``fn`` compiles once per rank, as on
    real ranks.  Raises :class:`RankFailure` naming the rank(s) that raised or
    did not finish within ``timeout`` seconds.

    What torch's threaded group lacks or shares between the rank threads is made up
    for, or scoped to the world, here:

    - Dynamo's cache of compiled code is per code object, and each rank's
      mesh fails the guards of the code another rank compiled (its process
      group is another).  Each rank thread's compiles count against the
      same recompile limit, so the limits are ``world_size`` times Dynamo's
      for the run: any world size runs, each rank as often as one would alone.
    - torch looks up a backend name (``backend="dtcompile"``) by check-then-
      register, which two threads can interleave ("duplicate name"): the name
      is resolved once before the ranks start.
    - torch's threaded group reduce-scatters with sum and avg only; here it
      takes max, min and product too (DTensor reduce-scatters ``Partial("max")``
      with max), as gloo and NCCL do.
    - DTensor's redistribute plans are cached per mesh, and a mesh made on a
      rank thread compares equal to one made on an earlier world's thread
      with the same ident (CPython reuses them), whose rank may differ: the
      caches are emptied before and after the world.  DTensor's fake-mode
      metadata pass is serialized across the rank threads, as torch's own
      threaded DTensor tests do (``ShardingPropagator._fake_mode_lock``).
    - torch notes whether a dispatch mode is active in flags of the process,
      which each mode saves as it is entered and restores as it exits; modes
      the rank threads enter at once restore each other's values and can
      leave the flags set after the world: they are put back as this thread
      had them (see :func:`_dispatch_mode_flags_kept`).
    - A thread's locals are freed as it ends, among them torch's captured
      tracebacks, and two threads freeing those at once can deadlock (one holds
      torch's traceback mutex and waits for the GIL, the other the reverse;
      seen once in 5000 fuzzed programs): each rank thread ends after the
      rank before it has ended.
    - A ``torch._dynamo.reset()`` (``torch.compiler.reset()``) on a rank thread
      would free the compiled code and guards the other rank threads run (a
      crash): it raises, saying what to do instead
      (:func:`reset_dynamo_on_every_rank`).
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    from dtcompile.base.sharding_cache import clear_sharding_caches

    if dist.is_initialized():
        raise RuntimeError(
            "run_threaded: a default process group is already initialized; "
            "run it outside fake_world()/simulated_world()"
        )
    results: dict[int, R] = {}
    failures: queue.Queue[tuple[int, str]] = queue.Queue()
    stopped: list[int] = []
    store = dist.HashStore()

    # Patched config is thread-local: each rank thread applies the world's limits.
    limits = {
        "recompile_limit": torch._dynamo.config.recompile_limit * world_size,
        "accumulated_recompile_limit": torch._dynamo.config.accumulated_recompile_limit * world_size,
    }

    def rank_main(rank: int) -> None:
        _rank_thread.rank, _rank_thread.reset = rank, reset
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            with torch._dynamo.config.patch(limits):
                results[rank] = fn(rank, *args)
        except SystemExit:
            # The threaded group ends ranks waiting in a collective with SystemExit
            # once another rank failed: not a failure of this rank's own.
            stopped.append(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            failures.put((rank, traceback.format_exc()))
            wake_ranks_waiting_for(rank, exc)
        finally:
            dist.destroy_process_group()
            if rank > 0:
                threads[rank - 1].join(max(0.0, deadline - time.monotonic()))

    _resolve_backend_names()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    reduce_scatter, threaded.ReduceScatter = threaded.ReduceScatter, _ReduceScatter
    clear_sharding_caches()
    fake_mode_lock = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = threading.Lock()
    reset = torch._dynamo.reset
    torch._dynamo.reset = _reset_refused_on_rank_threads(reset)
    deadline = time.monotonic() + timeout
    try:
        with _dispatch_mode_flags_kept():
            threads = [
                threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
                for rank in range(world_size)
            ]
            for thread in threads:
                thread.start()
            for rank, thread in enumerate(threads):
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    failures.put((rank, f"did not finish within {timeout} s"))
                    threaded.ProcessLocalGroup.exception_handle(TimeoutError(f"rank {rank}"))
    finally:
        torch._dynamo.reset = reset
        ShardingPropagator._fake_mode_lock = fake_mode_lock
        clear_sharding_caches()
        threaded.ProcessLocalGroup.reset()
        threaded.ReduceScatter = reduce_scatter
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if not failures.empty():
        what = "run_threaded"
        if stopped:
            what += f" (rank(s) {sorted(stopped)} stopped waiting for them)"
        raise _failure(what, list(failures.queue))
    return [results[rank] for rank in range(world_size)]


@contextlib.contextmanager
def _dispatch_mode_flags_kept() -> Iterator[None]:
    """torch's "a dispatch mode is active" flags, as this thread had them, after the block.

    torch keeps three (any mode, a non-infra mode, a mode that does not ignore
    compile internals) as globals of ``torch.utils._python_dispatch``, one set
    for the process, though modes are per thread.  Each mode saves them as it
    is entered and restores them as it exits, so two rank threads in a mode at
    once interleave: one enters (saves False), the other enters (saves True),
    the first exits (restores False), the second exits (restores True), and
    the flags say True with no mode left.  Eager DTensor code does this on rank
    threads: every rank enters, at about the same time, the
    ``PlacementTrackingMode`` in which DTensor shards an op through its
    decomposition (``index_add``, in ``index_select``'s backward), amid the
    ``FakeTensorMode`` of its sharding propagation.

    Left so, the next mode entered on this thread (a simulated world's
    ``LocalTensorMode``) copies the flag into Dynamo's own per-thread one, with
    which guards keep the mode's ``Python`` dispatch keys in a tensor's key
    set; tracing left them out, so every call of a compiled frame failed its
    tensor guards and compiled it again, for the same mesh and placements.
    """
    from torch.utils import _python_dispatch as dispatch

    before = (
        dispatch._is_in_torch_dispatch_mode,
        dispatch._is_in_non_infra_torch_dispatch_mode,
        dispatch._is_in_any_mode_without_ignore_compile_internals,
    )
    try:
        yield
    finally:
        (
            dispatch._is_in_torch_dispatch_mode,
            dispatch._is_in_non_infra_torch_dispatch_mode,
            dispatch._is_in_any_mode_without_ignore_compile_internals,
        ) = before


def wake_ranks_waiting_for(rank: int, exc: BaseException) -> None:
    """From a rank thread that failed: ends its peers' waits for it, in a threaded group's
    collective and at dtcompile's ranks' check (:func:`dtcompile.ranks.check.abort_checks`)."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    from dtcompile.ranks.check import abort_checks

    abort_checks(f"rank {rank} stopped ({type(exc).__name__}: {str(exc).strip()[:200]})")
    threaded.ProcessLocalGroup.exception_handle(exc)


def _resolve_backend_names() -> None:
    """Registers ``backend="dtcompile"`` with torch before rank threads look it up (see run_threaded)."""
    from torch._dynamo.backends import registry
    from torch._dynamo.exc import InvalidBackend

    if "dtcompile" not in registry._COMPILER_FNS:
        with contextlib.suppress(InvalidBackend):  # not installed as a package: no name to race on
            registry.lookup_backend("dtcompile")


def wait_for_eager_on_every_rank() -> None:
    """Between a rank's eager step and its compile: waits for every rank, when ranks are threads.

    ``torch.compiler.is_compiling()`` is one flag for the whole process.  While
    one rank thread compiles it reads True on every thread, so another rank's
    eager code that branches on it takes the compiled branch, and an eager
    reference taken then is wrong.  Real ranks are processes and do not wait.
    """
    from dtcompile.ranks.check import ranks_are_threads

    if ranks_are_threads():
        dist.barrier()


# Seconds to collect the other ranks' reports once one rank failed.
_FAILURE_GRACE_S = 3.0


def _rendezvous_store(world_size: int, timeout: float) -> dist.TCPStore:
    """The run's rendezvous store, served by this process on a port the kernel picks.

    The port is held from the moment it is chosen: a port picked free and handed to
    the ranks (to bind when their interpreter has started, seconds later) can be taken
    in between by another run's rank or gloo connection on the same machine, and then
    two runs meet in one store (CI saw ``Gloo connectFullMesh failed ... Connection
    closed by peer``).
    """
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )


def _gloo_rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
    env: Mapping[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    wait = timedelta(seconds=timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait)
        try:
            # Sent as bytes: tensors pickled through a Queue share file descriptors
            # with the parent, which break once this process has exited.
            buffer = io.BytesIO()
            torch.save(fn(rank, *args), buffer)
            results.put((rank, True, buffer.getvalue()))
        except BaseException as exc:
            # Ends the peers' waits for this rank at dtcompile's ranks' check.
            with contextlib.suppress(Exception):
                from dtcompile.ranks.check import abort_checks

                abort_checks(f"rank {rank} stopped ({type(exc).__name__}: {str(exc).strip()[:200]})")
            raise
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def _check_picklable(fn: Callable[..., Any]) -> None:
    """Refuses, before any rank starts, a function that a spawned rank could not unpickle.

    Functions pickle by module and qualified name, so a lambda or a local
    function fails; a ``functools.partial`` is checked through to its function.
    """
    func = fn
    while isinstance(func, functools.partial):
        func = func.func
    if not isinstance(func, types.FunctionType):
        return
    try:
        pickle.dumps(func)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"run_gloo: fn {func.__module__}.{func.__qualname__} cannot be pickled, and each rank is a "
            "process that receives fn pickled (by module and name); pass a module-level function, "
            "or run a lambda or closure on threads with run_threaded(...)"
        ) from err


def run_gloo(
    world_size: int,
    fn: Callable[..., R],
    *args: Any,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> list[R]:
    """Runs ``fn(rank, *args)`` on ``world_size`` processes with gloo over 127.0.0.1.

    ``fn`` and ``args`` must be picklable (a module-level function), and so must
    its result; a lambda or local function is refused with a ``TypeError``
    before any rank starts.  Each rank is a fresh interpreter (nothing compiled
    in memory) with this process's environment plus ``env``.  The first rank to fail, or ``timeout`` seconds
    passing, ends the run: the other ranks get a short grace period to report,
    those still running then are killed, and :class:`RankFailure` carries the
    failing ranks' tracebacks.
    """
    _check_picklable(fn)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = _rendezvous_store(world_size, timeout)
    port = store.port
    procs = [
        ctx.Process(
            target=_gloo_rank_main,
            args=(rank, world_size, port, fn, args, results, timeout, dict(env or {})),
            name=f"gloo-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    # Every rank ends up in exactly one of these, or is still running when the run ends.
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    # After the first failure, wait briefly for the other ranks' reports: the rank
    # that failed first is often not the first to report (its peers see the
    # connection drop at once), and a peer busy outside a collective never reports.
    grace_until = float("inf")
    try:
        while len(outputs) + len(failures) < world_size and time.monotonic() < grace_until:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                # A rank that crashed (signal, os._exit) never reports: look at exit codes.
                # A rank that reported has exit code 0 or is in outputs/failures already.
                for rank, proc in enumerate(procs):
                    if proc.exitcode not in (None, 0) and rank not in outputs and rank not in failures:
                        failures[rank] = f"exited with code {proc.exitcode} before returning a result"
                        grace_until = min(grace_until, time.monotonic() + _FAILURE_GRACE_S)
                if not failures and time.monotonic() > deadline:
                    for r in range(world_size):
                        if r not in outputs:
                            failures[r] = f"no result within {timeout} s"
                continue
            if ok:
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                # A report replaces an exit code seen first: the traceback says more.
                failures[rank] = payload
                grace_until = min(grace_until, time.monotonic() + _FAILURE_GRACE_S)
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    if failures:
        what = "run_gloo"
        stopped = sorted(set(range(world_size)) - outputs.keys() - failures.keys())
        if stopped:
            what += f" (rank(s) {stopped} still running, stopped)"
        raise _failure(what, list(failures.items()))
    return [outputs[rank] for rank in range(world_size)]


def run_cold_and_warm(
    world_size: int,
    fn: Callable[..., R],
    *args: Any,
    cache_dir: str | os.PathLike[str],
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> tuple[list[R], list[R]]:
    """Runs ``fn(rank, *args)`` on gloo ranks twice, as a job and its restart: the ranks of
    both runs share the compile cache folder ``cache_dir`` (``TORCHINDUCTOR_CACHE_DIR``, as
    torch's default folder is shared by every rank of a node), and each run is fresh
    processes, so the second ("warm") is served by what the first ("cold") wrote.
    Returns ``(cold, warm)``, each the ranks' results in rank order; a test compares
    both with eager.  ``fn`` and ``env`` as for :func:`run_gloo`."""
    env = {**(env or {}), "TORCHINDUCTOR_CACHE_DIR": os.fspath(cache_dir)}
    cold = run_gloo(world_size, fn, *args, timeout=timeout, env=env)
    warm = run_gloo(world_size, fn, *args, timeout=timeout, env=env)
    return cold, warm
