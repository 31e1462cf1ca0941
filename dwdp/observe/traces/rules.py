"""The category table (`categories.json` next to this file): loading, validation, lookup."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_RULES = Path(__file__).with_name("categories.json")
OTHERS = "Others"
SYNCHRONIZATION = "Synchronization"


@dataclass(frozen=True)
class CategoryRules:
    order: tuple[str, ...]                      # priority and display order; contains Others
    phases: dict[str, str]                      # phase name -> category
    kernels: tuple[tuple[str, re.Pattern], ...]  # (category, pattern), first match wins
    copies: dict[str, str]                      # copy kind -> category

    def __post_init__(self):
        if OTHERS not in self.order or SYNCHRONIZATION not in self.order:
            raise ValueError(f"order {self.order} must contain {OTHERS!r} and {SYNCHRONIZATION!r}")
        used = set(self.phases.values()) | {c for c, _ in self.kernels} | set(self.copies.values())
        unknown = used - set(self.order)
        if unknown:
            raise ValueError(f"categories {sorted(unknown)} are used but not listed in order {self.order}")

    def level(self, category: str) -> int:
        return self.order.index(category)

    def of_kernel(self, name: str) -> str:
        return next((category for category, pattern in self.kernels if pattern.search(name)), OTHERS)


def load_rules(path: str | Path = DEFAULT_RULES) -> CategoryRules:
    """Rules from a JSON file shaped like categories.json; ValueError names what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
        return CategoryRules(
            order=tuple(raw["order"]), phases=dict(raw["phases"]),
            kernels=tuple((c, re.compile(p)) for c, p in raw["kernels"]), copies=dict(raw["copies"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, re.error) as exc:
        raise ValueError(f"{path}: bad category rules: {exc!r}") from None
