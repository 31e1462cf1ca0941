"""The transformers releases the suite runs on, and what tests expect of each where the releases differ.

CI runs the pinned release (constraints.txt); the oldest supported release (the floor of pyproject.toml
and dwdp/versions.py) is run too (GPU machines carry it). Where an expectation differs between them it
is keyed here by release, so each release is held to what it ships and nothing is loosened for both.
"""
from pathlib import Path

import pytest
import transformers

from dwdp.runtime.coverage import TABLE_PAGE, table_block
from dwdp.models.families import moe_families
from dwdp.versions import FLOORS, _release

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = _release(transformers.__version__)


def _pinned_version() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith("transformers=="):
            return line.split("==")[1].strip()
    raise AssertionError("constraints.txt pins no transformers release")


PINNED_VERSION = _pinned_version()
PINNED = _release(PINNED_VERSION)

# MoE families of the pinned release that the oldest supported release (5.17) does not ship.
NOT_IN_OLDEST = frozenset({
    "bailing_hybrid", "beam", "dots3_note", "flint", "hy_v4_vl", "inkling2", "inkling2_loop", "kolibri1",
    "lara_mini", "mistral_large4", "muse_spark", "unlimited_ocr",
})


def pinned_families() -> list[str]:
    """The MoE families of the pinned release: the rows of the family table (docs/models.md), generated on it."""
    block = table_block((ROOT / TABLE_PAGE).read_text())
    rows = [line.split("|")[1].strip() for line in block.splitlines() if line.startswith("| ")]
    return [r for r in rows if r != "family"]


def absent_here() -> list[str]:
    """The families of NOT_IN_OLDEST the installed release does not ship: none on the pinned release or
    later, where every one of them must be there."""
    if INSTALLED >= PINNED:
        return []
    discovered = {f.name for f in moe_families()}
    return sorted(NOT_IN_OLDEST - discovered)


def family_case(family: str, *values):
    """A pytest case for `family`, skipped (saying why) only on a release older than the pinned one that
    is known not to ship it; anywhere else a missing family fails the test."""
    absent = family in absent_here()
    return pytest.param(family, *values, marks=pytest.mark.skipif(
        absent, reason=f"{family} is not in transformers {transformers.__version__} (it ships in "
                       f"{PINNED_VERSION}, not in {FLOORS['transformers']})"))


# -- torch ------------------------------------------------------------------------------------------------
# The torch releases dwdp was checked on are a table of docs/install.md (`.ci/torch-release VERSION` runs
# the check and prints its row); pyproject.toml's torch range must span exactly those releases.
TORCH_TABLE_PAGE = "docs/install.md"
TORCH_TABLE_BEGIN, TORCH_TABLE_END = "<!-- torch-releases:begin -->", "<!-- torch-releases:end -->"
TORCH_RESULTS = ("passed", "partial")  # partial: the row says what ran and what did not


def checked_torch_releases() -> dict[str, str]:
    """torch release -> result, from the table of checked releases in docs/install.md."""
    text = (ROOT / TORCH_TABLE_PAGE).read_text()
    if TORCH_TABLE_BEGIN not in text or TORCH_TABLE_END not in text:
        raise AssertionError(f"{TORCH_TABLE_PAGE} has no table between {TORCH_TABLE_BEGIN} and {TORCH_TABLE_END}")
    block = text.split(TORCH_TABLE_BEGIN, 1)[1].split(TORCH_TABLE_END, 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| torch ")]
    return {row[0]: row[-1] for row in rows}


def torch_range_of(releases) -> str:
    """The pyproject.toml requirement that spans `releases` (versions such as '2.11.0'): from the oldest
    one's minor release up to, not including, the minor release after the newest."""
    minors = sorted(_release(v)[:2] for v in releases)
    (low_major, low_minor), (high_major, high_minor) = minors[0], minors[-1]
    return f"torch>={low_major}.{low_minor},<{high_major}.{high_minor + 1}"
