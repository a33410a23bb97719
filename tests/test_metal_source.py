"""The Metal build of the decode kernels (``_compile.render_metal``, opt-in ``VELOXQUANT_METAL_KERNELS=1``), checked
without an Apple GPU: the body is wrapped in the signature MLX's ``mx.fast.metal_kernel`` generates and parsed by
libclang as C++ against a stand-in for Metal's types, functions and address spaces (``device`` and ``threadgroup`` as
clang address spaces, so a pointer that loses its address space is an error, as in Metal). It catches what a first
build on a Mac would report for names, types, overloads and address spaces; it cannot say that the kernel runs or is
fast there -- on a Mac ``checked_call`` compares it with the op path at first use. The plumbing of a Metal call
(inputs, the scalars' array, grid) is checked with ``mx.fast.metal_kernel`` stood in."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest

from scripts_util import load_script
from veloxquant_mlx.cache.kernels import _common, _compile

cindex = pytest.importorskip("clang.cindex", reason="libclang (the test extra's) parses the Metal source")

# the decode kernels with a Metal build (the partials' kernels; the fused and tensor-core ones are CUDA's)
METAL_CASES = ["kivi_d128_r4", "kivi_batch_d128_r4", "kivi_d128_b2_r3", "kivi_d128_b8_r8", "kivi_d64_b2",
               "waterfill_d128_r4", "waterfill_batch_d128_r4", "waterfill_d64_r3", "waterfill_d64_r8_b3"]
# Metal's names as MLX's generated source sees them; no definitions needed, only what parsing resolves
STAND_IN = r"""
#define device __attribute__((address_space(1)))
#define threadgroup __attribute__((address_space(3)))
#define thread
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef unsigned long size_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef _Float16 half;
typedef half float16_t;
typedef __bf16 bfloat16_t;
struct uint3 { uint x, y, z; };
#define INFINITY __builtin_inff()
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T, typename U> T as_type(U u) { return __builtin_bit_cast(T, u); }
namespace metal {
float exp(float);
float fmax(float, float);
float rsqrt(float);
float fma(float, float, float);
float sqrt(float);
template <typename T> T min(T, T);
template <typename T> T max(T, T);
namespace precise { float sincos(float, thread float&); }
}
using namespace metal;
"""
_MLX_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.uint32: "uint32_t",
              mx.int32: "int32_t"}
# MLX's thread attributes (name, type), declared when the body's text names them
_ATTRIBUTES = [("simdgroup_index_in_threadgroup", "uint"), ("thread_index_in_simdgroup", "uint"),
               ("thread_index_in_threadgroup", "uint"), ("thread_position_in_grid", "uint3"),
               ("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
               ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"), ("threads_per_threadgroup", "uint3")]


def _case(label):
    """(kernel, input dtypes, output dtypes, constants) of ``scripts/check_decode_kernels.py``'s case, one exact row
    a warp at a time (``XP``, as that script compiles it)."""
    mod = load_script("check_decode_kernels")
    kernel, dtypes, out_dtypes, consts = next(rest for name, *rest in mod.CASES if name == label)
    return kernel, dtypes, out_dtypes, consts + (("XP", 1),)


def metal_translation_unit(kernel, in_dtypes, out_dtypes, consts) -> str:
    """The source MLX's ``metal_kernel`` compiles for this variant (its signature rules), after the stand-in."""
    symbol, body = kernel.metal_source(consts)
    params = [f"const device {_MLX_TYPES[d]}* {n} [[buffer({i})]]"
              for i, (n, d) in enumerate(zip([*kernel.inputs, "vq_scalars"], [*in_dtypes, mx.int32]))]
    params += [f"device {_MLX_TYPES[d]}* {n} [[buffer({len(params) + i})]]"
               for i, (n, d) in enumerate(zip(kernel.outputs, out_dtypes))]
    params += [f"{t} {a} [[{a}]]" for a, t in _ATTRIBUTES if a in body]
    # threadgroup arrays are kernel-scope variables in Metal; clang's C++ takes an address space on static ones only
    body = body.replace("#define VQ_SHARED threadgroup", "#define VQ_SHARED static threadgroup")
    sig = ",\n  ".join(params)
    return f"{STAND_IN}{_compile.METAL_HEADER}\n[[kernel]] void custom_kernel_{symbol}(\n  {sig}) {{\n{body}}}\n"


