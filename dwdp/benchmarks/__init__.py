"""The `dwdp bench ...` drivers: `compare` (DWDP against DEP and replicated under imbalance, and with
`--experts-paths` the ways of reading split experts: `experts_paths`), `regimes` (copy and compute
regimes), `serving` (TTFT curves of the two serving modes), `load`: the options every load bench
against `dwdp serve` shares (`dwdp bench serve`, bench/serve_load.py, bench/chaos.py), and
`submit_cost`: what bench/submit_cost.py times (a no-device transport's submit, the bindings calls).

May import: every wing below it, `dwdp.serve`, `dwdp.tune`, `dwdp.predict`, `dwdp.runtime`,
`dwdp.models`, `dwdp.observe`, `dwdp.kernels`, the leaves.
"""
