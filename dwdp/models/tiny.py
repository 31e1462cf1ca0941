"""Tiny random-weight MoE models of any transformers MoE family, built offline from configs.

Used by `dwdp demo`, the family sweep and the tests; nothing is downloaded. `tiny_config` shrinks a
family's default config by field name (hidden size, expert counts, heads, layers, vocabulary, ...),
in every sub-config (text, vision, audio); `_HINTS` holds the few settings a family needs on top of
that to build at this size (a layer pattern, a ratio between two sizes).
"""
from __future__ import annotations

import dataclasses

import torch

# The families the examples, benches and classic tests default to (any MoE family builds).
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe")

_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SPECIAL_TOKEN_IDS = dict(_TOKENS)  # of every tiny model (a server stops a decoded choice at eos)


def _size_rules(hidden: int, intermediate: int, num_experts: int, top_k: int, num_layers: int, vocab: int) -> dict:
    """Config field name -> tiny value, for text decoders."""
    head_dim = max(8, hidden // 4)  # 4 heads span the hidden size
    rules = dict(
        hidden_size=hidden, d_model=hidden, moe_hidden_size=hidden, out_hidden_size=hidden,
        projector_hidden_size=hidden,
        vocab_size=vocab, unpadded_vocab_size=vocab,
        num_hidden_layers=num_layers, n_layers=num_layers, num_layers=num_layers,
        num_attention_heads=4, n_heads=4, num_key_value_heads=4, kv_n_heads=4, head_dim=head_dim,
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=head_dim,
        kv_lora_rank=hidden // 2, q_lora_rank=hidden // 2, o_lora_rank=hidden // 2, qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim, v_head_dim=head_dim, rotary_dim=head_dim,
        index_n_heads=2, index_head_dim=16, index_topk=16,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_head_dim=head_dim, linear_num_heads=4,
        mamba_n_heads=4, mamba_num_heads=4, mamba_head_dim=head_dim, mamba_d_state=8, ssm_state_size=8,
        mamba_chunk_size=16, chunk_size=16, n_groups=1,
        intermediate_size=intermediate, moe_intermediate_size=intermediate, expert_ffn_hidden_size=intermediate,
        ffn_hidden_size=intermediate, shared_expert_intermediate_size=intermediate,
        shared_experts_intermediate_size=intermediate, shared_intermediate_size=intermediate,
        moe_shared_expert_intermediate_size=intermediate, dense_intermediate_size=intermediate,
        intermediate_size_mlp=intermediate, prefix_dense_intermediate_size=intermediate,
        num_experts=num_experts, num_local_experts=num_experts, n_routed_experts=num_experts,
        moe_num_experts=num_experts,
        num_experts_per_tok=top_k, moe_topk=top_k, moe_k=top_k, moe_top_k=top_k, top_k_experts=top_k,
        enable_moe_block=True, is_moe=True,
        n_group=1, topk_group=1, num_shared_experts=1, n_shared_experts=1, moe_num_shared_experts=1,
        first_k_dense_replace=1, num_dense_layers=1,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab,
        initializer_range=0.1, **_TOKENS,
    )
    return rules


# Towers (vision, audio) only have to be built: the smallest size that constructs.
_TOWER_RULES = dict(
    hidden_size=16, embed_dim=16, d_model=16, intermediate_size=32, encoder_ffn_dim=32, num_hidden_layers=1,
    depth=1, num_layers=1, encoder_layers=1, num_attention_heads=2, num_heads=2, encoder_attention_heads=2,
    num_key_value_heads=2, head_dim=8, projection_dim=16, out_hidden_size=None,  # set to the text hidden size
)

# What a family needs beyond the generic shrink; a callable value gets the knobs (hidden, intermediate, ...).
_CLASSIC = dict(max_position_embeddings=1024)
_HYBRID = ["linear_attention", "full_attention", "linear_attention"]  # at least one attention layer
_HINTS: dict[str, dict] = {
    # The five first families keep the tiny shapes their tests, benches and recorded numbers use.
    "mixtral": _CLASSIC,
    "olmoe": _CLASSIC,
    "qwen3_moe": dict(_CLASSIC, intermediate_size=lambda k: 2 * k["intermediate"]),
    "qwen2_moe": dict(_CLASSIC, intermediate_size=lambda k: 2 * k["intermediate"],
                      shared_expert_intermediate_size=lambda k: 2 * k["intermediate"]),
    "deepseek_v3": dict(_CLASSIC, n_group=lambda k: 2 if k["num_experts"] % 2 == 0 else 1, num_key_value_heads=4,
                        intermediate_size=lambda k: 2 * k["intermediate"]),
    # Layer patterns with a MoE layer (and an attention layer) within three layers.
    "bailing_hybrid": dict(layer_types=_HYBRID),
    "beam": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "deepseek_ocr2": {"text_config.mlp_layer_types": ["dense", "sparse", "sparse"]},
    "flint": dict(mlp_only_layers=[0]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "kimi_linear": dict(layer_types=_HYBRID),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention", "moe"]),
    "qwen3_5_moe": dict(layer_types=_HYBRID),
    "qwen3_next": dict(layer_types=_HYBRID),
    # Their configs turn "full_attention" into their own sparse-attention layer type, whose name changes
    # between releases ("qwen_sparse_attention" / "deepseek_sparse_attention", later "indexed_attention").
    "qwen4_exp": dict(layer_types=_HYBRID, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                      indexer_budget=16, indexer_compress_ratio=4),
    "glm5_next": {"text_config.qk_rope_head_dim": 0,  # its sparse-attention layers use no RoPE
                  "text_config.layer_types": _HYBRID,
                  "text_config.mlp_layer_types": ["dense", "sparse", "sparse"]},
    "step3p7": {"text_config.sliding_window": 16, "text_config.mlp_layer_types": ["dense", "sparse", "sparse"]},
    # Sizes whose default relation to others breaks at tiny size.
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},  # read, but without a default
    "diffusion_gemma": dict(canvas_length=8),
    "dots3_note": dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
                       swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=8),
    "longcat_flash": dict(zero_expert_num=2),  # identity experts next to the 8 real ones
    "mimo_v2_flash": dict(num_key_value_heads=2),  # its sliding-window layers use twice the KV heads
    "zaya": dict(num_experts_per_tok=1),  # ZAYA routes each token to one expert
    # Multimodal RoPE splits the rotary half of each head into sections: heads must be wide enough.
    "ernie4_5_vl_moe": {"text_config.moe_intermediate_size": lambda k: [k["intermediate"], k["intermediate"]],
                        "text_config.head_dim": 32,
                        "text_config.rope_parameters": dict(rope_type="default", rope_theta=5e5,
                                                            mrope_section=[6, 6, 4])},
    "glm4v_moe": {"text_config.head_dim": 32,
                  "text_config.rope_parameters": dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5,
                                                      mrope_section=[2, 3, 3])},
    # Its towers are pyramids of four stages.
    "muse_spark": {"vision_config.num_hidden_layers": 4, "vision_config.hidden_sizes": [16, 16, 16, 16],
                   "vision_config.depths": [1, 1, 1, 1], "audio_config.num_hidden_layers": 4,
                   "audio_config.hidden_sizes": [16, 16, 16, 16], "audio_config.depths": [1, 1, 1, 1]},
}


