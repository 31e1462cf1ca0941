"""One prefill worker: a DWDP rank that serves its own request queue, independently of its peers.

Legend: P = prompts in a forward (its requests), Tmax = longest prompt of the forward, V = vocabulary.

After the one collective of DWDP setup the worker never talks to another rank: it takes what is
in its queue and runs one forward through DWDPModel (whose expert prefetch runs in this same
process): packed, at most `max_num_tokens` real tokens, prompts back to back and long ones in
chunks (dwdp.serve.prefill), or, for families whose attention cannot pack, left-padded under
`max_num_tokens` padded tokens. Every finished request is answered with its first token, timings
and a KV artifact.

A health thread reads the peers' liveness (re-planning around a lost one) and reports this rank's
failover status to the router several times per stall bound; a forward that fails for what the
rank lost (RankDegraded) answers its requests as retryable, so the router hands them on.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque

import torch

from dwdp import envs
from dwdp.runtime.failover import RankDegraded
from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import artifact_metadata, latent_layout, request_cache, to_host, write_kv_artifact
from dwdp.serve.packcheck import worker_forwards
from dwdp.serve.prefill import InProgress, advance
from dwdp.serve.protocol import (STOP, BatchDone, BatchStarted, InjectFault, PrefillError, PrefillJob, PrefillResult,
                                 WorkerFailed, WorkerHealth, WorkerReady, greedy_first)
from dwdp.serve.scheduling import take_forward, take_pieces

log = logging.getLogger("dwdp")



def pad_left(prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Left-pad prompts so every last token sits in the last column.

    Returns input_ids [P, Tmax], attention_mask [P, Tmax], position_ids [P, Tmax] (each prompt
    counts from 0 at its first real token, as it would alone) and the padding of each row.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)   # [P, Tmax]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [P, Tmax]
    pads = []
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        ids[row, pad:] = torch.tensor(prompt, dtype=torch.long)
        mask[row, pad:] = 1
        pads.append(pad)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)            # [P, Tmax]
    return ids, mask, positions, pads


def model_info(model, packing: tuple[bool, str]) -> dict:
    """What the router and /health learn of the model; packing: (is_packed, padded_reason) from
    dwdp.serve.packcheck.worker_forwards."""
    cfg = model.config
    is_packed, why = packing
    return {"vocab_size": int(cfg.vocab_size), "max_position_embeddings": int(cfg.max_position_embeddings),
            "num_layers": int(cfg.num_hidden_layers), "model_type": cfg.model_type,
            "local_expert_bytes": model.memory.local_expert_bytes,
            "full_expert_bytes": model.memory.full_expert_bytes,
            "forwards": "packed" if is_packed else "padded", "padded_reason": why}


def worker_info(model, ready_s: float, backend: str, experts_kernel: str) -> dict:
    """What this worker (a DWDPModel or DEPModel) runs on and what it holds there, for /health and /metrics."""
    device = model.model.get_input_embeddings().weight.device
    info = {"device": str(device), "backend": backend, "experts_kernel": experts_kernel,
            "dtype": str(model.model.get_input_embeddings().weight.dtype).removeprefix("torch."),
            "local_expert_bytes": model.memory.local_expert_bytes,
            "prefetch_buffer_bytes": model.memory.prefetch_buffer_bytes,
            "warmup_s": getattr(model, "warmup_s", 0.0), "ready_s": ready_s, "node": envs.node_name()}
    placement = getattr(model, "placement", None)
    if placement is not None and hasattr(model, "group"):
        info["local_experts"] = list(placement.local_experts(model.group.rank))
    if hasattr(model, "expert_source_used"):
        info["expert_source"] = model.expert_source_used
    prefetcher = getattr(model, "prefetcher", None)  # DWDP only: what its prefetch runs with
    if prefetcher is not None:
        info["num_buffers"], info["slice_bytes"] = prefetcher.num_buffers, prefetcher.plans.slice_bytes
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_allocated_bytes"] = torch.cuda.memory_allocated(device)
    return info


def health_message(model, rank: int) -> WorkerHealth:
    """This rank's failover status, after reading its peers' liveness now."""
    status = model.check_peers()
    return WorkerHealth(rank, {**dataclasses.asdict(status), "can_serve_all": status.can_serve_all,
                               "kernel_compiles_after_ready": model.compiles_after_warmup})


class HealthReporter:
    """Reports `health_message` to the router every `interval_s` from a thread of its own, so a
    stopped or hung worker goes silent while an idle one keeps speaking."""

    def __init__(self, model, rank: int, results, interval_s: float):
        self.model, self.rank, self.results, self.interval_s = model, rank, results, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dwdp-health-{rank}", daemon=True)

    def start(self) -> "HealthReporter":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.results.put(health_message(self.model, self.rank))
            except Exception:  # a report lost is a report late; the next one follows
                log.exception("rank %d: health report failed", self.rank)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class ForwardGaps:
    """A worker's time outside its forwards: from the end of one to the start of the next (its answers
    and KV artifacts, the router's next requests, planning the forward), what it spent waiting for work
    left out. BatchDone.outside_s carries it; the router sums it per rank (/health)."""

    def __init__(self):
        self._end: float | None = None
        self._waited = 0.0

    def start(self, now: float) -> float | None:
        """A forward starts at `now`: seconds outside forwards since the previous one (None: none yet)."""
        gap = None if self._end is None else max(0.0, now - self._end - self._waited)
        self._end, self._waited = None, 0.0
        return gap

    def end(self, now: float) -> None:
        self._end, self._waited = now, 0.0

    def waited(self, seconds: float) -> None:
        """The worker waited this long for work (nothing to do): not time outside a forward."""
        self._waited += seconds

    def forget(self) -> None:
        """Something else ran since the last forward (a DEP idle step): the next gap is not measured."""
        self._end, self._waited = None, 0.0


def run_batch(model, batch: list[PrefillJob], rank: int, kv_dir: str, model_name: str, results,
              gaps: ForwardGaps | None = None) -> None:
    """One forward over `batch`; puts one PrefillResult (or PrefillError) per job on `results`."""
    results.put(BatchStarted(rank, tuple(job.request_id for job in batch)))
    started = time.monotonic()
    outside_s = gaps.start(started) if gaps is not None else None
    ids, mask, positions, pads = pad_left([job.input_ids for job in batch])
    device = model.device  # the wrapped model's own device
    wait_before = model.stats.wait_s
    try:
        with torch.inference_mode():
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                        use_cache=True, logits_to_keep=1)
        first = [greedy_first(row, job.banned_first) for row, job in zip(out.logits[:, -1], batch)]  # [P] of [P, V]
    except RankDegraded as exc:  # lost experts or device: another rank can still serve these prompts
        for job in batch:
            results.put(PrefillError(job.request_id, rank, "rank_degraded", str(exc), retryable=True))
        results.put(health_message(model, rank))  # so the router stops sending work here now
        return
    except Exception as exc:  # one bad forward fails its requests, not the worker
        for job in batch:
            results.put(PrefillError(job.request_id, rank, "prefill_failed", f"rank {rank}: {exc!r}"))
        return
    ended = time.monotonic()
    if gaps is not None:
        gaps.end(ended)
    wait_s = model.stats.wait_s - wait_before
    answer_forward(out.past_key_values, first, batch, pads, int(ids.numel()), rank, kv_dir, model_name, results,
                   started, ended - started, wait_s, outside_s, latent_layout(model.config))


def answer_forward(cache, first: list[int], batch: list[PrefillJob], pads: list[int], batch_tokens: int, rank: int,
                   kv_dir: str, model_name: str, results, started: float, prefill_s: float, wait_s: float,
                   outside_s: float | None = None, latent=None) -> None:
    """After a forward over `batch` that started at `started`: BatchDone, then one PrefillResult
    (or PrefillError) per job, with its KV artifact cut from `cache`; `first`: [P] first tokens;
    outside_s: the rank's time outside forwards before this one (ForwardGaps); latent: the model's MLA
    latent layout (dwdp.serve.kv.latent_layout), if any."""
    real = sum(len(job.input_ids) for job in batch)
    results.put(BatchDone(rank, len(batch), batch_tokens, prefill_s, wait_s, real,
                          tuple((job.request_id, len(job.input_ids)) for job in batch), outside_s))
    for row, job in enumerate(batch):
        t0 = time.monotonic()
        try:
            layers = request_cache(cache, row, pads[row])
            kv = write_kv_artifact(kv_dir, job.request_id, layers, artifact_metadata(
                rank, model_name, first[row], (len(job.input_ids),), "padded", job.input_ids, latent))
        except Exception as exc:
            results.put(PrefillError(job.request_id, rank, "kv_write_failed", f"rank {rank}: {exc!r}"))
            continue
        results.put(PrefillResult(
            request_id=job.request_id, rank=rank, first_token_id=int(first[row]), prompt_tokens=len(job.input_ids),
            queue_s=started - job.enqueued, prefill_s=prefill_s, kv_write_s=time.monotonic() - t0,
            batch_size=len(batch), batch_tokens=batch_tokens, prefetch_wait_s=wait_s, kv=kv,
        ))


def run_packed(model, plan: list[tuple[InProgress, int]], rank: int, kv_dir: str, model_name: str, results,
               wait_before: float = 0.0, wait_of=None, gaps: ForwardGaps | None = None) -> list[InProgress]:
    """One packed forward of `plan` (dwdp.serve.scheduling.take_pieces): BatchStarted, the forward,
    BatchDone with each prompt's tokens in it, then a PrefillResult (or PrefillError) for every
    prompt it finished. Returns [(finished prompt, its last-position logits [V])]. Raises what
    the forward raised, after nothing was answered: the caller fails the plan's prompts.
    wait_of(): the exposed wait of the forward (DWDP prefetch wait, DEP all-to-all time) so far;
    gaps: the rank's ForwardGaps (BatchDone.outside_s)."""
    started = time.monotonic()
    outside_s = gaps.start(started) if gaps is not None else None
    for state, _ in plan:
        if state.started is None:
            state.started = started
    results.put(BatchStarted(rank, tuple(state.job.request_id for state, _ in plan)))
    finished = advance(model, plan)
    ended = time.monotonic()
    if gaps is not None:
        gaps.end(ended)
    wait_s = (wait_of() if wait_of is not None else 0.0) - wait_before
    real = sum(n for _, n in plan)
    results.put(BatchDone(rank, len(plan), real, ended - started, wait_s, real,
                          tuple((state.job.request_id, n) for state, n in plan), outside_s))
    for state, first, _ in finished:
        job, t0 = state.job, time.monotonic()
        try:
            kv = write_kv_artifact(kv_dir, job.request_id, to_host(state.kv), artifact_metadata(
                rank, model_name, first, tuple(state.chunks), "packed", job.input_ids, latent_layout(model.config)))
        except Exception as exc:
            results.put(PrefillError(job.request_id, rank, "kv_write_failed", f"rank {rank}: {exc!r}"))
            continue
        finally:
            state.kv = None  # its KV is in the artifact (or lost with the error): free the device copy
        results.put(PrefillResult(
            request_id=job.request_id, rank=rank, first_token_id=first, prompt_tokens=len(job.input_ids),
            queue_s=state.started - job.enqueued, prefill_s=time.monotonic() - state.started,
            kv_write_s=time.monotonic() - t0, batch_size=len(plan), batch_tokens=real, prefetch_wait_s=wait_s,
            kv=kv, chunks=tuple(state.chunks)))
    return [(state, logits) for state, _, logits in finished]


