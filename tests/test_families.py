"""Every MoE family of the installed transformers, discovered from transformers itself, wrapped on 2
ranks of one process group: logits equal to the unwrapped model's on two forwards, bytes copied.

A family transformers adds shows up here as a new case. Families dwdp refuses are listed with the
reason below, and the list is asserted, so coverage cannot silently shrink (or grow unnoticed). On a
release older than the pinned one, the families it is known not to ship (tests/releases.py) are the
only ones allowed to be missing.
"""
from pathlib import Path

import pytest
import transformers

from dwdp.benchmarks.family_sweep import sweep_rank
from dwdp.models.families import moe_families
from dwdp.runtime.coverage import TABLE_PAGE, markdown, table_block, table_version
from dwdp.runtime.group import launch_local
from dwdp.runtime.transport.host_composite import composite_unsupported_reason
from logits_check import check_logits
from releases import PINNED_VERSION, absent_here, pinned_families

FAMILIES = [f.name for f in moe_families()]
# family -> what the refusal names (module class, and the attribute that stops it)
REFUSED = {
    # product-key experts: one [E, H] embedding row per expert, not stacked weights
    "doge": "DogeCDMoE) cannot be wrapped: down_embed.weight",
    # experts (of the MLP and of the attention) driven by (inputs, expert_size)
    "jetmoe": "JetMoeMoE) cannot be wrapped: input_linear.weight [8, 96, 32] is driven by "
              "JetMoeParallelExperts.forward(inputs, expert_size)",
}


@pytest.fixture(scope="module")
def sweep():
    """Each rank's outcomes; how long the sweep takes is bench/family_sweep.py's figure, not asserted here."""
    return launch_local(sweep_rank, 2, (FAMILIES,), timeout_s=400)


def test_families_are_discovered_from_transformers():
    absent = absent_here()
    missing = sorted(set(pinned_families()) - set(FAMILIES) - set(absent))
    assert not missing, (f"families of transformers {PINNED_VERSION} (family table) not discovered in "
                         f"{transformers.__version__}: {missing}")
    assert len(FAMILIES) >= 70 - len(absent), f"only {len(FAMILIES)} MoE families found: {FAMILIES}"
    for known in ("gpt_oss", "mixtral", "llama4", "dbrx", "longcat_flash", "qwen3_vl_moe", "step3p7", "doge"):
        assert known in FAMILIES, f"{known} missing from the discovered families {FAMILIES}"


@pytest.mark.timeout(450)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_wraps_and_matches_unwrapped(sweep, family):
    ranks = sweep
    for rank, out in enumerate(ranks):
        r = out["results"][family]
        assert "error" not in r, f"{family} rank {rank}: {r['error']}"
        if family in REFUSED:
            assert REFUSED[family] in r.get("refused", ""), f"{family} rank {rank}: expected refusal, got {r}"
            continue
        assert "refused" not in r, f"{family} rank {rank}: refused: {r.get('refused')}"
        check_logits(family, dict(diff=max(r["diff"], r["diff_again"]), scale=r["scale"]), rank)
        assert r["bytes_copied"] > 0, f"{family} rank {rank}: nothing was prefetched ({r})"
        # The default mode on Linux is composite views (tests/test_composite_model.py runs the other).
        if composite_unsupported_reason() is None:
            assert r["kernel"] == "composite", f"{family} rank {rank}: ran {r['kernel']!r}, not composite views"


@pytest.mark.timeout(120)
def test_a_family_that_cannot_be_built_fails_alone():
    """A family whose tiny config raises (on one rank only, the harder case) is reported with its error;
    the families before and after it still wrap and match."""
    ranks = launch_local(sweep_rank, 2, (["mixtral", "olmoe", "qwen3_moe"], ("olmoe",)), timeout_s=100)
    for rank, out in enumerate(ranks):
        results = out["results"]
        assert "planted: the tiny config of olmoe raises" in results["olmoe"].get("error", ""), (rank, results["olmoe"])
        for family in ("mixtral", "qwen3_moe"):
            r = results[family]
            assert "error" not in r and "refused" not in r, (rank, family, r)
            check_logits(family, dict(diff=max(r["diff"], r["diff_again"]), scale=r["scale"]), rank)
    assert not ranks[0]["results"]["olmoe"]["coverage"].built


@pytest.mark.timeout(450)
def test_refused_families_are_exactly_the_listed_ones(sweep):
    ranks = sweep
    refused = {f: r["refused"] for f, r in ranks[0]["results"].items() if "refused" in r}
    assert sorted(refused) == sorted(REFUSED), f"refused families changed: {refused}"
    wrapped = len(FAMILIES) - len(refused)
    floor = 68 - len(absent_here())  # families a release does not ship cannot wrap
    assert wrapped >= floor, f"only {wrapped} of {len(FAMILIES)} families wrap (at least {floor} expected)"


@pytest.mark.timeout(450)
def test_docs_family_table_is_generated(sweep):
    ranks = sweep
    rows = [ranks[0]["results"][f]["coverage"] for f in FAMILIES]
    page = (Path(__file__).parent.parent / TABLE_PAGE).read_text()
    generated_with = table_version(page)
    if generated_with != transformers.__version__:
        pytest.skip(f"the family table of {TABLE_PAGE} is for transformers {generated_with}; this is "
                    f"{transformers.__version__} (the constraints file pins the table's version)")
    assert table_block(page) == markdown(rows), (
        f"the family table of {TABLE_PAGE} is stale: paste `dwdp families --markdown` over its block"
    )
