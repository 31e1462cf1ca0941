"""The startup self-check of packed forwards (dwdp.serve.packcheck): a packing family stays packed
through the wrapper a worker serves with, a mask that lets one prompt see another and a forward that
raises send the worker to padded forwards with the reason, and the families the static refusal
names (doge, diffusion_gemma) do fail the check."""
from __future__ import annotations

import pytest
import torch

from dwdp.models.tiny import build_tiny_model
from dwdp.serve import prefill
from dwdp.serve.config import ServeConfig
from dwdp.serve.packcheck import TOLERANCES, check_packed_forward, worker_forwards
from dwdp.serve.packed import NOT_PACKABLE, packing_support


def _wrapped(model, mode: str):
    """`model` as a one-rank worker of `mode` serves it (None: unwrapped)."""
    if mode == "dwdp":
        from dwdp.runtime.config import DWDPConfig
        from dwdp.runtime.group import DWDPGroup
        from dwdp.runtime.model import DWDPModel

        return DWDPModel(model, DWDPConfig(), DWDPGroup(0, 1))
    if mode == "dep":
        from dwdp.runtime.baselines.dep import DEPModel

        return DEPModel(model)
    return model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["dwdp", "dep"])
def test_a_packing_family_passes_the_self_check_and_stays_packed(mode):
    from dwdp.serve.worker import model_info

    wrapped = _wrapped(build_tiny_model("qwen3_moe", seed=0), mode)
    try:
        check = check_packed_forward(wrapped)
        atol, rtol = TOLERANCES[torch.float32]
        assert check.is_packed and check.reason == "", check
        assert check.max_dlogit <= atol and check.max_dkv <= atol, check
        packing = worker_forwards(wrapped, ServeConfig(), rank=0)
        assert packing == (True, ""), packing
        info = model_info(wrapped, packing)
        assert (info["forwards"], info["padded_reason"]) == ("packed", ""), info
    finally:
        wrapped.close()


@pytest.mark.timeout(60)
def test_a_model_that_ignores_logits_to_keep_passes_with_each_prompts_last_position():
    """qwen3_omni_moe's thinker returns logits at every position: the packed forward must still answer
    each prompt from its own last one (it failed the self-check with max |dlogit| 1.48 before)."""
    model = build_tiny_model("qwen3_omni_moe", seed=0)
    check = check_packed_forward(model)
    assert check.is_packed and check.max_dlogit <= TOLERANCES[torch.float32][0], check


@pytest.mark.timeout(60)
def test_a_mask_that_lets_one_prompt_see_another_sends_the_worker_to_padded(monkeypatch):
    """Regression guard for the mask: every token may see every key of the row, later tokens of its own
    prompt included (attention cuts the row into its prompts, so only a leak within a prompt shows)."""
    model = build_tiny_model("qwen3_moe", seed=0)

    def leaky(config, packed, dtype, device):
        n = packed["q_segment"].numel()
        return torch.ones(n, n, dtype=torch.bool, device=device)[None, None]  # [1, 1, N, N]: no causality at all

    monkeypatch.setattr(prefill, "attention_masks", leaky)
    check = check_packed_forward(model)
    assert not check.is_packed, check
    assert check.reason.startswith("packed self-check: prompt 0: max |dlogit|") and "> tol" in check.reason, check
    assert check.max_dlogit > 1e-2, check
    assert worker_forwards(model, ServeConfig(), rank=0) == (False, check.reason)


@pytest.mark.timeout(60)
def test_a_packed_forward_that_raises_sends_the_worker_to_padded_with_its_first_line():
    model = build_tiny_model("qwen3_moe", seed=0)

    def refuse_rows_of_two_prompts(module, args, kwargs):
        positions = kwargs.get("position_ids")                                  # [1, N], None alone
        if positions is not None and positions[0, -1] < positions.shape[-1] - 1:  # positions restart: packed
            raise RuntimeError("packed rows are not supported here\nsecond line")

    model.model.register_forward_pre_hook(refuse_rows_of_two_prompts, with_kwargs=True)
    check = check_packed_forward(model)
    assert (check.is_packed, check.reason) == (
        False, "packed self-check: RuntimeError: packed rows are not supported here"), check


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,says", [("doge", "router"), ("diffusion_gemma", "canvas")])
def test_families_that_fail_the_self_check_are_refused_statically_with_the_reason(family, says, monkeypatch):
    from dwdp.serve import packcheck

    model = build_tiny_model(family, seed=0)
    check = check_packed_forward(model)
    assert not check.is_packed and check.reason.startswith("packed self-check: prompt 0: max |dlogit|"), check
    assert check.max_dlogit > 0.1, check
    ok, why = packing_support(model.config)
    assert not ok and why.startswith(f"{family}: ") and says in why, why
    assert family in NOT_PACKABLE
    monkeypatch.setattr(packcheck, "check_packed_forward", lambda model: pytest.fail("the self-check ran"))
    assert worker_forwards(model, ServeConfig(), rank=0) == (False, why)  # no startup forward spent on them


def test_forwards_padded_asked_for_skips_the_self_check(monkeypatch):
    from dwdp.serve import packcheck

    model = build_tiny_model("qwen3_moe", seed=0)
    monkeypatch.setattr(packcheck, "check_packed_forward", lambda model: pytest.fail("the self-check ran"))
    packing = worker_forwards(model, ServeConfig(forwards="padded"), rank=0)
    assert packing == (False, "padded forwards asked for (forwards='padded')"), packing
