"""A kernel that holds every SM: each program (1024 threads) spins on %globaltimer for `duration_ns`;
two programs per SM fill its 2048 thread slots, so no other kernel's block can start on any SM
until it ends (section c uses it to tell copy-engine copies from copies that need SMs). Compiles
for sm_90 (checked with triton's AOT compiler on a CPU); not yet run on a GPU."""
import triton
import triton.language as tl


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, duration_ns):
    start = _globaltimer()
    now = start
    while now - start < duration_ns:
        now = _globaltimer()
    tl.store(out_ptr + tl.program_id(0), now - start)


def hold_every_sm(out, duration_ns: int, num_sms: int) -> None:
    """Launch the spin on the current stream: out is an int64 tensor of >= 2 * num_sms entries."""
    if out.numel() < 2 * num_sms or out.dtype.itemsize != 8:
        raise ValueError(f"out must hold >= {2 * num_sms} int64 values, got {out.numel()} of {out.dtype}")
    _spin_kernel[(2 * num_sms,)](out, duration_ns, num_warps=32)
