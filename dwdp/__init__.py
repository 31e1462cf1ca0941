"""dwdp: Distributed Weight Data Parallelism for serving Mixture-of-Experts models.

`import dwdp` is light: the public names below load the runtime (model wrapper, transports, Triton
kernels) on first use, so a process that only needs a leaf (a decode engine loading
`dwdp.integrations.vllm_connector`, which reads KV artifacts) never imports them.
"""
import importlib
import logging

from dwdp.versions import check_versions

check_versions()  # one clear line for a too-old torch, transformers or triton, before anything uses them

from dwdp import envs  # noqa: E402

logging.getLogger("dwdp").setLevel(envs.log_level())

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first access
_LAZY = {"DWDPConfig": "dwdp.runtime.config", "DWDPGroup": "dwdp.runtime.group", "init_group": "dwdp.runtime.group",
         "DWDPModel": "dwdp.runtime.model"}

__all__ = ["DWDPConfig", "DWDPGroup", "DWDPModel", "init_group", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dwdp' has no attribute {name!r}")
