"""The HuggingFace zoo: models as people download them from ``transformers`` (pinned in the
``hf`` test extra), tiny configs, random init, each with its example inputs.

Every config is small enough to plan in seconds and shards evenly over 4 ranks (batch 4,
4 heads, hidden 64, dims multiples of 4, vocabulary 256); one layer (DeepSeek-V3: a dense layer,
then a routed one), since a repeated layer is planned once (tied, ``auto_parallel/tying.py``) and
only lengthens the solve; attention is SDPA, ``use_cache=False``, and the wrapper returns
the logits (or the image classifier's logits) as a plain tensor, so the plan's output is one
tensor.  The first eight families are issue #35's; the rest widen it (GQA, MoE, MLA, sliding
windows, parallel blocks, encoder-decoder, vision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TRANSFORMERS_VERSION = "5.24.0"

BATCH, SEQ, VOCAB = 4, 8, 256
_DECODER = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


class LogitsOf(nn.Module):
    """``model(input_ids=ids, use_cache=False).logits``; the HF model is ``self.model``, so the
    parameter names are the user's behind one ``model.`` prefix."""

    def __init__(self, model: nn.Module, key: str = "input_ids", **extra: Any) -> None:
        super().__init__()
        self.model = model
        self.key = key
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}, **self.extra).logits


def require_transformers() -> None:
    """Fails in CI (which installs the ``hf`` test extra), skips elsewhere, without transformers
    at the pinned version."""
    from support.pinned import require_pinned

    require_pinned("transformers", TRANSFORMERS_VERSION, "pip install '.[hf]'")


def _config(model_type: str, **kwargs: Any) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    # No dropout: the single-process model is the reference, and random masks differ by rank.
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def _causal(model_type: str, attention: str = "sdpa", **overrides: Any) -> Callable[[], nn.Module]:
    """A causal LM of ``model_type`` from the tiny decoder config; ``attention``: transformers'
    implementation (``eager`` for families that have no SDPA one)."""

    def make() -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = _config(model_type, **{**_DECODER, **overrides})
        config._attn_implementation = attention
        return LogitsOf(AutoModelForCausalLM.from_config(config), use_cache=False)

    return make


