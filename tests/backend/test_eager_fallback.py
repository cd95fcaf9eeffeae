"""Graphs torch's AOTAutograd cannot trace over DTensor run eagerly, loudly (``eager_fallback``).

The fuzzer's runs of 5000 found programs that eager DTensor runs and stock
AOTAutograd refuses (tests/fuzz/test_fuzz_regressions.py pins each family).
The one used here: two outputs that are views of one result, which AOTAutograd
refuses when the outputs are tensor subclasses ("ANY output aliasing ... is
currently unsupported if there are any subclass outputs").
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

import dtcompile
from dtcompile.base.channels import Artifact, parse_artifact
from dtcompile.compiler import _raised_on_purpose
from dtcompile.hops.spec import LocalMapError
from dtcompile.testing import run_threaded


def _two_views(x):
    y = x * x + 1.0
    return y.squeeze(1), y.permute(2, 1, 0)


def _loss(outputs):
    first, second = outputs
    return first.sum() + (second * torch.arange(1.0, 4.0)).sum()


def _full() -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 1, 4) / 4 - 1.0


def _replicated_input(mesh) -> DTensor:
    return DTensor.from_local(_full(), mesh, [Replicate()]).detach().requires_grad_()


def _views_on_a_rank(rank: int) -> dict[str, object]:
    from dtcompile.testing.worlds import _mesh

    mesh = _mesh(2, None, None)
    backend = dtcompile.backend(inductor=False)
    results = {}
    compiled = torch.compile(_two_views, backend=backend, fullgraph=True)
    for name, fn in [("eager", _two_views), ("compiled", compiled)]:
        x = _replicated_input(mesh)
        outputs = fn(x)
        # Local values: a DTensor loss would make the two backwards' collectives differ.
        _loss([out.to_local() for out in outputs]).backward()
        locals_ = [out.full_tensor() for out in outputs]
        results[name] = (locals_, x.grad.full_tensor())
    results["fallbacks"] = [f.error for f in backend.fallbacks]
    results["records"] = len(backend.records)
    return results


def test_graph_torch_cannot_trace_runs_eagerly_with_a_warning():
    ranks = run_threaded(2, _views_on_a_rank, timeout=120)
    full = _full().requires_grad_()
    expected = _two_views(full)
    _loss(expected).backward()
    for rank, results in enumerate(ranks):
        (outs, grad), (eager_outs, eager_grad) = results["compiled"], results["eager"]
        for out, eager_out, want in zip(outs, eager_outs, expected, strict=True):
            torch.testing.assert_close(out, want.detach(), msg=f"rank {rank} forward")
            torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
        torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)
        torch.testing.assert_close(grad, full.grad, msg=f"rank {rank} grad")
        assert results["records"] == 0, "a graph that falls back is not compiled"
        (error,) = results["fallbacks"]
        assert error == "AssertionError: torch.compile is currently being used with tensor subclass inputs."


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.inductor)], ids=["aot", "inductor"])
def test_fallback_says_why_and_is_logged_as_an_artifact(fake_world, monkeypatch, inductor):
    traced = []

    def capture(kind, metadata_fn=None, payload_fn=None, **kwargs):
        meta = metadata_fn() if metadata_fn is not None else {}
        if kind == "artifact" and parse_artifact(meta.get("name", "")) is not None:
            traced.append((meta["name"], payload_fn()))

    monkeypatch.setattr("torch._logging.trace_structured", capture)
    mesh = fake_world(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_two_views, backend=dtcompile.backend(inductor=inductor))(_replicated_input(mesh))
    (warning,) = [str(w.message) for w in caught if str(w.message).startswith("dtcompile:")]
    assert warning.startswith(
        "dtcompile: compile 0/0: torch's AOTAutograd could not trace this graph over DTensor "
        "(AssertionError: torch.compile is currently being used with tensor subclass inputs.); it runs eagerly instead"
    )
    assert warning.endswith("dtcompile.backend(eager_fallback=False) raises the error instead")
    ((name, payload),) = traced
    assert name == Artifact.EAGER_FALLBACK
    assert "tensor subclass inputs" in payload
    assert "torch.ops.aten" not in payload and "permute" in payload, "the Dynamo graph, as it runs"


def test_fallback_off_raises_torchs_error(fake_world):
    mesh = fake_world(2)
    backend = dtcompile.backend(inductor=False, eager_fallback=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="outputs\\s+that alias one another"):
        torch.compile(_two_views, backend=backend)(_replicated_input(mesh))
    assert not backend.fallbacks


def test_a_failure_in_dtcompiles_passes_is_never_run_eagerly(fake_world, monkeypatch):
    """The fallback covers AOTAutograd's trace only: once a graph reaches dtcompile's
    partitioner or passes, an error is dtcompile's and raises."""
    mesh = fake_world(2)

    def broken(*args, **kwargs):
        raise RuntimeError("a pass broke")

    monkeypatch.setattr("dtcompile.pipeline.graph_compile.run_passes", broken)
    backend = dtcompile.backend(inductor=False)
    x = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a pass broke"):
        torch.compile(lambda t: t * 2, backend=backend)(x)
    assert not backend.fallbacks


def test_dtcompiles_own_errors_are_raised_on_purpose():
    try:
        try:
            raise LocalMapError("region: out_placements has 2 entries for 1 output")
        except LocalMapError as own:
            raise RuntimeError("while tracing") from own
    except RuntimeError as wrapped:
        assert _raised_on_purpose(wrapped)
    assert not _raised_on_purpose(RuntimeError("aten.cat.default got mixed torch.Tensor and DTensor"))
