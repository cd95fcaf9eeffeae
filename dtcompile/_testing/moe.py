"""A mixture-of-experts layer and its expert parallel plan, tokens dispatched by ``all_to_all_single``.

Holds :class:`MoE` (top-k routed GELU experts, pre-norm with a residual) and
:func:`parallelize_moe` (whole experts per rank over the mesh's ``ep`` axis,
the norm and the router replicated, each parameter handed to the module as its
local tensor by the ``_LocalForCompute`` parametrization).  Its build, seeded
with example inputs, is ``build_moe`` in :mod:`dtcompile._testing.models`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize

from dtcompile._testing.transformer_block import RMSNorm

__all__ = ["MoE", "parallelize_moe"]


class MoE(nn.Module):
    """A mixture-of-experts feed-forward on ``(tokens, dim)``, pre-norm with a
    residual: a softmax router picks ``top_k`` experts per normed token, each a
    GELU MLP (``w1[e]``, ``w2[e]``), whose outputs are summed weighted by the
    router's scores.

    Single process (no ``ep_mesh``) every expert runs on every token and the
    picked outputs are kept: a computation independent of the dispatch below.
    With expert parallelism (:func:`parallelize_moe`) the rank holds
    ``num_experts / ep`` experts and sends each token to the ranks of its experts.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm = RMSNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.ep_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        top_scores, top_ids = self.router(h).softmax(-1).topk(self.top_k, dim=-1)
        if self.ep_mesh is None:
            return x + self._every_expert(h, top_scores, top_ids)
        return x + self._expert_parallel(h, top_scores, top_ids, self.ep_mesh)

    def _every_expert(self, x: torch.Tensor, top_scores: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("teh,ehd->ted", F.gelu(torch.einsum("td,edh->teh", x, self.w1)), self.w2)
        picked = out.gather(1, top_ids.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return (picked * top_scores.unsqueeze(-1)).sum(1)

    def _expert_parallel(
        self, x: torch.Tensor, top_scores: torch.Tensor, top_ids: torch.Tensor, ep_mesh: DeviceMesh
    ) -> torch.Tensor:
        ep = ep_mesh.size()
        # Token copies sorted by expert: rank r's experts are [r * E/ep, (r + 1) * E/ep).
        expert_ids = top_ids.reshape(-1)
        order = expert_ids.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.long).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        # received[r * E/ep + e]: how many tokens rank r sends to local expert e.
        received = funcol.all_to_all_single(counts, None, None, ep_mesh).wait()
        input_splits = counts.view(ep, -1).sum(1).tolist()
        output_splits = received.view(ep, -1).sum(1).tolist()
        routed = funcol.all_to_all_single(x[tokens], output_splits, input_splits, ep_mesh)
        # Rank-major, expert-sorted within each rank: the local expert of each token.
        local_expert = torch.arange(self.num_experts // ep).repeat(ep).repeat_interleave(received, output_size=routed.shape[0])
        hidden = F.gelu(torch.bmm(routed.unsqueeze(1), self.w1[local_expert]))
        out = torch.bmm(hidden, self.w2[local_expert]).squeeze(1)
        back = funcol.all_to_all_single(out, input_splits, output_splits, ep_mesh)
        weighted = back * top_scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, weighted)


class _LocalForCompute(nn.Module):
    """Parametrization: the stored DTensor parameter's local tensor, for modules that
    compute on plain tensors.  Its gradient is summed over the axes where the
    parameter is replicated (each rank's loss is its own tokens' part of the
    whole loss) and stays the shard's own on the others."""

    def forward(self, stored: DTensor) -> torch.Tensor:
        grad_placements = [Partial("sum") if p.is_replicate() else p for p in stored.placements]
        return stored.redistribute(placements=stored.placements).to_local(grad_placements=grad_placements)


def parallelize_moe(model: MoE, mesh: DeviceMesh) -> MoE:
    """Expert parallel over ``mesh["ep"]``: ``w1`` and ``w2`` ``Shard(0)`` there (whole
    experts per rank), replicated on any other axis, as the norm and the router are everywhere.

    Every rank feeds its own tokens.  Gradients are the sums of the ranks' losses':
    the loss of a rank is its part of the whole (``out.pow(2).sum() / all tokens``).
    """
    names = mesh.mesh_dim_names
    if names is None or "ep" not in names:
        raise ValueError(f"parallelize_moe: the mesh has axes {names}; name one of them 'ep'")
    ep_axis = names.index("ep")
    ep = mesh.size(ep_axis)
    if model.num_experts % ep:
        raise ValueError(f"parallelize_moe: {model.num_experts} experts do not divide over ep={ep} ranks")
    for module, name in [(model.norm, "weight"), (model.router, "weight"), (model, "w1"), (model, "w2")]:
        sharded = module is model
        placements = [Shard(0) if sharded and axis == ep_axis else Replicate() for axis in range(mesh.ndim)]
        # Every rank built the same weights: no communication to place them.
        stored = distribute_tensor(getattr(module, name).detach(), mesh, placements, src_data_rank=None)
        setattr(module, name, nn.Parameter(stored))
        parametrize.register_parametrization(module, name, _LocalForCompute(), unsafe=True)
    model.ep_mesh = mesh["ep"]
    return model
