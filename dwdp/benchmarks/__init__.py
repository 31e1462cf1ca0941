"""The `dwdp bench ...` drivers: `compare` (DWDP against DEP and replicated under imbalance, and with
`--experts-paths` the ways of reading split experts: `experts_paths`), `regimes` (copy and compute
regimes), `serving` (TTFT curves of the two serving modes), and `load`: the options every load bench
against `dwdp serve` shares (`dwdp bench serve`, bench/serve_load.py, bench/chaos.py).

May import: every wing below it, `dwdp.serve`, `dwdp.tune`, `dwdp.predict`, `dwdp.runtime`,
`dwdp.models`, `dwdp.observe`, `dwdp.kernels`, the leaves.
"""
