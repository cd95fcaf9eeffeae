"""SPMD types across compiled graphs (dtcompile.spmd.carry): stamped on outputs, re-checked on new inputs.

Two ranks as threads, tensors typed with ``spmd_types.assert_type`` on the world's
axis, collectives from ``torch.distributed._functional_collectives``, each function
compiled with dtcompile (no Inductor) on its own, as torchtitan compiles its blocks:

- a compiled graph's outputs carry the types its check computed, so the next
  compiled graph, given them and nothing else, is typed and checked (a partial sum
  it adds to a replicated value is refused at its compile; untyped, it was not);
- the same compiled graph called with inputs typed otherwise is checked again for
  them, without a recompile: a contradiction is refused before it runs, a
  consistent typing runs and types its outputs for the new inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from support.pinned import require_pinned

import dtcompile
from dtcompile.spmd.inference import SpmdTypeCheckError
from dtcompile.testing import run_threaded

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLD_SIZE = 2


@pytest.fixture(autouse=True)
def _spmd_types_installed() -> None:
    require_pinned("spmd_types", "0.2.3", "pip install --no-deps -r tests/clients/requirements.txt")


def _row_parallel(x: torch.Tensor, w: torch.Tensor, reduce: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, hidden/2) @ w.t() (hidden/2 of the contraction): a partial sum, all-reduced or not;
    and x doubled (still a shard of dim 1)."""
    y = x @ w.t()
    if reduce:
        y = funcol.all_reduce(y, "sum", dist.group.WORLD)
    return y, x * 2


def _add_bias(y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(y + b)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import spmd_types as spmd

    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((4, 16), (8, 16), (8,)))
    x, w = x.chunk(WORLD_SIZE, 1)[rank].contiguous(), w.chunk(WORLD_SIZE, 1)[rank].contiguous()
    axis = dist.group.WORLD
    spmd.assert_type(x, {axis: spmd.S(1)})
    spmd.assert_type(w, {axis: spmd.S(1)})
    spmd.assert_type(b, {axis: spmd.R})
    return x, w, b


def _local(value: torch.Tensor) -> dict[str, str]:
    import spmd_types as spmd

    return {str(axis): repr(t) for axis, t in spmd.get_local_type(value).items()}


def _chain_on_rank(rank: int, reduce: bool) -> dict[str, Any]:
    """``_row_parallel`` then ``_add_bias``, each compiled on its own; the second gets the first's
    output with no annotation of the test's."""
    import spmd_types as spmd

    x, w, b = _inputs(rank)
    backend = dtcompile.backend(inductor=False)
    first = torch.compile(_row_parallel, backend=backend, fullgraph=True)
    second = torch.compile(_add_bias, backend=backend, fullgraph=True)
    y, doubled = first(x, w, reduce)
    result: dict[str, Any] = {
        "y": _local(y), "doubled": _local(doubled), "doubled_spec": spmd.get_partition_spec(doubled),
        "x": _local(x),
    }
    y_eager, _ = _row_parallel(x, w, reduce)
    try:
        result["out"] = second(y, b)
    except Exception as exc:
        result["error"] = exc
    result["eager"] = _add_bias(y_eager, b)
    result["second_forward"] = next(r for r in backend.records if r.kind != "backward" and "relu" in str(r.graph.code)) \
        if "error" not in result else None
    return result


def test_compiled_outputs_carry_their_types_and_the_next_compiled_graph_starts_typed():
    for rank, result in enumerate(run_threaded(WORLD_SIZE, _chain_on_rank, True)):
        axis = next(iter(result["x"]))
        assert result["y"] == {axis: "R"}, f"rank {rank}: the all-reduced output: {result['y']}"
        assert result["doubled"] == {axis: "V"}, f"rank {rank}: {result['doubled']}"
        assert result["doubled_spec"] is not None and tuple(result["doubled_spec"])[1] is not None, result["doubled_spec"]
        assert "error" not in result, result.get("error")
        torch.testing.assert_close(result["out"], result["eager"])
        # The second graph, given only the first's outputs: every tensor node typed.
        lines = [line for line in result["second_forward"].annotated().splitlines() if " = " in line and "  # " in line]
        assert lines and all("world:" in line and "world:?" not in line for line in lines), "\n".join(lines)


def test_a_partial_output_carried_to_the_next_graph_is_refused_there():
    """Without the all-reduce the first graph's output is a partial sum, which it may return
    (it is typed P); the second graph adds it to a replicated bias, and is refused at its compile
    because that type reached it."""
    for rank, result in enumerate(run_threaded(WORLD_SIZE, _chain_on_rank, False)):
        axis = next(iter(result["x"]))
        assert result["y"] == {axis: "P"}, f"rank {rank}: {result['y']}"
        error = result.get("error")
        assert error is not None, f"rank {rank}: the partial sum added to a replicated bias compiled"
        assert "SpmdTypeCheckError" in f"{type(error).__name__}: {error}", error
        assert "in _add_bias: `return torch.relu(y + b)`" in str(error), error


def _retyped_on_rank(rank: int) -> dict[str, Any]:
    """``_add_bias`` compiled for a replicated ``y``, then called with ``y`` typed otherwise."""
    import spmd_types as spmd

    x, w, b = _inputs(rank)
    axis = dist.group.WORLD
    counter = torch._dynamo.testing.CompileCounterWithBackend(dtcompile.backend(inductor=False))
    compiled = torch.compile(_add_bias, backend=counter, fullgraph=True)

    def typed(t: Any) -> torch.Tensor:
        return spmd.assert_type(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), {axis: t})

    result: dict[str, Any] = {"replicated": _local(compiled(typed(spmd.R), b))}
    try:
        compiled(typed(spmd.P), b)
    except Exception as exc:
        result["partial_error"] = exc
    result["varying"] = _local(compiled(typed(spmd.V), b))
    result["replicated_again"] = _local(compiled(typed(spmd.R), b))
    result["frames"] = counter.frame_count
    return result


def test_the_same_graph_called_with_inputs_typed_otherwise_is_checked_again_without_a_recompile():
    for rank, result in enumerate(run_threaded(WORLD_SIZE, _retyped_on_rank)):
        axis = next(iter(result["replicated"]))
        assert result["replicated"] == {axis: "R"}, result
        error = result.get("partial_error")
        assert isinstance(error, SpmdTypeCheckError), f"rank {rank}: a partial y ran through the R-typed graph: {error!r}"
        assert "partial" in str(error) and "in _add_bias" in str(error), error
        # V + R is V: it runs, and its output is typed for the new input.
        assert result["varying"] == {axis: "V"}, result
        assert result["replicated_again"] == {axis: "R"}, result
        assert result["frames"] == 1, f"rank {rank}: compiled {result['frames']} times"
