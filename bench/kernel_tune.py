"""Sweep the Triton experts kernel's tiles for a model on this GPU and write the device's configuration
file: the same as `dwdp tune-kernel` (see dwdp/tune/kernel.py), for a checkout without the entry point.

Run: python bench/kernel_tune.py --preset DeepSeek-R1 [--dtype fp8] [--tokens 512,4096,16384] [--full]
Writes kernels/configs/<device>.json (or under DWDP_KERNEL_CONFIGS / --out-dir) and prints each
candidate's TFLOP/s and the best per shape.
"""
import sys

from dwdp.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune-kernel", *sys.argv[1:]]))
