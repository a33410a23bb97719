"""Compile KIVI's decode kernels (tensor-core and float32 forms, all four variants each) with NVRTC for sm_90 on a
machine without a GPU, and print ptxas' registers and spills: compile errors show before an H200 call. NVRTC from
the PyPI wheel (``pip download --no-deps nvidia-cuda-nvrtc-cu12``, unzipped into NVRTC_DIR, default /tmp/nvrtc).

    PYTHONPATH=. python scripts/kernel_compile_check.py
"""
import ctypes, glob, importlib, os, sys
LIB = os.path.join(os.environ.get("NVRTC_DIR", "/tmp/nvrtc"), "nvidia/cuda_nvrtc/lib")
ctypes.CDLL(glob.glob(LIB + "/libnvrtc-builtins.so.*")[0], mode=ctypes.RTLD_GLOBAL)
from veloxquant_mlx.cache.kernels import _compile
_compile._LIBS["libnvrtc.so.13"] = ctypes.CDLL(LIB + "/libnvrtc.so.12")
import mlx.core as mx
mod = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "veloxquant_mlx.cache.kernels.kivi")
from veloxquant_mlx.cache.kernels import _common
consts = (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), ("PRS", 36), ("XP", 1),
          ("NW", 4), ("REP", 4), ("DV", 128))
for tab in ("_MMA_KERNELS", "_KERNELS"):
    for (b, f), k in getattr(mod, tab).items():
        c = consts + ((("HK", 8),) if b else ()) + ((("HAS_SINK", 0), ("ROT", 0)) if f else ())
        dt = [mx.float16, mx.uint32, mx.float16, mx.float16, mx.uint32, mx.float16, mx.float16] + [mx.int32] * b + [mx.float16] * 6 + ([mx.float32, mx.int32] if f else [])
        outd = [mx.float32] * (2 if f else 3)
        sym, src = k.source(tuple(dt), outd, c)
        cub = _compile.compile_binary(src, sym, "sm_90")
        print(tab, b, f, len(cub), "bytes")

def ptxas_info(src, name, arch="sm_90"):
    lib = _compile._LIBS["libnvrtc.so.13"]
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None)
    opts = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
    r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value); lib.nvrtcGetProgramLog(prog, buf)
    return r, buf.value.decode()

for tab in ("_MMA_KERNELS", "_KERNELS"):
    k = getattr(mod, tab)[False, True]
    dt = [mx.float16, mx.uint32, mx.float16, mx.float16, mx.uint32, mx.float16, mx.float16] + [mx.float16] * 6 + [mx.float32, mx.int32]
    sym, src = k.source(tuple(dt), [mx.float32] * 2, consts + (("HAS_SINK", 0), ("ROT", 0)))
    r, log = ptxas_info(src, sym)
    print(tab, r, [l for l in log.splitlines() if "registers" in l or "spill" in l])
