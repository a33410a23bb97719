"""Compile the CUDA decode kernels offline with nvcc (no GPU needed) and print ptxas's resource
report (registers, shared memory, spills), wrapping each body the way ``mx.fast.cuda_kernel`` does.

    python scripts/check_decode_kernels.py [--arch sm_90] [--keep DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.cache.kernels import _common, kivi, waterfill  # noqa: E402

# What MLX's JIT puts before a custom kernel (its default header), reduced to what the bodies use
# (MLX 0.32.4's own header defines no ``inf``: the bodies use the prelude's VQ_INF).
_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 8>; }
"""

_CTYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "u32": "uint32_t", "i32": "int32_t"}


def render(name, body, inputs, outputs, template, out_type="float"):
    """``inputs``: (name, ctype key); shapes are passed for the names the body uses."""
    sig = []
    for n, t in inputs:
        sig.append(f"    const {_CTYPES[t]}* {n}")
        if f"{n}_shape" in body:
            sig.append(f"    const __grid_constant__ Shape {n}_shape")
    sig += [f"    {out_type}* {n}" for n in outputs]
    consts = "".join(f"  using {k} = {v};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                     for k, v in template)
    return (_HEADER + _common.PRELUDE + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {name}(\n" + ",\n".join(sig) + ") {\n" + consts + body + "\n}\n}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--keep", default=None)
    a = ap.parse_args(argv)
    exact = [("ek0", "f16"), ("ev0", "f16"), ("ek1", "bf16"), ("ev1", "bf16"), ("nk", "f32"), ("nv", "f32")]
    wf_in = [("q", "bf16"), ("fs", "f32"), ("kw", "u32"), ("ktab", "u32"), ("klo", "f32"), ("kst", "f32"), ("rw", "f32"),
             ("rp", "i32"), ("rs", "f32"), ("vw", "u32"), ("vs", "f16"), ("vpoly", "f32"), ("meta", "i32")] + exact
    kv_in = [("q", "f16"), ("fs", "f32"), ("kc", "u32"), ("ks", "f16"), ("kb", "f16"), ("vc", "u32"), ("vsc", "f16"),
             ("vbi", "f16"), ("meta", "i32")] + exact
    merge_in = [("pm", "f32"), ("pl", "f32"), ("pa", "f32"), ("sk", "bf16")]
    cases = [
        ("waterfill_d128_r4", waterfill._SOURCE, wf_in,
         [("D", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("NW", 4), ("REP", 4), ("DV", 128)]),
        ("waterfill_d64_r3", waterfill._SOURCE, wf_in,
         [("D", 64), ("WK", 8), ("WV", 8), ("VB", 4), ("NW", 4), ("REP", 3), ("DV", 64)]),
        ("kivi_d128_r4", kivi._SOURCE, kv_in,
         [("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("NW", 4), ("REP", 4), ("DV", 128)]),
        ("kivi_d128_b2_r3", kivi._SOURCE, kv_in,
         [("D", 128), ("KB", 2), ("G", 64), ("GV", 32), ("WV", 8), ("NW", 4), ("REP", 3), ("DV", 128)]),
        ("kivi_d128_b8_r8", kivi._SOURCE, kv_in,
         [("D", 128), ("KB", 8), ("G", 128), ("GV", 32), ("WV", 32), ("NW", 4), ("REP", 8), ("DV", 128)]),
        ("kivi_d64_b2", kivi._SOURCE, kv_in,
         [("D", 64), ("KB", 2), ("G", 64), ("GV", 64), ("WV", 4), ("NW", 4), ("REP", 3), ("DV", 64)]),
    ]
    merges = [("merge_rot_bf16", merge_in, [("DV", 128), ("HAS_SINK", 1), ("ROT", 1), ("OT", "__nv_bfloat16")]),
              ("merge_f16", merge_in, [("DV", 64), ("HAS_SINK", 0), ("ROT", 0), ("OT", "__half")])]
    out = Path(a.keep or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    jobs = [(n, b, i, t, "float", _common.OUTPUTS) for n, b, i, t in cases]
    jobs += [(n, _common._MERGE_SOURCE, i, t, dict(t)["OT"], ["out"]) for n, i, t in merges]
    for name, body, ins, tmpl, otype, outs in jobs:
        src = out / f"{name}.cu"
        src.write_text(render(name, body, ins, outs, tmpl, otype))
        r = subprocess.run(["nvcc", f"-arch={a.arch}", "-c", "-o", str(out / f"{name}.o"), "-Xptxas", "-v",
                            "--std=c++17", str(src)], capture_output=True, text=True)
        report = [ln for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln or "error" in ln]
        print(f"{name}: {'ok' if r.returncode == 0 else 'FAILED'}")
        for ln in report if r.returncode == 0 else r.stderr.splitlines()[:30]:
            print("   ", ln.strip())
        ok &= r.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
