"""dwdp: Distributed Weight Data Parallelism for serving Mixture-of-Experts models."""
import logging

from . import envs
from .config import DWDPConfig
from .group import DWDPGroup, init_group
from .model import DWDPModel

logging.getLogger("dwdp").setLevel(envs.log_level())

__version__ = "0.1.0"

__all__ = ["DWDPConfig", "DWDPGroup", "DWDPModel", "init_group", "__version__"]
