"""Build and launch the decode kernels: each body is compiled once per variant (its constants and its
arrays' dtypes) with NVRTC, the CUDA runtime compiler that MLX's CUDA backend already links, and run with
``mx.fast.precompiled_cuda_kernel``: the step's counts and scale travel as scalar arguments, not as a small
array built and copied to the device each step, and the sources need no header.

MLX carries the compiled source with every call, which costs host time per byte of cubin (docs/RESULTS.md,
``scripts/kernel_call_host.py``); MLX 0.32 cannot reuse a loaded module by name (handing over a placeholder source
fails: "Binary format ... is not recognized"), so every call carries it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import operator
import struct

import mlx.core as mx

__all__ = ["PRELUDE", "TENSOR_PRELUDE", "METAL_MACROS", "METAL_HEADER", "CTYPES", "Kernel", "render", "render_metal",
           "compile_binary", "on_metal"]

# The thin macro layer: kernel bodies use only these names for the backend's primitives (CUDA here), and
# no header: half and bfloat16 are read and written through their bits.
PRELUDE = r"""
#define VQ_FULL 0xffffffffu
#define VQ_INF __int_as_float(0x7f800000)
#define VQ_LANE ((int)(threadIdx.x & 31))
#define VQ_WARP ((int)(threadIdx.x >> 5))
#define VQ_NTHREADS ((int)blockDim.x)
#define VQ_TID ((int)threadIdx.x)
#define VQ_BLOCK_X ((int)blockIdx.x)
#define VQ_BLOCK_Y ((int)blockIdx.y)
#define VQ_GRID_X ((int)gridDim.x)
#define VQ_GRID_Y ((int)gridDim.y)
#define VQ_SHFL(v, src) __shfl_sync(VQ_FULL, (v), (src))
#define VQ_SHFL_XOR(v, m) __shfl_xor_sync(VQ_FULL, (v), (m))
#define VQ_FUNNEL(lo, hi, s) __funnelshift_r((lo), (hi), (s))  // bits s.. of the 64-bit hi:lo
#define VQ_VCH(l, j) ((l) + 32 * (j))  // value channel of a lane's acc[r][j] (a kernel may #undef, map its own)
#define VQ_SHARED __shared__
#define VQ_DEV   // a body's pointer into device memory (Metal: ``device``)
#define VQ_TG    // a body's pointer into shared memory (Metal: ``threadgroup``)
#define VQ_SYNC() __syncthreads()
#define VQ_SYNCWARP() __syncwarp()
#define VQ_ATOMIC_OR(p, x) atomicOr((p), (x))
#define VQ_ATOMIC_ADD(p, x) atomicAdd((p), (x))
#define VQ_FENCE() __threadfence()
#define VQ_EXP(x) __expf(x)
#define VQ_F(x) vq_f(x)
typedef unsigned int vq_u32;
struct vq_f16 { unsigned short b; };
struct vq_bf16 { unsigned short b; };
__device__ __forceinline__ float vq_f(float x) { return x; }
__device__ __forceinline__ float vq_f(vq_f16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.b)); return f; }
__device__ __forceinline__ float vq_f(vq_bf16 x) { return __uint_as_float((unsigned int)x.b << 16); }
__device__ __forceinline__ void vq_store(float* p, float x) { *p = x; }
// code i (KB bits from bit i * KB) of word w as the float 1 + code / 2^KB: the code shifted into the top of the
// mantissa of 1.0 (a shift and a mask, no int-to-float conversion; i unrolled, so the shift is a constant)
__device__ __forceinline__ float vq_code(unsigned int w, int sh, unsigned int mask) {
  const unsigned int x = sh >= 0 ? w << sh : w >> -sh;
  unsigned int r;  // (x & mask) | 1.0f's bits in one lop3 (C's two operators compile to two)
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "r"(mask), "r"(0x3f800000u));
  return __uint_as_float(r);
}
#define VQ_CODE(w, i) vq_code((w), 23 - KB * ((i) + 1), ((1u << KB) - 1u) << (23 - KB))
struct vq_f4 { float x, y, z, w; };
// loads through L2 (not L1): data other blocks of the same launch wrote before a fence
__device__ __forceinline__ float vq_ldcg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ vq_f4 vq_ldcg4(const float* p) {
  vq_f4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void vq_store(vq_f16* p, float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p->b = h;
}
__device__ __forceinline__ void vq_store(vq_bf16* p, float x) {  // round to nearest even; NaN stays NaN
  const unsigned int u = __float_as_uint(x);
  p->b = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 64u)
                                         : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""

# Device functions of the tensor-core kernels: float16 pairs without a header (PTX), a code pair to a float16 pair
# (the nibble ORed into the mantissa of 1024 or 64, which is then subtracted exactly), one mma.m16n8k16
TENSOR_PRELUDE = r"""
__device__ __forceinline__ vq_u32 vq_h2(float lo, float hi) {  // {lo, hi} as float16, lo in the low half
  vq_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned int vq_hbits(vq_f16 x) { return x.b; }
__device__ __forceinline__ unsigned int vq_hbits(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ unsigned int vq_hbits(vq_bf16 x) { return vq_hbits(vq_f(x)); }
template <typename T> __device__ __forceinline__ vq_u32 vq_hpair(T lo, T hi) {
  return vq_hbits(lo) | (vq_hbits(hi) << 16);
}
// s * c + z for the codes c in nibbles 0 and 4 (lo) or 1 and 5 (hi) of p, as a float16 pair
__device__ __forceinline__ vq_u32 vq_deq(vq_u32 p, vq_u32 mask, vq_u32 magic, vq_u32 s, vq_u32 z) {
  vq_u32 x, r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(x) : "r"(p), "r"(mask), "r"(magic));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(magic));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(s), "r"(z));
  return r;
}
#define vq_deq_lo(p, s, z) vq_deq((p), 0x000f000fu, 0x64006400u, (s), (z))  // 1024 + c
#define vq_deq_hi(p, s, z) vq_deq((p), 0x00f000f0u, 0x54005400u, (s), (z))  // 64 + c (the mantissa's unit is 1/16)
__device__ __forceinline__ void vq_mma(float* c, vq_u32 a0, vq_u32 a1, vq_u32 a2, vq_u32 a3, vq_u32 b0, vq_u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

CTYPES = {mx.float32: "float", mx.float16: "vq_f16", mx.bfloat16: "vq_bf16", mx.uint32: "vq_u32", mx.int32: "int",
          mx.uint16: "unsigned short"}

# The same macro layer for Metal (``mx.fast.metal_kernel``; opt-in, see ``_common.metal_enabled``). The macros go at the
# start of the body, not in the header: MLX declares a thread attribute (``thread_index_in_simdgroup`` ...) only when
# its name appears in the body's text. MLX names the arrays' types (float16_t, bfloat16_t, uint32_t, int32_t).
METAL_MACROS = r"""
#define VQ_FULL 0xffffffffu
#define VQ_INF INFINITY
#define VQ_LANE ((int)thread_index_in_simdgroup)
#define VQ_WARP ((int)simdgroup_index_in_threadgroup)
#define VQ_NTHREADS ((int)threads_per_threadgroup.x)
#define VQ_TID ((int)thread_position_in_threadgroup.x)
#define VQ_BLOCK_X ((int)threadgroup_position_in_grid.x)
#define VQ_BLOCK_Y ((int)threadgroup_position_in_grid.y)
#define VQ_GRID_X ((int)threadgroups_per_grid.x)
#define VQ_GRID_Y ((int)threadgroups_per_grid.y)
#define VQ_SHFL(v, src) simd_shuffle((v), (ushort)(src))
#define VQ_SHFL_XOR(v, m) simd_shuffle_xor((v), (ushort)(m))
#define VQ_FUNNEL(lo, hi, s) ((uint)(((((ulong)(hi)) << 32) | (ulong)(lo)) >> ((s) & 31u)))
#define VQ_VCH(l, j) ((l) + 32 * (j))
#define VQ_SHARED threadgroup
#define VQ_DEV device
#define VQ_TG threadgroup
#define VQ_SYNC() threadgroup_barrier(mem_flags::mem_threadgroup)
#define VQ_SYNCWARP() simdgroup_barrier(mem_flags::mem_threadgroup)
#define VQ_EXP(x) metal::exp(x)
#define VQ_F(x) vq_f(x)
#define VQ_CODE(w, i) vq_code((w), 23 - KB * ((i) + 1), ((1u << KB) - 1u) << (23 - KB))
#define fmaxf(a, b) metal::fmax((a), (b))
#define fmaf(a, b, c) metal::fma((a), (b), (c))
#define sqrtf(x) metal::sqrt(x)
#define rsqrtf(x) metal::rsqrt(x)
#define sincosf(x, s, c) vq_sincos((x), (s), (c))
"""
METAL_HEADER = r"""
typedef uint vq_u32;
inline float vq_f(float x) { return x; }
inline float vq_f(half x) { return float(x); }
inline float vq_f(bfloat16_t x) { return float(x); }
inline void vq_store(device float* p, float x) { *p = x; }
inline void vq_store(device half* p, float x) { *p = half(x); }
inline void vq_store(device bfloat16_t* p, float x) { *p = bfloat16_t(x); }
inline float vq_code(uint w, int sh, uint mask) {  // as the CUDA prelude's: the code in the mantissa of 1.0
  const uint x = sh >= 0 ? w << sh : w >> -sh;
  return as_type<float>((x & mask) | 0x3f800000u);
}
inline void vq_sincos(float x, thread float* s, thread float* c) {
  float co;
  *s = metal::precise::sincos(x, co);
  *c = co;
}
"""


def render_metal(body: str, scalars, consts) -> str:
    """The body of a kernel for ``mx.fast.metal_kernel``: the macro layer, the constants, the scalars read from the
    int32 input ``vq_scalars`` (a float as its bits, as on CUDA), then the body."""
    head = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in consts)
    head += "".join(f"  const int {n} = vq_scalars[{i}];\n" if t == "int" else
                    f"  const float {n} = as_type<float>(vq_scalars[{i}]);\n" for i, (n, t) in enumerate(scalars))
    return f"{METAL_MACROS}{head}{body}\n"


def render(symbol: str, body: str, inputs, outputs, scalars, consts, bounds=None, prelude: str = "") -> str:
    """The kernel's CUDA source: ``inputs``/``outputs`` (name, C type) pointers, ``scalars`` (name, "int" or
    "float") by value, ``consts`` (name, int) compile-time constants, then the body. A float scalar travels as
    its bits in an int (MLX 0.32.4's binding refuses Python floats: "Received float but must be one of bool,
    int or float", seen on the H200). ``bounds`` = (threads per block, blocks per SM): ``__launch_bounds__``, which
    caps the registers so that many blocks fit. ``prelude``: the kernel's own device functions, after ``PRELUDE``."""
    sig = ([f"const {t}* __restrict__ {n}" for n, t in inputs] + [f"{t}* __restrict__ {n}" for n, t in outputs]
           + [f"const int {n}" + ("_bits" if t == "float" else "") for n, t in scalars])
    head = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in consts)
    head += "".join(f"  const float {n} = __int_as_float({n}_bits);\n" for n, t in scalars if t == "float")
    lb = f"__launch_bounds__({bounds[0]}, {bounds[1]}) " if bounds else ""
    args = ",\n    ".join(sig)
    return f'{PRELUDE}{prelude}\nextern "C" __global__ void {lb}{symbol}(\n    {args}) {{\n{head}{body}\n}}\n'


