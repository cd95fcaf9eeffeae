"""The region op's own machinery: the joint traced once for identical layers, forward and
backward paired by call id, and selective activation checkpointing."""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import dtcompile
import dtcompile.hops.joint as joint
from dtcompile.base.channels import Meta
from dtcompile.hops import local_map, local_map_region


def _layer(a, w):
    return torch.relu(a @ w)


def _model(tp_mesh, widths):
    region = local_map(_layer, [Shard(0)], ([Shard(0)], [Replicate()]), device_mesh=tp_mesh)

    def model(x, ws):
        for w in ws:
            x = region(x, w)
        return x

    x = distribute_tensor(torch.randn(8, widths[0]), tp_mesh, [Shard(0)]).requires_grad_()
    ws = [
        distribute_tensor(torch.randn(k, n) / k**0.5, tp_mesh, [Replicate()]).requires_grad_()
        for k, n in zip(widths, widths[1:])
    ]
    return model, x, ws


def _count_traces(monkeypatch):
    traces = []
    original = joint._trace_joint

    def counting(*args, **kwargs):
        traces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(joint, "_trace_joint", counting)
    return traces


def test_identical_layers_trace_their_region_once(tp_mesh, monkeypatch):
    traces = _count_traces(monkeypatch)
    model, x, ws = _model(tp_mesh, [16, 16, 16, 16, 16])
    backend = dtcompile.backend(inductor=False)
    out = torch.compile(model, backend=backend, fullgraph=True)(x, ws)
    out.to_local().sum().backward()
    assert len(traces) == 1, "4 identical layers traced their region's joint more than once"
    forward, backward = backend.records
    assert len(forward.regions) == len(backward.regions) == 4
    expected = model(x.detach(), [w.detach() for w in ws])
    torch.testing.assert_close(out.to_local(), expected.to_local())


def test_a_layer_of_another_shape_traces_again(tp_mesh, monkeypatch):
    traces = _count_traces(monkeypatch)
    model, x, ws = _model(tp_mesh, [16, 16, 16, 8])
    out = torch.compile(model, backend=dtcompile.backend(inductor=False), fullgraph=True)(x, ws)
    out.to_local().sum().backward()
    assert len(traces) == 2  # two 16x16 layers share one trace, the 16x8 one has its own


def test_forward_and_backward_regions_are_paired_by_call_id(tp_mesh):
    model, x, ws = _model(tp_mesh, [16, 16, 16])
    backend = dtcompile.backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(x, ws).to_local().sum().backward()
    forward, backward = backend.records
    fw_ids = [r.call for r in forward.regions]
    bw_ids = [r.call for r in backward.regions]
    assert None not in fw_ids and len(set(fw_ids)) == 2 and sorted(fw_ids) == sorted(bw_ids)
    # The backward regions are charged to the forward region's Dynamo node.
    notes = [n.meta[Meta.ANNOTATION] for n in backward.graph.graph.nodes if n.meta.get(Meta.REGION)]
    assert notes and all(note.startswith("grad of _layer") for note in notes), notes


def test_a_region_under_selective_activation_checkpointing(tp_mesh):
    """With a SAC policy that saves the region, the compiled step equals eager, and the
    policy saw the region op as one op."""
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.MUST_SAVE if op is local_map_region else CheckpointPolicy.PREFER_RECOMPUTE

    model, x, ws = _model(tp_mesh, [16, 16, 16])
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def step(x, ws):
        return checkpoint(model, x, ws, use_reentrant=False, context_fn=context_fn)

    eager = step(x, ws)
    eager.to_local().sum().backward()
    eager_grads = [x.grad.to_local().clone(), *(w.grad.to_local().clone() for w in ws)]
    x.grad = None
    for w in ws:
        w.grad = None
    out = torch.compile(step, backend=dtcompile.backend(inductor=False), fullgraph=True)(x, ws)
    out.to_local().sum().backward()
    torch.testing.assert_close(out.to_local(), eager.to_local())
    for got, want in zip([x.grad.to_local(), *(w.grad.to_local() for w in ws)], eager_grads):
        torch.testing.assert_close(got, want)
    assert local_map_region in seen
