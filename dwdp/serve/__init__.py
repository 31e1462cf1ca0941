"""Context server: every DWDP rank an independent prefill worker, behind a load-aware router.

`dwdp serve --ranks N` runs one router process (FastAPI + uvicorn; dwdp.serve.api) and N worker
processes forming one DWDP group (dwdp.serve.worker). The router assigns each request to the
healthy worker with the fewest outstanding prompt tokens (dwdp.serve.routing); a worker batches
what is in its queue up to `max_num_tokens` padded tokens, prefills through DWDPModel, and writes
each request's KV cache as a safetensors artifact (dwdp.serve.kv).

May import: `dwdp.tune`, `dwdp.predict`, `dwdp.runtime`, `dwdp.models`, `dwdp.observe`, `dwdp.kernels`, the
leaves `dwdp.envs`, `dwdp.versions`. Never `dwdp.benchmarks` or the entry points (`cli`, `demo`).
"""
from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import read_kv_artifact, write_kv_artifact

__all__ = ["ServeConfig", "read_kv_artifact", "write_kv_artifact", "run_server"]


def run_server(config: ServeConfig, front=None) -> int:
    from dwdp.serve.server import run_server as run

    return run(config, front)
