"""Declared dependency ranges agree with the tested set, and a too-old dependency fails at import in one line."""
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dwdp.versions import FLOORS, _release, too_old
from releases import TORCH_RESULTS, checked_torch_releases, torch_range_of

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


# -- the torch range: what was checked, and what pip does with it ------------------------------------------
def test_declared_torch_range_equals_the_table_of_checked_releases():
    table = checked_torch_releases()
    declared = _declared()["torch"]
    assert declared == torch_range_of(table), (f"pyproject.toml declares {declared!r}; the releases checked in "
                                                f"docs/install.md ({sorted(table)}) span {torch_range_of(table)!r}")
    assert all(result in TORCH_RESULTS for result in table.values()), table
    newest = max(table, key=_release)
    assert table[newest] == "passed", f"the newest release of the range, {newest}, must have passed in full: {table}"
    assert _pinned()["torch"] in table and table[_pinned()["torch"]] == "passed", (_pinned()["torch"], table)


@pytest.mark.parametrize("table, expected", [({"2.11.0": "passed"}, "torch>=2.11,<2.12"),
                                             ({"2.15.0": "passed", "2.11.0": "partial", "2.14.1": "passed"},
                                              "torch>=2.11,<2.16")])
def test_the_range_of_a_table_runs_from_its_oldest_minor_release_to_the_one_after_its_newest(table, expected):
    assert torch_range_of(table) == expected


def _pip_dry_run(project: Path, tmp_path: Path, *requirements: str) -> tuple[subprocess.CompletedProcess, list]:
    """`pip install --dry-run -e project *requirements` in this environment, offline: what pip would install."""
    pytest.importorskip("setuptools", reason="builds dwdp's metadata without the network (--no-build-isolation)")
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--report", str(report), "-e", str(project), *requirements],
                          capture_output=True, text=True, timeout=120)
    installs = json.loads(report.read_text())["install"] if report.exists() else []
    return done, [(i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in installs]


def _installed_torch() -> str:
    from importlib import metadata

    return metadata.version("torch")


@pytest.mark.timeout(120)
def test_pip_install_leaves_a_torch_inside_the_declared_range_untouched(tmp_path):
    from packaging.specifiers import SpecifierSet

    declared = _declared()["torch"]
    is_pinned = _release(_installed_torch()) == _release(_pinned()["torch"])  # CI's torch must be inside
    if not is_pinned and not SpecifierSet(declared[len("torch"):]).contains(_installed_torch()):
        pytest.skip(f"the installed torch {_installed_torch()} is outside {declared!r} (a release being checked)")
    done, installs = _pip_dry_run(ROOT, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert installs == [("dwdp", "0.1.0")], f"pip would install {installs} beside torch {_installed_torch()}"


def _copy_requiring(where: Path, requirement: str) -> Path:
    """A throw-away copy of the project, in `where`, whose torch requirement is `requirement`."""
    copy = where / "dwdp-copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for tree in ("dwdp", "kernels"):
        shutil.copytree(ROOT / tree, copy / tree, ignore=ignore)
    shutil.copy(ROOT / "README.md", copy / "README.md")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pyproject.count(f'"{_declared()["torch"]}"') == 1, "pyproject.toml names its torch requirement once"
    (copy / "pyproject.toml").write_text(pyproject.replace(f'"{_declared()["torch"]}"', f'"{requirement}"'))
    return copy


@pytest.mark.timeout(120)
def test_pip_refuses_a_torch_outside_the_declared_range_when_it_is_named(tmp_path):
    """The install line docs/install.md gives for a machine with its own torch names that torch: pip then
    refuses a dwdp whose range leaves it out, instead of replacing it (here: the range moved past the
    installed torch in a copy of the project)."""
    installed = _installed_torch()
    major, minor = _release(installed)[:2]
    copy = _copy_requiring(tmp_path, f"torch>={major}.{minor + 1},<{major}.{minor + 3}")
    done, installs = _pip_dry_run(copy, tmp_path, f"torch=={installed}")
    assert done.returncode != 0, f"pip accepted torch {installed} outside the copy's range: {installs}"
    assert "conflicting dependencies" in done.stderr or "ResolutionImpossible" in done.stderr, done.stderr[-2000:]
    # The same copy with the declared range takes that torch as it is: the refusal is the range's.
    same = _copy_requiring(tmp_path / "declared", _declared()["torch"])
    done, installs = _pip_dry_run(same, tmp_path / "declared", f"torch=={installed}")
    assert done.returncode == 0 and installs == [("dwdp", "0.1.0")], (installs, done.stderr[-2000:])
