"""Seeing what happened: per-rank Chrome traces (`tracing`), NVTX ranges (`nvtx_ranges`), the phase
names both use (`phases`), the one timing helper of every benchmark (`timing`, `device_timing`) and
the `traces/` readers and analyses behind the top-level `traces/` scripts.

May import: `dwdp.kernels` and the leaves `dwdp.envs`, `dwdp.versions`; nothing of the runtime.
"""
