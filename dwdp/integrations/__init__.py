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


# vLLM's CPU build keeps one core per rank free of its worker's threads (for its scheduler and front end),
# and one more per rank whenever a KV connector is configured (its comment: for NIXL's transfers); when
# that leaves the worker no core it binds the worker's threads to every core instead. dwdp's connector
# reads inside the worker's forward and has no transfers of its own: vllm_cpu_env() keeps the layout vLLM
# alone has (one reserved core per rank on x86 and ARM), so the pair and vLLM alone run the same way.
RESERVED_CPU_VARIABLE = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def vllm_cpu_env(local_ranks: int = 1) -> dict[str, str]:
    """The environment of a vLLM CPU server with dwdp's connector and `local_ranks` ranks on its host (its
    tensor x pipeline parallel size there): the cores vLLM alone would reserve."""
    if type(local_ranks) is not int or local_ranks < 1:
        raise ValueError(f"local_ranks={local_ranks!r} must be an integer >= 1")
    return {RESERVED_CPU_VARIABLE: str(local_ranks)}


def reserved_cpu_advice(environ, on_cpu: bool, local_ranks: int) -> str | None:
    """What to tell a vLLM CPU server that runs dwdp's connector with vLLM's doubled core reservation (None
    when it runs on GPUs or the reservation is set)."""
    if not on_cpu or RESERVED_CPU_VARIABLE in environ:
        return None
    return (f"vLLM's CPU build reserves {local_ranks} more core(s) for a KV connector's own transfers, which "
            f"dwdp's connector does not have; start vLLM with {RESERVED_CPU_VARIABLE}={local_ranks} to bind its "
            f"worker as vLLM alone binds it")

