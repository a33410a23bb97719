"""Next-token fidelity of anchorkv and nsnquant (where registered), with plain KIVI 2-bit as the
baseline, on the embedded SmolLM2-135M over an essay context.

Prefill ``--n-context`` tokens through the method's caches, then score ``--n-score`` tokens one decode
step at a time against the uncompressed model (``veloxquant_mlx.eval.fidelity.next_token_fidelity``).
Prints mean next-token KL (nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes really held
after the run over mlx_lm's plain fp16 cache for the same tokens).

    python scripts/quality_anchor_nsn.py
    python scripts/quality_anchor_nsn.py --methods anchorkv
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import fidelity_table  # noqa: E402  (scripts/fidelity_table.py)
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache import options as O  # noqa: E402

CONFIGS = {
    "kivi[2b, G=32]": ("kivi", lambda: KVCacheConfig(method="kivi", bit_width_inlier=2)),
    "anchorkv[2b, G=32, 1 anchor/group]": ("anchorkv", lambda: KVCacheConfig(method="anchorkv",
                                                                              options=O.AnchorKVOptions())),
    "anchorkv[2b, G=32, 4 anchors/group]": ("anchorkv", lambda: KVCacheConfig(
        method="anchorkv", options=O.AnchorKVOptions(anchor_frac=0.125))),
    "nsnquant[256 codes x 8 dims, R=64]": ("nsnquant", lambda: KVCacheConfig(method="nsnquant",
                                                                            options=O.NSNQuantOptions())),
}


def main(argv=None):
    fidelity_table.main(CONFIGS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
