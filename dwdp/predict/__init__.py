"""Will DWDP pay on this model, hardware and workload? Predictions without running a model.

The roofline `costmodel/` with its `data/` (model presets, hardware figures, fitted constants), the
per-iteration simulator of DWDP against DEP (`simulate`), the serving queue simulator `serve_sim`, many-to-one
`contention` of pulls, request `packing` into forwards and per-rank `workload` streams.

May import: `dwdp.runtime` (placement and copy plans, to simulate the real ones), `dwdp.models`,
`dwdp.observe`, `dwdp.kernels`, and the leaves.
"""
