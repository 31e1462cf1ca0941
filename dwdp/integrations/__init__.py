"""Hand-offs from dwdp to other engines: decode engines that continue from dwdp's prefill KV.

vllm_connector: vLLM's v1 KV connector over dwdp KV artifacts (runs inside vLLM's processes);
vllm_pages: its cache-writing half; kv_transfer: its transfer half (where the KV comes from).

May import: `dwdp.serve.kv` (the artifact format) and the leaves `dwdp.envs`, `dwdp.versions`; never
the runtime, the models or the server, whose dependencies a decode engine's environment lacks.
"""