def _t5() -> nn.Module:
    from transformers import T5ForConditionalGeneration

    config = _config(
        "t5", d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4, vocab_size=VOCAB,
        decoder_start_token_id=0, pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    ids = torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB
    return LogitsOf(model, decoder_input_ids=ids, use_cache=False)


def _vit() -> nn.Module:
    from transformers import ViTForImageClassification

    config = _config(
        "vit", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=16,
        patch_size=4, num_channels=3, num_labels=8,
    )
    return LogitsOf(ViTForImageClassification(config), key="pixel_values")


def _swin() -> nn.Module:
    from transformers import SwinForImageClassification

    config = _config(
        "swin", image_size=16, patch_size=4, num_channels=3, embed_dim=16, depths=[1], num_heads=[4], window_size=2,
        num_labels=8,
    )
    config._attn_implementation = "eager"  # (transformers' Swin has no SDPA attention)
    return LogitsOf(SwinForImageClassification(config), key="pixel_values")


def _bert() -> nn.Module:
    from transformers import BertForMaskedLM

    config = _config(
        "bert", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return LogitsOf(BertForMaskedLM(config))


HF_ZOO: dict[str, Callable[[], nn.Module]] = {
    # Issue #35's eight.
    "llama": _causal("llama"),
    "mistral": _causal("mistral", sliding_window=4),
    "qwen2": _causal("qwen2"),
    "gpt2": _causal("gpt2", n_embd=64, n_layer=1, n_head=4, n_positions=64, n_inner=128),
    "gpt_neox": _causal("gpt_neox"),
    "phi3": _causal("phi3"),
    "gemma": _causal("gemma", head_dim=16),
    "bert": _bert,
    # Wider: GQA, MoE, MLA, other norms and blocks, encoder-decoder, vision.
    "llama3_gqa": _causal("llama", num_key_value_heads=2, rope_theta=500000.0),
    "qwen3": _causal("qwen3", head_dim=16),
    "qwen3_moe": _causal("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": _causal("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": _causal(
        "deepseek_v3", kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_hidden_layers=2,  # a dense layer, then a routed one
    ),
    "gemma3": _causal("gemma3_text", head_dim=16, sliding_window=4),
    "phi": _causal("phi"),
    "olmo2": _causal("olmo2"),
    "falcon": _causal("falcon", new_decoder_architecture=True, num_kv_heads=4),
    "starcoder2": _causal("starcoder2"),
    "t5": _t5,
    "vit": _vit,
}


# Families outside the zoo above, none of them written or tuned for by dtcompile, each
# checked end to end (planned on 2 x 2, compiled on 4 threaded ranks, equal to the single-process
# model): ALiBi (BLOOM, MPT), parallel attention and MLP (GPT-J, CodeGen), multi-query attention
# (GPTBigCode), partial rotary (StableLM, Persimmon), scaled logits and residuals (Granite, Cohere),
# layer norms without weights (OLMo), learned and sinusoidal positions (OPT, XGLM, BioGPT), local
# attention layers (GPT-Neo), squared-ReLU MLPs (Nemotron); and Swin (windowed attention over
# images, pooled by AdaptiveAvgPool1d).  BLOOM, GPT-Neo, XGLM, MPT and Swin have no SDPA attention
# in transformers: theirs is the eager one.
HF_WIDER: dict[str, Callable[[], nn.Module]] = {
    "opt": _causal("opt", ffn_dim=128, word_embed_proj_dim=64),
    "bloom": _causal("bloom", "eager", n_head=4, n_layer=1),
    "gptj": _causal("gptj", n_embd=64, n_layer=1, n_head=4, rotary_dim=8, n_positions=64),
    "codegen": _causal("codegen", n_embd=64, n_layer=1, n_head=4, rotary_dim=8, n_positions=64, n_ctx=64),
    "gpt_bigcode": _causal("gpt_bigcode", n_embd=64, n_layer=1, n_head=4, n_positions=64, n_inner=128, multi_query=True),
    "gpt_neo": _causal("gpt_neo", "eager", num_layers=1, attention_types=[[["global"], 1]], num_heads=4),
    "stablelm": _causal("stablelm"),
    "cohere": _causal("cohere"),
    "granite": _causal("granite"),
    "olmo": _causal("olmo"),
    "helium": _causal("helium", head_dim=16),
    "smollm3": _causal("smollm3"),
    "glm": _causal("glm", head_dim=16),
    "nemotron": _causal("nemotron", head_dim=16),
    "persimmon": _causal("persimmon"),
    "xglm": _causal("xglm", "eager", d_model=64, ffn_dim=128, num_layers=1, attention_heads=4),
    "biogpt": _causal("biogpt"),
    "mpt": _causal("mpt", "eager", d_model=64, n_heads=4, n_layers=1, expansion_ratio=2),
    "swin": _swin,
}


def example_input(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    if name in ("vit", "swin"):
        return torch.randn(BATCH, 3, 16, 16, generator=generator)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``(model, (input,))`` for zoo entry ``name`` (of :data:`HF_ZOO` or :data:`HF_WIDER`): the
    same weights on every call (seeded), in training mode, without dropout (its probabilities set
    to 0 in the config and the modules)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = (HF_ZOO.get(name) or HF_WIDER[name])()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, (example_input(name),)


class NoTorchEquivalent(Exception):
    """transformers' plan for the model cannot be run with torch's ``parallelize_module``: there
    is none, it uses a style torch cannot express, or, applied, it fails in eager."""


def hf_tp_plan(model: LogitsOf) -> dict[str, Any]:
    """transformers' own tensor-parallel plan for ``model`` (the model class's ``_tp_plan``:
    ``config.base_model_tp_plan`` under the base model's prefix, plus the head), as torch's
    ``parallelize_module`` styles, for ``model.model``.

    transformers' styles map one to one: ``colwise`` and ``rowwise`` are Megatron's,
    ``colwise_gather_output`` gathers its output, ``rowwise_split_input`` splits a replicated
    input, ``embedding_rowwise`` shards the vocabulary.  ``replicated_with_grad_allreduce``
    (Qwen3's and Gemma 3's q/k norms) is left out: the weight stays a plain tensor, so the
    all-reduce of its gradient is missing -- a cost the HF plan would pay, so the comparison is
    in its favour -- and the gradient is wrong: such models are compared, never run for
    numerics.  Raises :class:`NoTorchEquivalent` for MoE packing and expert styles, and when
    the model has no plan.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan = getattr(model.model, "_tp_plan", None) or {}
    if not getattr(model.model.config, "base_model_tp_plan", None):
        raise NoTorchEquivalent(f"{type(model.model).__name__} has no base_model_tp_plan")
    out = {}
    for key, style in plan.items():
        if style == "replicated_with_grad_allreduce":
            continue
        if style not in styles:
            raise NoTorchEquivalent(f"{key}: {style!r} has no torch parallelize_module style")
        out[key] = styles[style]()
    return out


def plan_hf(model: nn.Module, args: tuple[Any, ...], mesh: Any, **options: Any) -> Any:
    """``dtcompile.auto_parallel.plan`` as the zoo plans: gathered weights kept (the zoo's
    compile config), under half the replicated parameter bytes unless ``options`` say otherwise."""
    import dtcompile
    from support.ap_cases import KEPT_GATHERED, sharded_budget

    options.setdefault("param_memory_budget_bytes", sharded_budget(model))
    return dtcompile.auto_parallel.plan(model, mesh, args, config=KEPT_GATHERED, **options)


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


@dataclass
class AgainstHF:
    """dtcompile's plan against transformers' own, both compiled (see :func:`against_hf_plan`)."""

    hf_us: float
    auto_us: float
    solution: Any
    hf_placements: dict[str, Any]
    """The HF plan's placements, by the user's parameter names."""
    hf_collectives: int
    auto_collectives: int
    """Collectives in the compiled graphs (forward and backward, bucketing off)."""


def against_hf_plan(name: str) -> AgainstHF:
    """On a fake 1-D mesh of 4: transformers' own TP plan (:func:`hf_tp_plan`) applied with
    ``parallelize_module``, and dtcompile's plan under the same parameter bytes per rank, input
    and logits replicated as the HF plan has them; each compiled with dtcompile, its forward
    and backward played under the h100 profile."""
    import copy

    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import dtcompile
    from dtcompile.testing import fake_world
    from support.ap_cases import KEEP_COLLECTIVES, compiled_records, step_us

    model, args = build(name)
    plan = hf_tp_plan(model)
    with fake_world(4, (4,), ("tp",)) as mesh:
        hand = copy.deepcopy(model)
        parallelize_module(hand.model, mesh, plan)
        # parallelize_module gives a tied weight (the embedding and the head) one parameter per
        # module: counted once, under the name the user's model gives it.
        names = {n for n, _ in model.named_parameters()}
        hand_params = {n: p for n, p in hand.named_parameters(remove_duplicate=False) if n in names}
        hand_bytes = sum(_local(p).numel() * p.element_size() for p in hand_params.values())
        placements = {n: p.placements if isinstance(p, DTensor) else (Replicate(),) for n, p in hand_params.items()}
        try:
            hand(*args)
        except Exception as e:  # e.g. Llama 3's 2 KV heads cannot be split over 4 ranks
            raise NoTorchEquivalent(f"the HF plan fails in eager: {type(e).__name__}: {str(e).splitlines()[0][:120]}") from e
        solution = plan_hf(
            model, args, mesh, param_memory_budget_bytes=hand_bytes,
            input_placements=[(Replicate(),)], output_placements=[(Replicate(),)],
        )
        auto = dtcompile.auto_parallel.parallelize(model, solution)
        auto_args = (distribute_tensor(args[0], mesh, [Replicate()], src_data_rank=None),)
        us = [step_us(compiled_records(m, *a)) for m, a in ((hand, args), (auto, auto_args))]
        counts = [
            sum(len(r.collectives) for r in compiled_records(m, *a, disable_passes=KEEP_COLLECTIVES))
            for m, a in ((hand, args), (auto, auto_args))
        ]
    assert solution.param_bytes_per_rank() <= hand_bytes
    return AgainstHF(us[0], us[1], solution, placements, counts[0], counts[1])
