"""``prefill_peak.py`` under another device policy for blocks, waits and attention tiles (a GPU experiment).

    python scripts/device_policy_variants.py cpu --contexts 2047 --steps 2048 --methods all --warm

The first argument names the policy; the rest go to ``scripts/prefill_peak.py``. Policies:
  asis     the library as it is
  cpu      the CPU's whole policy on any device (``primitives.blocks.on_cpu``): small blocks, waited for, the last
           one too, and prefill attention in tiles of query rows (``attention.dense_attention``)
  gpu      the GPU's policy on any device (on the CPU: to study a GPU's transients there)
  gpuN_E   the GPU's policy with blocks waited for N back (``blocks.GPU_IN_FLIGHT``; 0 for none: never waited for)
           and of 2^E entries (``blocks.BLOCK_ENTRIES_GPU``; E optional); session 33's library was ``gpu0_24`` but
           for its array-mask tiles
Prefill only: the CPU policy's decode-step stream split is not exercised by ``prefill_peak.py``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from veloxquant_mlx.cache.primitives import blocks


def apply(policy: str) -> None:
    if policy == "asis":
        return
    if policy == "cpu":
        blocks.on_cpu = lambda: True
        return
    if not policy.startswith("gpu"):
        raise SystemExit(f"policy {policy!r}: one of asis, cpu, gpu, gpuN, gpuN_E")
    blocks.on_cpu = lambda: False
    ahead, _, entries = policy[3:].partition("_")
    if ahead:
        blocks.GPU_IN_FLIGHT = int(ahead) or 1 << 30
    if entries:
        blocks.BLOCK_ENTRIES_GPU = 1 << int(entries)


if __name__ == "__main__":
    policy = sys.argv[1]
    apply(policy)
    print(f"policy={policy} device={mx.default_device()}", flush=True)
    sys.argv = ["prefill_peak.py"] + sys.argv[2:]
    runpy.run_path(str(Path(__file__).with_name("prefill_peak.py")), run_name="__main__")
