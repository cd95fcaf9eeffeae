"""SPMD types in compiled graphs (dtcompile.spmd.inference) on small plain-tensor programs.

Two ranks as threads; tensors typed with ``spmd_types.assert_type`` on the world's
axis, collectives from ``torch.distributed._functional_collectives``.  Each
program is compiled with dtcompile (no Inductor): the types it prints, the
refusals of the check, and, where it compiles, its outputs against eager.
"""

from __future__ import annotations

from collections.abc import Callable
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


def _row_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *, reduce: int = 1) -> torch.Tensor:
    """x (sequence, hidden/2) @ w.t() (hidden/2 of the contraction) -> partial sums, all-reduced
    ``reduce`` times, plus a replicated bias."""
    y = x @ w.t()
    for _ in range(reduce):
        y = funcol.all_reduce(y, "sum", dist.group.WORLD)
    return torch.relu(y + b)


def _on_rank(rank: int, fn: Callable[..., torch.Tensor], typed: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    import spmd_types as spmd

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    x, w = x.chunk(WORLD_SIZE, 1)[rank].contiguous(), w.chunk(WORLD_SIZE, 1)[rank].contiguous()
    w.requires_grad_(True)
    axis = dist.group.WORLD
    if typed:
        spmd.assert_type(x, {axis: spmd.S(1)})
        spmd.assert_type(w, {axis: spmd.S(1)})
        spmd.assert_type(b, {axis: spmd.R})

    def call(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fn(x, w, b, **kwargs)

    result: dict[str, Any] = {"eager": call(x, w, b).detach()}
    try:
        result["report"] = dtcompile.explain(call)(x, w, b)
    except Exception as exc:
        result["error"] = exc
        return result
    # No torch._dynamo.reset() here: the ranks share Dynamo, and the new backend compiles anew.
    result["compiled"] = torch.compile(call, backend=dtcompile.backend(inductor=False))(x, w, b).detach()
    return result


def _forward_types(report: Any) -> dict[str, str]:
    """Forward graph: node target -> its types, first node of each target."""
    forward = next(r for r in report.graphs if r.kind == "forward")
    found: dict[str, str] = {}
    for line in forward.annotated().splitlines():
        target = line.split(" = ", 1)[1].split("(", 1)[0]
        found.setdefault(target, line.rsplit("; ", 1)[-1] if "world:" in line else "")
    return found


def test_a_row_parallel_matmul_is_partial_until_reduced_and_compiles_equal_to_eager():
    for result in run_threaded(WORLD_SIZE, _on_rank, _row_parallel, True, {}):
        assert "error" not in result, result.get("error")
        torch.testing.assert_close(result["compiled"], result["eager"])
        types = _forward_types(result["report"])
        assert types["aten.mm.default"] == "world:P", types  # contracting a dim both sides shard
        assert types["_c10d_functional.all_reduce.default"] == "world:R", types
        assert types["aten.add.Tensor"] == "world:R", types
        assert types["aten.permute.default"] == "world:S(0)", types  # w.t(): the shard moves


def test_a_missing_all_reduce_is_a_compile_error_naming_the_add_and_the_matmul():
    for result in run_threaded(WORLD_SIZE, _on_rank, _row_parallel, True, {"reduce": 0}):
        error = result.get("error")
        assert error is not None, "the partial sum added to a replicated bias compiled"
        assert isinstance(error, SpmdTypeCheckError) or "SpmdTypeCheckError" in str(error), error
        text = str(error)
        assert "node add (aten.add.Tensor, at " in text and "mesh axis 'world'" in text, text
        assert "partial since mm (aten.mm.default)" in text, text
        assert "in _row_parallel: `return torch.relu(y + b)`" in text, text  # the model's own line


def test_a_value_reduced_twice_is_a_compile_error():
    for result in run_threaded(WORLD_SIZE, _on_rank, _row_parallel, True, {"reduce": 2}):
        text = str(result.get("error"))
        assert "already replicated on 'world'" in text and "reduced twice" in text, text


def test_untyped_inputs_are_unknown_and_nothing_is_refused():
    for result in run_threaded(WORLD_SIZE, _on_rank, _row_parallel, False, {"reduce": 0}):
        # No type anywhere: no typing, no check (the program is wrong, but nothing says so).
        assert "error" not in result, result.get("error")
        assert "world:" not in result["report"].graphs[0].annotated()
        torch.testing.assert_close(result["compiled"], result["eager"])


ALL_PASSES = frozenset({"async_tp", "bucketing", "overlap", "annotate"})


def _on_rank_without_passes(rank: int, reduce: int) -> dict[str, Any]:
    """The row-parallel program compiled with every pass off: the check is the trace's, not a pass's."""
    import spmd_types as spmd

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    x, w = x.chunk(WORLD_SIZE, 1)[rank].contiguous(), w.chunk(WORLD_SIZE, 1)[rank].contiguous()
    for tensor, types in ((x, spmd.S(1)), (w, spmd.S(1)), (b, spmd.R)):
        spmd.assert_type(tensor, {dist.group.WORLD: types})
    backend = dtcompile.backend(inductor=False, disable_passes=ALL_PASSES)
    try:
        torch.compile(lambda x, w, b: _row_parallel(x, w, b, reduce=reduce), backend=backend)(x, w, b)
    except Exception as exc:
        return {"error": str(exc)}
    return {"traced": [dict(r.spmd_types_traced) for r in backend.records]}


def test_the_check_runs_on_the_graph_as_traced_with_every_pass_off():
    """The check and the types it computed come before the passes: with none of them run, a
    missing all-reduce is still refused, and the record keeps each node's types as traced."""
    for result in run_threaded(WORLD_SIZE, _on_rank_without_passes, 0):
        assert "node add (aten.add.Tensor, at " in result.get("error", ""), result
    for result in run_threaded(WORLD_SIZE, _on_rank_without_passes, 1):
        (traced,) = result["traced"]  # one inference graph
        by_op = {name.rstrip("_0123456789"): types for name, types in traced.items()}
        assert by_op["mm"] == {"world": "P"} and by_op["all_reduce"] == {"world": "R"}, traced


def _fuzz_program_on_rank(rank: int, seed: int) -> dict[str, Any]:
    from support.spmd_fuzz import build, generate, run_program

    program = generate(seed)
    backend = dtcompile.backend(inductor=False)
    try:
        run_program(torch.compile(build(program), backend=backend, fullgraph=True), program, rank)
    except Exception as exc:
        return {"error": str(exc)}
    forward = next(r for r in backend.records if r.kind == "forward")
    return {"types": {name.rstrip("_0123456789"): t["world"] for name, t in forward.spmd_types_traced.items()}}


def test_head_sharded_attention_is_typed_through_expand_and_bmm_and_its_partial_sum_checked():
    """Two of the SPMD-type fuzzer's programs (tests/clients/test_spmd_fuzz.py), which found that
    ``expand`` and a batch-sharded ``bmm`` lost the shard dim (the output projection's partial
    sum was then plain ``V`` and a ReLU on it passed): heads sharded, q @ k^T and the weighted sum
    keep the heads' shard, the row-parallel projection is a partial sum."""
    clean, planted = run_threaded(WORLD_SIZE, _fuzz_program_on_rank, 78), run_threaded(WORLD_SIZE, _fuzz_program_on_rank, 74)
    for result in clean:
        types = result["types"]
        assert types["bmm"] == "S(0)" and types["expand"] == "S(0)" and types["amax"] == "S(0)", types
        assert types["all_reduce"] == "R" and "?" not in types.values(), types
    for result in planted:
        error = result.get("error", "")
        assert "aten.relu.default" in error and "partial since mm_" in error, error
        assert "y0 = torch.relu(y0)" in error, error
