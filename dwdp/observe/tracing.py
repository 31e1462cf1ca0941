"""Per-rank Chrome trace recording (`trace_rank{r}.json`, opens in Perfetto).

Lanes: tid 0 is the compute thread (forward, attention, router, MoE compute, prefetch issue and
wait); tid 100 + i is copier i, one event per copy slice with its source, destination and bytes (on the
host backend, i = inflight is the compute thread copying batches no copier had started when it waited).
Timestamps are microseconds of the host's monotonic clock, shared by every process on the host,
so the ranks' files line up. With recording off nothing here runs: callers hold `None`.

Event args: forward {iteration}; attention and router {layer: decoder layer, iteration} (router
also {moe_layer}); MoE compute {layer: MoE layer, iteration}; prefetch issue and wait {layer: MoE
layer, slot, iteration} (an issue made before the first forward has iteration -1); copy slice
{src, dst, bytes, layer: MoE layer, slot, expert}. otherData carries rank, group_size,
num_moe_layers and plan_bytes_per_layer (bytes one layer's plan copies).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import torch

from dwdp.observe import phases

COMPUTE_TID = 0
COPIER_TID0 = 100


def now_us() -> float:
    return time.perf_counter_ns() / 1e3


class TraceRecorder:
    """Collects one rank's events in memory; `write` puts them in `directory/trace_rank{r}.json`."""

    def __init__(self, directory: str | Path, rank: int, group_size: int, num_moe_layers: int, plan_bytes: dict):
        self.directory = Path(directory)
        self.rank, self.group_size, self.num_moe_layers = rank, group_size, num_moe_layers
        self.plan_bytes = {str(k): v for k, v in plan_bytes.items()}
        self.iteration = -1
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._copier_tids: set[int] = set()
        self._forward_start: float | None = None

    def complete(self, name: str, start_us: float, end_us: float, tid: int = COMPUTE_TID, cat: str = "dwdp",
                 **args) -> None:
        event = {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": tid, "ts": start_us,
                 "dur": max(end_us - start_us, 0.0), "args": args}
        with self._lock:
            self._events.append(event)

    def begin_forward(self) -> None:
        self.iteration += 1
        self._forward_start = now_us()

    def end_forward(self) -> None:
        if self._forward_start is not None:
            self.complete(phases.FORWARD, self._forward_start, now_us(), iteration=self.iteration)
            self._forward_start = None

    def copy_slice(self, worker: int, start_us: float, end_us: float, peer: int, nbytes: int, layer: int,
                   slot: int, expert: int) -> None:
        self._copier_tids.add(COPIER_TID0 + worker)
        self.complete(phases.COPY_SLICE, start_us, end_us, tid=COPIER_TID0 + worker, cat="copy",
                      src=peer, dst=self.rank, bytes=nbytes, layer=layer, slot=slot, expert=expert)

    def _metadata(self) -> list[dict]:
        meta = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": COMPUTE_TID, "args": {"name": "compute"}}]
        for tid in sorted(self._copier_tids):
            meta.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                         "args": {"name": f"copier {tid - COPIER_TID0}"}})
        return meta

    def write(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_rank{self.rank}.json"
        with self._lock:
            events = self._metadata() + sorted(self._events, key=lambda e: e["ts"])
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"rank": self.rank, "group_size": self.group_size, "pid": os.getpid(),
                             "num_moe_layers": self.num_moe_layers, "plan_bytes_per_layer": self.plan_bytes}}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)  # readers never see a half-written file
        return path


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def phase_modules(model: torch.nn.Module, experts_names: list[str]):
    """(module, phase, decoder layer, extra args) for every attention block and MoE router."""
    for module_name, module in model.named_modules():
        match = _LAYER_INDEX.search(module_name + ".")
        if match and module_name.endswith(".self_attn"):
            yield module, phases.ATTENTION, int(match.group(1)), {}
    for moe_layer, experts_name in enumerate(experts_names):
        parent = model.get_submodule(experts_name.rsplit(".", 1)[0])
        router = getattr(parent, "gate", None)
        match = _LAYER_INDEX.search(experts_name + ".")
        if isinstance(router, torch.nn.Module) and match:
            # `layer` is the decoder layer, as for attention; `moe_layer` matches MoE compute's `layer`.
            yield router, phases.ROUTER, int(match.group(1)), {"moe_layer": moe_layer}


def attach_phase_hooks(model: torch.nn.Module, recorder: TraceRecorder, experts_names: list[str]) -> list:
    """Time every attention block and MoE router of `model` with forward hooks; returns the handles."""
    handles = []
    for module, name, layer, extra in phase_modules(model, experts_names):
        state = {}

        def pre(*_, state=state):
            state["t"] = now_us()

        def post(*_, state=state, name=name, layer=layer, extra=extra):
            recorder.complete(name, state.pop("t", now_us()), now_us(), layer=layer, iteration=recorder.iteration,
                              **extra)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


def attach_nvtx_hooks(model: torch.nn.Module, ranges, experts_names: list[str]) -> list:
    """NVTX ranges (dwdp.observe.nvtx_ranges.NvtxRanges) around the forward, attention blocks and routers."""
    handles = [model.register_forward_pre_hook(lambda *_: ranges.push(phases.FORWARD)),
               model.register_forward_hook(lambda *_: ranges.pop())]
    for module, name, layer, _extra in phase_modules(model, experts_names):
        handles.append(module.register_forward_pre_hook(lambda *_, name=name, layer=layer: ranges.push(name, layer)))
        handles.append(module.register_forward_hook(lambda *_: ranges.pop()))
    return handles
