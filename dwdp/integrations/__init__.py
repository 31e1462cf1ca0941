"""Hand-offs from dwdp to other engines: decode engines that continue from dwdp's prefill KV.

vllm_connector: vLLM's v1 KV connector over dwdp KV artifacts (runs inside vLLM's processes);
vllm_pages: its cache-writing half; kv_transfer: its transfer half (where the KV comes from).

May import: `dwdp.serve.kv` (the artifact format), `dwdp.serve.kv_handoff` (the descriptor and its
authenticator) and the leaves `dwdp.envs`, `dwdp.versions`; never
the runtime, the models or the server, whose dependencies a decode engine's environment lacks.
"""

# vLLM's --kv-transfer-config for a decode server that continues from dwdp's KV (as JSON on its command
# line): our connector, consuming only, and a prompt whose KV cannot be read is recomputed, not failed.
VLLM_KV_TRANSFER_CONFIG = {"kv_connector": "DWDPConnector",
                           "kv_connector_module_path": "dwdp.integrations.vllm_connector",
                           "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}


def vllm_kv_transfer_config(kv_dir: str) -> dict:
    """VLLM_KV_TRANSFER_CONFIG reading artifacts from `kv_dir` (the directory `dwdp serve --kv-dir` writes)."""
    return {**VLLM_KV_TRANSFER_CONFIG, "kv_connector_extra_config": {"kv_dir": str(kv_dir)}}
