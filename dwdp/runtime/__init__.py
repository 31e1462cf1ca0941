"""One rank's forward and the group it belongs to.

What a DWDP forward runs through: the wrapper (`model`), its `config`, the process `group` and its
one collective at setup, expert `placement`, the sliced copy `plan`, the `prefetch` pipeline and its
two slots, the experts function (`experts`, `experts_kernel`, `expert_math`), `liveness` and
`failover` around lost peers, the `transport/` backends (host, cuda) that move the bytes, the
`devices` each rank uses, and the `baselines/` (DEP, replicated) that run the same models another
way. `coverage` reports which experts path the runtime takes for each model family.

May import: `dwdp.models`, `dwdp.observe`, `dwdp.kernels`, and the leaves `dwdp.envs`,
`dwdp.versions`. Never `dwdp.predict`, `dwdp.tune`, `dwdp.benchmarks` or `dwdp.serve`.
"""
