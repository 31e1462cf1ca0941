"""The serving queueing simulation on plans small enough to work out by hand."""
from __future__ import annotations

import dataclasses
from collections import deque

import pytest

from dwdp.predict.costmodel import OutsideForward
from dwdp.predict.serve_sim import (Service, fitted_service, line_service, simulate_dep_serving, simulate_dwdp_serving,
                                    summarise_ttft, take_lengths)


def flat(forward_s: float = 1.0, per_token_s: float = 0.0) -> Service:
    padded = lambda lengths: len(lengths) * max(lengths) if lengths else 0  # noqa: E731
    return Service(lambda lengths: forward_s + per_token_s * padded(lengths),
                   lambda per_rank: forward_s + per_token_s * max(padded(x) for x in per_rank), {"dwdp": 0.5},
                   "test")


@pytest.mark.timeout(10)
def test_spaced_arrivals_wait_for_nothing():
    plan = [(0.0, 10), (5.0, 10), (10.0, 10)]
    for run in (simulate_dwdp_serving, simulate_dep_serving):
        assert [end - a for a, end in run(plan, 2, 64, flat())] == [1.0, 1.0, 1.0], run.__name__


@pytest.mark.timeout(10)
def test_dep_waits_for_the_step_in_flight_dwdp_does_not():
    """Two prompts 0.1 s apart land on the two ranks: DWDP's second rank starts at once; DEP's second
    prompt waits for the running step to end, then steps (its peer idle)."""
    plan = [(0.0, 10), (0.1, 10)]
    assert sorted(simulate_dwdp_serving(plan, 2, 64, flat())) == [(0.0, 1.0), (0.1, 1.1)]
    assert sorted(simulate_dep_serving(plan, 2, 64, flat())) == [(0.0, 1.0), (0.1, 2.0)]


@pytest.mark.timeout(10)
def test_queued_prompts_share_a_forward_within_the_budget():
    """Four prompts at once on one rank (ranks=1): 3 x 20 fit 64, the fourth runs next."""
    plan = [(0.0, 20), (0.0, 20), (0.0, 20), (0.0, 20)]
    ends = sorted(end for _, end in simulate_dwdp_serving(plan, 1, 64, flat()))
    assert ends == [1.0, 2.0, 2.0, 2.0], ends  # the first alone (it arrived to an idle rank), then three
    assert [n for _, n in take_lengths(deque([(0, 5), (0, 30), (0, 2)]), 64)] == [5, 30]


@pytest.mark.timeout(10)
def test_summary_adds_the_overhead_and_counts_tokens():
    plan = [(0.0, 10), (1.0, 30)]
    row = summarise_ttft(plan, [(0.0, 1.0), (1.0, 2.0)], 0.5, 1.0, 2)
    assert row["ttft_p50_s"] == pytest.approx(1.5) and row["tokens_per_s_per_rank"] == pytest.approx(40 / 2.5 / 2)


@pytest.mark.timeout(10)
def test_fitted_service_recovers_the_measured_lines():
    def rows(a, b):
        samples = [{"ok": True, "batch_tokens": t, "prefill_s": a + b * t, "ttft_s": a + b * t + 0.3, "queue_s": 0.2}
                   for t in (100, 300, 700)]
        return {"rows": [{"samples": samples}]}

    service = fitted_service({"mix": {"dwdp": rows(0.01, 1e-3), "dep": rows(0.02, 5e-4)}}, "mix")
    assert service.forward_s([100, 50]) == pytest.approx(0.01 + 1e-3 * 200)
    assert service.step_s([[100], [], [300, 10]]) == pytest.approx(0.02 + 5e-4 * 600)
    assert service.overhead_s["dep"] == pytest.approx(0.1)


def packed_flat(forward_s: float = 1.0, per_token_s: float = 0.0) -> Service:
    return Service(lambda lengths: forward_s + per_token_s * sum(lengths),
                   lambda per_rank: forward_s + per_token_s * max(sum(x) for x in per_rank), {}, "test", packed=True)