def step_packed(model, active: list[InProgress], pending: deque, rank: int, config: ServeConfig, kv_dir: str,
                results, gaps: ForwardGaps | None = None) -> None:
    """Take the next packed forward from `active` and `pending` and run it (DWDP worker); a forward
    that fails answers every prompt it held (retryable when the rank lost experts or its device)."""
    plan = take_pieces(active, pending, config.max_num_tokens, config.batch_order, config.fairness_s,
                       time.monotonic())
    try:
        done = [state for state, _ in run_packed(model, plan, rank, kv_dir, config.model_name, results,
                                                 model.stats.wait_s, lambda: model.stats.wait_s, gaps)]
    except RankDegraded as exc:
        for state, _ in plan:
            results.put(PrefillError(state.job.request_id, rank, "rank_degraded", str(exc), retryable=True))
        done = [state for state, _ in plan]
        results.put(health_message(model, rank))
    except Exception as exc:
        for state, _ in plan:
            results.put(PrefillError(state.job.request_id, rank, "prefill_failed", f"rank {rank}: {exc!r}"))
        done = [state for state, _ in plan]
    gone = {id(state) for state in done}
    active[:] = [state for state in active if id(state) not in gone]


def serve_queue(model, rank: int, config: ServeConfig, kv_dir: str, requests, results, is_packed: bool) -> None:
    """Loop until STOP (after finishing everything queued before it) or until the router is gone.
    is_packed: packed forwards (dwdp.serve.packcheck.worker_forwards), else padded ones."""
    parent = multiprocessing.parent_process()
    pending: deque[PrefillJob] = deque()
    active: list[InProgress] = []  # prompts with chunks prefilled and chunks to go
    gaps = ForwardGaps()
    stopping = False
    while not (stopping and not pending and not active):
        if not pending and not active and not stopping:
            waiting = time.monotonic()
            try:
                job = requests.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the router died without stopping us: nobody will read our answers
                continue
            finally:
                gaps.waited(time.monotonic() - waiting)
            if job is STOP:
                stopping = True
                continue
            if not _control(model, rank, job, results):
                pending.append(job)
        while not stopping:  # take whatever else already arrived, without waiting for more
            try:
                job = requests.get_nowait()
            except queue.Empty:
                break
            if job is STOP:
                stopping = True
            elif not _control(model, rank, job, results):
                pending.append(job)
        if is_packed and (pending or active):
            step_packed(model, active, pending, rank, config, kv_dir, results, gaps)
        elif pending:
            batch = take_forward(pending, config.max_num_tokens, config.batch_order, config.fairness_s,
                                 time.monotonic())
            run_batch(model, batch, rank, kv_dir, config.model_name, results, gaps)


