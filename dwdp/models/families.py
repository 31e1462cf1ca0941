"""The MoE model families of the installed transformers, discovered from transformers itself.

A family is one `transformers.models.<name>` package whose modeling code defines a
mixture-of-experts module (a class whose name contains `Experts`, `MoE` or `MoA`), and that
either has a generation head (causal LM or image-text-to-text) or whose experts class carries
transformers' experts-implementation decorator (the seam dwdp plugs into). A family transformers
adds tomorrow shows up here without any change to dwdp.

Which model a family builds: the text causal LM when the family has one, else its multimodal
image-text-to-text model (wrapped through its text model), else its base model.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# A class whose name says it is an experts container or a sparse MoE block.
_EXPERTS_CLASS = re.compile(r"^class (\w*(?:Experts|MoE|MoA)\w*)\(", re.MULTILINE)
_DECORATED = "@use_experts_implementation"


@dataclass(frozen=True)
class Family:
    """One MoE family: `name` is the transformers.models package, `model_type` the config built."""

    name: str
    model_type: str
    head: str                          # "causal_lm", "image_text_to_text" or "base"
    experts_classes: tuple[str, ...]   # classes of its modeling code that look like experts / MoE blocks
    decorated: bool                    # its experts class uses transformers' experts-implementation decorator

    @property
    def model_class_name(self) -> str:
        return _head_mapping(self.head)[self.model_type]


def _head_mapping(head: str) -> dict:
    from transformers.models.auto import modeling_auto as auto

    return {
        "causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "image_text_to_text": auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        "base": auto.MODEL_MAPPING_NAMES,
    }[head]


def _modeling_source(package: str) -> str | None:
    spec = importlib.util.find_spec(f"transformers.models.{package}")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / f"modeling_{package}.py"
    return path.read_text() if path.is_file() else None


def _pick_model_type(model_types: list[str]) -> tuple[str, str]:
    """(model_type, head): a text-only causal LM first, then any causal LM, then multimodal, then base."""
    causal, multimodal, base = (_head_mapping(h) for h in ("causal_lm", "image_text_to_text", "base"))
    for ok, head in (
        (lambda t: t in causal and t not in multimodal, "causal_lm"),
        (lambda t: t in causal, "causal_lm"),
        (lambda t: t in multimodal, "image_text_to_text"),
        (lambda t: t in base, "base"),
    ):
        found = [t for t in model_types if ok(t)]
        if found:
            return found[0], head
    raise LookupError(f"no model class for model types {model_types}")


@lru_cache(maxsize=None)
def moe_families() -> tuple[Family, ...]:
    """Every MoE family of the installed transformers, sorted by name (reads source, imports nothing)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    causal, multimodal = _head_mapping("causal_lm"), _head_mapping("image_text_to_text")
    by_package: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        by_package.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    families = []
    for package, model_types in sorted(by_package.items()):
        generates = any(t in causal or t in multimodal for t in model_types)
        source = _modeling_source(package)
        if source is None:
            continue
        classes = tuple(_EXPERTS_CLASS.findall(source))
        decorated = _DECORATED in source
        if not classes or not (generates or decorated):
            continue
        try:
            model_type, head = _pick_model_type(model_types)
        except LookupError:
            continue
        families.append(Family(package, model_type, head, classes, decorated))
    return tuple(families)


def family(name: str) -> Family:
    """The family `name` (a transformers.models package such as "gpt_oss"); ValueError if unknown."""
    for f in moe_families():
        if f.name == name:
            return f
    known = [f.name for f in moe_families()]
    raise ValueError(f"family={name!r} is not an MoE family of this transformers; known: {known}")


def model_class(fam: Family):
    """The transformers model class a family builds (imports its modeling module)."""
    module = importlib.import_module(f"transformers.models.{fam.name}.modeling_{fam.name}")
    return getattr(module, fam.model_class_name)