def _fields(config_class) -> dict:
    return {f.name: f for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else {}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _shrink(config_class, rules: dict, text_hidden: int, is_tower: bool) -> dict:
    """kwargs that shrink `config_class` by field name, recursing into its sub-configs."""
    fields = _fields(config_class)
    kwargs = {}
    for name, value in rules.items():
        if name in fields:
            kwargs[name] = text_hidden if value is None else value
    # Per-layer lists given in the defaults (layer patterns) follow the new layer count.
    layers = kwargs.get("num_hidden_layers") or kwargs.get("num_layers") or kwargs.get("n_layers")
    default_layers = next((_default(fields[n]) for n in ("num_hidden_layers", "num_layers", "n_layers") if n in fields),
                          None)
    for name, field in fields.items():
        value = _default(field)
        if layers and isinstance(value, list) and default_layers and len(value) == default_layers:
            kwargs[name] = value[:layers]
    for name, sub_class in _sub_config_classes(config_class).items():
        tower = is_tower or name not in ("text_config", "attn_config", "ffn_config", "llm_config", "language_config")
        sub_rules = _TOWER_RULES if tower else rules
        kwargs[name] = _shrink(sub_class, sub_rules, text_hidden, tower)
    return kwargs


# (config model type, sub-config) -> the model type of an AutoConfig sub-config whose release declares no
# default for it: DiffusionGemmaConfig of 5.17 builds no vision config by default, yet its encoder always
# builds a vision tower from one (later releases declare gemma4_vision).
_SUB_CONFIG_TYPES = {("diffusion_gemma", "vision_config"): "gemma4_vision"}


def _sub_config_classes(config_class) -> dict:
    """Sub-config name -> its config class (resolving an AutoConfig spec through its default model type)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    out = {}
    specs = getattr(config_class, "sub_configs_defaults", None) or {}
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        model_type = (getattr(specs.get(name), "model_type", None)
                      or _SUB_CONFIG_TYPES.get((getattr(config_class, "model_type", None), name)))
        if sub_class is AutoConfig and model_type in CONFIG_MAPPING:
            sub_class = CONFIG_MAPPING[model_type]
        if isinstance(sub_class, type) and sub_class is not AutoConfig:
            out[name] = sub_class
    return out


def tiny_config(family: str, *, hidden: int = 32, intermediate: int = 48, num_experts: int = 8, top_k: int = 2,
                num_layers: int = 3, vocab: int = 128, **overrides):
    """A transformers config of `family` (a transformers.models package, e.g. "gpt_oss") whose every MoE
    layer holds `num_experts` experts of `intermediate` features on a `hidden`-wide model.

    overrides: config fields set last (e.g. hidden_act="gelu"); ValueError for an unknown family.
    """
    from transformers import CONFIG_MAPPING

    from dwdp.models.families import family as find_family

    fam = find_family(family)
    config_class = CONFIG_MAPPING[fam.model_type]
    knobs = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                 num_layers=num_layers, vocab=vocab)
    rules = _size_rules(**knobs)
    kwargs = _shrink(config_class, rules, hidden, is_tower=False)
    for name, value in _HINTS.get(fam.name, {}).items():
        _set_nested(kwargs, name, value(knobs) if callable(value) else value)
    for name, value in overrides.items():
        _set_nested(kwargs, name, value)
    _derive_rope_sections(config_class, kwargs)
    return config_class(**kwargs)


def _derive_rope_sections(config_class, kwargs: dict) -> None:
    """Multimodal RoPE splits half of each head's rotary width into (time, height, width) sections, and
    configs validate that sum: give every config that has sections (by default or from a hint) sections
    in their own proportions that sum to half its rotary width at the tiny size. Recurses into sub-configs."""
    for name, sub_class in _sub_config_classes(config_class).items():
        if isinstance(kwargs.get(name), dict):
            _derive_rope_sections(sub_class, kwargs[name])
    rope = dict(kwargs.get("rope_parameters") or {})
    default = _default_rope_parameters(config_class) if "mrope_section" not in rope else {}
    sections = rope.get("mrope_section") or default.get("mrope_section")
    if not sections:
        return
    fields = _fields(config_class)

    def value(field: str):
        if field in kwargs:
            return kwargs[field]
        return _default(fields[field]) if field in fields else None

    if "qk_rope_head_dim" in fields:  # MLA: RoPE runs on its own slice of each head
        rotary = value("qk_rope_head_dim")
    else:
        head_dim = value("head_dim") or value("hidden_size") // value("num_attention_heads")
        factor = rope.get("partial_rotary_factor", default.get("partial_rotary_factor", 1.0))
        rotary = int(head_dim * factor)
    kwargs["rope_parameters"] = {**default, **rope, "mrope_section": split_in_proportion(rotary // 2, sections)}


def _default_rope_parameters(config_class) -> dict:
    """The rope parameters a config class fills in by default, when its module speaks of RoPE sections."""
    import sys

    module = sys.modules.get(config_class.__module__)
    path = getattr(module, "__file__", None)
    if path is None or "mrope_section" not in open(path).read():
        return {}
    try:
        return dict(getattr(config_class(), "rope_parameters", None) or {})
    except Exception:  # a class that needs arguments to build states no usable default
        return {}


def split_in_proportion(total: int, parts: list[int]) -> list[int]:
    """`total` split into len(parts) integers in the proportions of `parts` (largest remainders first),
    each at least 1 when total allows."""
    weight = sum(parts)
    out = [total * p // weight for p in parts]
    by_remainder = sorted(range(len(parts)), key=lambda i: -(total * parts[i] % weight))
    for i in by_remainder[:total - sum(out)]:
        out[i] += 1
    for i, v in enumerate(out):  # a zero section would drop that axis: borrow from the largest
        if v == 0 and total >= len(parts):
            out[out.index(max(out))] -= 1
            out[i] = 1
    return out


def _set_nested(kwargs: dict, name: str, value) -> None:
    """Set `name` ("field" or "sub_config.field") in the shrink kwargs."""
    head, _, rest = name.partition(".")
    if rest:
        _set_nested(kwargs.setdefault(head, {}), rest, value)
    elif value is _DROP:
        kwargs.pop(head, None)
    else:
        kwargs[head] = value


_DROP = object()  # a hint value that removes a shrink rule's setting


def build_tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised model of `family` (same seed -> same weights in every process).

    Builds the family's text causal LM, or its multimodal model when it has no text-only one.
    """
    from dwdp.models.families import family as find_family, model_class

    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = model_class(find_family(family))._from_config(config, dtype=dtype)
    _randomize_zero_biases(model, seed)
    return model.eval()


def _randomize_zero_biases(model: torch.nn.Module, seed: int) -> None:
    """Biases start at zero in transformers' init; a zero bias would hide any mistake in its handling."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.is_floating_point() and not p.is_meta and not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))