@pytest.mark.timeout(10)
def test_packed_forwards_fill_the_budget_and_count_no_padding():
    """Five prompts of 20 at once on one rank, budget 64: packed, the first alone (it arrived to an
    idle rank), then 20 + 20 + 20 + 4 of the fifth, whose last 16 end one forward later."""
    plan = [(0.0, 20)] * 5
    counts = {}
    ends = sorted(end for _, end in simulate_dwdp_serving(plan, 1, 64, packed_flat(), counts))
    assert ends == [1.0, 2.0, 2.0, 2.0, 3.0], ends
    assert counts == {"computed": 100, "real": 100}, counts
    padded = {}
    simulate_dwdp_serving([(0.0, 10), (0.0, 10), (0.0, 30)], 1, 64, flat(), padded)
    assert padded == {"computed": 10 + 2 * 30, "real": 50}, padded  # the first alone, then 10 padded to 30


@pytest.mark.timeout(10)
@pytest.mark.parametrize("run", [simulate_dwdp_serving, simulate_dep_serving])
def test_a_long_prompt_takes_one_forward_per_chunk(run):
    """100 tokens, budget 40: three forwards of 1 s (40, 40, 20); its TTFT is the third's end."""
    assert run([(0.0, 100)], 2, 40, packed_flat()) == [(0.0, 3.0)]


@pytest.mark.timeout(10)
def test_time_outside_the_forward_holds_the_rank():
    """One rank, two 40-token prompts at once (budget 64: a forward each), 1 s forwards, then 10 ms
    per token of KV hand-off (a prompt is answered after it) and 0.5 s of host work: answers at 1.4
    and 3.3 s, the second forward starting at 1.9 s, not 1 s. A DEP step pays the host time once and
    the hand-off of its busiest rank: the first step runs 10 tokens (answered at 1.1, over at 1.6), the
    second 20 on one rank and 30 on the other (answered 0.2 and 0.3 s after its forward, over 0.8 s
    after it)."""
    host = OutsideForward(host_s=0.5, kv_s_per_token=0.01)
    service = dataclasses.replace(packed_flat(), outside={"dwdp": host, "dep": host})
    plan = [(0.0, 40), (0.0, 40)]
    ends = sorted(end for _, end in simulate_dwdp_serving(plan, 1, 64, service))
    assert ends == pytest.approx([1.4, 3.3]), ends
    assert sorted(end for _, end in simulate_dwdp_serving(plan, 1, 64, packed_flat())) == [1.0, 2.0]
    ends = sorted(end for _, end in simulate_dep_serving([(0.0, 10), (0.0, 30), (0.0, 20), (2.0, 10)], 2, 64,
                                                         service))
    assert ends == pytest.approx([1.1, 2.8, 2.9, 4.5]), ends  # the last arrives mid-step: its step starts at 3.4


@pytest.mark.timeout(10)
def test_line_service_runs_the_measured_lines():
    host = OutsideForward(host_s=0.02)
    service = line_service({"dwdp": (0.01, 1e-3), "dep": (0.02, 5e-4)}, {"dwdp": host}, {"dwdp": 0.1}, True, "test")
    assert service.forward_s([100, 50]) == pytest.approx(0.01 + 1e-3 * 150)
    assert service.step_s([[100], [], [300, 10]]) == pytest.approx(0.02 + 5e-4 * 310)
    assert service.outside_s("dwdp", [[100]]) == pytest.approx(0.02) and service.outside_s("dep", [[100]]) == 0.0


@pytest.fixture(scope="module")
def analytic():
    """DeepSeek-R1 on GB200-NVL72 (the defaults), group 4, its analytic services and cost model parts."""
    from dwdp.predict import costmodel as cm
    from dwdp.predict.serve_sim import analytic_service
    from dwdp.predict.simulate import SimConfig, simulate

    cfg = SimConfig(iterations=20, seed=3)
    spec, hw, cal = cm.load_model(cfg.model), cm.load_hardware(cfg.hardware), cm.load_calibration()
    return {"cfg": cfg, "spec": spec, "hw": hw, "cal": cal, "stretch": simulate(cfg, cal).stretch,
            "padded": analytic_service(cfg), "packed": analytic_service(cfg, packed=True)}


