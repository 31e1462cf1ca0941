"""The oldest releases of fast-moving dependencies dwdp works with, checked when dwdp is imported.

The floors are the oldest releases the test suite has passed on (pyproject.toml declares the same
ranges); an older one fails at import with one line that names it and what to install, instead of
failing later inside a model or a kernel. Versions are read from the installed distributions'
metadata, so the check imports none of them.
"""
from __future__ import annotations

import re
from importlib import metadata

# distribution -> oldest supported release
FLOORS = {"torch": "2.11", "transformers": "5.17", "triton": "3.6"}


def _release(version: str) -> tuple[int, ...]:
    """(major, minor[, patch]) of a version string such as '2.11.0+cu130' or '5.24.0.dev0'."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(g) for g in found.groups() if g is not None)


def too_old(installed: dict[str, str | None]) -> list[str]:
    """One message per installed distribution older than its floor (absent ones are not checked here)."""
    messages = []
    for name, floor in FLOORS.items():
        found = installed.get(name)
        if found is not None and _release(found) < _release(floor):
            messages.append(f"dwdp needs {name} >= {floor}, found {name} {found}: pip install -U '{name}>={floor}'")
    return messages


def installed_versions() -> dict[str, str | None]:
    out = {}
    for name in FLOORS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def check_versions() -> None:
    """ImportError naming every dependency older than dwdp supports."""
    messages = too_old(installed_versions())
    if messages:
        raise ImportError("; ".join(messages))
