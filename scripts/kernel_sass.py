"""Compile the decode kernels here, with no GPU, and print each one's registers, shared memory and instruction mix
(SASS): a quick check of a kernel edit before spending device time. Needs NVIDIA's wheels, unpacked into one
folder (``--tools``)::

    pip download --no-deps -d /tmp/cuda nvidia-cuda-nvrtc-cu12 nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    for w in /tmp/cuda/*.whl; do unzip -qo $w -d /tmp/cuda/x; done
    python scripts/kernel_sass.py --tools /tmp/cuda/x [--arch sm_90] [--out DIR]

Shapes: 8 KV heads x 4 query heads, d 128, 4-bit, float16 rows (the H200 measurements' shape).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tool(root: str, name: str) -> str:
    found = glob.glob(f"{root}/nvidia/**/bin/{name}", recursive=True)
    if not found:
        sys.exit(f"{name} not found under {root}")
    return found[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", required=True, help="folder holding the unpacked NVIDIA wheels")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default=None, help="also write each kernel's .cu and .sass here")
    a = ap.parse_args(argv)
    lib = glob.glob(f"{a.tools}/nvidia/cuda_nvrtc/lib/libnvrtc.so.*")
    builtins = glob.glob(f"{a.tools}/nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.*")
    if not lib or not builtins:
        sys.exit("libnvrtc not found under --tools")
    ctypes.CDLL(sorted(builtins)[0], mode=ctypes.RTLD_GLOBAL)
    import mlx.core as mx

    from veloxquant_mlx.cache.kernels import _common, _compile, kivi, turboquant_rvq, turboquant_rvq_rows, waterfill

    _compile._LIBS["libnvrtc.so.13"] = ctypes.CDLL(sorted(lib)[0])
    f16, u32, f32, i32 = mx.float16, mx.uint32, mx.float32, mx.int32
    block = (("NW", _common.WARPS), ("REP", 4), ("DV", 128))
    # exact rows one at a time (KIVI's residual, waterfill's window: a few dozen), TurboQuant-RVQ's four (its window)
    kivi_consts = (("D", 128), ("KB", 4), ("G", 32), ("GV", 32), ("WV", 16), ("TW", kivi.TILE_WORDS), ("XP", 1)) + block
    wf_consts = ((("D", 128), ("WK", 16), ("WV", 16), ("VB", 4), ("PAIR", True)) + waterfill.group_constants(4, 4, 128)
                 + (("XP", 1),) + block)
    tq_consts = (("D", 128), ("SK", 4), ("B1", 8), ("B2", 4), ("W1", 8), ("W2", 4), ("VS", 8), ("VB1", 8), ("VB2", 0),
                 ("WV1", 4), ("WV2", 4)) + block
    kernels = {
        "kivi": (kivi._KERNELS[False, False], [f16, u32, f16, f16, u32, f16, f16] + [f16] * 6, [f32] * 3, kivi_consts),
        "waterfill": (waterfill._KERNELS[False, False], [f16, u32, u32, f32, f32, f32, i32, f32, u32, f16, f32] + [f16] * 6,
                      [f32] * 3, wf_consts),
        "waterfill_mma_fused": (waterfill._MMA_KERNELS[False, True], [f16, u32, u32, f32, f32, f32, u32, u32, f16, f32]
                                + [f16] * 7 + [i32], [f32, f16], (("D", 128), ("WK", 16), ("WV", 16), ("XP", 1)) + block
                                + (("HAS_SINK", 1), ("ROT", 1))),
        "kivi_fused": (kivi._KERNELS[False, True], [f16, u32, f16, f16, u32, f16, f16] + [f16] * 7 + [i32], [f32, f16],
                       kivi_consts + (("HAS_SINK", 0), ("ROT", 0))),
        "waterfill_fused": (waterfill._KERNELS[True, True], [f16, u32, u32, f32, f32, f32, i32, f32, u32, f16, f32, i32]
                            + [f16] * 6 + [f32, i32], [f32, f16], wf_consts + (("HK", 8), ("HAS_SINK", 1), ("ROT", 1))),
        # TurboQuant-RVQ defaults at d 128: keys 32 sub-vectors x (8 + 4) bits, values 16 x 8 bits
        "turboquant_rvq_fused": (turboquant_rvq._KERNELS[False, True], [f16, f32, u32, u32, f16, u32, u32, f16]
                                 + [f32] * 7 + [f16] * 7 + [i32], [f32, f16], tq_consts + (("XP", 4), ("HAS_SINK", 1), ("ROT", 2))),
        # TurboQuant-RVQ's prefill encoder at the defaults: keys (4 coordinates, 8 + 4 bits), values (8, 8)
        "rvq_encode_keys": (turboquant_rvq_rows._ENCODE, [f32] * 6, [u32, u32, f16], (("D", 128), ("SD", 4), ("B1", 8),
                            ("B2", 4), ("TWO", 1), ("W1", 8), ("W2", 4), ("BEAM", 4), ("V", 32), ("NORM", 1))),
        "rvq_encode_values": (turboquant_rvq_rows._ENCODE, [f32] * 6, [u32, u32, f16], (("D", 128), ("SD", 8), ("B1", 8),
                              ("B2", 0), ("TWO", 0), ("W1", 4), ("W2", 1), ("BEAM", 1), ("V", 64), ("NORM", 1))),
        "rvq_rows_keys": (turboquant_rvq_rows._ROWS, [u32, u32, f16, f32, f32, f32, f16], [f16],
                          (("D", 128), ("SD", 4), ("B1", 8), ("B2", 4), ("TWO", 1), ("W1", 8), ("W2", 4))),
        "merge": (_common._MERGE, [f32] * 4, [f16], (("DV", 128), ("MP", 8), ("MAX_S1", _common.MAX_SPLITS + 1),
                                                      ("HAS_SINK", 0), ("ROT", 1))),
    }
    out = Path(a.out) if a.out else Path("/tmp")
    out.mkdir(parents=True, exist_ok=True)
    for name, (kern, dtypes, out_dtypes, consts) in kernels.items():
        symbol, text = kern.source(dtypes, out_dtypes, consts)
        cubin = out / f"{name}.cubin"
        cubin.write_bytes(_compile.compile_binary(text, symbol, a.arch))
        res = subprocess.run([tool(a.tools, "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True)
        usage = " ".join(line.strip() for line in res.stdout.splitlines() if "REG" in line)
        sass = subprocess.run([tool(a.tools, "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
        ops = collections.Counter(m.split(".")[0] for m in re.findall(
            r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M))
        print(f"{name}: {usage}\n  {sum(ops.values())} instructions; {dict(ops.most_common(12))}")
        if a.out:
            (out / f"{name}.cu").write_text(text)
            (out / f"{name}.sass").write_text(sass)


if __name__ == "__main__":
    main()