def _errors(source: str) -> list[str]:
    tu = cindex.TranslationUnit.from_source("kernel.metal.cpp", args=["-x", "c++", "-std=c++17",
                                                                      "-Wno-unknown-attributes"],
                                            unsaved_files=[("kernel.metal.cpp", source)])
    lines = source.splitlines()
    return [f"{d.location.line}: {d.spelling} | {lines[d.location.line - 1].strip()}" for d in tu.diagnostics
            if d.severity >= cindex.Diagnostic.Error]


@pytest.mark.parametrize("label", METAL_CASES)
def test_metal_build_of_the_decode_kernels_parses(label):
    kernel, in_dtypes, out_dtypes, consts = _case(label)
    source = metal_translation_unit(kernel, in_dtypes, out_dtypes, consts)
    assert "thread_index_in_simdgroup [[thread_index_in_simdgroup]]" in source  # the macros named the attributes
    assert _errors(source) == []


@pytest.mark.parametrize("name,consts", [
    ("power_fit", (("M", 32), ("N", 128), ("R", 4), ("ITERS", 8), ("TOL_E8", 10000))),
    ("vq_nearest", (("D", 4), ("TILE_FLOATS", 7936))),
    ("observed_decode", (("D", 128), ("DV", 128), ("REP", 4), ("CAP", 640), ("THREADS", 128))),
    ("observed_decode", (("D", 64), ("DV", 48), ("REP", 3), ("CAP", 577), ("THREADS", 128)))])
def test_metal_build_of_the_encoding_kernels_parses(name, consts):
    """GEAR's fit, the nearest-codeword search and the observing eviction caches' decode step (opt-in on Metal with
    the decode kernels), parsed as above."""
    import importlib

    kernel = importlib.import_module(f"veloxquant_mlx.cache.kernels.{name}")._KERNEL
    ins = [mx.bfloat16, mx.float16, mx.float16] if name == "observed_decode" else [mx.float32] * len(kernel.inputs)
    outs = {"power_fit": [mx.float32] * len(kernel.outputs), "vq_nearest": [mx.int32],
            "observed_decode": [mx.bfloat16, mx.float32]}[name]
    source = metal_translation_unit(kernel, ins, outs, consts)
    assert "thread_index_in_simdgroup [[thread_index_in_simdgroup]]" in source or name == "vq_nearest"
    assert _errors(source) == []


def test_the_metal_stand_in_catches_what_metal_refuses():
    """The check can fail: a pointer into threadgroup or device memory without its address space, an unknown name,
    a CUDA intrinsic left in a body."""
    kernel, in_dtypes, out_dtypes, consts = _case("kivi_batch_d128_r4")  # the batch form: per-sequence counts
    good = metal_translation_unit(kernel, in_dtypes, out_dtypes, consts)
    for old, new in [("VQ_TG float* wp", "float* wp"), ("#define VQ_DEV device", "#define VQ_DEV"),
                     ("VQ_SYNC();", "__syncthreads();"), ("#define VQ_INF INFINITY", "#define VQ_INF inf")]:
        src = good.replace(old, new)
        assert src != good and _errors(src), old


