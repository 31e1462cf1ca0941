"""Packed and chunked forwards through both serving modes' models (DWDPModel, DEPModel) on two
spawned ranks, per attention variant: each prompt's first token and KV equal the unwrapped model's
forward of that prompt alone. The ranks hold different prompts (DEP ranks exchange tokens)."""
from __future__ import annotations

import pytest
import torch

from dwdp.runtime.group import launch_local

ATOL, RTOL = 2e-5, 1e-4
BUDGET = 12  # max_num_tokens: the 20-token prompt is chunked, the others share forwards with its chunks
# (name, family, overrides, modes): GQA, MHA, MLA, sliding window + sinks (eager), chunked attention
# (llama4: DWDP only, DEPModel does not take experts with routing weights on the input).
VARIANTS = [("gqa", "qwen3_moe", {}, ("dwdp", "dep")), ("mha", "olmoe", {"num_key_value_heads": 4}, ("dwdp", "dep")),
            ("mla", "deepseek_v3", {}, ("dwdp", "dep")), ("sliding_sinks", "gpt_oss", {"sliding_window": 4}, ("dwdp", "dep")),
            ("chunked", "llama4", {"attention_chunk_size": 4}, ("dwdp",))]
CASES = [(name, mode) for name, _, _, modes in VARIANTS for mode in modes]


def _rank(rank: int, size: int) -> dict:
    from collections import deque

    from transformers import DynamicCache

    from dwdp.models.tiny import build_tiny_model
    from dwdp.runtime.baselines import DEPModel
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.group import init_group
    from dwdp.runtime.model import DWDPModel
    from dwdp.serve.prefill import InProgress, advance
    from dwdp.serve.protocol import PrefillJob
    from dwdp.serve.scheduling import take_pieces

    group = init_group(size)
    out = {}
    for name, family, overrides, modes in VARIANTS:
        reference = build_tiny_model(family, seed=5, **overrides)
        vocab = reference.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(100 + rank)
        lengths = [20, 3, 7, 1] if rank == 0 else [5, 9, 2, 11]  # same total: the DEP ranks step together
        prompts = [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]
        want = []
        for p in prompts:
            with torch.inference_mode():
                o = reference(input_ids=torch.tensor([p]), cache=DynamicCache(), use_cache=True)
            want.append((int(o.logits[0, -1].argmax()), [(l.keys, l.values) for l in o.cache.layers]))
        for mode in modes:
            model = build_tiny_model(family, seed=5, **overrides)
            wrapped = DWDPModel(model, DWDPConfig(), group) if mode == "dwdp" else DEPModel(model, group)
            pending = deque(PrefillJob(f"r{i}", p, 0.0) for i, p in enumerate(prompts))
            active, got, plans = [], {}, []
            while pending or active:
                plan = take_pieces(active, pending, BUDGET)
                plans.append([n for _, n in plan])
                for state, token, _ in advance(wrapped, plan):
                    got[state.job.request_id] = (token, state.kv, state.chunks)
                active[:] = [s for s in active if not s.is_finished]
            if mode == "dwdp":
                wrapped.close()
            errors = []
            for i, (token, layers) in enumerate(want):
                g_token, g_layers, chunks = got[f"r{i}"]
                kv_err = max(max((k - rk).abs().max().item(), (v - rv).abs().max().item())
                             for (k, v), (rk, rv) in zip(g_layers, layers))
                kv_ok = all(torch.allclose(k, rk, atol=ATOL, rtol=RTOL) and torch.allclose(v, rv, atol=ATOL, rtol=RTOL)
                            and k.shape == rk.shape for (k, v), (rk, rv) in zip(g_layers, layers))
                errors.append({"token": g_token, "want": token, "kv_err": kv_err, "kv_ok": kv_ok,
                               "chunks": list(chunks), "layers": (len(g_layers), len(layers))})
            out[(name, mode)] = {"errors": errors, "plans": plans}
    return out


@pytest.fixture(scope="module")
def results():
    return launch_local(_rank, 2, (2,), timeout_s=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant,mode", CASES)
def test_packed_and_chunked_prompts_equal_each_alone(results, variant, mode):
    for rank, per_rank in enumerate(results):
        r = per_rank[(variant, mode)]
        assert all(sum(plan) <= BUDGET for plan in r["plans"]), r["plans"]
        for i, e in enumerate(r["errors"]):
            where = f"{variant} {mode} rank {rank} prompt {i}: {e}"
            assert e["layers"][0] == e["layers"][1] and e["kv_ok"], where
            assert e["token"] == e["want"], where
        if rank == 0:
            assert r["errors"][0]["chunks"] == [12, 8], r["errors"][0]  # 20 tokens in two forwards
