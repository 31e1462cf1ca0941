"""Prometheus metrics of the router (text exposition at GET /metrics).

Per-rank gauges are read from the pool at scrape time; latencies and errors are recorded as
requests finish.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector:
    """Exports the pool's per-rank state (queue depth, outstanding tokens, ...) at scrape time."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        snap = self.pool.snapshot()
        gauges = {
            "queue_depth": ("dwdp_serve_queue_depth", "requests waiting in a worker's queue", "queued"),
            "running": ("dwdp_serve_running_requests", "requests in a worker's current forward", "running"),
            "outstanding": ("dwdp_serve_outstanding_tokens", "prompt tokens queued or running on a worker",
                            "outstanding_tokens"),
            "up": ("dwdp_serve_worker_up", "1 while the worker is alive and serving", "alive"),
            "routable": ("dwdp_serve_worker_routable", "1 while the router sends the worker new requests (alive, "
                         "not stalled, every expert reachable)", "routable"),
            "stalled": ("dwdp_serve_worker_stalled", "1 while the worker is silent past the stall timeout", "stalled"),
            "lost": ("dwdp_serve_lost_peers", "peers the worker has declared lost", "num_lost_peers"),
            "unservable": ("dwdp_serve_unservable_experts", "experts the worker can no longer reach",
                           "num_unservable_experts"),
            "local_experts": ("dwdp_serve_local_expert_bytes", "bytes of the worker's local experts on its device",
                              "local_expert_bytes"),
            "prefetch": ("dwdp_serve_prefetch_buffer_bytes", "bytes of the worker's prefetch buffers on its device",
                         "prefetch_buffer_bytes"),
            "compiles": ("dwdp_serve_kernel_compiles_after_ready", "experts-kernel specialisations the worker "
                         "compiled after it was ready (each stalled a forward; 0 when warm-up covered every form)",
                         "kernel_compiles_after_ready"),
            "ready": ("dwdp_serve_worker_ready_seconds", "seconds from the worker's start to ready (model built, "
                      "kernels compiled, warmed up)", "ready_s"),
        }
        counters = {
            "served": ("dwdp_serve_requests", "requests a worker answered", "served_requests"),
            "tokens": ("dwdp_serve_prompt_tokens", "prompt tokens a worker prefilled", "served_tokens"),
            "forwards": ("dwdp_serve_forwards", "batched forwards a worker ran", "forwards"),
            "wait": ("dwdp_serve_prefetch_wait_seconds", "exposed expert-prefetch wait of a worker's forwards "
                     "(dep mode: time inside its all-to-alls, waiting for the slowest rank included)",
                     "prefetch_wait_s"),
            "replans": ("dwdp_serve_replans", "copy plans a worker rebuilt around lost peers", "replans"),
            "retried_slices": ("dwdp_serve_retried_slices", "copy slices a worker copied again from another owner",
                               "retried_slices"),
            "restarts": ("dwdp_serve_worker_restarts", "times the router started a dead worker again", "restarts"),
            "rejoins": ("dwdp_serve_worker_rejoins", "restarts that rejoined the DWDP group and reported ready",
                        "rejoins"),
        }
        families = []
        for name, doc, _ in gauges.values():
            families.append(GaugeMetricFamily(name, doc, labels=["rank"]))
        for name, doc, _ in counters.values():
            families.append(CounterMetricFamily(name, doc, labels=["rank"]))
        keys = [key for _, _, key in gauges.values()] + [key for _, _, key in counters.values()]
        for worker in snap["workers"]:
            counts = {"num_lost_peers": len(worker["lost_peers"]),
                      "num_unservable_experts": len(worker["unservable_experts"])}
            for family, key in zip(families, keys):
                family.add_metric([str(worker["rank"])], float(counts.get(key, worker.get(key, 0))))
        yield from families
        device = GaugeMetricFamily("dwdp_serve_worker_device", "1 for the device and backend each worker runs on",
                                   labels=["rank", "device", "backend", "experts_kernel"])
        for worker in snap["workers"]:
            if "device" in worker:
                device.add_metric([str(worker["rank"]), worker["device"], worker["backend"], worker["experts_kernel"]],
                                  1.0)
        yield device
        mode = GaugeMetricFamily("dwdp_serve_mode", "1 for the mode the workers run (dwdp: independent ranks; "
                                 "dep: expert parallel, ranks in lockstep)", labels=["mode"])
        mode.add_metric([snap["mode"]], 1.0)
        yield mode
        yield GaugeMetricFamily("dwdp_serve_tokens_per_second", "prompt tokens prefilled per second, all workers, "
                                "averaged over the last 10 s", value=snap["tokens_per_s"])
        yield GaugeMetricFamily("dwdp_serve_in_flight_requests", "admitted requests not answered yet",
                                value=snap["in_flight"])
        yield CounterMetricFamily("dwdp_serve_retried_requests", "requests moved off a dead or degraded worker",
                                  value=snap["retried"])
        yield CounterMetricFamily("dwdp_serve_failed_requests", "admitted requests answered with an error",
                                  value=snap["failed"])
        down = GaugeMetricFamily("dwdp_serve_worker_down", "1 for a worker left down after too many restarts",
                                 labels=["rank"])
        for worker in snap["workers"]:
            down.add_metric([str(worker["rank"])], float(worker["down_reason"] is not None))
        yield down
        redundancy = GaugeMetricFamily("dwdp_serve_expert_redundancy", "routable workers holding each expert locally",
                                       labels=["expert"])
        for expert, count in enumerate(snap["redundancy"]):
            redundancy.add_metric([str(expert)], float(count))
        yield redundancy


class _LedgerCollector:
    """KV artifacts by what became of them (dwdp.serve.kv_ledger), at scrape time."""

    def __init__(self, ledger):
        self.ledger = ledger

    def collect(self):
        family = CounterMetricFamily("dwdp_serve_kv_artifacts", "KV artifacts written by the workers, loaded by the "
                                     "decode side (removed by its connector), expired (removed unloaded after "
                                     "--kv-ttl) and dropped (removed unloaded when no decode would read them)",
                                     labels=["event"])
        for event, count in self.ledger.counts().items():
            family.add_metric([event], float(count))
        yield family
        yield GaugeMetricFamily("dwdp_serve_kv_artifacts_pending", "KV artifacts written and not yet loaded or "
                                "removed", value=self.ledger.pending())


class ServeMetrics:
    def __init__(self, pool, ledger=None):
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        if ledger is not None:
            self.registry.register(_LedgerCollector(ledger))
        self.decode = Histogram("dwdp_serve_decode_seconds", "decode request sent -> its last token (--decode-url)",
                                buckets=LATENCY_BUCKETS, registry=self.registry)
        self.completion_tokens = Counter("dwdp_serve_completion_tokens", "tokens answered, the first ones included",
                                         registry=self.registry)
        self.ttft = Histogram("dwdp_serve_ttft_seconds", "arrival at the router -> first token answered",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("dwdp_serve_queue_seconds", "queued at the router -> forward started",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prefill = Histogram("dwdp_serve_prefill_seconds", "the forward a request ran in",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("dwdp_serve_errors", "requests answered with an error, by type",
                              ["type"], registry=self.registry)

    def observe(self, result, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.queue.observe(max(0.0, result.queue_s))
        self.prefill.observe(result.prefill_s)

    def observe_decode(self, seconds: float) -> None:
        self.decode.observe(seconds)

    def observe_completion(self, num_tokens: int) -> None:
        self.completion_tokens.inc(num_tokens)

    def error(self, error_type: str) -> None:
        self.errors.labels(type=error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
