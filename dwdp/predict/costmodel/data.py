"""Reading the data files under dwdp/predict/data/ (model presets, hardware figures, calibration)."""
from __future__ import annotations

import json
from importlib import resources


def load_json(name: str) -> dict:
    """dwdp/predict/data/<name> parsed."""
    return json.loads(resources.files("dwdp.predict").joinpath("data", name).read_text())


def preset_names(name: str) -> tuple[str, ...]:
    """Entry names of a data file; keys starting with '_' are documentation."""
    return tuple(k for k in load_json(name) if not k.startswith("_"))
