"""Records the experts kernel's launches as Triton would specialise them, without running the kernel.

Triton compiles one binary per specialisation key: the constexprs, the launch options, and for each
runtime argument its type plus what Triton reads off its value (a pointer's 16-byte alignment, an int
being 1 or divisible by 16), except for the arguments declared `do_not_specialize`
(grouped_gemm.RUNTIME_ARGS). A launch whose key is new compiles on the spot.
"""
import importlib

gg = importlib.import_module("dwdp.kernels.grouped_gemm")
moe = importlib.import_module("dwdp.kernels.moe")
launch_mod = importlib.import_module("dwdp.kernels.launch")

# What torch reports on the H100 the shipped configuration file was measured on (232,448 bytes of shared
# memory per block, as Triton's OutOfResources errors there said).
H100 = launch_mod.DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132)


class LaunchRecorder:
    """Stands in for `_grouped_gemm_kernel`. Each launch is kept as {"args": name -> (kind, value, key),
    "options": {num_warps, num_stages}}; its output is zero-filled (a model run through it stays
    finite) and nothing is launched."""

    def __init__(self):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        self.names = list(gg._grouped_gemm_kernel.arg_names)
        self.launches: list[dict] = []
        self._specialize = lambda arg, specialize: native_specialize_impl(CUDABackend, arg, False, specialize, True)

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **constexprs):
            spec = {}
            for name, arg in zip(self.names, args):
                kind, key = self._specialize(arg, name not in gg.RUNTIME_ARGS)
                value = key if kind == "constexpr" else arg if isinstance(arg, (int, float)) else None
                spec[name] = (kind, value, key if kind != "constexpr" else "")
                if name == "out_ptr":
                    arg.zero_()
            for name, value in constexprs.items():
                spec[name] = ("constexpr", value, "")
            self.launches.append({"args": spec, "options": {"num_warps": num_warps, "num_stages": num_stages}})
        return launch

    @property
    def keys(self) -> list[tuple]:
        """Each launch's specialisation key: constexprs, Triton's reading of the specialised arguments, options."""
        return [specialization(launch) for launch in self.launches]

    def install(self, monkeypatch=None, device: "launch_mod.DeviceInfo" = H100) -> "LaunchRecorder":
        """Replace the kernel as `device` would see the launches (no interpreter: tensor-core dots and its
        tile files; no CPU-device refusal), through pytest's monkeypatch or for good in a spawned rank."""
        patches = [(gg, "_grouped_gemm_kernel", self), (gg, "is_interpreter", lambda: False),
                   (launch_mod, "device_info", lambda d: device), (moe, "device_info", lambda d: device),
                   (gg, "_check_device", lambda d, name: None), (moe, "_check_device", lambda d, name: None)]
        for module, name, value in patches:
            if monkeypatch is not None:
                monkeypatch.setattr(module, name, value)
            else:
                setattr(module, name, value)
        return self


def specialization(launch: dict) -> tuple:
    """What Triton compiles a launch for: each argument's kind and key (values of constexprs), and the options."""
    return tuple((name, kind, key if kind != "constexpr" else repr(value))
                 for name, (kind, value, key) in sorted(launch["args"].items())) + tuple(sorted(launch["options"].items()))


def differing(key: tuple, known: set) -> list:
    """(entry of `key`, entry of the nearest known key) where `key` differs from the nearest of `known`."""
    best = None
    for other in known:
        diff = [(a, b) for a, b in zip(key, other) if a != b]
        if best is None or len(diff) < len(best):
            best = diff
    return best or []
