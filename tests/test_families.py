"""Every MoE family of the installed transformers, discovered from transformers itself, wrapped on 2
ranks of one process group: logits equal to the unwrapped model's on two forwards, bytes copied.

A family transformers adds shows up here as a new case. Families dwdp refuses are listed with the
reason below, and the list is asserted, so coverage cannot silently shrink (or grow unnoticed). On a
release older than the pinned one, the families it is known not to ship (tests/releases.py) are the
only ones allowed to be missing.
"""
import time
import traceback
from pathlib import Path

import pytest
import torch
import transformers

from dwdp.models.adapters import Unsupported, find_experts
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.coverage import TABLE_PAGE, coverage_of, markdown, not_built, table_block, table_version
from dwdp.models.families import moe_families
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model
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
SWEEP_BUDGET_S = 90.0


def _forward(model, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits (or the last hidden state of a model without a head) of one forward. Seeded: a block
    diffusion model draws its canvas at random when none is given."""
    torch.manual_seed(seed)
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def _try_family(rank: int, index: int, family: str, group, broken: tuple[str, ...]) -> dict:
    """One family's outcome on this rank: refused, or its logits against the unwrapped model's.

    Building is agreed on by every rank before anything collective (wrapping exchanges handles), so a
    family that cannot be built on one rank is skipped by all of them instead of hanging the others."""
    model = build_error = None
    try:
        if family in broken and rank == 0:
            raise ValueError(f"planted: the tiny config of {family} raises on rank {rank}")
        model = build_tiny_model(family, seed=index)
    except Exception as exc:
        build_error = exc
    errors = group.all_gather_object(None if build_error is None else f"{type(build_error).__name__}: {build_error}")
    coverage = None
    if rank == 0:
        coverage = not_built(family, build_error) if build_error is not None else coverage_of(family, model)
    if any(errors):
        failed = {r: e for r, e in enumerate(errors) if e}
        return dict(error=f"not built on ranks {sorted(failed)}: {next(iter(failed.values()))}", coverage=coverage)
    try:
        # What DWDPModel checks first, before the unwrapped forward: a refused family's own forward need
        # not run (Doge's MoE model of transformers 5.17 raises in its decoder layer).
        find_experts(model)
    except Unsupported as exc:
        return dict(refused=str(exc), coverage=coverage)
    gen = torch.Generator().manual_seed(1000 * rank + index)
    ids = torch.randint(3, 128, (2, 5 + 2 * rank), generator=gen)  # this rank's own batch
    try:
        with torch.no_grad():
            reference = _forward(model, ids, index)
        wrapped = DWDPModel(model, DWDPConfig(slice_bytes=4096), group)
    except Unsupported as exc:
        return dict(refused=str(exc), coverage=coverage)
    except Exception:
        return dict(error=traceback.format_exc(limit=4), coverage=coverage)
    try:
        with wrapped, torch.no_grad():
            got = _forward(wrapped, ids, index)
            again = _forward(wrapped, ids, index)  # second forward: slots reused across forwards
            copied = wrapped.stats.bytes_copied
            kernel = wrapped.experts_kernel
    except Exception:
        return dict(error=traceback.format_exc(limit=4), coverage=coverage)
    return dict(
        diff=(got - reference).abs().max().item(), diff_again=(again - reference).abs().max().item(),
        scale=reference.abs().max().item(), bytes_copied=copied, layers=len(wrapped.experts_layers), kernel=kernel,
        coverage=coverage,
    )


def _sweep_rank(rank: int, families: list[str], broken: tuple[str, ...] = ()) -> dict:
    """Every family in one process group, each on its own: one that cannot be built, wrapped or run is
    recorded with its error and the sweep goes on. `broken`: families planted to fail their build on rank 0."""
    torch.set_num_threads(1)
    group = init_group()
    start = time.perf_counter()
    results = {}
    for index, family in enumerate(families):
        began = time.perf_counter()
        results[family] = _try_family(rank, index, family, group, broken)
        results[family]["seconds"] = time.perf_counter() - began
    return dict(results=results, seconds=time.perf_counter() - start)


@pytest.fixture(scope="module")
def sweep():
    start = time.perf_counter()
    ranks = launch_local(_sweep_rank, 2, (FAMILIES,), timeout_s=400)
    return ranks, time.perf_counter() - start


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
    ranks, _ = sweep
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
    ranks = launch_local(_sweep_rank, 2, (["mixtral", "olmoe", "qwen3_moe"], ("olmoe",)), timeout_s=100)
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
    ranks, _ = sweep
    refused = {f: r["refused"] for f, r in ranks[0]["results"].items() if "refused" in r}
    assert sorted(refused) == sorted(REFUSED), f"refused families changed: {refused}"
    wrapped = len(FAMILIES) - len(refused)
    floor = 68 - len(absent_here())  # families a release does not ship cannot wrap
    assert wrapped >= floor, f"only {wrapped} of {len(FAMILIES)} families wrap (at least {floor} expected)"


@pytest.mark.timeout(450)
def test_sweep_fits_its_time_budget(sweep):
    ranks, wall = sweep
    slowest = max(out["seconds"] for out in ranks)
    assert wall <= SWEEP_BUDGET_S, f"family sweep took {wall:.1f} s (ranks {slowest:.1f} s) > {SWEEP_BUDGET_S} s"


@pytest.mark.timeout(450)
def test_docs_family_table_is_generated(sweep):
    ranks, _ = sweep
    rows = [ranks[0]["results"][f]["coverage"] for f in FAMILIES]
    page = (Path(__file__).parent.parent / TABLE_PAGE).read_text()
    generated_with = table_version(page)
    if generated_with != transformers.__version__:
        pytest.skip(f"the family table of {TABLE_PAGE} is for transformers {generated_with}; this is "
                    f"{transformers.__version__} (the constraints file pins the table's version)")
    assert table_block(page) == markdown(rows), (
        f"the family table of {TABLE_PAGE} is stale: paste `dwdp families --markdown` over its block"
    )
