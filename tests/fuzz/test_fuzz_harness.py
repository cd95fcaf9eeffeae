"""The fuzzer itself can fail: it draws the same programs from a seed, catches a wrong
backend and shrinks its program, sees eager's refusals refused, and a rank that
raises alone is a hang reported in seconds, not a run that waits forever."""

from __future__ import annotations

import ast
import time

import pytest
import torch
import torch.distributed as dist
from support.fuzz_check import classify
from support.fuzz_generate import generate_programs
from support.fuzz_known import check_program
from support.fuzz_programs import Input, Program, Step, program_from_text
from support.fuzz_shrink import shrink
from support.fuzz_world import ProgramRun, RankRun, Side, Value, run_programs


@pytest.mark.models
def test_a_seed_draws_the_same_programs():
    first = generate_programs({"1d2": 6, "2d": 3}, seed=7)
    again = generate_programs({"1d2": 6, "2d": 3}, seed=7)
    other = generate_programs({"1d2": 6, "2d": 3}, seed=8)
    assert [p.describe() for p in first] == [p.describe() for p in again]
    assert [p.describe() for p in first] != [p.describe() for p in other]
    assert [p.mesh for p in first] == ["1d2"] * 6 + ["2d"] * 3
    for program in first:
        ast.parse(program.source())


def _value(local: torch.Tensor, placements: str | None = "[Shard(0)]") -> Value:
    return Value("DTensor", placements, (4,), "torch.float32", local)


def _run(eager: list[Side], compiled: list[Side]) -> ProgramRun:
    program = Program("1d2", (Input("x0", (4,), ("Shard(0)",), False, 0),), (Step("elementwise", "relu", "t0", ("x0",), "torch.relu({0})"),), ("t0",))
    return ProgramRun(program, [RankRun(e, c) for e, c in zip(eager, compiled)])


def test_verdicts():
    same = [Side(outputs=[_value(torch.tensor([1.0, float("nan")]))]) for _ in range(2)]
    assert classify(_run(same, same)).kind == "ok"
    off = [Side(outputs=[_value(torch.tensor([1.001, float("nan")]))]) for _ in range(2)]
    verdict = classify(_run(same, off))
    assert (verdict.kind, verdict.signature) == ("mismatch", "mismatch: output values")
    moved = [Side(outputs=[_value(torch.tensor([1.0, float("nan")]), "[Replicate()]")]) for _ in range(2)]
    verdict = classify(_run(same, moved))
    assert (verdict.kind, verdict.signature) == ("mismatch", "mismatch: output placements")
    assert "rank 1, output t0: placements differ: compiled is ('DTensor', '[Replicate()]'" in verdict.detail
    refused = [Side(error="ValueError: no", error_type="ValueError") for _ in range(2)]
    assert classify(_run(refused, same)).kind == "compiled_accepts"
    assert classify(_run(refused, refused)).signature == "both_raise: same: ValueError: no"
    assert classify(_run(same, refused)).kind == "internal_error"
    assert classify(_run(same, [refused[0], same[1]])).signature == "hang: compiled ranks disagree: ValueError: no"


def _relu_becomes_tanh():
    """A wrong compiler: dtcompile, after swapping relu for tanh in the Dynamo graph."""
    import dtcompile

    inner = dtcompile.backend(inductor=False)

    def wrong(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.relu:
                node.target = torch.tanh
        gm.recompile()
        return inner(gm, example_inputs)

    return wrong


@pytest.mark.fuzz
def test_a_wrong_backend_is_caught_and_shrunk_to_its_op():
    inputs = (Input("x0", (4, 3), ("Shard(0)",), True, 1), Input("x1", (4, 3), ("Replicate()",), False, 2))
    steps = (
        Step("elementwise", "abs", "t0", ("x1",), "{0}.abs()"),
        Step("elementwise", "scale", "t1", ("x0",), "{0} * 0.5"),
        Step("elementwise", "relu", "t2", ("t1",), "torch.relu({0})"),
        Step("elementwise", "add", "t3", ("t2", "x1"), "{0} + {1}"),
        Step("reduction", "sum_dim", "t4", ("t3",), "{0}.sum(0)"),
    )
    program = Program("1d2", inputs, steps, ("t0", "t4"), (("t4", "full_tensor"),))
    verdict = check_program(program, _relu_becomes_tanh)
    assert verdict.kind == "mismatch", verdict
    small, runs = shrink(program, verdict.signature, lambda p: check_program(p, _relu_becomes_tanh))
    assert [s.op for s in small.steps] == ["relu"], small.describe()
    assert small.inputs == (Input("x0", (4, 3), ("Replicate()",), False, 1),), small.describe()
    assert small.source() == "def prog(mesh, x0):\n    t2 = torch.relu(x0)\n    return (t2,)\n"
    assert runs < 40


@pytest.mark.fuzz
def test_what_eager_refuses_compiled_refuses():
    program = program_from_text("1d2", [Input("x0", (4, 3), ("Shard(0)",), False, 0)], """
t0 = x0.to_local()
t1 = x0 + t0
return t1
""")
    verdict = check_program(program)
    assert verdict.signature.startswith("both_raise: same: RuntimeError: "), verdict
    assert "mixed torch.Tensor and DTensor" in verdict.detail


@pytest.mark.fuzz
def test_a_rank_that_raises_alone_is_a_hang_and_the_next_program_runs():
    refused: list[int] = []

    def rank1_refuses_once():
        import dtcompile

        inner = dtcompile.backend(inductor=False)

        def backend(gm, example_inputs):
            if dist.get_rank() == 1 and not refused:
                refused.append(1)
                raise RuntimeError("rank 1 refuses")
            return inner(gm, example_inputs)

        return backend

    gather = program_from_text("1d2", [Input("x0", (4, 3), ("Shard(0)",), False, 0)], """
t0 = x0.redistribute(mesh, [Replicate()])
return t0
""")
    start = time.monotonic()
    first, second = run_programs([gather, gather], rank1_refuses_once)
    assert time.monotonic() - start < 15
    verdict = classify(first)
    assert verdict.kind == "hang"
    # Rank 0 compiled and waits at dtcompile's ranks' check for rank 1, which raised:
    # the harness sees it waiting there and ends the check, which raises on rank 0.
    assert verdict.signature.startswith("hang: some ranks raised in compiled: RanksDisagree: "), verdict.signature
    assert "rank 1 raised: compiled: BackendCompilerFailed: RuntimeError: rank 1 refuses" in verdict.detail
    assert "rank 0 raised: compiled: RanksDisagree: dtcompile: graph" in verdict.detail
    assert "waits at the check of graph" in verdict.detail
    assert classify(second).kind == "ok"
