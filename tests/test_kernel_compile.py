"""The CUDA decode kernels compiled here, with no GPU (``nvcc`` where the machine has one), exactly as the library
builds them at run time: they compile, and the decode kernels keep their per-lane arrays in registers -- a stack
frame means an array indexed at run time (local memory in the hot loop: waterfill's reduce-scatter had one, 28
local loads per group of rows, found this way)."""

from __future__ import annotations

import re
import shutil

import pytest

from scripts_util import load_script

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) on this machine")


def _script():
    return load_script("check_decode_kernels")


@pytest.mark.parametrize("label", ["waterfill_d128_r4", "waterfill_batch_d128_r4", "waterfill_d64_r3",
                                   "waterfill_d64_r8_b3", "kivi_d128_r4", "kivi_batch_d128_r4",
                                   "kivi_mma_d64_r3", "kivi_mma_d128_r4", "kivi_mma_fused_d128_r4",
                                   "kivi_mma_fused_batch_d128_r8"])
def test_decode_kernels_compile_without_a_stack_frame(label, tmp_path):
    mod = _script()
    case = next(rest for name, *rest in mod.CASES if name == label)
    _, _, r = mod.compile_case(label, *case, tmp_path)  # the script's own compile: the same source and flags
    assert r.returncode == 0, r.stderr[-3000:]
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert frames and frames == [0] * len(frames) and spills == [0] * len(spills), r.stderr


@pytest.mark.parametrize("label", ["waterfill_mma_fused_d128_r4", "waterfill_mma_fused_batch_d128_r8",
                                   "waterfill_mma_batch_d64_r8", "waterfill_mma_d128_k20_r2"])
def test_waterfill_tensor_core_form_compiles_within_static_shared_memory(label, tmp_path):
    """Waterfill's tensor-core form stages a tile's key words in shared memory only where the block's 48 KB of
    static shared memory hold them beside its other arrays (8 query heads at d 128 and 5-bit keys read global memory):
    every layout it takes compiles, and the staged ones do hold the buffer."""
    mod = _script()
    case = next(rest for name, *rest in mod.CASES if name == label)
    _, _, r = mod.compile_case(label, *case, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", r.stderr)]
    assert smem and max(smem) <= 48 * 1024, r.stderr
    consts = dict(case[-1])
    stride = consts["WK"] + 4 if consts["WK"] % 8 == 0 else consts["WK"]
    staged = 4 * 4 * 64 * stride  # NW warps x 64 rows x the padded row
    if label in ("waterfill_mma_fused_d128_r4", "waterfill_mma_batch_d64_r8"):
        assert max(smem) >= staged, (smem, staged)
    else:  # left in global memory only where staging would not have fit (or rows of more than 16 words)
        assert consts["WK"] > 16 or max(smem) + staged > 48 * 1024 - 256, (smem, staged)
