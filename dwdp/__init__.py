"""dwdp: Distributed Weight Data Parallelism for serving Mixture-of-Experts models."""
from .config import DWDPConfig

__version__ = "0.1.0"

__all__ = ["DWDPConfig", "__version__"]