def _check(lib, res: int, prog=None) -> None:
    if res != 0:
        log = ""
        if prog is not None:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(res).decode()} {log}".strip())


_LIBS: dict = {}


def _lib(names):
    if names[0] not in _LIBS:
        for name in names:
            with contextlib.suppress(OSError):
                _LIBS[names[0]] = ctypes.CDLL(name)
                break
        else:
            raise RuntimeError(f"none of {names} could be loaded")
    return _LIBS[names[0]]


HALF_FLOATS = (mx.float16, mx.bfloat16)  # query dtypes the tensor-core kernels take (float16 operands lose nothing)


@functools.cache
def tensor_cores_here() -> bool:
    """Whether CUDA device 0 is sm_80+ (the ``mma.m16n8k16`` the tensor-core kernels use); False without a CUDA
    driver (a launch stood in on another machine: scripts/decode_host_layer.py). Asked once per process."""
    try:
        return int(_arch()[3:]) >= 80
    except RuntimeError:
        return False


@functools.cache
def _arch() -> str:
    """``sm_XY`` of CUDA device 0 (through the driver API MLX has initialised; asked once per process)."""
    cuda = _lib(["libcuda.so.1", "libcuda.so"])
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
        raise RuntimeError("no CUDA device")
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return f"sm_{major.value}{minor.value}"


