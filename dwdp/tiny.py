"""Tiny random-weight MoE models of the supported families, built offline from configs.

Used by `dwdp demo` and the tests; nothing is downloaded.
"""
from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe")


def tiny_config(family: str, *, hidden: int = 32, intermediate: int = 48, num_experts: int = 8, top_k: int = 2,
                num_layers: int = 3, vocab: int = 128, **overrides):
    """A transformers config of `family` with every MoE layer holding `num_experts` experts."""
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_experts_per_tok=top_k, initializer_range=0.1,
    )
    if family == "mixtral":
        cfg = dict(common, intermediate_size=intermediate, num_local_experts=num_experts)
        cls = MixtralConfig
    elif family == "qwen3_moe":
        cfg = dict(common, moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                   num_experts=num_experts, head_dim=hidden // 4)
        cls = Qwen3MoeConfig
    elif family == "qwen2_moe":
        cfg = dict(common, moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                   shared_expert_intermediate_size=2 * intermediate, num_experts=num_experts)
        cls = Qwen2MoeConfig
    elif family == "deepseek_v3":
        # MLA attention (every head its own KV), one dense layer first, grouped top-k routing.
        cfg = dict(common, num_key_value_heads=4, moe_intermediate_size=intermediate,
                   intermediate_size=2 * intermediate,
                   n_routed_experts=num_experts, n_shared_experts=1, first_k_dense_replace=1,
                   n_group=2 if num_experts % 2 == 0 else 1, topk_group=1, q_lora_rank=hidden // 2,
                   kv_lora_rank=hidden // 2, qk_nope_head_dim=hidden // 4, qk_rope_head_dim=hidden // 4,
                   v_head_dim=hidden // 4)
        cls = DeepseekV3Config
    elif family == "olmoe":
        cfg = dict(common, intermediate_size=intermediate, num_experts=num_experts)
        cls = OlmoeConfig
    else:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    cfg.update(overrides)
    return cls(**cfg)


def build_tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised causal LM of `family` (same seed -> same weights in every process)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
