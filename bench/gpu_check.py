"""The cuda backend meets a GPU: correctness and the figures that decide whether DWDP pays, on one GPU.

Run on a machine with one NVIDIA GPU and its own packages (no network needed):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 bench/gpu_check.py --quick

--quick is the check to run first whenever a GPU is at hand (a few minutes of a borrowed one): correctness
first (b, d, f, i, then the kernels' correctness halves of e and g), the timings after (a, c, e, g), each
timing step skipped once --budget-s is spent; the JSON is rewritten after every step, so a crash or a
kill leaves what ran, and one verdict table comes last. Section h (serving) needs carried wheels and is
left to a full run.

Sections, one module each under bench/gpu_checks/ (two processes share the one GPU where ranks are
needed, over a gloo group):
  a  copy bandwidth per slice size (256 KiB .. 8 MiB): one cudaMemcpyAsync per slice and one
     cudaMemcpyBatchAsync (the copy-engine API), and tensor.copy_ per slice (an SM kernel)
  b  CUDA IPC: each rank maps the other's segment through the cuda transport and pulls its seeded
     pattern bit-exactly (batch and per-copy paths); opening one's own handle must fail; the
     prefetch as DWDP issues it against bare batches of the same bytes, step by step (the plan's
     slices, the copies issued, the batch cuts, the full submit and wait), both ranks at once and
     each alone, with the host's microseconds per submit and per layer beside each bandwidth
  c  overlap: a large bf16 GEMM alone, the prefetch alone, both at once (with and without the
     PreferOverlapWithCompute hint): share of the prefetch hidden, slowdown of each; SM clock,
     memory clock and power sampled while the GEMM runs alone, with the prefetch, and with an SM
     copy of the same bytes; whether each copy path needs SMs (issued under a kernel holding them)
  d  a 2-rank DWDPModel (cuda backend, Triton experts path) on a bf16 model with hundreds of MB
     of experts: logits against the unwrapped model, tokens/s against the same kernel with every
     expert local (one-rank group, no copies), the compute stream's stall in prefetch waits, and
     the host's microseconds per prefetch submit and per layer
  e  the Triton kernel: against the reference (output poisoned first), TFLOP/s against
     F.grouped_mm and per-expert matmuls, multi-buffer / single-buffer, measured bf16 matmul peak;
     per shape our TFLOP/s, grouped_mm on the experts merged beforehand, the ratio, the launch
     configuration used, and TMA against pointer loads with the same tiles
  f  write-after-read stress: many layers through two slots while compute is slowed, each
     'kernel' checksumming its slot on the device
  g  fp8 experts (128 x 128 block scales): the kernel's bf16 dots and fp8 x fp8 dots against their
     references; per shape TFLOP/s of both next to the same experts in bf16 (ours, and grouped_mm on
     the experts merged beforehand), the ratios (target: fp8 dots >= 1.6x our bf16) and the launch
     configurations
  h  `dwdp serve --device cuda`, two workers: time to ready, TTFT p50/p99 and tokens/s under an
     open-loop load through the openai client, worst of the first 50 forwards after ready against
     their median (needs the serve extras: bench/gpu_wheels.sh fetches them for a machine without network)
  i  composite views (not yet run on a GPU): two ranks map each other's experts with cuMem and POSIX fds
     passed over a Unix socket, views compared bit-exactly with the seeded experts, torch._grouped_mm on the
     composite view against the same call on a contiguous clone (target >= 0.98) and our multi-buffer kernel
One GPU measures copies inside one device's memory, not NVLink: NVLink stays unmeasured here.

A section whose optional packages (its module's REQUIRES) are missing is skipped, saying which and how to
carry them. Prints versions first and a table last; writes bench/results/gpu_check_<gpu>.json; exits 0
when every section that ran passed, 1 on any correctness failure, 2 at once on a machine without a GPU.
Takes a few minutes.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from gpu_checks import a_copy, b_ipc, c_overlap, d_model, e_kernel, f_war, g_fp8, h_serve, i_composite
from gpu_checks.common import RESULTS, code_version, versions

# Letter -> section module (KEY, run(sections[, part]) -> dict, summary(section) -> rows), in run order.
SECTIONS = {"a": a_copy, "b": b_ipc, "c": c_overlap, "d": d_model, "e": e_kernel, "f": f_war, "g": g_fp8,
            "h": h_serve, "i": i_composite}
# --quick: (letter, part) steps, every correctness check before any timing. A module whose run takes `part`
# runs that half; the others run whole.
QUICK = (("b", "all"), ("d", "all"), ("f", "all"), ("i", "all"), ("e", "correctness"), ("g", "correctness"),
         ("a", "all"), ("c", "all"), ("e", "timing"), ("g", "timing"))
CORRECTNESS_PARTS = ("all", "correctness")


# How a machine without network gets a section's missing packages (GPU_NOTES: the image installs nothing).
CARRY = ("carry them as wheels: run bench/gpu_wheels.sh on a machine with network, copy .whl/ over, then "
         "`python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`")


def missing_requirements(module) -> list[str]:
    """The importable names in the section module's REQUIRES that this Python cannot import."""
    return [name for name in getattr(module, "REQUIRES", ()) if importlib.util.find_spec(name) is None]