def _control(model, rank: int, message, results) -> bool:
    """Act on a control message (True), or leave a PrefillJob to the caller (False)."""
    if isinstance(message, InjectFault):
        model.inject_fault(message.rank, "injected through POST /admin/fault")
        results.put(health_message(model, rank))
        return True
    return False


def build_worker_model(config: ServeConfig, rank: int):
    """This rank's DWDPModel on its device, warmed up (no kernel compiles once it serves); joins the
    env:// world, so every rank must call it together."""
    from dwdp.runtime.devices import model_dtype, rank_device
    from dwdp.runtime.group import init_group
    from dwdp.runtime.model import DWDPModel

    device = rank_device(config.device, rank - config.first_rank)  # this node's devices, by local rank
    dtype = model_dtype(config.device, config.dtype)
    dwdp_config = config.worker_dwdp
    group = init_group()
    if config.model is not None:
        model = DWDPModel.from_pretrained(config.model, config=dwdp_config, group=group, dtype=dtype, device=device)
    else:
        from dwdp.serve.presets import preset_model

        model = DWDPModel(preset_model(config.preset, config.seed, dtype).to(device), dwdp_config, group)
    model.warmup()
    return model


def worker_main(rank: int, world_size: int, store_env: dict, config: ServeConfig, kv_dir: str,
                requests, results, rejoin: bool = False) -> None:
    """Entry point of a spawned worker process. rejoin: it replaces a dead worker of the running
    group and joins through the group's board, with no collective (dwdp.runtime.rejoin)."""
    # Ctrl-C reaches the whole process group; the router drains and stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank - config.first_rank), "WORLD_SIZE": str(world_size),
                       **store_env, "DWDP_REJOIN": "1" if rejoin else "0"})
    torch.set_num_threads(config.threads_per_worker)
    import torch.distributed as dist

    model = reporter = None
    started = time.monotonic()
    try:
        model = build_worker_model(config, rank)
        packing = worker_forwards(model, config, rank)  # through DWDPModel: the forward it will serve with
        ready = worker_info(model, time.monotonic() - started, model.backend, model.experts_kernel)
        results.put(WorkerReady(rank, os.getpid(), model_info(model, packing), ready))
        reporter = HealthReporter(model, rank, results, config.health_interval_s).start()
        serve_queue(model, rank, config, kv_dir, requests, results, packing[0])
    except BaseException:
        results.put(WorkerFailed(rank, traceback.format_exc()))
    finally:
        if reporter is not None:
            reporter.stop()
        if model is not None:
            model.close()
        if dist.is_initialized():
            dist.destroy_process_group()