def _shape(per_rank: list[list[int]], windows):
    """A forward's shape by hand: [1, G] tokens, and per window the causal pairs of each piece summed."""
    import numpy as np

    from dwdp.predict import costmodel as cm

    tokens = np.array([[float(sum(p)) for p in per_rank]])
    pairs = {w: np.array([[sum(float(np.sum(cm.causal_pairs(np.array([n]), w))) for n in p) for p in per_rank]])
             for w in windows}
    return cm.ForwardShape(tokens, pairs, {w: tokens.copy() for w in windows})


@pytest.mark.timeout(120)
def test_the_analytic_service_is_the_cost_models_forward_step_and_outside_by_hand(analytic):
    """Forwards: simulate_dwdp of the forward's own shape (padded: P x Tmax; packed: the pieces as they are)
    at the simulated copy stretch; steps: simulate_dep of every rank's shape; both modes pay, after each
    forward or step, the calibration's host and other time and the KV hand-off of the busiest rank's real
    tokens at the copy engines' rate, (kv_lora_rank + rope dims) x layers x 2 bytes a token for MLA."""
    import numpy as np

    from dwdp.predict.simulate import simulate_dep, simulate_dwdp

    spec, hw, cal, cfg = analytic["spec"], analytic["hw"], analytic["cal"], analytic["cfg"]
    windows = sorted(set(spec.window), key=lambda w: -1 if w is None else w)
    for kind, padded_as in (("padded", [[3000, 3000]]), ("packed", [[3000, 1200]])):
        got = analytic[kind].forward_s([3000, 1200])
        _, rank_time, _ = simulate_dwdp(spec, hw, cfg.deployment, cal, _shape(padded_as, windows), analytic["stretch"])
        assert got == pytest.approx(float(rank_time[0, 0]), rel=1e-12), kind
    per_rank = [[2000], [], [500, 700], [4000]]
    fresh = np.random.default_rng(cfg.seed)  # the service's own generator, first drawn here too
    _, step = simulate_dep(spec, hw, cfg.deployment, cal, _shape([[2000], [], [700, 700], [4000]], windows), fresh)
    assert analytic["padded"].step_s(per_rank) == pytest.approx(float(step[0]), rel=1e-12)
    kv_s = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * spec.num_layers * 2 / hw.copy_bytes_per_s
    assert kv_s > 0 and cal.outside_host_s + cal.outside_other_s > 0
    for mode in ("dwdp", "dep"):
        assert analytic["packed"].outside_s(mode, per_rank) == pytest.approx(
            cal.outside_host_s + cal.outside_other_s + 4000 * kv_s, rel=1e-12), mode
        assert analytic["packed"].handoff_s(mode, [500, 700]) == pytest.approx(1200 * kv_s, rel=1e-12), mode


@pytest.mark.timeout(120)
def test_a_dep_step_holds_the_group_for_its_time_outside_before_the_next(analytic):
    """Two prompts a microsecond apart on DEP: the second waits for the first step and the time outside it,
    then is answered after its own step and its hand-off."""
    steps = []  # a DEP step's time draws on the routing's randomness: keep what each step took

    def step_s(per_rank):
        steps.append(analytic["packed"].step_s(per_rank))
        return steps[-1]

    service = dataclasses.replace(analytic["packed"], step_s=step_s)
    n = 2000
    (_, end1), (_, end2) = sorted(simulate_dep_serving([(0.0, n), (1e-6, n)], 4, 8192, service))
    assert len(steps) == 2 and min(steps) > 0, steps
    handoff, outside = service.handoff_s("dep", [n]), service.outside_s("dep", [[n]])
    assert handoff > 0 and outside > handoff
    assert end1 == pytest.approx(steps[0] + handoff, rel=1e-9)
    assert end2 == pytest.approx(steps[0] + outside + steps[1] + handoff, rel=1e-9), (end1, end2, steps)
