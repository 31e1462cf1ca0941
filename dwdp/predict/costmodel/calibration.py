"""Constants fitted to measurements: how far real kernels and links fall short of the datasheet peaks.

The values live in dwdp/predict/data/calibration.json, each with its source; bench/calibrate.py fits the
kernel and link shares to the DEP4 column of the DWDP paper's Table 1, and the host time outside the
forward to one end-to-end point (its Table 3b: ISL 8K, ratio 0.8, max-num-tokens 32K), and rewrites
that file. `IDEAL` is the plain roofline (every peak reached, no expert-load spread, nothing outside
the forward but the KV hand-off).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from dwdp.predict.costmodel.data import load_json

# The paper's breakdown categories that are kernel classes (operators carry one of these).
ATTENTION, GROUPED_GEMM, DENSE_GEMM, OTHERS = "Attention", "GroupedGEMM", "DenseGEMM", "Others"
KERNEL_CATEGORIES = (ATTENTION, GROUPED_GEMM, DENSE_GEMM, OTHERS)


@dataclass(frozen=True)
class Calibration:
    """attention / grouped_gemm / dense_gemm: share of the tensor-core peak those kernels reach;
    memory: share of the HBM peak reached by memory-bound kernels (and a merge copy);
    all_to_all: share of the NVLink rate per direction reached by DEP's dispatch and combine;
    expert_load_cv: per-layer coefficient of variation of routed rows across DEP ranks (expert skew);
    clock_power_exponent: a: dynamic power of a compute-bound kernel ~ clock ** a;
    outside_host_s / outside_other_s: seconds per forward every mode pays outside it for host work and
    for the rest (dwdp.predict.costmodel.outside)."""

    attention: float = 1.0
    grouped_gemm: float = 1.0
    dense_gemm: float = 1.0
    memory: float = 1.0
    all_to_all: float = 1.0
    expert_load_cv: float = 0.0
    clock_power_exponent: float = 1.0
    outside_host_s: float = 0.0
    outside_other_s: float = 0.0

    def __post_init__(self):
        for name in ("attention", "grouped_gemm", "dense_gemm", "memory", "all_to_all"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name}={value} must be in (0, 1]: a share of a peak")
        if self.expert_load_cv < 0 or self.clock_power_exponent <= 0:
            raise ValueError(f"expert_load_cv={self.expert_load_cv} must be >= 0 and "
                             f"clock_power_exponent={self.clock_power_exponent} > 0")
        if self.outside_host_s < 0 or self.outside_other_s < 0:
            raise ValueError(f"outside_host_s={self.outside_host_s} and outside_other_s={self.outside_other_s} must "
                             f"be >= 0: time outside the forward")

    def compute_efficiency(self, category: str) -> float:
        """Share of the tensor-core (or CUDA-core) peak an operator of `category` reaches."""
        return {ATTENTION: self.attention, GROUPED_GEMM: self.grouped_gemm, DENSE_GEMM: self.dense_gemm,
                OTHERS: self.memory}[category]

    def replace(self, **changes) -> "Calibration":
        return dataclasses.replace(self, **changes)


IDEAL = Calibration()
FIELDS = tuple(f.name for f in dataclasses.fields(Calibration))


@lru_cache(maxsize=None)
def load_calibration() -> Calibration:
    """The calibrated constants from dwdp/predict/data/calibration.json."""
    data = load_json("calibration.json")
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise ValueError(f"dwdp/predict/data/calibration.json lacks {missing}")
    return Calibration(**{name: float(data[name]["value"]) for name in FIELDS})


def calibration_sources() -> dict[str, str]:
    """{constant: where its value comes from}."""
    data = load_json("calibration.json")
    return {name: data[name]["source"] for name in FIELDS}
