"""gpu_check section d  a 2-rank DWDPModel (cuda backend, Triton experts path) on a bf16 model with hundreds of MB of
   experts: logits against the unwrapped model, tokens/s against the same kernel with every expert
   local (one-rank group, no copies), and the compute stream's stall in prefetch waits."""
from __future__ import annotations

import time

import torch

from .common import MiB

KEY = "d_model"


def _model_rank(rank: int, opts: dict) -> dict:
    from dwdp import DWDPConfig, DWDPModel
    from dwdp.observe.device_timing import DeviceWaitTimer
    from dwdp.runtime.group import DWDPGroup, init_group
    from dwdp.models.tiny import build_tiny_model

    torch.cuda.set_device(0)
    group = init_group()
    build = dict(hidden=opts["hidden"], intermediate=opts["intermediate"], num_experts=opts["experts"],
                 top_k=opts["top_k"], num_layers=opts["layers"], vocab=opts["vocab"], dtype=torch.bfloat16, seed=0,
                 initializer_range=opts["initializer_range"])
    gen = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(3, opts["vocab"], (opts["batch"], opts["seq"]), generator=gen).cuda()
    model = build_tiny_model(opts["family"], **build).cuda()
    experts = model.model.layers[0].mlp.experts
    seen = {}
    def keep_first_call(module, args, out):
        seen.setdefault("layer0", (args, out))  # returns None: a hook's return value would replace the output

    hook = experts.register_forward_hook(keep_first_call)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        reference = model(input_ids=ids).logits.float()
        hook.remove()
        # Two correct bf16 paths of transformers disagree too: their spread scales the tolerance.
        model.set_experts_implementation("grouped_mm")
        spread = (model(input_ids=ids).logits.float() - reference).abs().max().item()
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    config = DWDPConfig(backend="cuda", slice_bytes=opts["slice_bytes"])
    dwdp = DWDPModel(model, config, group)
    local = DWDPModel(build_tiny_model(opts["family"], **build).cuda(), config, DWDPGroup(0, 1))
    result = {"rank": rank, "expert_bytes": expert_bytes, "experts_kernel": dwdp.experts_kernel,
              "transformers_spread": spread,
              "nvtx": type(dwdp.prefetcher.nvtx).__name__ + ":" + dwdp.prefetcher.nvtx.source}
    with torch.no_grad():
        args, out = seen["layer0"]
        dwdp(input_ids=ids[:, :8])  # a forward keeps the prefetcher's layer cycle in step
        layer0 = experts(*args).float()  # the same module, now running the dwdp experts function
        result["layer0_experts_rel_err"] = ((layer0 - out.float()).norm() / out.float().norm()).item()
        for name, wrapped in (("dwdp", dwdp), ("local", local)):
            logits = wrapped(input_ids=ids).logits.float()
            result[f"{name}_max_abs_diff"] = (logits - reference).abs().max().item()
        result["scale"] = reference.abs().max().item()
        again = dwdp(input_ids=ids).logits.float()
        result["dwdp_second_forward_diff"] = (again - reference).abs().max().item()
        tokens = ids.numel()
        timer = DeviceWaitTimer()
        for name, wrapped in (("dwdp", dwdp), ("local", local)):
            for _ in range(2):
                wrapped(input_ids=ids)
            torch.cuda.synchronize()
            group.barrier()  # both ranks run the same mode at the same time
            if name == "dwdp":
                dwdp.prefetcher.wait_timer = timer
                dwdp.stats.reset()
            start = time.perf_counter()
            for _ in range(opts["forwards"]):
                wrapped(input_ids=ids)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            result[f"{name}_tokens_per_s"] = opts["forwards"] * tokens / elapsed
            result[f"{name}_ms_per_forward"] = elapsed / opts["forwards"] * 1e3
        dwdp.prefetcher.wait_timer = None
        result["stall_ms_per_forward"] = timer.total_ms() / opts["forwards"]
        result["copied_MiB_per_forward"] = dwdp.stats.bytes_copied / opts["forwards"] / MiB
        result["host_wait_ms_per_forward"] = dwdp.stats.wait_s / opts["forwards"] * 1e3
        result.update(_host_cost(dwdp.stats, opts))
    result["memory"] = {"local_expert_MiB": dwdp.memory.local_expert_bytes / MiB,
                        "prefetch_MiB": dwdp.memory.prefetch_buffer_bytes / MiB,
                        "full_expert_MiB": dwdp.memory.full_expert_bytes / MiB}
    dwdp.close()
    local.close()
    return result


