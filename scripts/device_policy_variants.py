"""``prefill_peak.py`` under another device policy for blocks, waits and attention tiles (a GPU experiment).

    python scripts/device_policy_variants.py cpu --contexts 2047 --steps 2048 --methods all --warm

The first argument names the policy; the rest go to ``scripts/prefill_peak.py``. Policies:
  asis     the library as it is
  cpu      the CPU's policy on any device (``primitives.blocks.on_cpu``): 2^18-entry blocks, and prefill attention
           in tiles of query rows (``attention.dense_attention``) with a floor of rows
  gpu      the GPU's policy on any device (on the CPU: to study a GPU's transients there)
  gpuN_E   the GPU's policy with blocks waited for N back (``blocks.IN_FLIGHT``) and of 2^E entries
           (``blocks.BLOCK_ENTRIES_GPU``; E optional)
Since session 34 the waits are the same on every device; the runs of docs/data/h100_policies_s34_2026-12-05 were
made before (their README says what each policy was then).
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
        blocks.IN_FLIGHT = int(ahead)
    if entries:
        blocks.BLOCK_ENTRIES_GPU = 1 << int(entries)


if __name__ == "__main__":
    policy = sys.argv[1]
    apply(policy)
    print(f"policy={policy} device={mx.default_device()}", flush=True)
    sys.argv = ["prefill_peak.py"] + sys.argv[2:]
    runpy.run_path(str(Path(__file__).with_name("prefill_peak.py")), run_name="__main__")
