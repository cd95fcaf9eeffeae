"""A HuggingFace model as users already run it: transformers' own tensor-parallel plan
(``base_model_tp_plan`` and the head's, as torch's ``parallelize_module`` styles) on 4 threaded
ranks, compiled with ``torch.compile(backend="dtcompile")``: logits and every parameter's
gradient equal the eager parallel model's and the single-process model's."""

from __future__ import annotations

import copy

import pytest
import torch
from support.hf_models import build, hf_tp_plan, require_transformers
from torch.distributed.tensor import DTensor

from dtcompile.testing import run_threaded


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank_step(rank, reference, ids):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference = copy.deepcopy(reference)  # each rank's own: gradients accumulate on it
    results = {}
    for how in ("eager", "compiled"):
        model = copy.deepcopy(reference)
        parallelize_module(model.model, mesh, hf_tp_plan(model))
        run = torch.compile(model, backend="dtcompile", options={"inductor": False}, fullgraph=True) if how == "compiled" else model
        logits = run(ids)
        logits.pow(2).mean().backward()
        results[how] = (logits.detach(), {n: _full(p.grad) for n, p in model.named_parameters()})
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()]
    ref_logits = reference(ids)
    ref_logits.pow(2).mean().backward()
    results["single process"] = (ref_logits.detach(), {n: p.grad for n, p in reference.named_parameters()})
    return results, sharded


@pytest.mark.models
@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_hf_model_with_its_own_tp_plan_compiled_equals_eager_and_one_process(name):
    require_transformers()
    reference, (ids,) = build(name)  # here: transformers' lazy imports are not thread-safe
    for rank, (results, sharded) in enumerate(run_threaded(4, _rank_step, reference, ids)):
        assert len(sharded) >= 4, f"rank {rank}: the HF plan sharded only {sharded}"
        compiled_logits, compiled_grads = results["compiled"]
        for other in ("eager", "single process"):
            logits, grads = results[other]
            torch.testing.assert_close(compiled_logits, logits, rtol=1e-4, atol=1e-5, msg=lambda m, o=other: f"rank {rank}, logits vs {o}: {m}")
            assert compiled_grads.keys() == grads.keys()
            for n, g in grads.items():
                torch.testing.assert_close(
                    compiled_grads[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, o=other, n=n: f"rank {rank}, grad of {n} vs {o}: {m}"
                )
