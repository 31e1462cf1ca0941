"""Per-GPU figures from dwdp/data/hardware.json (every value there carries its source)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .data import load_json, preset_names


@dataclass(frozen=True)
class Hardware:
    """Per-GPU peaks. peak_flops[dtype] in FLOP/s (None = no tensor-core support), bandwidths in B/s."""

    name: str
    peak_flops: dict
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float  # NVLink, per direction per GPU
    domain_size: int

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


def hardware_names() -> tuple[str, ...]:
    return preset_names("hardware.json")


@lru_cache(maxsize=None)
def load_hardware(name: str) -> Hardware:
    """A hardware preset from dwdp/data/hardware.json (values there carry their sources)."""
    data = load_json("hardware.json")
    if name not in data or name.startswith("_"):
        raise ValueError(f"unknown hardware {name!r}; presets: {hardware_names()}")
    entry = data[name]
    peaks = {k: (None if v["value"] is None else v["value"] * 1e12) for k, v in entry["peak_tflops"].items()}
    return Hardware(
        name=name,
        peak_flops=peaks,
        hbm_bytes_per_s=entry["hbm_tb_s"]["value"] * 1e12,
        hbm_bytes=entry["hbm_gb"]["value"] * 1e9,
        link_bytes_per_s=entry["nvlink_gb_s"]["value"] * 1e9,
        domain_size=entry["gpus_per_nvlink_domain"]["value"],
    )


# ---------------------------------------------------------------------------------------------
