"""How much slower a kernel runs while prefetch copies run beside it (docs/design.md 1.4).

Two mechanisms, one per operator class:
  * memory-bound kernels share HBM with the copies. A rank writes what it pulls and is read by the
    peers pulling from it (a symmetric group moves as much out as in), so the copies take
    2 * rate of the bandwidth such kernels can reach (memory efficiency x HBM peak): time x 1 / (1 - share).
  * compute-bound kernels run at the power limit. The copies add their watts; when compute + copy
    (less the idle floor counted twice) asks for more than the limit, the clock drops until the
    kernel's dynamic power fits what is left: idle + copy + (compute - idle) * clock ** a = 1, and a
    compute-bound kernel's time scales with 1 / clock.
Units: bytes/s, fractions of the power limit.

What is measured and what is not: the power figures are the DWDP paper's GB200 NVL72 measurements
(Appendix A), carried to the other GPUs as assumptions (dwdp/predict/data/hardware.json says so per value).
bench/gpu_check.py section c samples SM clock, memory clock and power on one GPU while a GEMM runs
alone, beside copy-engine copies and beside an SM copy, and reports watts per TB/s of copy traffic
inside that GPU; no run of it has been stored yet, so nothing here comes from it. Even once it has
run, its copies read and write the GEMM's own HBM (and may run on SMs, which section c also checks),
while an NVLink pull reads another GPU's HBM and adds the link's power: a one-GPU figure would
describe HBM contention and power on one device, not the NVLink case this model is for.
"""
from __future__ import annotations

from dataclasses import dataclass

from dwdp.predict.costmodel.calibration import Calibration
from dwdp.predict.costmodel.hardware import Hardware


@dataclass(frozen=True)
class CopySlowdown:
    """Factors on an operator's time while copies run: compute (compute-bound), memory (memory-bound).
    clock: SM clock scale; hbm_share: share of reachable HBM bandwidth taken by copies; power_demand:
    what a compute-bound kernel plus the copies ask, as a fraction of the limit (0 = no power model)."""

    compute: float
    memory: float
    clock: float = 1.0
    hbm_share: float = 0.0
    power_demand: float = 0.0


NONE = CopySlowdown(1.0, 1.0)


def copy_slowdown(hw: Hardware, pull_bytes_per_s: float, cal: Calibration) -> CopySlowdown:
    """Slowdowns while this rank pulls at `pull_bytes_per_s` (mean rate over the copy, per direction)."""
    if pull_bytes_per_s < 0:
        raise ValueError(f"pull_bytes_per_s={pull_bytes_per_s} must be >= 0")
    traffic = 2.0 * pull_bytes_per_s  # in + out: the peers pull from this rank as fast as it pulls
    share = traffic / (hw.hbm_bytes_per_s * cal.memory)
    if share >= 1.0:
        raise ValueError(f"copy traffic {traffic / 1e12:.2f} TB/s takes all the HBM bandwidth memory-bound kernels "
                         f"reach on {hw.name} ({hw.hbm_bytes_per_s * cal.memory / 1e12:.2f} TB/s)")
    clock, demand = 1.0, 0.0
    if hw.power is not None:
        p = hw.power
        copy_power = p.copy_w_per_tb_s * traffic / 1e12 / p.limit_w
        demand = p.compute + copy_power
        if demand > 1.0:
            left = 1.0 - p.idle - copy_power
            if left <= 0:
                raise ValueError(f"copies alone ({copy_power:.2f} of the limit above idle {p.idle}) exceed "
                                 f"the power limit of {hw.name}")
            clock = (left / (p.compute - p.idle)) ** (1.0 / cal.clock_power_exponent)
    return CopySlowdown(1.0 / clock, 1.0 / (1.0 - share), clock, share, demand)