def test_metal_call_hands_the_scalars_as_an_int32_array(monkeypatch):
    """A Metal call: built once per constants through ``mx.fast.metal_kernel`` (names, body, header), called with the
    arrays, then the scalars (ints, a float as its bits) in one int32 array, the grid and threadgroup in threads."""
    built, calls = [], []

    def fake_metal_kernel(**kw):
        built.append(kw)
        return lambda **call: calls.append(call) or [mx.zeros(s, d) for s, d in zip(call["output_shapes"],
                                                                                     call["output_dtypes"])]

    monkeypatch.setattr(_compile, "on_metal", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", fake_metal_kernel)
    k = _compile.Kernel("vq_test", ["a", "b"], ["out"], [("n", "int"), ("scale", "float")], "  out[0] = a[0];")
    a, b = mx.ones((4,)), mx.ones((2,), dtype=mx.uint32)
    for _ in range(2):
        (out,) = k([a, b], [7, 0.5], (("D", 64),), [(3,)], [mx.float32], grid=(256, 2, 1), threads=(128, 1, 1))
    assert out.shape == (3,) and len(built) == 1 and len(calls) == 2
    assert built[0]["input_names"] == ["a", "b", "vq_scalars"] and built[0]["output_names"] == ["out"]
    assert "constexpr int D = 64;" in built[0]["source"] and "as_type<float>(vq_scalars[1])" in built[0]["source"]
    assert built[0]["header"] == _compile.METAL_HEADER
    sc = calls[0]["inputs"][-1]
    assert sc.dtype == mx.int32 and sc.tolist() == [7, 0x3F000000]  # 0.5's float32 bits
    assert calls[0]["grid"] == (256, 2, 1) and calls[0]["threadgroup"] == (128, 1, 1)


def test_metal_kernels_are_opt_in_and_metal_only(monkeypatch):
    assert not _common.metal_enabled()  # this machine: no Metal, and the variable unset
    assert _common.shared_limit() == 48 * 1024  # CUDA's static shared memory
    monkeypatch.setattr(_common, "_METAL_ON", True)
    monkeypatch.setattr(_common, "on_metal", lambda: True)
    assert _common.metal_enabled() and _common.shared_limit() == 32 * 1024  # Metal's threadgroup memory
    monkeypatch.setattr(_common, "_ENV_ON", False)  # VELOXQUANT_DECODE_KERNELS=0 turns these off too
    assert not _common.metal_enabled()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to run the macros' arithmetic")
def test_metal_macros_compute_what_the_cuda_intrinsics_do(tmp_path):
    """The two macros that replace CUDA intrinsics, run on this CPU (g++, the stand-in's types): ``VQ_FUNNEL`` is
    ``__funnelshift_r`` (bits s.. of the 64-bit hi:lo, s taken mod 32) and ``VQ_CODE(w, i)`` reads code i of a word
    as 1 + code / 2^KB, for every shift and every code position of 2-, 4- and 8-bit words."""
    import random
    import subprocess

    rng = random.Random(0)
    cases = [(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(64)) for _ in range(200)]
    words = [rng.getrandbits(32) for _ in range(20)]
    src = ("#include <cmath>\n#include <cstdio>\n#include <cstring>\n"
           "typedef unsigned int uint; typedef unsigned long ulong; typedef _Float16 half;\n"
           "struct bfloat16_t { float v; bfloat16_t(float x) : v(x) {} "
           "explicit operator float() const { return v; } };\n"
           "template <typename T, typename U> T as_type(U u) { T t; std::memcpy(&t, &u, sizeof t); return t; }\n"
           "namespace metal { namespace precise { float sincos(float x, float& c) { c = std::cos(x); "
           "return std::sin(x); } } }\n#define device\n#define thread\n"
           + _compile.METAL_HEADER
           + "\n".join(line for line in _compile.METAL_MACROS.splitlines() if "FUNNEL" in line or "VQ_CODE" in line)
           + "\nint main() {\n"
           + "".join(f"  printf(\"%u\\n\", VQ_FUNNEL({lo}u, {hi}u, {s}u));\n" for lo, hi, s in cases)
           + "".join(f"  {{ const int KB = {kb}; printf(\"%.9g\\n\", (double)VQ_CODE({w}u, {i})); }}\n"
                     for kb in (2, 4, 8) for w in words for i in range(32 // kb))
           + "}\n")
    (tmp_path / "m.cpp").write_text(src)
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "m"), str(tmp_path / "m.cpp")], check=True,
                   capture_output=True, timeout=120)
    out = subprocess.run([str(tmp_path / "m")], check=True, capture_output=True, text=True).stdout.split()
    funnel = [int(x) for x in out[:len(cases)]]
    assert funnel == [((hi << 32 | lo) >> (s % 32)) & 0xFFFFFFFF for lo, hi, s in cases]
    codes = [float(x) for x in out[len(cases):]]
    want = [1 + ((w >> (kb * i)) & ((1 << kb) - 1)) / 2 ** kb
            for kb in (2, 4, 8) for w in words for i in range(32 // kb)]
    assert codes == want
