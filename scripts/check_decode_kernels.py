"""Compile the CUDA decode kernels offline (no GPU needed), exactly the sources the library builds at run time,
and print ptxas's resource report (registers, shared memory, spills) from ``nvcc``; with ``--nvrtc LIBDIR`` also
compile them with the NVRTC library found there (the compiler the library uses on the device).

    python scripts/check_decode_kernels.py [--arch sm_90] [--keep DIR] [--nvrtc .../nvidia/cu13/lib]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache.kernels import _common, _compile, kivi, kivi_rows, waterfill, waterfill_rows  # noqa: E402

F32, F16, BF16, U32, I32 = mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int32
EXACT = [F16, F16, BF16, BF16, F32, F32]
PRS = ("PRS", kivi.PAIR_ROW_WORDS)  # the tensor-core kernel's constant
PARTIALS = [F32] * 3
WF_MMA_IN = [F16, U32, U32, F32, F32, F32, U32, U32, F16, F32]  # waterfill's tensor-core form's own inputs
FUSED_IN = [F32, I32]  # a fused kernel's sink logits and block counters; then the owner's last output (its dtype)
CASES = [  # (label, kernel, input dtypes, output dtypes, constants)
    ("waterfill_d128_r4", waterfill._KERNELS[False, False], [BF16, U32, U32, F32, F32, F32, I32, F32, U32, F16, F32] + EXACT,
     PARTIALS, (("D", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("PAIR", True)) + waterfill.group_constants(4, 4, 128)
     + (("NW", 4), ("REP", 4), ("DV", 128))),
    ("waterfill_batch_d128_r4", waterfill._KERNELS[True, False], [BF16, U32, U32, F32, F32, F32, I32, F32, U32, F16, F32, I32]
     + EXACT, PARTIALS, (("D", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("PAIR", True))
     + waterfill.group_constants(4, 4, 128) + (("HK", 8), ("NW", 4), ("REP", 4), ("DV", 128))),
    ("waterfill_d64_r3", waterfill._KERNELS[False, False], [F16, U32, U32, F32, F32, F32, I32, F32, U32, F16, F32] + EXACT,
     PARTIALS, (("D", 64), ("WK", 8), ("WV", 8), ("VB", 4), ("PAIR", False)) + waterfill.group_constants(3, 4, 64)
     + (("NW", 4), ("REP", 3), ("DV", 64))),
    ("waterfill_d64_r8_b3", waterfill._KERNELS[False, False], [F16, U32, U32, F32, F32, F32, I32, F32, U32, F16, F32]
     + EXACT, PARTIALS, (("D", 64), ("WK", 8), ("WV", 6), ("VB", 3), ("PAIR", True)) + waterfill.group_constants(8, 3, 64)
     + (("NW", 4), ("REP", 8), ("DV", 64))),
    ("kivi_d128_r4", kivi._KERNELS[False, False], [F16, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), ("NW", 4),
      ("REP", 4), ("DV", 128))),
    ("kivi_batch_d128_r4", kivi._KERNELS[True, False], [BF16, U32, F16, F16, U32, F16, F16, I32] + EXACT, PARTIALS,
     (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), ("HK", 8), ("NW", 4),
      ("REP", 4), ("DV", 128))),
    ("kivi_mma_d128_r4", kivi._MMA_KERNELS[False, False], [F16, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), PRS, ("NW", 4),
      ("REP", 4), ("DV", 128))),
    ("kivi_mma_fused_d128_r4", kivi._MMA_KERNELS[False, True], [F16, U32, F16, F16, U32, F16, F16] + EXACT
     + FUSED_IN + [F16], [F32, F16], (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), PRS,
                                ("HAS_SINK", 0), ("ROT", 0), ("NW", 4), ("REP", 4), ("DV", 128))),
    ("kivi_mma_fused_batch_d128_r8", kivi._MMA_KERNELS[True, True], [BF16, U32, F16, F16, U32, F16, F16, I32] + EXACT
     + FUSED_IN + [BF16], [F32, BF16], (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", 8), PRS,
                                 ("HK", 8), ("HAS_SINK", 1), ("ROT", 0), ("NW", 4), ("REP", 8), ("DV", 128))),
    ("kivi_mma_d64_r3", kivi._MMA_KERNELS[False, False], [F16, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 64), ("KB", 4), ("G", 64), ("GV", 64), ("WV", 8), ("TW", 8), PRS, ("NW", 4), ("REP", 3),
      ("DV", 64))),
    # waterfill's tensor-core form (a stack frame of spilled registers is expected there: it runs at 128 registers);
    # WK 16 and 8 stage their key words in shared memory, WK 20 (5-bit keys) reads them from global memory
    ("waterfill_mma_fused_d128_r4", waterfill._MMA_KERNELS[False, True], WF_MMA_IN + EXACT + FUSED_IN + [F16],
     [F32, F16], (("D", 128), ("WK", 16), ("WV", 16), ("HAS_SINK", 1), ("ROT", 1), ("NW", 4), ("REP", 4), ("DV", 128))),
    ("waterfill_mma_fused_batch_d128_r8", waterfill._MMA_KERNELS[True, True],
     WF_MMA_IN + [I32] + EXACT + FUSED_IN + [BF16], [F32, BF16],
     (("D", 128), ("WK", 16), ("WV", 16), ("HK", 8), ("HAS_SINK", 0), ("ROT", 1), ("NW", 4), ("REP", 8), ("DV", 128))),
    ("waterfill_mma_batch_d64_r8", waterfill._MMA_KERNELS[True, False], WF_MMA_IN + [I32] + EXACT, PARTIALS,
     (("D", 64), ("WK", 8), ("WV", 8), ("HK", 8), ("NW", 4), ("REP", 8), ("DV", 64))),
    ("waterfill_mma_d128_k20_r2", waterfill._MMA_KERNELS[False, False], WF_MMA_IN + EXACT, PARTIALS,
     (("D", 128), ("WK", 20), ("WV", 16), ("NW", 4), ("REP", 2), ("DV", 128))),
    ("kivi_d128_b2_r3", kivi._KERNELS[False, False], [BF16, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 128), ("KB", 2), ("G", 64), ("GV", 32), ("WV", 8), ("TW", 8), ("NW", 4), ("REP", 3), ("DV", 128))),
    ("kivi_d128_b8_r8", kivi._KERNELS[False, False], [F32, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 128), ("KB", 8), ("G", 128), ("GV", 32), ("WV", 32), ("TW", 8), ("NW", 4), ("REP", 8), ("DV", 128))),
    ("kivi_d64_b2", kivi._KERNELS[False, False], [F16, U32, F16, F16, U32, F16, F16] + EXACT, PARTIALS,
     (("D", 64), ("KB", 2), ("G", 64), ("GV", 64), ("WV", 4), ("TW", 8), ("NW", 4), ("REP", 3), ("DV", 64))),
    ("waterfill_encode_d128_b4", waterfill_rows._ENCODE_K, [BF16, BF16, U32, F32, F32, F32, I32, F32, F32],
     [U32, U32, F16], (("D", 128), ("DV", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("LEVELS", 4), ("NW", 4))),
    ("waterfill_encode_d64_b3", waterfill_rows._ENCODE_K, [F32, F32, U32, F32, F32, F32, I32, F32, F32],
     [U32, U32, F16], (("D", 64), ("DV", 64), ("WK", 6), ("WV", 6), ("VB", 3), ("LEVELS", 3), ("NW", 4))),
    ("waterfill_rows_d128_b4", waterfill_rows._DECODE_K, [U32, U32, F32, F32, F32, I32, F32, U32, F16, F32],
     [BF16, BF16], (("D", 128), ("DV", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("NW", 4))),
    ("kivi_rows_d128_b4", kivi_rows._KERNEL, [U32, F16, F16, U32, F16, F16], [BF16, BF16],
     (("D", 128), ("DV", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TT", 64))),
    ("kivi_rows_d64_b2", kivi_rows._KERNEL, [U32, F16, F16, U32, F16, F16], [F32, F32],
     (("D", 64), ("DV", 64), ("KB", 2), ("G", 64), ("GV", 64), ("WV", 4), ("TT", 64))),
    ("merge_rot_bf16", _common._MERGE, [F32, F32, F32, BF16], [BF16], (("DV", 128), ("MP", 4), ("MAX_S1", 513), ("HAS_SINK", 1),
                                                                           ("ROT", 1))),
    ("merge_f16", _common._MERGE, [F32, F32, F32, F32], [F16], (("DV", 64), ("MP", 8), ("MAX_S1", 513), ("HAS_SINK", 0),
                                                                       ("ROT", 0))),
]


def compile_case(label: str, kernel, dtypes, out_dtypes, consts, out: Path, arch: str = "sm_90"):
    """(symbol, CUDA source, nvcc's completed process with ptxas's resource report on stderr) of one case, its source
    and cubin written to ``out``; a decode kernel's exact rows taken one at a time (EXACT_PREFETCH past a few dozen)."""
    if "ek0" in kernel.inputs:
        consts = consts + (("XP", 1),)
    symbol, text = kernel.source(dtypes, out_dtypes, consts)
    src = out / f"{label}.cu"
    src.write_text(text)
    r = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-o", str(out / f"{label}.cubin"), "-Xptxas", "-v",
                        str(src)], capture_output=True, text=True, timeout=600)
    return symbol, text, r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--keep", default=None)
    ap.add_argument("--nvrtc", default=None, help="folder holding libnvrtc.so.*")
    a = ap.parse_args(argv)
    if a.nvrtc:
        for lib in sorted(Path(a.nvrtc).glob("libnvrtc-builtins.so*")) + sorted(Path(a.nvrtc).glob("libnvrtc.so*")):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    out = Path(a.keep or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for label, *case in CASES:
        symbol, text, r = compile_case(label, *case, out, a.arch)
        report = [ln for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln or "error" in ln]
        print(f"{label}: nvcc {'ok' if r.returncode == 0 else 'FAILED'}")
        for ln in report if r.returncode == 0 else r.stderr.splitlines()[:30]:
            print("   ", ln.strip())
        ok &= r.returncode == 0
        if a.nvrtc:
            try:
                size = len(_compile.compile_binary(text, symbol, a.arch))
                print(f"    nvrtc ok ({size} bytes)")
            except RuntimeError as err:
                print(f"    nvrtc FAILED: {err}")
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
