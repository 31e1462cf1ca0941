"""The cuda backend meets a GPU: correctness and the figures that decide whether DWDP pays, on one GPU.

Run on a machine with one NVIDIA GPU and its own packages (no network needed):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 bench/gpu_check.py

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
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from gpu_checks import a_copy, b_ipc, c_overlap, d_model, e_kernel, f_war, g_fp8, h_serve, i_composite
from gpu_checks.common import RESULTS, code_version, versions

# Letter -> section module (KEY, run(sections) -> dict, summary(section) -> rows), in run order.
SECTIONS = {"a": a_copy, "b": b_ipc, "c": c_overlap, "d": d_model, "e": e_kernel, "f": f_war, "g": g_fp8,
            "h": h_serve, "i": i_composite}


# How a machine without network gets a section's missing packages (GPU_NOTES: the image installs nothing).
CARRY = ("carry them as wheels: run bench/gpu_wheels.sh on a machine with network, copy .whl/ over, then "
         "`python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`")


def missing_requirements(module) -> list[str]:
    """The importable names in the section module's REQUIRES that this Python cannot import."""
    return [name for name in getattr(module, "REQUIRES", ()) if importlib.util.find_spec(name) is None]


def run_sections(selected: str, modules: dict, after_each=lambda: None) -> dict:
    """Run the sections whose letters are in `selected`, in order: KEY -> the section's dict (its "error"
    traceback if it raised, "skipped" saying why if its packages are missing) plus its "seconds"."""
    sections: dict = {}
    for letter, module in modules.items():
        if letter not in selected:
            continue
        t0 = time.perf_counter()
        missing = missing_requirements(module)
        if missing:
            sections[module.KEY] = {"skipped": f"needs {', '.join(missing)}, not installed here; {CARRY}",
                                    "missing": missing}
            print(f"section {letter} skipped: {sections[module.KEY]['skipped']}", flush=True)
            continue
        try:
            sections[module.KEY] = module.run(sections)
        except Exception:
            sections[module.KEY] = {"error": traceback.format_exc()}
            print(sections[module.KEY]["error"], file=sys.stderr, flush=True)
        sections[module.KEY]["seconds"] = time.perf_counter() - t0
        print(f"section {letter} done in {sections[module.KEY]['seconds']:.1f} s", flush=True)
        after_each()
    return sections


def failures_of(sections: dict) -> list[str]:
    """Each failed check and each section that raised; skipped sections fail nothing."""
    failures = [f for s in sections.values() for f in s.get("failures", [])]
    return failures + [f"{k}: raised {v['error'].splitlines()[-1]}" for k, v in sections.items() if "error" in v]


def _summary(sections: dict, modules: dict | None = None) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows for the table."""
    rows = []
    for module in (modules or SECTIONS).values():
        section = sections.get(module.KEY)
        if isinstance(section, dict) and "skipped" in section:
            rows.append((f"{module.KEY} skipped", "missing " + ", ".join(section["missing"]), "", "skip"))
        elif isinstance(section, dict) and "error" not in section:
            rows += module.summary(section)
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
    sections = run_sections(args.sections, SECTIONS, after_each=torch.cuda.empty_cache)
    failures = failures_of(sections)
    result = {"bench": "gpu_check", "date": time.strftime("%Y-%m-%d"), "code": code_version(), "versions": found,
              "seconds": time.perf_counter() - started, "sections": sections, "failures": failures}
    path = args.out or RESULTS / f"gpu_check_{device_tag('cuda')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    for f in failures:
        print(f"FAILED: {f}")
    print(_table(_summary(sections)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
