"""Every MoE family of the installed transformers, discovered from transformers itself, wrapped on 2
ranks of one process group: logits equal to the unwrapped model's on two forwards, bytes copied.

A family transformers adds shows up here as a new case. Families dwdp refuses are listed with the
reason below, and the list is asserted, so coverage cannot silently shrink (or grow unnoticed).
"""
import time
from pathlib import Path

import pytest
import torch

from dwdp.adapters import Unsupported
from dwdp.config import DWDPConfig
from dwdp.coverage import coverage_of, markdown, readme_block
from dwdp.families import moe_families
from dwdp.group import init_group, launch_local
from dwdp.model import DWDPModel
from dwdp.tiny import build_tiny_model
from logits_check import check_logits

FAMILIES = [f.name for f in moe_families()]
# family -> what the refusal names (module class, and the attribute that stops it)
REFUSED = {
    # product-key experts: one [E, H] embedding row per expert, not stacked weights
    "doge": "DogeCDMoE) cannot be wrapped: down_embed.weight",
    # experts (of the MLP and of the attention) driven by (inputs, expert_size)
    "jetmoe": "JetMoeMoE) cannot be wrapped: input_linear.weight [8, 96, 32] is driven by "
              "JetMoeParallelExperts.forward(inputs, expert_size)",
}
SWEEP_BUDGET_S = 90.0


def _forward(model, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits (or the last hidden state of a model without a head) of one forward. Seeded: a block
    diffusion model draws its canvas at random when none is given."""
    torch.manual_seed(seed)
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def _sweep_rank(rank: int, families: list[str]) -> dict:
    torch.set_num_threads(1)
    group = init_group()
    start = time.perf_counter()
    results = {}
    for i, family in enumerate(families):
        model = build_tiny_model(family, seed=i)
        coverage = coverage_of(family, model) if rank == 0 else None
        gen = torch.Generator().manual_seed(1000 * rank + i)
        ids = torch.randint(3, 128, (2, 5 + 2 * rank), generator=gen)  # this rank's own batch
        with torch.no_grad():
            reference = _forward(model, ids, i)
        try:
            wrapped = DWDPModel(model, DWDPConfig(slice_bytes=4096), group)
        except Unsupported as exc:
            results[family] = dict(refused=str(exc), coverage=coverage)
            continue
        with wrapped, torch.no_grad():
            got = _forward(wrapped, ids, i)
            again = _forward(wrapped, ids, i)  # second forward: slots reused across forwards
            copied = wrapped.stats.bytes_copied
        results[family] = dict(
            diff=(got - reference).abs().max().item(), diff_again=(again - reference).abs().max().item(),
            scale=reference.abs().max().item(), bytes_copied=copied, layers=len(wrapped.experts_layers),
            coverage=coverage,
        )
    return dict(results=results, seconds=time.perf_counter() - start)


@pytest.fixture(scope="module")
def sweep():
    start = time.perf_counter()
    ranks = launch_local(_sweep_rank, 2, (FAMILIES,), timeout_s=400)
    return ranks, time.perf_counter() - start


def test_families_are_discovered_from_transformers():
    assert len(FAMILIES) >= 70, f"only {len(FAMILIES)} MoE families found: {FAMILIES}"
    for known in ("gpt_oss", "mixtral", "llama4", "dbrx", "longcat_flash", "qwen3_vl_moe", "step3p7", "doge"):
        assert known in FAMILIES, f"{known} missing from the discovered families {FAMILIES}"


@pytest.mark.timeout(450)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_wraps_and_matches_unwrapped(sweep, family):
    ranks, _ = sweep
    for rank, out in enumerate(ranks):
        r = out["results"][family]
        if family in REFUSED:
            assert REFUSED[family] in r.get("refused", ""), f"{family} rank {rank}: expected refusal, got {r}"
            continue
        assert "refused" not in r, f"{family} rank {rank}: refused: {r.get('refused')}"
        check_logits(family, dict(diff=max(r["diff"], r["diff_again"]), scale=r["scale"]), rank)
        assert r["bytes_copied"] > 0, f"{family} rank {rank}: nothing was prefetched ({r})"


@pytest.mark.timeout(450)
def test_refused_families_are_exactly_the_listed_ones(sweep):
    ranks, _ = sweep
    refused = {f: r["refused"] for f, r in ranks[0]["results"].items() if "refused" in r}
    assert sorted(refused) == sorted(REFUSED), f"refused families changed: {refused}"
    wrapped = len(FAMILIES) - len(refused)
    assert wrapped >= 68, f"only {wrapped} of {len(FAMILIES)} families wrap"


@pytest.mark.timeout(450)
def test_sweep_fits_its_time_budget(sweep):
    ranks, wall = sweep
    slowest = max(out["seconds"] for out in ranks)
    assert wall <= SWEEP_BUDGET_S, f"family sweep took {wall:.1f} s (ranks {slowest:.1f} s) > {SWEEP_BUDGET_S} s"


@pytest.mark.timeout(450)
def test_readme_family_table_is_generated(sweep):
    ranks, _ = sweep
    rows = [ranks[0]["results"][f]["coverage"] for f in FAMILIES]
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert readme_block(readme) == markdown(rows), (
        "README family table is stale: regenerate it with `dwdp families --markdown`"
    )
