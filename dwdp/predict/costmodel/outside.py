"""What a rank pays per forward outside the forward, whatever the mode (DWDP, DEP, replicated).

Legend: T = tokens of the forward on this rank. Seconds and bytes.

Three named parts:
- host: scheduling, sampling, host work and the gap until the next forward starts: one constant per
  forward (`Calibration.outside_host_s`, fitted to one end-to-end point; on a CPU server measured);
- KV hand-off: the forward's KV cache sent to the generation side, T x KV bytes per token over the
  link (`kv_bytes_per_token`, the link's copy-engine rate): derived, nothing fitted;
- other: whatever else; `Calibration.outside_other_s`, kept apart so a second measured point can
  split it from host (with one point it cannot be told apart and stays 0).
A DEP step pays it once for the group: host and other, and the slowest rank's KV hand-off (the next
step starts when every rank is done); a DWDP rank pays it alone after each of its forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dwdp.predict.costmodel.calibration import Calibration
from dwdp.predict.costmodel.formats import ACT_BYTES
from dwdp.predict.costmodel.hardware import Hardware
from dwdp.predict.costmodel.models import ModelSpec

OUTSIDE_PARTS = ("Host", "KV hand-off", "Other")


@dataclass(frozen=True)
class OutsideForward:
    """host_s, other_s: seconds per forward; kv_s_per_token: seconds of KV hand-off per token."""

    host_s: float = 0.0
    kv_s_per_token: float = 0.0
    other_s: float = 0.0

    def __post_init__(self):
        for name in ("host_s", "kv_s_per_token", "other_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0: a cost, not a credit")

    def parts(self, tokens) -> dict:
        """{part of OUTSIDE_PARTS: seconds} of a forward of `tokens` (arrays give one value per entry)."""
        t = np.asarray(tokens, float)
        return {"Host": np.full_like(t, self.host_s), "KV hand-off": t * self.kv_s_per_token,
                "Other": np.full_like(t, self.other_s)}

    def seconds(self, tokens):
        """Seconds outside a forward of `tokens` (arrays give one value per entry)."""
        return self.host_s + self.other_s + np.asarray(tokens, float) * self.kv_s_per_token


NONE = OutsideForward()


def kv_bytes_per_token(spec: ModelSpec, elem_bytes: float = ACT_BYTES) -> float:
    """Bytes of KV cache one prompt token leaves in every layer (what a context server hands to the
    generation side): MLA keeps its latent and rope key (kv_lora_rank + qk_rope_head_dim), other
    attention K and V of every KV head. Sliding-window layers are counted whole (the hand-off of a
    prompt shorter than the window sends them all)."""
    if spec.mla is not None:
        per_layer = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    else:
        per_layer = 2 * spec.num_kv_heads * spec.head_dim
    return float(per_layer * spec.num_layers * elem_bytes)


def outside_forward(spec: ModelSpec, hw: Hardware, cal: Calibration) -> OutsideForward:
    """The GPU term: host and other from the calibration, the KV hand-off over the copy engines'
    NVLink rate (generation servers in the same NVLink domain, as the DWDP paper's NVL72 runs)."""
    return OutsideForward(cal.outside_host_s, kv_bytes_per_token(spec) / hw.copy_bytes_per_s, cal.outside_other_s)
