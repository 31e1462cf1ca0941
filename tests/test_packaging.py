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


def _package_dir(package: str) -> Path:
    """The source directory of `package` (dwdp.kernels ships from kernels/, see package-dir)."""
    if package == "dwdp.kernels" or package.startswith("dwdp.kernels."):
        return ROOT / "kernels" / Path(*package.split(".")[2:])
    return ROOT / Path(*package.split("."))


def test_every_data_file_is_package_data():
    package_data = _setuptools()["package-data"]
    packages = sorted(_source_packages(), key=lambda p: -len(_package_dir(p).parts))
    data_files = [*(ROOT / "dwdp").rglob("*.json"), *(ROOT / "kernels").rglob("*.json")]
    assert data_files
    for path in data_files:
        # the innermost package holding the file ships it
        package = next(p for p in packages if path.is_relative_to(_package_dir(p)))
        rel = path.relative_to(_package_dir(package))
        patterns = package_data.get(package, [])
        assert any(rel.match(pattern) for pattern in patterns), (package, str(rel), patterns)
