"""Declared dependency ranges agree with the tested set, and a too-old dependency fails at import in one line."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dwdp.versions import FLOORS, too_old

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}


def _pinned() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {name.lower(): version for name, version in (l.split("==") for l in lines if "==" in l and not l.startswith("#"))}


def test_tested_set_is_inside_the_declared_ranges():
    from packaging.specifiers import SpecifierSet

    pinned = _pinned()
    for name, requirement in _declared().items():
        spec = SpecifierSet(requirement.split(";")[0][len(name):])
        assert name in pinned, f"{name} is a dependency but constraints.txt does not pin it"
        assert spec.contains(pinned[name]), f"constraints.txt pins {name}=={pinned[name]} outside {requirement!r}"


def test_import_floors_match_the_declared_lower_bounds():
    declared = _declared()
    for name, floor in FLOORS.items():
        assert f">={floor}" in declared[name], (name, floor, declared[name])


@pytest.mark.parametrize("name, old", [("transformers", "5.3.0"), ("triton", "3.0.1"), ("torch", "2.6.0+cu124")])
def test_a_too_old_dependency_is_named_with_what_to_install(name, old):
    messages = too_old({name: old})
    assert len(messages) == 1 and f"{name} >= {FLOORS[name]}" in messages[0] and old in messages[0], messages


@pytest.mark.parametrize("found", ["5.17.0", "5.24.0.dev0", "5.30.1", None])
def test_supported_or_absent_versions_pass(found):
    assert too_old({"transformers": found}) == []


def test_import_of_dwdp_fails_in_one_line_on_an_old_transformers(tmp_path):
    """A fake transformers distribution 5.3.0 ahead on the path: `import dwdp` names it."""
    dist = tmp_path / "transformers-5.3.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.3.0\n")
    code = "import sys; sys.path.insert(0, %r); import dwdp" % str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: dwdp needs transformers >= 5.17, found transformers 5.3.0"), done.stderr[-800:]