def _host_cost(stats, opts: dict) -> dict:
    """Host microseconds the prefetch's submits took (transport.submit: batches issued on the copy
    stream), per submit and per MoE layer, over the timed DWDP forwards."""
    layers = opts["forwards"] * opts["layers"]
    return {"host_us_per_submit": stats.issue_s / max(1, stats.plans_issued) * 1e6,
            "host_us_per_layer": stats.issue_s / layers * 1e6, "submits_per_layer": stats.plans_issued / layers}


def _logits_bound(r: dict) -> float:
    """The bf16 tolerance of the CPU tests, or twice the spread between transformers' own eager and
    grouped_mm experts paths on the same input when that is wider (bench/bf16_spread.py)."""
    return max(2e-2 + 2e-2 * r["scale"], 2 * r["transformers_spread"])


def run(sections: dict) -> dict:
    from dwdp.runtime.group import launch_local

    opts = {"family": "qwen3_moe", "hidden": 2048, "intermediate": 1024, "experts": 16, "top_k": 4, "layers": 4,
            "vocab": 4096, "batch": 4, "seq": 1024, "forwards": 10, "slice_bytes": MiB,
            "initializer_range": 0.02}
    ranks = launch_local(_model_rank, 2, (opts,), timeout_s=400)
    failures = []
    for r in ranks:
        if not r["layer0_experts_rel_err"] < 1e-2:
            failures.append(f"model rank {r['rank']}: first MoE layer's experts differ from transformers' by "
                            f"{r['layer0_experts_rel_err']:.3e} (relative)")
        bound = _logits_bound(r)
        for key in ("dwdp_max_abs_diff", "dwdp_second_forward_diff", "local_max_abs_diff"):
            if not r[key] <= bound:
                failures.append(f"model rank {r['rank']}: {key}={r[key]:.3e} > {bound:.3e}")
    return {"options": opts, "ranks": ranks, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "ranks" in section:
        for r in section["ranks"]:
            bound = _logits_bound(r)
            ok = r["dwdp_max_abs_diff"] <= bound
            rows.append((f"d first MoE layer vs transformers, rank {r['rank']}",
                         f"{r['layer0_experts_rel_err']:.2e} rel", "< 1e-2",
                         "ok" if r["layer0_experts_rel_err"] < 1e-2 else "FAIL"))
            rows.append((f"d DWDPModel logits vs unwrapped, rank {r['rank']}",
                         f"{r['dwdp_max_abs_diff']:.2e} (transformers' own spread {r['transformers_spread']:.2e})",
                         f"<= {bound:.2e}", "ok" if ok else "FAIL"))
            rows.append((f"d DWDP / all-local tokens/s, rank {r['rank']}",
                         f"{r['dwdp_tokens_per_s'] / r['local_tokens_per_s']:.3f}", "", "info"))
            rows.append((f"d compute stall in waits, rank {r['rank']}",
                         f"{r['stall_ms_per_forward']:.3f} of {r['dwdp_ms_per_forward']:.2f} ms/fwd", "", "info"))
            if "host_us_per_submit" in r:
                rows.append((f"d host us per prefetch submit / per layer, rank {r['rank']}",
                             f"{r['host_us_per_submit']:.0f} / {r['host_us_per_layer']:.0f} "
                             f"({r['copied_MiB_per_forward']:.0f} MiB pulled per forward)", "", "info"))
    return rows
