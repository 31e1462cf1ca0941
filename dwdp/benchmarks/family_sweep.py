"""Every MoE family of the installed transformers wrapped on the ranks of one process group, each family on
its own: its tiny random model's logits against the unwrapped model's on two forwards, the bytes copied,
the experts path taken, and the seconds each family took.

The test suite's family sweep (tests/test_families.py) asserts the outcomes; `bench/family_sweep.py`
prints and stores the seconds (how long the sweep takes is a figure, not a test: a loaded machine only
makes it slower).

`sweep_rank(rank, families, broken)` runs on each rank of a group `launch_local` started; it returns
{"results": {family: outcome}, "seconds": the rank's wall time}. An outcome is one of
- {"refused": reason, "coverage": ...}: dwdp refuses to wrap the family (the reason names why);
- {"error": traceback, "coverage": ...}: it could not be built, wrapped or run;
- {"diff", "diff_again", "scale", "bytes_copied", "layers", "kernel", "coverage"}: max |logits - unwrapped|
  on the first and second forward, the largest unwrapped logit, and what the wrapped model did;
and every outcome has "seconds". `coverage` (rank 0 only) is the family table's row.
"""
from __future__ import annotations

import time
import traceback

import torch

from dwdp.models.adapters import Unsupported, find_experts
from dwdp.models.tiny import build_tiny_model
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.coverage import coverage_of, not_built
from dwdp.runtime.group import init_group
from dwdp.runtime.model import DWDPModel


def _forward(model, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits (or the last hidden state of a model without a head) of one forward. Seeded: a block
    diffusion model draws its canvas at random when none is given."""
    torch.manual_seed(seed)
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def try_family(rank: int, index: int, family: str, group, broken: tuple[str, ...]) -> dict:
    """One family's outcome on this rank: refused, failed, or its logits against the unwrapped model's.

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
    ids = torch.randint(3, 128, (2, 5 + 2 * rank), generator=gen)  # [2, T]: this rank's own batch
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


def sweep_rank(rank: int, families: list[str], broken: tuple[str, ...] = ()) -> dict:
    """Every family in one process group, each on its own: one that cannot be built, wrapped or run is
    recorded with its error and the sweep goes on. `broken`: families planted to fail their build on rank 0."""
    torch.set_num_threads(1)
    group = init_group()
    start = time.perf_counter()
    results = {}
    for index, family in enumerate(families):
        began = time.perf_counter()
        results[family] = try_family(rank, index, family, group, broken)
        results[family]["seconds"] = time.perf_counter() - began
    return dict(results=results, seconds=time.perf_counter() - start)
