"""pyproject.toml names every package the source tree holds, so a regular (non-editable) install ships
all of them, and the data files the code opens are declared as package data."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    found = {"dwdp." + ".".join(p.parent.relative_to(ROOT / "dwdp").parts)
             for p in (ROOT / "dwdp").rglob("__init__.py") if p.parent != ROOT / "dwdp"}
    return {"dwdp"} | found | {"dwdp.kernels"}


def test_every_package_of_the_tree_is_listed():
    listed = set(_setuptools()["packages"])
    assert listed == _source_packages(), (sorted(_source_packages() - listed), sorted(listed - _source_packages()))


def test_every_data_file_is_package_data():
    # package -> its source directory (dwdp.kernels ships from kernels/, see package-dir)
    for package, directory in (("dwdp", ROOT / "dwdp"), ("dwdp.kernels", ROOT / "kernels")):
        patterns = _setuptools()["package-data"][package]
        data_files = [p for p in directory.rglob("*.json")]
        assert data_files, package
        for path in data_files:
            rel = path.relative_to(directory)
            assert any(rel.match(pattern) for pattern in patterns), (package, str(rel), patterns)