def compile_binary(source: str, name: str, arch: str | None = None) -> bytes:
    """Compile ``source`` with NVRTC to a cubin for ``arch`` (default: the device's)."""
    lib = _lib(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"])
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        opts = [f"--gpu-architecture={arch or _arch()}".encode()]
        _check(lib, lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)), prog)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, buf))
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Kernel:
    """A kernel body with named inputs, outputs (pointers) and scalars (``"int"``/``"float"`` by value)."""

    def __init__(self, name: str, inputs: list[str], outputs: list[str], scalars: list[tuple[str, str]], body: str,
                 bounds=None, prelude: str = ""):
        self.name, self.inputs, self.outputs, self.scalars, self.body = name, inputs, outputs, scalars, body
        self.bounds, self.prelude = bounds, prelude
        self._convert = [int if t == "int" else _float_bits for _, t in scalars]
        self._built: dict = {}  # variant -> (symbol, cubin)

    def source(self, dtypes, out_dtypes, consts) -> tuple[str, str]:
        """(symbol, CUDA source) of the variant for these input/output dtypes and constants."""
        ins = [(n, CTYPES[d]) for n, d in zip(self.inputs, dtypes)]
        outs = [(n, CTYPES[d]) for n, d in zip(self.outputs, out_dtypes)]
        text = render("VQ_SYMBOL", self.body, ins, outs, self.scalars, consts, self.bounds, self.prelude)
        symbol = f"{self.name}_{hashlib.sha1(text.encode()).hexdigest()[:16]}"
        return symbol, text.replace("VQ_SYMBOL", symbol)

    def __call__(self, arrays: list, scalars: list, consts: tuple, out_shapes: list, out_dtypes: list,
                 grid: tuple, threads: tuple, init_value=None) -> list:
        if on_metal():
            return self._metal_call(arrays, scalars, consts, out_shapes, out_dtypes, grid, threads, init_value)
        dtypes = tuple(map(_DTYPE, arrays))
        key = (consts, dtypes, *out_dtypes)
        built = self._built.get(key)
        if built is None:
            symbol, text = self.source(dtypes, out_dtypes, consts)
            built = self._built[key] = (symbol, compile_binary(text, symbol))
        return mx.fast.precompiled_cuda_kernel(
            name=built[0], compiled_source=built[1], inputs=arrays, output_shapes=out_shapes,
            output_dtypes=out_dtypes, scalars=self.scalar_args(scalars), grid=grid, threadgroup=threads,
            init_value=init_value, ensure_row_contiguous=True)

    def metal_source(self, consts) -> tuple[str, str]:
        """(symbol, body) of the variant for ``mx.fast.metal_kernel`` (inputs typed by MLX, so one per constants)."""
        body = render_metal(self.body, self.scalars, consts)
        return f"{self.name}_{hashlib.sha1(body.encode()).hexdigest()[:16]}", body

    def _metal_call(self, arrays, scalars, consts, out_shapes, out_dtypes, grid, threads, init_value):
        """The call on Metal: the kernel built once per constants; grid and threadgroup in threads, as on CUDA."""
        key = ("metal", consts)
        kernel = self._built.get(key)
        if kernel is None:
            symbol, body = self.metal_source(consts)
            kernel = self._built[key] = mx.fast.metal_kernel(
                name=symbol, input_names=[*self.inputs, "vq_scalars"], output_names=list(self.outputs), source=body,
                header=METAL_HEADER)
        values = mx.array(self.scalar_args(scalars), dtype=mx.int32)
        return kernel(inputs=[*arrays, values], output_shapes=out_shapes, output_dtypes=out_dtypes, grid=grid,
                      threadgroup=threads, init_value=init_value)

    def scalar_args(self, values: list) -> list[int]:
        """The scalars as the kernel takes them: ints, a float as its float32 bits."""
        return [f(v) for f, v in zip(self._convert, values)]


_F32, _F32_BITS = struct.Struct("<f"), struct.Struct("<i")
_DTYPE = operator.attrgetter("dtype")


def on_metal() -> bool:
    """Whether the default device is a GPU of MLX's Metal backend (asked at every kernel launch: on a machine without
    Metal one cached answer, no device query)."""
    return _metal_available() and mx.default_device().type == mx.DeviceType.gpu


@functools.cache
def _metal_available() -> bool:
    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available())


def _float_bits(x) -> int:
    return _F32_BITS.unpack(_F32.pack(x))[0]
