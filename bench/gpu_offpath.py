"""The CUDA path off its happy path, on a lent GPU: one prepared run, every check in a child process of its
own (a CUDA error is sticky: one check's illegal address must not fail the next). Not yet run on a GPU.

    python3 -m pip install --no-deps --no-build-isolation -e . && python3 bench/gpu_offpath.py   # under 5 minutes

Checks (each prints one JSON line; a table last; bench/results/gpu_offpath_<gpu>.json):
  i            bench/gpu_check.py --sections i (composite views through CudaTransport and a 2-rank DWDPModel)
  side_stream  a transport's views read by a kernel queued on a side stream (torch.cuda.stream(s)), close()
               at once: close must drain it before the first cuMemUnmap (the device synchronises cleanly after)
  after_close  a 2-rank composite DWDPModel closed, then its experts read (.cpu()): a Python error naming a
               meta tensor, not an illegal address (the device synchronises cleanly after)
  fill_landed  a transport's segment filled by a copy queued behind torch.cuda._sleep (a slow fill):
               fill_landed() returns only once the copy stream is idle and the bytes are there
  pytest       pytest -m gpu -k composite
  ktail        the multi-buffer kernel's time per FLOP at K = 1032 over K = 1024 (target <= 1.3)
  gpt_oss      transformers' own spread on gpt_oss: its eager bf16 logits on CUDA against the same model on the
               CPU (the bound the Triton test should use), and dwdp's reference path against eager on CUDA
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIDE_STREAM = r"""
import json, torch
from dwdp.runtime.composite import composite_layouts
from dwdp.runtime.placement import build_placement
from dwdp.runtime.transport.cuda import CudaTransport
t = CudaTransport(0, torch.device("cuda", 0), mapping="vmm-posix-fd")
layout = composite_layouts(build_placement(8, 1), 2, (2 << 20,), t.granularity(), num_slots=2)[0]
segment = t.alloc_segment(layout.segment_nbytes, tuple(a.nbytes for a in layout.segment_allocations))
views = t.composite_views(layout)
segment.fill_(3)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)                     # ~0.1 s of spinning before the read
    total = views.layer_range(0).to(torch.int32).sum()  # a read of the views, queued behind it
t.close()                                               # must drain the side stream first
torch.cuda.synchronize()
print(json.dumps({"ok": int(total.item()) == 3 * layout.layer_nbytes or None, "sum": int(total.item())}))
"""

AFTER_CLOSE = r"""
import json, sys
sys.path.insert(0, "bench")
from gpu_checks.offpath import after_close_rank
from dwdp.runtime.group import launch_local
ranks = launch_local(after_close_rank, 2, timeout_s=300)
ok = all(r["kernel"] == "composite" and r["error"] and "meta" in r["error"] for r in ranks)
print(json.dumps({"ranks": ranks, "ok": ok}))
"""

FILL_LANDED = r"""
import json, torch
from dwdp.runtime.transport.cuda import CudaTransport
t = CudaTransport(0, torch.device("cuda", 0), mapping="vmm-posix-fd")
segment = t.alloc_segment(4 << 20)
source = torch.full((4 << 20,), 7, dtype=torch.uint8, device="cuda")
torch.cuda._sleep(500_000_000)                          # a slow fill: the copy waits ~0.3 s behind this
segment.copy_(source)
idle_before = torch.cuda.current_stream().query()
t.fill_landed()
idle_after = torch.cuda.current_stream().query()
ok = (not idle_before) and idle_after and bool((segment == 7).all())
t.close()
print(json.dumps({"ok": ok, "idle_before": idle_before, "idle_after": idle_after}))
"""

KTAIL = r"""
import json, torch
from dwdp.kernels import grouped_gemm
E, rows, N = 8, 512, 2048
out = {}
for K in (1024, 1032):
    x = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(E)]
    offs = torch.arange(0, E * rows + 1, rows, device="cuda", dtype=torch.int32)
    for _ in range(3):
        grouped_gemm(x, offs, w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        grouped_gemm(x, offs, w)
    end.record()
    torch.cuda.synchronize()
    out[K] = start.elapsed_time(end) / 20 / (2 * E * rows * N * K)  # ms per FLOP
print(json.dumps({"ratio_per_flop": out[1032] / out[1024], "ok": out[1032] / out[1024] <= 1.3}))
"""

GPT_OSS = r"""
import json, torch
from dwdp.models.tiny import build_tiny_model
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import DWDPGroup
from dwdp.runtime.model import DWDPModel
ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1))
def logits(model, x):
    with torch.no_grad():
        torch.manual_seed(0)
        return model(input_ids=x).logits.float().cpu()
cpu = build_tiny_model("gpt_oss", seed=3, dtype=torch.bfloat16, initializer_range=0.02)
cpu.set_experts_implementation("eager")
on_cpu = logits(cpu, ids)
gpu = build_tiny_model("gpt_oss", seed=3, dtype=torch.bfloat16, initializer_range=0.02).cuda()
gpu.set_experts_implementation("eager")
on_gpu = logits(gpu, ids.cuda())
with DWDPModel(gpu, DWDPConfig(experts_kernel="reference", backend="cuda"), DWDPGroup(0, 1)) as w:
    dwdp = logits(w, ids.cuda())
print(json.dumps({"eager_cuda_vs_cpu": (on_gpu - on_cpu).abs().max().item(),
                  "dwdp_reference_vs_eager_cuda": (dwdp - on_gpu).abs().max().item(),
                  "scale": on_gpu.abs().max().item(), "ok": True}))
"""


def _child(name: str, cmd: list[str], timeout_s: float) -> dict:
    started = time.monotonic()
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    result = {"check": name, "seconds": round(time.monotonic() - started, 1), "exit": run.returncode}
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if lines:
        result.update(json.loads(lines[-1]))
    if run.returncode != 0:
        result.update(ok=False, error=(run.stderr or run.stdout)[-1500:])
    elif name in ("i", "pytest"):
        result.update(ok=True, tail=run.stdout[-1500:])
    return result


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_offpath.py needs a CUDA GPU")
        return 2
    py = sys.executable
    checks = [("i", [py, "bench/gpu_check.py", "--sections", "i"], 240),
              ("side_stream", [py, "-c", SIDE_STREAM], 60),
              ("after_close", [py, "-c", AFTER_CLOSE], 120),
              ("fill_landed", [py, "-c", FILL_LANDED], 60),
              ("pytest", [py, "-m", "pytest", "-q", "-m", "gpu", "-k", "composite", "-p", "no:cacheprovider"], 240),
              ("ktail", [py, "-c", KTAIL], 120),
              ("gpt_oss", [py, "-c", GPT_OSS], 120)]
    results = []
    gpu = torch.cuda.get_device_name(0).split()[-1].lower()
    out = ROOT / "bench" / "results" / f"gpu_offpath_{gpu}.json"
    for name, cmd, timeout_s in checks:
        results.append(_child(name, cmd, timeout_s))
        print(json.dumps(results[-1])[:400], flush=True)
        out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "results": results}, indent=2) + "\n")
    print(f"{'check':12s} {'ok':5s} seconds")
    for r in results:
        print(f"{r['check']:12s} {str(r.get('ok')):5s} {r.get('seconds', '-')}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
