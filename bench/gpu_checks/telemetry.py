"""SM clock, memory clock, power draw and clock-event reasons of one GPU, sampled while work runs.

Sources, first that works: NVML through cuda.bindings.nvml (cuda-bindings 13.x), NVML through
pynvml (torch.cuda.clock_rate / power_draw use it), `nvidia-smi --query-gpu ... -lms` in a
subprocess. The GPU image has no network, so nothing here is installed at run time. NVML's power
figure on Hopper is an average over about a second (NVML documentation, nvmlDeviceGetPowerUsage):
sample a condition for a few seconds and drop its first samples. Not yet run on a GPU.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

# nvmlClocksEventReasons bits (nvml.h) that say why the SM clock is below its maximum.
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


@dataclass(frozen=True)
class Sample:
    t: float                 # perf_counter seconds
    sm_mhz: float | None
    mem_mhz: float | None
    power_w: float | None
    reasons: int | None      # nvmlClocksEventReasons bitmask


def reason_names(mask: int | None) -> list[str]:
    if mask is None:
        return []
    return [name for bit, name in REASONS.items() if mask & bit]


class _NvmlBindings:
    name = "cuda.bindings.nvml"

    def __init__(self, uuid: str | None):
        from cuda.bindings import nvml

        nvml.init_v2()
        self.nvml = nvml
        self.handle = None
        if uuid:
            try:
                self.handle = nvml.device_get_handle_by_uuid(uuid)
            except Exception:  # an older NVML without that name: fall back to the first device
                self.handle = None
        if self.handle is None:
            self.handle = nvml.device_get_handle_by_index_v2(0)

    def read(self) -> Sample:
        n, h = self.nvml, self.handle
        return Sample(time.perf_counter(), n.device_get_clock_info(h, n.ClockType.CLOCK_SM),
                      n.device_get_clock_info(h, n.ClockType.CLOCK_MEM), n.device_get_power_usage(h) / 1e3,
                      int(n.device_get_current_clocks_event_reasons(h)))

    def close(self) -> None:
        self.nvml.shutdown()


class _Pynvml:
    name = "pynvml"

    def __init__(self, uuid: str | None):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(self) -> Sample:
        n, h = self.nvml, self.handle
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            n.nvmlDeviceGetCurrentClocksThrottleReasons
        return Sample(time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                      n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM), n.nvmlDeviceGetPowerUsage(h) / 1e3,
                      int(reasons(h)))

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(int(text, 16)) if text.startswith("0x") else float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


class Sampler:
    """Samples GPU 0 every `period_s` on a thread (NVML) or from `nvidia-smi -lms` (fallback) between
    `start()` and `stop()`; `window(t0, t1)` summarises the samples taken in between."""

    def __init__(self, period_s: float = 0.02, uuid: str | None = None):
        self.period_s, self.samples, self.source, self.error = period_s, [], None, None
        self._uuid, self._stop = uuid, threading.Event()
        self._thread = self._proc = self._reader = None
        errors = []
        for cls in (_NvmlBindings, _Pynvml):
            try:
                self._nvml = cls(uuid)
                self._nvml.read()
                self.source = cls.name
                return
            except Exception as exc:  # not installed, or no driver library: try the next source
                errors.append(f"{cls.name}: {type(exc).__name__}: {exc}"[:200])
        self._nvml = None
        if shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
        else:
            self.error = "; ".join(errors + ["nvidia-smi: not found"])

    def start(self) -> "Sampler":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        elif self.source == "nvidia-smi":
            # Drivers before clock "events" were named call the same field clocks_throttle_reasons.
            known = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
            reasons = "clocks_event_reasons.active" if "clocks_event_reasons.active" in known else \
                "clocks_throttle_reasons.active"
            fields = f"clocks.sm,clocks.mem,power.draw,{reasons}"
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                           "-i", "0", f"-lms={max(10, int(self.period_s * 1e3))}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._reader = threading.Thread(target=self._read_smi, daemon=True)
            self._reader.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._nvml.read())
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:200]
                return
            self._stop.wait(self.period_s)

    def _read_smi(self) -> None:
        for line in self._proc.stdout:
            parts = line.split(",")
            if len(parts) != 4:
                continue
            sm, mem, power, reasons = (_number(p) for p in parts)
            self.samples.append(Sample(time.perf_counter(), sm, mem, power, None if reasons is None else int(reasons)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            if not self.samples:
                self.error = (self._proc.stderr.read() or "nvidia-smi printed no samples")[:200]
        if self._nvml is not None:
            self._nvml.close()

    def window(self, t0: float, t1: float, settle_s: float = 0.5) -> dict:
        """Medians (and the power's max) of the samples in [t0 + settle_s, t1], and every clock-event
        reason seen there."""
        inside = [s for s in self.samples if t0 + settle_s <= s.t <= t1]

        def med(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        reasons = 0
        for s in inside:
            reasons |= s.reasons or 0
        powers = [s.power_w for s in inside if s.power_w is not None]
        return {"samples": len(inside), "sm_mhz": med(s.sm_mhz for s in inside),
                "mem_mhz": med(s.mem_mhz for s in inside), "power_w": med(powers),
                "power_max_w": max(powers) if powers else None, "reasons": reason_names(reasons)}