def _merge(into: dict, more: dict) -> None:
    """Fold a second half of a section into the first: nested dicts merged, lists joined, numbers summed
    for "seconds", anything else replaced."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        elif key == "seconds" and key in into:
            into[key] += value
        else:
            into[key] = value


def run_steps(steps, modules: dict, after_each=lambda sections: None, budget_s: float | None = None) -> dict:
    """Run `steps`, (letter, part) pairs in order: KEY -> the section's dict (its "error" traceback if a
    step raised, "skipped" saying why if its packages are missing or a timing step found the budget
    spent) plus its "seconds"; the halves of one section are merged. after_each(sections) runs after
    every step (the caller writes the JSON there)."""
    sections: dict = {}
    started = time.perf_counter()
    for letter, part in steps:
        if letter not in modules:
            continue
        module = modules[letter]
        t0 = time.perf_counter()
        missing = missing_requirements(module)
        if missing:
            sections[module.KEY] = {"skipped": f"needs {', '.join(missing)}, not installed here; {CARRY}",
                                    "missing": missing}
            print(f"section {letter} skipped: {sections[module.KEY]['skipped']}", flush=True)
            continue
        if budget_s is not None and part not in CORRECTNESS_PARTS and t0 - started > budget_s:
            skipped = {"skipped": f"{part} skipped: the {budget_s:.0f} s budget was spent", "missing": []}
            _merge(sections.setdefault(module.KEY, {}), skipped)
            print(f"section {letter} ({part}) skipped: over budget", flush=True)
            continue
        takes_part = "part" in inspect.signature(module.run).parameters
        try:
            result = module.run(sections, part=part) if takes_part else module.run(sections)
        except Exception:
            result = {"error": traceback.format_exc()}
            print(result["error"], file=sys.stderr, flush=True)
        result["seconds"] = time.perf_counter() - t0
        _merge(sections.setdefault(module.KEY, {}), result)
        print(f"section {letter}{'' if part == 'all' else f' ({part})'} done in {result['seconds']:.1f} s", flush=True)
        after_each(sections)
    return sections


def run_sections(selected: str, modules: dict, after_each=lambda sections: None) -> dict:
    """Run the sections whose letters are in `selected`, whole, in the modules' order (see run_steps)."""
    return run_steps([(letter, "all") for letter in modules if letter in selected], modules, after_each)


def failures_of(sections: dict) -> list[str]:
    """Each failed check and each section that raised; skipped sections fail nothing."""
    failures = [f for s in sections.values() for f in s.get("failures", [])]
    return failures + [f"{k}: raised {v['error'].splitlines()[-1]}" for k, v in sections.items() if "error" in v]


def _summary(sections: dict, modules: dict | None = None) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows for the table."""
    rows = []
    for module in (modules or SECTIONS).values():
        section = sections.get(module.KEY)
        if not isinstance(section, dict):
            continue
        if section.get("missing"):
            rows.append((f"{module.KEY} skipped", "missing " + ", ".join(section["missing"]), "", "skip"))
            continue
        if "error" not in section:
            rows += module.summary(section)
        if "skipped" in section:  # a timing half past the --quick budget
            rows.append((f"{module.KEY} skipped", section["skipped"][:60], "", "skip"))
    for key, value in sections.items():
        if isinstance(value, dict) and "error" in value:
            rows.append((f"{key} raised", value["error"].splitlines()[-1][:60], "", "FAIL"))
    return rows


def _table(rows) -> str:
    widths = [max(len(r[i]) for r in rows + [("check", "measured", "target", "verdict")]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("check", "measured", "target", "verdict"), widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="".join(SECTIONS),
                        help=f"which sections to run, e.g. 'ab' (default {''.join(SECTIONS)})")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu_check_<gpu>.json)")
    parser.add_argument("--quick", action="store_true",
                        help="correctness of b, d, f, i, e, g first, then the timings of a, c, e, g (no h)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="with --quick: skip timing steps that would start after this many seconds")
    args = parser.parse_args()
    from dwdp.runtime.transport import cuda_api

    info = cuda_api.probe()
    if not info.usable or not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU on this machine ({info.error or 'torch has no CUDA'}); nothing was checked")
        return 2
    from dwdp.observe.timing import device_tag

    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    started = time.perf_counter()
    path = args.out or RESULTS / f"gpu_check_{device_tag('cuda')}{'_quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(sections: dict) -> dict:
        result = {"bench": "gpu_check", "date": time.strftime("%Y-%m-%d"), "code": code_version(), "versions": found,
                  "quick": args.quick, "seconds": time.perf_counter() - started, "sections": sections,
                  "failures": failures_of(sections)}
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return result

    def after_each(sections: dict) -> None:
        torch.cuda.empty_cache()
        write(sections)

    if args.quick:
        sections = run_steps(QUICK, SECTIONS, after_each, budget_s=args.budget_s)
    else:
        sections = run_sections(args.sections, SECTIONS, after_each)
    result = write(sections)
    failures = result["failures"]
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    for f in failures:
        print(f"FAILED: {f}")
    print(_table(_summary(sections)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
