"""dwdp: Distributed Weight Data Parallelism for serving Mixture-of-Experts models."""
import logging

from dwdp.versions import check_versions

check_versions()  # one clear line for a too-old torch, transformers or triton, before anything uses them

from dwdp import envs  # noqa: E402
from dwdp.runtime.config import DWDPConfig  # noqa: E402
from dwdp.runtime.group import DWDPGroup, init_group  # noqa: E402
from dwdp.runtime.model import DWDPModel  # noqa: E402

logging.getLogger("dwdp").setLevel(envs.log_level())

__version__ = "0.1.0"

__all__ = ["DWDPConfig", "DWDPGroup", "DWDPModel", "init_group", "__version__"]
