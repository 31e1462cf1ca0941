"""Per-GPU figures from dwdp/predict/data/hardware.json (every value there carries its source)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dwdp.predict.costmodel.data import load_json, preset_names


@dataclass(frozen=True)
class PowerFigures:
    """How close a GPU runs to its power limit (fractions of power_limit_w).

    idle: drawn with nothing running; compute: drawn by a tensor-core-bound kernel alone;
    copy_w_per_tb_s: watts added per TB/s of copy traffic through HBM and NVLink (in + out).
    """

    limit_w: float
    idle: float
    compute: float
    copy_w_per_tb_s: float

    def __post_init__(self):
        if not 0.0 <= self.idle < self.compute <= 1.0 or self.limit_w <= 0 or self.copy_w_per_tb_s < 0:
            raise ValueError(f"power figures {self} must satisfy 0 <= idle < compute <= 1, limit_w > 0, "
                             f"copy_w_per_tb_s >= 0")


@dataclass(frozen=True)
class Hardware:
    """Per-GPU peaks. peak_flops[dtype] in FLOP/s (None = no tensor-core support), bandwidths in B/s.

    power: None = no power model (compute never throttles); copy_engine_efficiency: share of the
    NVLink rate a copy-engine peer copy sustains."""

    name: str
    peak_flops: dict
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float  # NVLink, per direction per GPU
    domain_size: int
    power: PowerFigures | None = None
    copy_engine_efficiency: float = 1.0

    def flops_dtype(self, dtype: str) -> str:
        """The dtype a GEMM of `dtype` weights runs at: the narrowest supported one at least as wide."""
        chain = ("fp4", "fp8", "bf16")
        if dtype == "fp32":
            return dtype
        for candidate in chain[chain.index(dtype):]:
            if self.peak_flops.get(candidate) is not None:
                return candidate
        raise ValueError(f"{self.name} has no tensor-core peak for {dtype} or any wider dtype")

    def peak(self, dtype: str) -> float:
        return self.peak_flops[self.flops_dtype(dtype)]

    @property
    def copy_bytes_per_s(self) -> float:
        """Sustained rate of one copy-engine peer copy, per direction."""
        return self.link_bytes_per_s * self.copy_engine_efficiency


def hardware_names() -> tuple[str, ...]:
    return preset_names("hardware.json")


def hardware_sources(name: str) -> dict[str, str]:
    """{field: source} of every value of a preset (peaks as peak_tflops.<dtype>)."""
    entry = _entry(name)
    out = {}
    for key, value in entry.items():
        if isinstance(value, dict) and "source" in value:
            out[key] = value["source"]
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": v["source"] for k, v in value.items()})
    return out


def _entry(name: str) -> dict:
    data = load_json("hardware.json")
    if name not in data or name.startswith("_"):
        raise ValueError(f"unknown hardware {name!r}; presets: {hardware_names()}")
    return data[name]


@lru_cache(maxsize=None)
def load_hardware(name: str) -> Hardware:
    """A hardware preset from dwdp/predict/data/hardware.json (values there carry their sources)."""
    entry = _entry(name)
    value = lambda key: entry[key]["value"]  # noqa: E731
    peaks = {k: (None if v["value"] is None else v["value"] * 1e12) for k, v in entry["peak_tflops"].items()}
    power = PowerFigures(value("power_limit_w"), value("idle_power_fraction"), value("compute_power_fraction"),
                         value("copy_power_w_per_tb_s"))
    return Hardware(
        name=name,
        peak_flops=peaks,
        hbm_bytes_per_s=value("hbm_tb_s") * 1e12,
        hbm_bytes=value("hbm_gb") * 1e9,
        link_bytes_per_s=value("nvlink_gb_s") * 1e9,
        domain_size=value("gpus_per_nvlink_domain"),
        power=power,
        copy_engine_efficiency=value("copy_engine_efficiency"),
    )
