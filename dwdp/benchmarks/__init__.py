"""The `dwdp bench ...` drivers: `compare` (DWDP against DEP and replicated under imbalance),
`regimes` (copy and compute regimes), `serving` (TTFT curves of the two serving modes).

May import: every wing below it, `dwdp.serve`, `dwdp.tune`, `dwdp.predict`, `dwdp.runtime`,
`dwdp.models`, `dwdp.observe`, `dwdp.kernels`, the leaves.
"""
