"""dtcompile.testing: test parallelism plans in CI, in one CPU process.

Worlds (context managers; also pytest fixtures of the same names through the
``dtcompile`` pytest plugin):

- :func:`fake_world` -- the fake process group at any world size, one rank
  played; for graph structure and collective schedules;
- :func:`simulated_world` -- every rank in one process (``LocalTensorMode``),
  real collective semantics; :func:`threaded_world` -- ranks as threads, each
  compiling its own program; :func:`run_threaded`, :func:`run_gloo` -- run a
  function on every rank of a threaded or a real gloo world (on threads, call
  :func:`wait_for_eager_on_every_rank` between a rank's eager step and its
  compile, and :func:`reset_dynamo_on_every_rank` for ``torch._dynamo.reset()``,
  which they share); :func:`run_cold_and_warm` -- a gloo job and its restart, sharing
  one compile cache folder (the warm run is served by the cold run's entries).

Checks:

- :func:`collective_schedule` -- the forward and backward collectives of a
  compiled program, with a stable text form for ``assertExpectedInline``;
- :func:`assert_matches_eager` -- outputs and gradients, rank by rank;
- :func:`assert_no_graph_breaks`, :func:`assert_no_recompiles` -- context
  managers whose failures carry Dynamo's reasons.

Memory (:mod:`dtcompile.testing.memory`): :func:`measure_memory` -- a step's peak as
torch's allocator saw it, the counterpart of the estimates in ``record.memory``;
:func:`saved_bytes` -- what a forward leaves for its backward.
"""

from dtcompile.testing.asserts import (
    ThreadedWorld,
    assert_matches_eager,
    assert_no_graph_breaks,
    assert_no_recompiles,
    threaded_world,
)
from dtcompile.testing.memory import MeasuredMemory, measure_memory, saved_bytes, storage_bytes
from dtcompile.testing.schedule import (
    CollectiveSchedule,
    ScheduledCollective,
    collective_schedule,
)
from dtcompile.testing.worlds import (
    RankFailure,
    fake_world,
    reset_dynamo_on_every_rank,
    run_cold_and_warm,
    run_gloo,
    run_threaded,
    simulated_world,
    wait_for_eager_on_every_rank,
)

__all__ = [
    "CollectiveSchedule",
    "MeasuredMemory",
    "RankFailure",
    "ScheduledCollective",
    "ThreadedWorld",
    "assert_matches_eager",
    "assert_no_graph_breaks",
    "assert_no_recompiles",
    "collective_schedule",
    "fake_world",
    "measure_memory",
    "reset_dynamo_on_every_rank",
    "run_cold_and_warm",
    "run_gloo",
    "run_threaded",
    "saved_bytes",
    "simulated_world",
    "storage_bytes",
    "threaded_world",
    "wait_for_eager_on_every_rank",
]
