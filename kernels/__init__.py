"""Kernels of dwdp (installed as dwdp.kernels), each with a plain-PyTorch reference."""
from .reference import grouped_gemm_reference

__all__ = ["grouped_gemm_reference"]
