"""Running programs on threaded ranks: eager, then compiled, rank by rank, in long-lived worlds.

One :func:`dtcompile.testing.run_threaded` world per world size runs a whole
batch: every rank thread builds its meshes and its backend once, then walks the
list of programs.  Per program each rank ``exec``s the program's source (a
fresh code object: Dynamo's recompile limit is per code object), builds its
inputs from the seeds, runs eager (and the backward), waits for every rank,
compiles with ``fullgraph=True`` and runs, and waits again.  The waits are a
barrier of threads, not a collective: ``is_compiling()`` is one flag per
process, so no rank may run eager DTensor code while another compiles; and a
rank that has finished its phase while a peer waits in a collective of theirs
that it never joined (ranks that ran different programs, or one that raised
before a collective) knows at once that the peer is stuck.  Then the world is
aborted: the stuck ranks are woken (the threaded group's termination), the
program is recorded as a hang with where each rank was, and a fresh world goes
on with the next program.  Every 50 programs, with every rank at the barrier,
rank 0 empties Dynamo's caches.

What comes back per rank is plain data: each output's kind, placements,
global shape and this rank's local tensor, the loss, the inputs' gradients,
and the error text where a side raised.  :func:`run_on_gloo` runs one program
the same way on real ranks (gloo processes): the ground truth when a failure
could be the threaded group's.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtcompile.base.sharding_cache import clear_sharding_caches
from dtcompile.testing.asserts import per_rank
from dtcompile.testing.worlds import (
    RankFailure,
    _mesh,
    reset_dynamo_on_every_rank,
    run_gloo,
    run_threaded,
    wake_ranks_waiting_for,
)
from support.fuzz_programs import MESHES, Program, make_input, namespace, placements_text

__all__ = ["ProgramRun", "RankRun", "Side", "Stuck", "Value", "default_backend", "error_summary", "run_on_gloo", "run_programs"]

_LOADS = itertools.count()

# Every this many programs Dynamo's caches are emptied (all ranks at a barrier).
_RESET_EVERY = 50


@dataclass(frozen=True)
class Value:
    kind: str
    """``DTensor``, ``Tensor`` or a type name."""
    placements: str | None
    shape: tuple[int, ...]
    dtype: str
    local: torch.Tensor | None
    """This rank's local tensor (a DTensor's shard), detached."""


@dataclass
class Side:
    """One rank's eager or compiled run of a program."""

    phase: str = ""
    """``eager`` or ``compiled``."""
    error: str | None = None
    """``TypeName: message`` when the run raised."""
    error_type: str = ""
    graph_break: bool = False
    """The error is Dynamo's Unsupported (a graph break under ``fullgraph=True``)."""
    trace: str = ""
    outputs: list[Value] = field(default_factory=list)
    loss: Value | None = None
    grads: list[Value | None] = field(default_factory=list)


@dataclass
class RankRun:
    eager: Side
    compiled: Side


@dataclass
class ProgramRun:
    program: Program
    ranks: list[RankRun] | None
    """One per rank, or None when the program did not finish (see ``aborted``)."""
    aborted: str | None = None
    seconds: float = 0.0


def _value(x: Any) -> Value:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = per_rank(x, 1)[0].detach().clone()
        return Value("DTensor", placements_text(x.placements), tuple(x.shape), str(x.dtype), local)
    if isinstance(x, torch.Tensor):
        local = per_rank(x, 1)[0].detach().clone()
        return Value("Tensor", None, tuple(x.shape), str(x.dtype), local)
    return Value(type(x).__name__, None, (), "", None)


