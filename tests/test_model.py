"""DWDPModel across real processes equals the unwrapped model, for every family and group size."""
import gc
import weakref

import pytest
import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import FAMILIES, build_tiny_model
from logits_check import BF16_ATOL, BF16_RTOL, check_logits



def _compare(model, inputs: dict, config: DWDPConfig, group) -> dict:
    with torch.no_grad():
        reference = model(**inputs).logits
    stacked = weakref.ref(model.get_submodule(_first_experts(model)).gate_up_proj)
    full_expert_bytes = _expert_bytes(model)
    with DWDPModel(model, config, group) as wrapped, torch.no_grad():
        got = wrapped(**inputs).logits
        again = wrapped(**inputs).logits  # second forward: slots reused across forwards
        memory, stats = wrapped.memory, wrapped.stats
        local_bytes = _expert_bytes(model)
    gc.collect()
    return {
        "diff": max((got - reference).abs().max().item(), (again - reference).abs().max().item()),
        "scale": reference.abs().max().item(),
        "stacked_freed": stacked() is None,
        "full_expert_bytes": full_expert_bytes,
        "local_expert_bytes": local_bytes,
        "memory_full": memory.full_expert_bytes,
        "bytes_copied": stats.bytes_copied,
        "plans_issued": stats.plans_issued,
        "slot_hits": stats.slot_hits,
        "moe_layers": sum(1 for m in model.modules() if hasattr(m, "gate_up_proj")),
    }


def _first_experts(model) -> str:
    return next(n for n, m in model.named_modules() if hasattr(m, "gate_up_proj"))


def _expert_bytes(model) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in model.modules() if hasattr(m, "gate_up_proj")
        for t in (m.gate_up_proj, m.down_proj)
    )


def _tokens(rank: int, batch: int, length: int, vocab: int = 128) -> dict:
    gen = torch.Generator().manual_seed(100 + rank)
    return {"input_ids": torch.randint(3, vocab, (batch, length + rank), generator=gen)}


def _group_rank(rank: int, group_size: int) -> dict:
    group = init_group(group_size)
    out = {}
    for family in FAMILIES:
        model = build_tiny_model(family, seed=7)
        # The multi-buffer path, explicitly: its slot bookkeeping is what test_family_equals_unwrapped
        # counts; the default (composite views) runs every family in tests/test_families.py and the
        # awkward cases below.
        out[family] = _compare(model, _tokens(rank, 2, 9), DWDPConfig(slice_bytes=4096, experts_kernel="reference"),
                               group)
    awkward = {
        "one_token": (dict(), _tokens(rank, 1, 1 - rank), {}),
        "zero_tokens_for_some_experts": (dict(num_experts=8, top_k=1), _tokens(rank, 1, 2 - rank), {}),
        "slice_larger_than_expert": (dict(), _tokens(rank, 2, 5), dict(slice_bytes=1 << 24)),
        "slice_not_dividing_expert": (dict(), _tokens(rank, 2, 5), dict(slice_bytes=1000)),
        "more_local_experts": (dict(), _tokens(rank, 2, 5), dict(num_local_experts=min(8, -(-8 // group_size) + 2))),
    }
    for name, (model_kwargs, inputs, cfg) in awkward.items():
        model = build_tiny_model("mixtral", seed=3, **model_kwargs)
        out[name] = _compare(model, inputs, DWDPConfig(**cfg), group)
    model = build_tiny_model("deepseek_v3", seed=5, dtype=torch.bfloat16)
    out["bf16"] = _compare(model, _tokens(rank, 2, 9), DWDPConfig(), group)
    model = build_tiny_model("qwen3_moe", seed=9)
    prompt = _tokens(rank, 1, 6)["input_ids"]
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=4, do_sample=False)
    with DWDPModel(model, DWDPConfig(), group) as wrapped, torch.no_grad():
        generated = wrapped.generate(prompt, max_new_tokens=4, do_sample=False)
    out["generate_equal"] = torch.equal(reference, generated)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda g: f"G{g}")
def group_results(request):
    group_size = request.param
    return group_size, launch_local(_group_rank, group_size, (group_size,), timeout_s=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_unwrapped(group_results, family):
    group_size, results = group_results
    for rank, per_rank in enumerate(results):
        r = per_rank[family]
        check_logits(family, r, rank)
        assert r["stacked_freed"], f"{family} rank {rank}: the stacked [E, ...] experts were not freed"
        lowest = -(-8 // group_size)
        assert r["local_expert_bytes"] == r["full_expert_bytes"] * lowest // 8, (family, rank, r)
        # Two forwards with two slots, worked by hand (tests/test_prefetch.py has the slot-by-slot
        # walk): 3 MoE layers refill the other slot at every visit, 1 + 2 x 3 copies; 2 MoE layers
        # keep layer l in slot l after the first visit, so 2 copies and 3 hits.
        copies, hits = {3: (7, 0), 2: (2, 3)}[r["moe_layers"]]
        remote_layer_bytes = (8 - lowest) * r["full_expert_bytes"] // (8 * r["moe_layers"])
        got = (r["plans_issued"], r["slot_hits"], r["bytes_copied"])
        assert got == (copies, hits, copies * remote_layer_bytes), (family, rank, got, copies, hits, remote_layer_bytes)


AWKWARD = ["one_token", "zero_tokens_for_some_experts", "slice_larger_than_expert", "slice_not_dividing_expert",
           "more_local_experts"]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", AWKWARD)
def test_awkward_cases(group_results, case):
    _, results = group_results
    for rank, per_rank in enumerate(results):
        check_logits(case, per_rank[case], rank)


@pytest.mark.timeout(450)
def test_bf16_and_generate(group_results):
    _, results = group_results
    for rank, per_rank in enumerate(results):
        check_logits("bf16", per_rank["bf16"], rank, BF16_ATOL, BF16_RTOL)
        assert per_rank["generate_equal"], f"rank {rank}: generate() differs from the unwrapped model"
