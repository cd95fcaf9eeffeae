"""The zoo: torch.nn models the team did not design, tiny, each with its example inputs.

Each builder returns ``(model, args)``, the same on every call (seeded); the
sizes shard evenly over 4 ranks (batch 4, 4 heads, dims multiples of 4) so that
the solver has every layout to choose from.  The first four are the models
issue #23 found failing; the last two are torchtitan 0.3.0's own Llama3 and dense
Qwen3 (one layer, SDPA attention), built unparallelized from its model code
(``tests/support/titan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, SEQ, BATCH, VOCAB = 16, 4, 8, 4, 32


class GatedMLPBlock(nn.Module):
    """LayerNorm, two Linears gated by GELU and sigmoid, a down projection, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.gate = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(F.gelu(self.up(y)) * torch.sigmoid(self.gate(y)))


class SmallLM(nn.Module):
    """Embedding, LayerNorm, a Linear layer and a head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.hidden(self.norm(self.embed(ids)))))


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as self-attention (CPU: the flash attention kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class RMSNormSwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class ConvGroupNorm(nn.Module):
    """Two convolutions with GroupNorm, pooled into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class MixerBlock(nn.Module):
    """An MLP-Mixer block: token mixing across the sequence, then channel mixing."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.tokens = nn.Sequential(nn.Linear(SEQ, 2 * SEQ), nn.GELU(), nn.Linear(2 * SEQ, SEQ))
        self.norm2 = nn.LayerNorm(DIM)
        self.channels = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class WithBuffers(nn.Module):
    """A sinusoidal position table and a per-channel scale, both buffers (one not persistent)."""

    def __init__(self) -> None:
        super().__init__()
        position = torch.arange(SEQ, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, DIM, 2, dtype=torch.float32) * (-4.0 / DIM))
        table = torch.zeros(SEQ, DIM)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
        self.register_buffer("positions", table)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj((x + self.positions) * self.scale)


class CausalSDPA(nn.Module):
    """``F.scaled_dot_product_attention`` with a causal mask made in the model, then a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, DIM))


class DecoderLayer(nn.Module):
    """``nn.TransformerDecoderLayer`` over a target and a memory (two inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.layer(tgt, memory)


class GLUHead(nn.Module):
    """A GLU MLP with Hardswish and PReLU, and an MSE loss against a target: ops DTensor has
    no strategy for (``glu``, ``hardswish``, ``_prelu_kernel``, ``mse_loss``), planned as their
    decompositions."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.act = nn.Hardswish()
        self.prelu = nn.PReLU()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.prelu(self.act(self.down(F.glu(self.up(x), dim=-1)))), target)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _titan(which: str) -> tuple[nn.Module, tuple[Any, ...]]:
    from support.titan import llama3_config, qwen3_dense_config, torchtitan_on_cpu

    sizes = dict(dim=DIM, n_heads=HEADS, n_layers=1, vocab_size=VOCAB, seq_len=SEQ)
    with torchtitan_on_cpu():
        if which == "llama3":
            config = llama3_config(hidden_dim=2 * DIM, **sizes)
        else:
            config = qwen3_dense_config(hidden_dim=2 * DIM, n_kv_heads=HEADS // 2, **sizes)
        model = config.build()
        model.init_states()
    return model, (_tokens(),)


ZOO: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "gated_mlp_block": lambda: (GatedMLPBlock(), (torch.randn(BATCH, SEQ, DIM),)),
    "small_lm": lambda: (SmallLM(), (_tokens(),)),
    "multihead_attention": lambda: (SelfAttention(), (torch.randn(BATCH, SEQ, DIM),)),
    "transformer_encoder_layer": lambda: (
        nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True),
        (torch.randn(BATCH, SEQ, DIM),),
    ),
    "transformer_decoder_layer": lambda: (DecoderLayer(), (torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM))),
    "rmsnorm_swiglu": lambda: (RMSNormSwiGLU(), (torch.randn(BATCH, SEQ, DIM),)),
    "groupnorm_conv": lambda: (ConvGroupNorm(), (torch.randn(BATCH, 4, 8, 8),)),
    "mlp_mixer_block": lambda: (MixerBlock(), (torch.randn(BATCH, SEQ, DIM),)),
    "tied_embeddings_lm": lambda: (SmallLM(tied=True), (_tokens(),)),
    "with_buffers": lambda: (WithBuffers(), (torch.randn(BATCH, SEQ, DIM),)),
    "causal_sdpa": lambda: (CausalSDPA(), (torch.randn(BATCH, SEQ, DIM),)),
    "glu_hardswish_prelu_mse": lambda: (GLUHead(), (torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM))),
    "torchtitan_llama3": lambda: _titan("llama3"),
    "torchtitan_qwen3": lambda: _titan("qwen3"),
}


def build(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """The zoo model ``name`` and its example inputs, the same on every call."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ZOO[name]()
