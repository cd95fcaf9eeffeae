"""``loss_parallel()`` inside a compiled function keeps the logits vocab-sharded.

The forward is vocab-parallel (three all-reduces of one value per token); the
backward is traced with loss_parallel's backward handlers, so neither compiled
graph gathers the ``[tokens, vocab]`` logits.  Without them AOTAutograd traced
the backward with DTensor's default ``nll_loss_backward`` strategy, and the
forward saved an all-gather of the full logits for it (values were right).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

import dtcompile
from dtcompile.testing import fake_world

TOKENS, DIM, VOCAB, WORLD = 16, 8, 64, 2


def lm_head_loss(h, w, target):
    logits = h @ w.t()  # vocab-sharded: Shard(-1)
    with loss_parallel():
        return F.cross_entropy(logits, target)


@pytest.mark.parametrize("target_kind", ["tensor", "dtensor"])
@pytest.mark.parametrize("backward_under_loss_parallel", [True, False], ids=["bw-in-loss-parallel", "bw-outside"])
def test_compiled_loss_parallel_never_gathers_the_logits(target_kind, backward_under_loss_parallel):
    backend = dtcompile.backend(inductor=False)
    with fake_world(WORLD) as mesh:
        h = distribute_tensor(torch.randn(TOKENS, DIM), mesh, [Replicate()], src_data_rank=None).requires_grad_()
        w = distribute_tensor(torch.randn(VOCAB, DIM), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        target = torch.randint(0, VOCAB, (TOKENS,))
        if target_kind == "dtensor":
            target = distribute_tensor(target, mesh, [Replicate()], src_data_rank=None)
        loss = torch.compile(lm_head_loss, backend=backend, fullgraph=True)(h, w, target)
        if backward_under_loss_parallel:
            with loss_parallel():
                loss.backward()
        else:
            loss.backward()
        assert h.grad is not None and w.grad is not None
    by_kind = {record.kind: [(c.op, c.shape, c.bytes) for c in record.collectives] for record in backend.records}
    one_per_token = ("all_reduce", (TOKENS, 1), TOKENS * 4)
    # max, sum of exp, and the target's logit: one value per token each.
    assert by_kind == {"forward": [one_per_token] * 3, "backward": []}


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(TOKENS, DIM, generator=gen),
        torch.randn(VOCAB, DIM, generator=gen),
        torch.randint(0, VOCAB, (TOKENS,), generator=gen),
    )


def _gloo_rank(rank: int) -> dict[str, list[torch.Tensor]]:
    from dtcompile.testing.worlds import _mesh

    mesh = _mesh(WORLD, None, None)
    h_full, w_full, target_full = _weights()
    results = {}
    for name, fn in (("eager", lm_head_loss), ("compiled", torch.compile(lm_head_loss, backend=dtcompile.backend(inductor=False), fullgraph=True))):
        for target_kind in ("tensor", "dtensor"):
            h = distribute_tensor(h_full, mesh, [Replicate()]).requires_grad_()
            w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
            target = target_full if target_kind == "tensor" else distribute_tensor(target_full, mesh, [Replicate()])
            loss = fn(h, w, target)
            with loss_parallel():
                loss.backward()
            results[f"{name}/{target_kind}"] = [loss.full_tensor(), h.grad.full_tensor(), w.grad.full_tensor()]
    return results


@pytest.mark.gloo
def test_compiled_loss_parallel_matches_eager_and_the_single_process_loss_on_gloo():
    from dtcompile.testing import run_gloo

    h, w, target = (t.requires_grad_() if t.is_floating_point() else t for t in _weights())
    loss = F.cross_entropy(h @ w.t(), target)
    loss.backward()
    reference = [loss.detach(), h.grad, w.grad]
    for rank, results in enumerate(run_gloo(WORLD, _gloo_rank, timeout=300)):
        for run, values in results.items():
            for what, got, want in zip(("loss", "h.grad", "w.grad"), values, reference):
                torch.testing.assert_close(got, want, msg=f"rank {rank} {run} {what}")
