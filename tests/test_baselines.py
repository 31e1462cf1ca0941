"""DEP and replicated baselines across real processes equal the unwrapped model."""
import pytest
import torch

from dwdp.runtime.baselines import DEPModel, ReplicatedModel, expert_split
from dwdp.runtime.baselines.dep import waits_from_calls
from dwdp.runtime.group import DWDPGroup, init_group, launch_local
from dwdp.models.tiny import build_tiny_model
from logits_check import BF16_ATOL, BF16_RTOL, check_logits

FAMILIES = ("mixtral", "deepseek_v3", "qwen2_moe")


def _tokens(rank: int, batch: int, length: int, vocab: int = 128) -> dict:
    gen = torch.Generator().manual_seed(200 + rank)
    return {"input_ids": torch.randint(3, vocab, (batch, length), generator=gen)}


def _diff(got: torch.Tensor, reference: torch.Tensor) -> dict:
    return {"diff": (got - reference).abs().max().item(), "scale": reference.abs().max().item()}


def _moe_layers(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))


def _dep_case(model, inputs: dict, group, extra_forward: bool) -> dict:
    """DEP output on this rank's own inputs; `extra_forward` ranks run a second forward while the
    others run an idle step in the same step."""
    with torch.no_grad():
        reference = model(**inputs).logits
        full = sum(t.numel() for m in model.modules() if hasattr(m, "gate_up_proj")
                   for t in (m.gate_up_proj, m.down_proj))
        layers = _moe_layers(model)
        wrapped = DEPModel(model, group)
        got = wrapped(**inputs).logits
        if extra_forward:
            again = wrapped(**inputs).logits
        else:
            wrapped.idle_step()
            again = got
    local = sum(t.numel() for m in wrapped.experts_modules for t in (m.gate_up_proj, m.down_proj))
    out = _diff(torch.stack([got, again]), torch.stack([reference, reference]))
    out.update(calls=len(wrapped.stats.call_s), layers=layers, local_fraction=local / full,
               memory=wrapped.memory, idle_steps=wrapped.stats.idle_steps)
    return out


def _replicated_case(model, inputs: dict) -> dict:
    with torch.no_grad():
        reference = model(**inputs).logits
        wrapped = ReplicatedModel(model)
        out = _diff(wrapped(**inputs).logits, reference)
    out["memory"] = wrapped.memory
    return out


def _group_rank(rank: int, group_size: int) -> dict:
    group = init_group(group_size)
    out = {}
    for family in FAMILIES:
        # Different lengths per rank: the all-to-all splits differ in both directions.
        inputs = _tokens(rank, 2, 5 + 3 * rank)
        out[f"dep_{family}"] = _dep_case(build_tiny_model(family, seed=7), inputs, group, extra_forward=rank == 0)
        out[f"replicated_{family}"] = _replicated_case(build_tiny_model(family, seed=7), inputs)
    # One token on the last rank and top-1 of 8 experts: most experts get no row from anyone.
    one = _tokens(rank, 1, 1 if rank == group_size - 1 else 2)
    out["dep_zero_tokens_for_some_experts"] = _dep_case(
        build_tiny_model("mixtral", seed=3, top_k=1), one, group, extra_forward=False)
    # Experts not divisible by the group size: uneven expert ranges.
    out["dep_uneven_split"] = _dep_case(
        build_tiny_model("qwen3_moe", seed=4, num_experts=7), _tokens(rank, 3, 4), group, extra_forward=rank == 1)
    out["dep_bf16"] = _dep_case(
        build_tiny_model("deepseek_v3", seed=5, dtype=torch.bfloat16), _tokens(rank, 2, 6), group, extra_forward=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda g: f"G{g}")
def group_results(request):
    group_size = request.param
    return group_size, launch_local(_group_rank, group_size, (group_size,), timeout_s=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_dep_equals_unwrapped(group_results, family):
    group_size, results = group_results
    for rank, per_rank in enumerate(results):
        r = per_rank[f"dep_{family}"]
        check_logits(f"dep {family}", r, rank)
        # Two steps (a forward, then a forward or an idle step), three all-to-alls per MoE layer each.
        assert r["calls"] == 2 * 3 * r["layers"], (family, rank, r["calls"], r["layers"])
        assert r["idle_steps"] == (0 if rank == 0 else 1), (family, rank, r["idle_steps"])
        starts = expert_split(8, group_size)
        share = (starts[rank + 1] - starts[rank]) / 8
        assert r["local_fraction"] == pytest.approx(share), (family, rank, r["local_fraction"], share)
        assert r["memory"].local_expert_bytes == r["memory"].full_expert_bytes * share, (family, rank, r["memory"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_replicated_equals_unwrapped(group_results, family):
    _, results = group_results
    for rank, per_rank in enumerate(results):
        r = per_rank[f"replicated_{family}"]
        check_logits(f"replicated {family}", r, rank)
        assert r["memory"].local_expert_bytes == r["memory"].full_expert_bytes
        assert r["memory"].prefetch_buffer_bytes == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["dep_zero_tokens_for_some_experts", "dep_uneven_split"])
def test_dep_awkward_cases(group_results, case):
    group_size, results = group_results
    for rank, per_rank in enumerate(results):
        check_logits(case, per_rank[case], rank)
    if case == "dep_uneven_split":
        starts = expert_split(7, group_size)
        got = [round(per_rank[case]["local_fraction"] * 7) for per_rank in results]
        assert got == [b - a for a, b in zip(starts, starts[1:])], (got, starts)


@pytest.mark.timeout(240)
def test_dep_bf16(group_results):
    _, results = group_results
    for rank, per_rank in enumerate(results):
        check_logits("dep bf16", per_rank["dep_bf16"], rank, BF16_ATOL, BF16_RTOL)


def test_dep_one_rank_needs_no_collective():
    model = build_tiny_model("olmoe", seed=2)
    inputs = _tokens(0, 2, 7)
    r = _dep_case(model, inputs, DWDPGroup(rank=0, size=1), extra_forward=True)
    check_logits("dep one rank", r, 0)
    assert r["calls"] == 0 and r["local_fraction"] == 1.0


def test_expert_split_is_contiguous_and_disjoint():
    for experts in (1, 7, 8, 64):
        for group_size in range(1, min(experts, 9) + 1):
            starts = expert_split(experts, group_size)
            sizes = [b - a for a, b in zip(starts, starts[1:])]
            assert starts[0] == 0 and starts[-1] == experts and min(sizes) >= 1, (experts, group_size, starts)
            assert max(sizes) - min(sizes) <= 1, (experts, group_size, sizes)
    with pytest.raises(ValueError):
        expert_split(4, 5)


def test_waits_from_calls_charge_the_early_ranks():
    # Call 0: rank 1 arrived last (0.1 s, pure transfer); call 1: rank 0 did.
    waits = waits_from_calls([[0.5, 0.1], [0.1, 0.4]])
    assert waits == pytest.approx([0.4, 0.3]), waits
    with pytest.raises(ValueError):
        waits_from_calls([[0.1], [0.1, 0.2]])


def test_dep_function_needs_the_wrapper():
    model = build_tiny_model("mixtral", seed=1)
    from dwdp.runtime.baselines.dep import dep_experts_forward

    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    with pytest.raises(RuntimeError, match="not wrapped by DEPModel"):
        dep_experts_forward(experts, torch.zeros(1, 32), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
