"""The fields of an MoE model the cost model needs, read from transformers configs or presets."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dwdp.predict.costmodel.data import load_json, preset_names
from dwdp.predict.costmodel.formats import ACT_BYTES, WeightFormat


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek); q_lora_rank None = plain q projection."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """The fields of a model the cost model needs. is_moe[l] / window[l] per layer (window None = full)."""

    name: str
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_moe: tuple[bool, ...]
    window: tuple[int | None, ...]
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int  # total over shared experts; 0 = none
    dense_intermediate: int
    mla: MLA | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    expert_bias: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe)

    def expert_nbytes(self, fmt: WeightFormat) -> tuple[int, int]:
        """Bytes of one routed expert's (gate_up [2I, H], down [H, I]), biases included."""
        h, i = self.hidden, self.moe_intermediate
        gate_up, down = fmt.matrix_bytes(2 * i, h), fmt.matrix_bytes(h, i)
        if self.expert_bias:
            gate_up, down = gate_up + 2 * i * ACT_BYTES, down + h * ACT_BYTES
        return gate_up, down

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelSpec":
        """Read a transformers config (DeepSeek-V3, Qwen3-MoE, gpt-oss, Mixtral families and alike)."""
        get = lambda *keys, default=None: next(  # noqa: E731
            (getattr(config, k) for k in keys if getattr(config, k, None) is not None), default)
        num_layers = config.num_hidden_layers
        hidden, heads = config.hidden_size, config.num_attention_heads
        num_experts = get("n_routed_experts", "num_local_experts", "num_experts")
        if num_experts is None:
            raise ValueError(f"{type(config).__name__} has no routed-expert count: not an MoE config")
        moe_inter = get("moe_intermediate_size", "intermediate_size")
        dense_inter = get("intermediate_size", default=moe_inter)
        first_dense = get("first_k_dense_replace", default=0)
        sparse_step = get("decoder_sparse_step", "moe_layer_freq", default=1)
        mlp_only = set(get("mlp_only_layers", default=[]) or [])
        is_moe = tuple(
            l >= first_dense and l not in mlp_only and (l + 1) % sparse_step == 0 for l in range(num_layers)
        )
        shared = get("n_shared_experts", default=0) * moe_inter + get("shared_expert_intermediate_size", default=0)
        sliding = get("sliding_window")
        layer_types = get("layer_types")
        if layer_types is not None:
            window = tuple(sliding if t == "sliding_attention" else None for t in layer_types)
        elif sliding is not None and get("use_sliding_window", default=True):
            window = (sliding,) * num_layers
        else:
            window = (None,) * num_layers
        mla = None
        if get("kv_lora_rank") is not None:
            mla = MLA(get("q_lora_rank"), config.kv_lora_rank, config.qk_nope_head_dim,
                      config.qk_rope_head_dim, config.v_head_dim)
        model_type = getattr(config, "model_type", "")
        return cls(
            name=name or model_type,
            hidden=hidden,
            vocab=config.vocab_size,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", default=heads),
            head_dim=get("head_dim", default=hidden // heads) if mla is None else mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            is_moe=is_moe,
            window=window,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            moe_intermediate=moe_inter,
            shared_intermediate=shared,
            dense_intermediate=dense_inter,
            mla=mla,
            attention_bias=bool(get("attention_bias", default=False)),
            # Qwen3 normalises q and k per head; the config carries no flag for it.
            qk_norm=model_type.startswith("qwen3"),
            expert_bias=model_type == "gpt_oss",
        )


def model_names() -> tuple[str, ...]:
    return preset_names("models.json")


def preset_config(name: str):
    """A transformers config object for a preset, built offline from dwdp/predict/data/models.json."""
    from transformers import AutoConfig

    data = load_json("models.json")
    if name not in data or name.startswith("_"):
        raise ValueError(f"unknown model preset {name!r}; presets: {model_names()}")
    return AutoConfig.for_model(data[name]["model_type"], **data[name]["config"])


def preset_source(name: str) -> str:
    return load_json("models.json")[name]["source"]


@lru_cache(maxsize=None)
def load_model(name: str) -> ModelSpec:
    return ModelSpec.from_config(preset_config(name), name=name)
