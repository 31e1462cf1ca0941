"""Records the experts kernel's launches as Triton would specialise them, without running the kernel.

Triton compiles one binary per specialisation key: the constexprs, the launch options, and for each
runtime argument its type plus what Triton reads off its value (a pointer's 16-byte alignment, an
int being 1 or divisible by 16). A launch whose key is new compiles on the spot.
"""
import importlib

gg = importlib.import_module("dwdp.kernels.grouped_gemm")


class LaunchKeys:
    """Stands in for `_grouped_gemm_kernel`: keeps each launch's specialisation key, zero-fills its output
    (so a model run through it stays finite), and launches nothing."""

    def __init__(self):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        self.names = list(gg._grouped_gemm_kernel.arg_names)
        self.keys: list[tuple] = []
        self._specialize = lambda arg: native_specialize_impl(CUDABackend, arg, False, True, True)

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **constexprs):
            spec = []
            for name, arg in zip(self.names, args):
                kind, key = self._specialize(arg)
                spec.append((name, str(kind), str(key)))
                if name == "out_ptr":
                    arg.zero_()
            spec += [(name, "constexpr", repr(value)) for name, value in sorted(constexprs.items())]
            self.keys.append((tuple(spec), num_warps, num_stages))
        return launch

    def install(self, monkeypatch=None) -> "LaunchKeys":
        """Replace the kernel, as a CUDA device would see the launches (no interpreter: tensor-core dots;
        no CPU-device refusal), through pytest's monkeypatch or for good in a spawned rank."""
        moe = importlib.import_module("dwdp.kernels.moe")
        patches = [(gg, "_grouped_gemm_kernel", self), (gg, "is_interpreter", lambda: False),
                   (gg, "_check_device", lambda device, name: None), (moe, "_check_device", lambda device, name: None)]
        for module, name, value in patches:
            if monkeypatch is not None:
                monkeypatch.setattr(module, name, value)
            else:
                setattr(module, name, value)
        return self


def differing(key: tuple, known: set) -> list:
    """(argument, this key's form, the nearest known key's form) where `key` differs from the nearest of `known`."""
    mine = {name: (kind, value) for name, kind, value in key[0]}
    best = None
    for other in known:
        theirs = {name: (kind, value) for name, kind, value in other[0]}
        diff = [(name, mine.get(name), form) for name, form in theirs.items() if mine.get(name) != form]
        if best is None or len(diff) < len(best):
            best = diff
    return best or []
