"""Test-wide settings. TRITON_INTERPRET must be set before any Triton kernel is defined."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
