"""Packed and chunked prefill (dwdp.serve.packed, dwdp.serve.prefill) against the unwrapped model's
single-prompt forwards, per attention variant: first tokens, last-position logits and every layer's KV."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dwdp.models.tiny import build_tiny_model
from dwdp.serve.packed import Piece, allowed, pack, packing_support
from dwdp.serve.prefill import InProgress, advance
from dwdp.serve.protocol import PrefillJob

# Logits and KV of a packed row differ from one prompt alone only by the order of float sums.
ATOL, RTOL = 2e-5, 1e-4

# (family, config overrides, what it covers); windows shorter than the prompts so they matter.
VARIANTS = {
    "mha": ("olmoe", dict(num_key_value_heads=4)),
    "gqa": ("qwen3_moe", {}),
    "mla": ("deepseek_v3", {}),
    "sliding_sinks": ("gpt_oss", dict(sliding_window=4)),            # eager, sinks, sliding + full layers
    "sliding_all": ("mixtral", dict(sliding_window=5)),               # one sliding kind for every layer
    "chunked": ("llama4", dict(attention_chunk_size=4)),
}

_MODELS: dict = {}


def model_of(variant: str):
    if variant not in _MODELS:
        family, overrides = VARIANTS[variant]
        _MODELS[variant] = build_tiny_model(family, seed=0, **overrides)
    return _MODELS[variant]


def prompts(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    return [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]


def alone(model, prompt):
    """(last logits [V], L pairs of full-length KV [1, H, T, D]) of `prompt` run by itself."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), cache=DynamicCache(), use_cache=True)
    return out.logits[0, -1], [(layer.keys, layer.values) for layer in out.cache.layers]


def prefill_all(model, lengths_or_prompts, budget):
    """Run the prompts through advance() with at most `budget` tokens per forward, fifo, chunking
    whatever does not fit; returns {index: (InProgress, first token)} and the forwards' sizes."""
    states = [InProgress(PrefillJob(f"r{i}", p, 0.0)) for i, p in enumerate(lengths_or_prompts)]
    done, sizes = {}, []
    while len(done) < len(states):
        plan, left = [], budget
        for state in states:
            if state.job.request_id in done or left == 0:
                continue
            n = min(state.left, left)
            plan.append((state, n))
            left -= n
        sizes.append(sum(n for _, n in plan))
        for state, token, _ in advance(model, plan):
            done[state.job.request_id] = (state, token)
    return [done[f"r{i}"] for i in range(len(states))], sizes


def check_against_alone(model, batch, results):
    for prompt, (state, token) in zip(batch, results):
        logits, kv = alone(model, prompt)
        assert token == int(logits.argmax()), f"first token {token} != alone {int(logits.argmax())}"
        assert len(state.kv) == len(kv)
        for layer, ((k, v), (rk, rv)) in enumerate(zip(state.kv, kv)):
            assert k.shape == rk.shape, f"layer {layer}: keys {tuple(k.shape)} != alone {tuple(rk.shape)}"
            torch.testing.assert_close(k, rk, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {layer} keys: {m}")
            torch.testing.assert_close(v, rv, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {layer} values: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_forward_of_mixed_lengths_equals_each_prompt_alone(variant):
    model = model_of(variant)
    assert packing_support(model.config) == (True, "")
    batch = prompts(model, [7, 1, 12, 3], seed=list(VARIANTS).index(variant))
    results, sizes = prefill_all(model, batch, budget=sum(map(len, batch)))
    assert sizes == [23], sizes  # one forward, no padding
    check_against_alone(model, batch, results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["gqa", "mla", "sliding_sinks", "chunked"])
@pytest.mark.parametrize("ratio", [1.0, 2.5, 4.0])
def test_chunked_prompt_equals_one_unchunked_forward(variant, ratio):
    """A prompt of ratio x max_num_tokens, chunked, beside a short prompt sharing the forwards."""
    model = model_of(variant)
    budget = 6
    batch = prompts(model, [int(ratio * budget), 2], seed=int(ratio * 10))
    results, sizes = prefill_all(model, batch, budget)
    assert max(sizes) <= budget, sizes
    state, _ = results[0]
    assert sum(state.chunks) == len(batch[0]) and max(state.chunks) <= budget, state.chunks
    check_against_alone(model, batch, results)


def test_the_mask_keeps_each_prompt_to_itself_and_its_past():
    """The rule itself: no query sees a key of another prompt, nor a later key of its own."""
    packed = pack([Piece(0, (5, 6, 7), 0), Piece(1, (8, 9), 0)], [0, 0])
    ok = allowed(packed["q_segment"], packed["position_ids"][0], packed["kv_segment"], packed["kv_position"])
    assert ok.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("family,kind", [("qwen3_next", "linear_attention"), ("jamba", "linear_attention")])
def test_recurrent_families_do_not_pack_and_say_why(family, kind):
    from dwdp.models.tiny import tiny_config

    ok, why = packing_support(tiny_config(family))
    assert not ok and kind in why, why
