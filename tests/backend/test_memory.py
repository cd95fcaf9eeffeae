"""Memory: FSDP stays FSDP when compiled (reshard after forward), the peak-memory model
against the allocator's measurement, the memory budget the passes keep to, and the
activations recomputed to fit it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtcompile
from dtcompile._testing import models
from dtcompile._testing.cases import CASES
from dtcompile.base.notation import format_bytes
from dtcompile.graph.memory import MemoryBudgetError
from dtcompile.records import Action
from dtcompile.testing import assert_matches_eager, measure_memory, saved_bytes, threaded_world


def _stack(fake_world, **sizes):
    mesh = fake_world(4, (4,), ("dp",))
    reference, parallel, x = models.build_norm_mlp_stack(mesh, **sizes)
    return mesh, reference, parallel, x.chunk(4)[0]


def _fsdp2(reference, mesh):
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _saved_compiled(parallel, x, **options):
    backend = dtcompile.backend(inductor=False, **options)
    compiled = torch.compile(parallel, backend=backend)
    held, out = saved_bytes(lambda: compiled(x), parallel.parameters())
    out.sum().backward()  # compiles the backward
    return held, out.detach(), backend


def _gathered_weights(parallel) -> int:
    return sum(p.numel() * p.element_size() for p in parallel.parameters())


@pytest.mark.slow
def test_fsdp_compiled_holds_what_fsdp2_holds_between_forward_and_backward(fake_world):
    # The stack of issue #31 (4 x LayerNorm, Linear 256->1024, GELU, Linear 1024->256; 64 rows).
    mesh, reference, parallel, x = _stack(fake_world)
    fsdp2 = _fsdp2(reference, mesh)
    fsdp2_held, fsdp2_out = saved_bytes(lambda: fsdp2(x), fsdp2.parameters())
    eager_out = parallel(x)
    held, out, backend = _saved_compiled(parallel, x)
    assert held <= 1.05 * fsdp2_held, f"compiled holds {held} B, FSDP2 {fsdp2_held} B"
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(out, fsdp2_out)
    forward = backend.records[0]
    resharded = [d for p in forward.passes if p.name == "reshard_after_forward" for d in p.decisions]
    # Every weight the backward reads, none kept: the linears', and the norms' but the first
    # (the input needs no gradient, and the norm's weight gradient reads the normalized input).
    read = [f"layers.{i}.{m}.weight" for i in range(4) for m in ("norm", "up", "down") if (i, m) != (0, "norm")]
    assert [d.node for d in resharded] == read
    assert all(d.action is Action.RESHARDED for d in resharded)
    assert str(resharded[0]) == (
        "layers.0.up.weight: resharded after forward: gathered again in the backward, not held (1048576 B gathered)"
    )
    # The backward gathers them again, and only them.
    backward_gathers = [c for c in backend.records[1].collectives if c.op == "all_gather"]
    assert sum(c.bytes for c in backward_gathers) == (3 * 256 + 4 * 2 * 1024 * 256) * 4


@pytest.mark.models
def test_keeping_gathered_weights_holds_them_and_says_why(fake_world):
    mesh, _, parallel, x = _stack(fake_world)
    resharded, _, _ = _saved_compiled(parallel, x)
    kept, _, backend = _saved_compiled(parallel, x, reshard_after_forward=False)
    # The weights the backward reads stay gathered: the whole model but the biases.
    biases = sum(p.numel() * p.element_size() for n, p in parallel.named_parameters() if "bias" in n)
    assert kept - resharded == pytest.approx(_gathered_weights(parallel) - biases, rel=0.01)
    decisions = [str(d) for p in backend.records[0].passes if p.name == "reshard_after_forward" for d in p.decisions]
    assert decisions[0] == "layers.0.up.weight: kept gathered (1048576 B gathered): reshard_after_forward=False"
    assert not any(c.op == "all_gather" for c in backend.records[1].collectives)
    # Per module: the last block kept (FSDP2's fully_shard(layer, reshard_after_forward=False)).
    last, _, backend = _saved_compiled(parallel, x, keep_gathered={"layers.3"})
    weights = sum(p.numel() * p.element_size() for n, p in parallel.named_parameters() if n.startswith("layers.3") and "bias" not in n)
    assert last - resharded == pytest.approx(weights, rel=0.01)
    kept_names = [d.node for p in backend.records[0].passes for d in p.decisions if d.action is Action.SKIPPED and p.name == "reshard_after_forward"]
    assert kept_names == ["layers.3.norm.weight", "layers.3.up.weight", "layers.3.down.weight"]


@pytest.mark.models
@pytest.mark.parametrize("options", [{}, {"keep_gathered": frozenset({"layers.1"})}], ids=["resharded", "kept"])
def test_resharded_fsdp_equals_eager_forward_and_backward_on_4_threaded_ranks(options):
    def build(mesh):
        _, parallel, x = models.build_norm_mlp_stack(mesh, rows=8, dim=32, hidden=64)
        return parallel, (x.chunk(4)[mesh.get_local_rank()],)

    assert_matches_eager(build, world=threaded_world(4, (4,), ("dp",)), backend=dtcompile.backend(inductor=False, **options))


def _recomputed(backend) -> list[str]:
    return [d.node for r in backend.records for p in r.passes if p.name == "activation_budget" for d in p.decisions if d.node]


@pytest.mark.models
def test_a_budget_under_the_default_split_recomputes_activations_to_fit(fake_world):
    mesh, _, parallel, x = _stack(fake_world)
    held, out, backend = _saved_compiled(parallel, x)
    default_peak = max(r.memory_traced.peak_bytes for r in backend.records)
    budget = default_peak * 92 // 100
    torch._dynamo.reset()
    fitted_held, fitted_out, fitted = _saved_compiled(parallel, x, memory_budget_bytes=budget)
    torch.testing.assert_close(fitted_out, out)
    for record in fitted.records:
        assert record.memory_traced.peak_bytes <= budget and record.memory.peak_bytes <= budget, record.kind
    # What the record names is what the forward no longer saves, and the bytes held fall.
    recomputed = _recomputed(fitted)
    assert recomputed and not _recomputed(backend)
    returned = lambda b: {a.name for a in b.records[0].graph.graph.output_node().args[0]}  # noqa: E731
    assert set(recomputed) <= returned(backend) - returned(fitted)
    summary = next(p for p in fitted.records[0].passes if p.name == "activation_budget").decisions[0]
    assert f"over memory_budget_bytes {format_bytes(budget)}; {len(recomputed)} activations" in summary.text
    assert fitted_held < held, (fitted_held, held)


@pytest.mark.models
def test_recomputed_activations_equal_eager_forward_and_backward_on_4_threaded_ranks():
    sizes = dict(rows=8, dim=32, hidden=64)

    def build(mesh):
        _, parallel, x = models.build_norm_mlp_stack(mesh, **sizes)
        return parallel, (x.chunk(4)[mesh.get_local_rank()],)

    with dtcompile.testing.fake_world(4, (4,), ("dp",)) as mesh:
        _, parallel, x = models.build_norm_mlp_stack(mesh, **sizes)
        _, _, backend = _saved_compiled(parallel, x.chunk(4)[0])
    budget = max(r.memory_traced.peak_bytes for r in backend.records) * 92 // 100
    torch._dynamo.reset()
    fitted = dtcompile.backend(inductor=False, memory_budget_bytes=budget)
    assert_matches_eager(build, world=threaded_world(4, (4,), ("dp",)), backend=fitted)
    assert _recomputed(fitted)


@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.models
def test_the_estimated_peak_is_within_10_percent_of_the_measured_one(fake_world, case_name):
    case = CASES[case_name]
    mesh = fake_world(4, case.mesh_shape(4), case.mesh_dim_names)
    _, model, x = case.build(mesh)
    x = case.local_input(x, mesh)
    backend = dtcompile.backend(inductor=False)
    compiled = torch.compile(model, backend=backend)

    def step():
        out = compiled(x)
        (out.full_tensor() if isinstance(out, DTensor) else out).pow(2).mean().backward()

    step()  # compiles; the measured step is the next one
    for p in model.parameters():
        p.grad = None
    measured = measure_memory(step, [*model.parameters(), x])
    estimated = max(record.memory.peak_bytes for record in backend.records)
    assert estimated == pytest.approx(measured.peak_bytes, rel=0.10), (estimated, measured)


def _peaks(backend):
    return {r.kind: (r.memory_traced.peak_bytes, r.memory.peak_bytes, r.memory_budget.num_bytes) for r in backend.records}


@pytest.mark.models
def test_a_budget_the_passes_would_pass_is_kept_and_the_refusals_say_so(fake_world):
    mesh, _, parallel, x = _stack(fake_world, rows=16)
    step = lambda backend: torch.compile(parallel, backend=backend)(x).sum().backward()  # noqa: E731
    unbounded = dtcompile.backend(inductor=False, memory_budget_bytes=1 << 40)
    step(unbounded)
    free = _peaks(unbounded)
    # Unbounded, bucketing gathers the whole model at once: both graphs peak above their traced peak.
    assert all(after > traced for traced, after, _ in free.values()), free
    budget = max(traced for traced, _, _ in free.values())
    torch._dynamo.reset()
    bounded = dtcompile.backend(inductor=False, memory_budget_bytes=budget)
    step(bounded)
    for kind, (_, after, kept_to) in _peaks(bounded).items():
        assert kept_to == budget and after <= budget, (kind, after, budget)
    refusals = [str(d) for r in bounded.records for p in r.passes for d in p.decisions if "over the memory budget" in str(d)]
    assert refusals and all("(memory_budget_bytes)" in line for line in refusals), refusals
    assert any(": starts a new bucket: joining" in line for line in refusals)


@pytest.mark.models
def test_a_budget_below_the_least_peak_is_a_clear_error(fake_world):
    mesh, _, parallel, x = _stack(fake_world, rows=16)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        torch.compile(parallel, backend=dtcompile.backend(inductor=False, memory_budget_bytes=1 << 20))(x)
    error = raised.value.__cause__ if isinstance(raised.value.__cause__, MemoryBudgetError) else raised.value.inner_exception
    assert isinstance(error, MemoryBudgetError)
    message = str(error)
    # Even with its activations recomputed in the backward, the graph peaks above 1 MiB.
    assert message.startswith("dtcompile: memory_budget_bytes=1048576 (1 MiB) is below the least peak of compile 0/0: ")
    assert "the least of every share of its activations recomputed in the backward" in message
    least = int(message.split("Raise memory_budget_bytes to at least ")[1].split(",")[0])
    torch._dynamo.reset()
    torch.compile(parallel, backend=dtcompile.backend(inductor=False, memory_budget_bytes=least))(x).sum().backward()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"memory_budget_bytes": 0}, ValueError, "memory_budget_bytes must be >= 1 bytes, got 0"),
        ({"memory_budget_bytes": 1.5}, TypeError, "memory_budget_bytes must be a number of bytes (int), got float 1.5"),
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward must be True or False, got str 'yes'"),
        ({"keep_gathered": "layers.0"}, TypeError, "keep_gathered must be a set of parameter or module names, got str 'layers.0'; write {'layers.0'} for one name"),
        ({"keep_gathered": {"layers.0."}}, ValueError, "keep_gathered must hold parameter or module names like 'layers.0.attention', got [\"'layers.0.'\"]"),
    ],
)
def test_memory_options_are_checked(options, error, message):
    with pytest.raises(error) as raised:
        dtcompile.backend(**options)
    assert message in str(raised.value)
