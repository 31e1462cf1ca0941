"""How long the family sweep takes: every MoE family of the installed transformers wrapped on one local group.

    PYTHONPATH=. python bench/family_sweep.py              # 2 ranks, every family
    PYTHONPATH=. python bench/family_sweep.py --ranks 2 --families mixtral olmoe

The same sweep as tests/test_families.py (dwdp.benchmarks.family_sweep), whose outcomes the tests
assert; here its seconds are the figure: the group's wall time (spawn to the last result), each rank's
own, and the slowest families. A loaded machine makes all of them larger, so the 1-min load average
before and after is stored beside them. Writes <out-dir>/family_sweep_<device>.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dwdp.benchmarks.family_sweep import sweep_rank
from dwdp.models.families import moe_families
from dwdp.observe.timing import device_tag, load_average_1min, machine
from dwdp.runtime.group import launch_local


def _outcome(r: dict) -> str:
    if "error" in r:
        return "error"
    if "refused" in r:
        return "refused"
    return "wrapped"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--families", nargs="*", help="these families only (default: every one transformers has)")
    p.add_argument("--top", type=int, default=10, help="slowest families listed (default 10)")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args(argv)
    import transformers

    families = args.families or [f.name for f in moe_families()]
    load_before = load_average_1min()
    start = time.perf_counter()
    ranks = launch_local(sweep_rank, args.ranks, (families,), timeout_s=args.timeout_s)
    wall = time.perf_counter() - start
    load_after = load_average_1min()
    per_family = {f: max(out["results"][f]["seconds"] for out in ranks) for f in families}
    outcomes = {f: _outcome(ranks[0]["results"][f]) for f in families}
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("wrapped", "refused", "error")}
    report = dict(argv=sys.argv, machine=machine(), transformers=transformers.__version__, ranks=args.ranks,
                  families=len(families), outcomes=counts, wall_s=wall,
                  rank_seconds=[out["seconds"] for out in ranks], family_seconds=per_family,
                  load_average_1min=dict(before=load_before, after=load_after))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"family_sweep_{device_tag('cpu')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{len(families)} families of transformers {transformers.__version__} on {args.ranks} ranks: "
          f"{counts['wrapped']} wrapped, {counts['refused']} refused, {counts['error']} failed; 1-min load average "
          f"{load_before:.1f} before, {load_after:.1f} after; wrote {path}")
    slowest = sorted(per_family.items(), key=lambda kv: -kv[1])[: args.top]
    rows = [("whole sweep (wall)", f"{wall:.1f}")]
    rows += [(f"rank {r}", f"{s:.1f}") for r, s in enumerate(report["rank_seconds"])]
    rows += [(f"  {f} ({outcomes[f]})", f"{s:.2f}") for f, s in slowest]
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  seconds")
    print("\n".join(f"{name:<{width}}  {value:>7}" for name, value in rows))
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
