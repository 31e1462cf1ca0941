"""Measure this machine and choose settings: `dwdp tune` (`recommend`, with the copy measurements
of `copies`) and `dwdp tune-kernel` (`kernel`: the experts kernel's tiles per device).

May import: `dwdp.predict`, `dwdp.runtime`, `dwdp.models`, `dwdp.observe`, `dwdp.kernels`, the leaves.
"""