def error_summary(error: str) -> str:
    """An error's telling line: Dynamo's wrappers (``BackendCompilerFailed: backend=... raised:``)
    put the underlying error on a later line; that one is kept, after the wrapper's name."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0]
    if head.endswith("raised:") and len(lines) > 1:
        return f"{head.split(':', 1)[0]}: {lines[1]}"
    return head


def _error_side(phase: str, exc: Exception) -> Side:
    from torch._dynamo.exc import Unsupported

    text = f"{type(exc).__name__}: {exc}"
    return Side(
        phase=phase,
        error=text[:4000],
        error_type=type(exc).__name__,
        graph_break=isinstance(exc, Unsupported),
        trace=traceback.format_exc()[-6000:],
    )


def _run_side(phase: str, call: Callable[[], Any], program: Program) -> tuple[Side, Any]:
    """Runs the program (and its backward); returns the side with its raw result, not yet recorded."""
    try:
        result = call()
        if program.loss:
            outputs, loss = result
            loss.backward()
        else:
            outputs, loss = result, None
    except Exception as exc:  # noqa: BLE001 - recorded and classified by the caller
        return _error_side(phase, exc), None
    return Side(phase), (outputs, loss)


def _record(side: Side, raw: Any, inputs: Sequence[Any]) -> Side:
    if side.error is not None:
        return side
    outputs, loss = raw
    try:
        side.outputs = [_value(o) for o in outputs]
        side.loss = None if loss is None else _value(loss)
        side.grads = [None if x.grad is None else _value(x.grad) for x in inputs]
    except Exception as exc:  # noqa: BLE001 - reading a result raised: report it as the run's error
        return _error_side(side.phase, exc)
    return side


class Stuck(RuntimeError):
    """The ranks cannot all meet: a peer waits in a collective this rank will not join, or time ran out."""


def _unjoined_collective(rank: int) -> str | None:
    """A collective still open on a group of this rank's, which peers wait in.

    Called by a rank that has finished its phase, and so is in no collective:
    such a collective can never complete (the peers and this rank ran different
    programs, this rank raised before it, or its data exchange failed), so
    waiting longer only wastes time.  Reads the threaded group's table of
    collectives in progress (``ProcessLocalGroup._cur_coll_on_pgs``).
    """
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    from dtcompile.ranks.check import checks_waiting_for

    # A peer waiting at dtcompile's ranks' check for this rank, which has finished its phase.
    waiting = checks_waiting_for(rank)
    if waiting:
        return "; ".join(waiting) + ", for this rank, which will not come"
    world = dist.distributed_c10d._world
    groups = {name: pg for pg, name in world.pg_names.items()}
    with threaded.ProcessLocalGroup._coll_lock:
        pending = dict(threaded.ProcessLocalGroup._cur_coll_on_pgs)
    for name, collective in pending.items():
        if name not in groups or collective._done:
            continue
        # This rank is out of every collective: one of its groups' still open is one it
        # never joined, or one whose data exchange raised (a shape mismatch) after it joined.
        joined = collective._data[dist.get_group_rank(groups[name], rank)] is not None
        waiting = [k for k, data in enumerate(collective._data) if data is not None]
        how = "after this rank's data could not be exchanged with theirs" if joined else "that this rank never joined"
        return f"group {name}: group ranks {waiting} wait in {type(collective._collective).__name__} {how}"
    return None


class _Meet:
    """A barrier that breaks at once when a peer is stuck in a collective no one else will join."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cond = threading.Condition()
        self.count = 0
        self.generation = 0
        self.broken: str | None = None

    def wait(self, rank: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            if self.broken:
                raise Stuck(self.broken)
            generation = self.generation
            self.count += 1
            if self.count == self.world_size:
                self.count, self.generation = 0, self.generation + 1
                self.cond.notify_all()
                return
            while self.generation == generation and not self.broken:
                stuck = _unjoined_collective(rank)
                if stuck is None and time.monotonic() > deadline:
                    stuck = f"not every rank arrived within {timeout} s"
                if stuck is not None:
                    self.broken = f"rank {rank} finished its phase, but {stuck}"
                    self.cond.notify_all()
                    break
                self.cond.wait(0.05)
            if self.broken:
                raise Stuck(self.broken)

    def abort(self, why: str) -> None:
        with self.cond:
            self.broken = self.broken or why
            self.cond.notify_all()


class _Shared:
    def __init__(self, world_size: int, barrier_timeout: float, on_progress: Callable[[int], None] | None = None) -> None:
        self.meet = _Meet(world_size)
        self.on_progress = on_progress
        """Called by rank 0 with how many programs of the batch are done, every few programs."""
        self.timeout = barrier_timeout
        self.results: dict[int, dict[int, RankRun]] = {}
        self.seconds: dict[int, float] = {}
        self.lock = threading.Lock()
        self.aborted_at: int | None = None
        self.abort_reasons: list[str] = []
        self.errors: dict[int, dict[int, str]] = {}
        """Program index -> rank -> the first line of each error it raised so far (for a hang's story)."""

    def wait(self, index: int, rank: int, side: Side) -> None:
        """All ranks meet (see :class:`_Meet`); a side's error is kept for the story of a hang."""
        if side.error is not None:
            with self.lock:
                first = error_summary(side.error) or side.error_type
                self.errors.setdefault(index, {})[rank] = self.errors.get(index, {}).get(rank, "") + f"{side.phase}: {first[:300]}; "
        self.meet.wait(rank, self.timeout)

    def abort(self, index: int, rank: int, exc: BaseException) -> None:
        with self.lock:
            first = self.aborted_at is None
            if self.aborted_at is None or index < self.aborted_at:
                self.aborted_at = index
            self.abort_reasons.append(f"rank {rank}: {type(exc).__name__}: {exc}")
            if first and isinstance(exc, Stuck):
                self.abort_reasons.append(_stacks_of_other_ranks())


def _stacks_of_other_ranks() -> str:
    """Where each rank thread is now (the ones not at the barrier are the story of a hang)."""
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        if thread.name.startswith("rank") and thread.ident in frames and thread is not threading.current_thread():
            stack = "".join(traceback.format_stack(frames[thread.ident])[-12:])
            parts.append(f"--- {thread.name} is at:\n{stack}")
    return "\n".join(parts)


def _load(program: Program, index: int, rank: int) -> Callable[..., Any]:
    ns = namespace()
    # A file name of its own: Dynamo's automatic dynamic shapes remember sizes per
    # (file, line, name), and programs that shared one would compile with dynamic shapes.
    exec(compile(program.source(), f"<fuzz program {index}, rank {rank}, {next(_LOADS)}>", "exec"), ns)
    return ns["prog"]


def _run_program(rank: int, index: int, program: Program, mesh: Any, backend: Any, wait: Callable[[Side], None]) -> RankRun:
    coordinate = mesh.get_coordinate()
    eager_inputs = [make_input(spec, mesh, coordinate) for spec in program.inputs]
    compiled_inputs = [make_input(spec, mesh, coordinate) for spec in program.inputs]
    fn = _load(program, index, rank)
    eager, raw = _run_side("eager", lambda: fn(mesh, *eager_inputs), program)
    eager = _record(eager, raw, eager_inputs)
    wait(eager)  # every rank's eager is done before any rank compiles
    compiled_fn = torch.compile(fn, backend=backend, fullgraph=True)
    compiled, raw = _run_side("compiled", lambda: compiled_fn(mesh, *compiled_inputs), program)
    wait(compiled)  # every rank's compile is done before results are read
    return RankRun(eager, _record(compiled, raw, compiled_inputs))


def _rank_loop(rank: int, world_size: int, programs: Sequence[Program], start: int, shared: _Shared, make_backend: Callable[[], Any]) -> None:
    try:
        _walk(rank, world_size, programs, start, shared, make_backend)
    finally:
        # Sharding decisions cached on this world's meshes must not answer for the next world's.
        clear_sharding_caches()


def _walk(rank: int, world_size: int, programs: Sequence[Program], start: int, shared: _Shared, make_backend: Callable[[], Any]) -> None:

    meshes = {kind: _mesh(ws, shape, names) for kind, (ws, shape, names) in MESHES.items() if ws == world_size}
    backend = make_backend()
    for index in range(start, len(programs)):
        program = programs[index]
        began = time.perf_counter()
        try:
            wait = functools.partial(shared.wait, index, rank)
            run = _run_program(rank, index, program, meshes[program.mesh], backend, wait)
            with shared.lock:
                shared.results.setdefault(index, {})[rank] = run
                if rank == 0:
                    shared.seconds[index] = time.perf_counter() - began
            if (index - start + 1) % _RESET_EVERY == 0:
                shared.wait(index, rank, Side())  # every rank got here: none is stuck in a collective
                reset_dynamo_on_every_rank()
                if rank == 0 and shared.on_progress is not None:
                    shared.on_progress(index + 1)
        except BaseException as exc:  # noqa: BLE001 - stuck peers, or woken from a collective
            shared.abort(index, rank, exc)
            shared.meet.abort(f"rank {rank} stopped: {type(exc).__name__}")
            # Wakes the ranks that wait in a collective (or at dtcompile's check) for one that never comes.
            wake_ranks_waiting_for(rank, exc)
            return


def default_backend() -> Any:
    """The default tier's backend: dtcompile without Inductor."""
    import dtcompile

    return dtcompile.backend(inductor=False)


def run_programs(
    programs: Sequence[Program],
    make_backend: Callable[[], Any] = default_backend,
    *,
    barrier_timeout: float = 60.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[ProgramRun]:
    """Every program on threaded ranks (one world per world size, restarted after a hang), in order.

    ``barrier_timeout``: seconds ranks wait for each other at a phase's end
    (a peer stuck in a collective this rank never joined ends the wait at once).
    ``progress(done, total)`` is called every 50 programs (from a rank thread).
    """
    done_before = 0
    runs: list[ProgramRun | None] = [None] * len(programs)
    for world_size in sorted({p.world_size for p in programs}):
        indices = [i for i, p in enumerate(programs) if p.world_size == world_size]
        batch = [programs[i] for i in indices]
        start = 0
        while start < len(batch):
            on_progress = None if progress is None else (lambda k, base=done_before: progress(base + k, len(programs)))
            shared = _Shared(world_size, barrier_timeout, on_progress)
            failure = None
            try:
                run_threaded(
                    world_size, _rank_loop, world_size, batch, start, shared, make_backend,
                    timeout=60.0 + 30.0 * (len(batch) - start),
                )
            except RankFailure as exc:
                failure = str(exc)
            finally:
                clear_sharding_caches()
            end = len(batch) if shared.aborted_at is None and failure is None else None
            for k in range(start, len(batch)):
                ranks = shared.results.get(k, {})
                if len(ranks) == world_size:
                    runs[indices[k]] = ProgramRun(batch[k], [ranks[r] for r in range(world_size)], None, shared.seconds.get(k, 0.0))
            if end is not None:
                break
            stopped = shared.aborted_at if shared.aborted_at is not None else min(
                (k for k in range(start, len(batch)) if runs[indices[k]] is None), default=len(batch)
            )
            if stopped < len(batch):
                errors = shared.errors.get(stopped, {})
                raised = "".join(f"rank {r} raised: {e}\n" for r, e in sorted(errors.items()))
                reason = raised + ("\n".join(shared.abort_reasons) or (failure or "the world stopped"))
                runs[indices[stopped]] = ProgramRun(batch[stopped], None, f"hang or rank failure: {reason}"[:4000])
            start = stopped + 1
        done_before += len(batch)
    return [r if r is not None else ProgramRun(p, None, "not run") for r, p in zip(runs, programs)]


def _gloo_rank(rank: int, program: Program) -> RankRun:
    world_size, shape, names = MESHES[program.mesh]
    mesh = _mesh(world_size, shape, names)
    return _run_program(rank, 0, program, mesh, default_backend(), lambda side: dist.barrier())


def run_on_gloo(program: Program, timeout: float = 120.0) -> ProgramRun:
    """One program on real ranks (gloo processes): the ground truth when the threaded
    group is in doubt.  A rank that fails or hangs makes it a ``hang``."""
    try:
        ranks = run_gloo(program.world_size, _gloo_rank, program, timeout=timeout)
    except RankFailure as exc:
        return ProgramRun(program, None, f"on gloo: {exc}"[-4000:])
    return ProgramRun(program, ranks)
