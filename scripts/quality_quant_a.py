"""Next-token fidelity of the KIVI-layout quantizer variants (kivi, kivi_sink, kitty, skvq,
age_tiered, zipcache where registered) on the embedded SmolLM2-135M over an essay context.

Prefill ``--n-context`` tokens through the method's caches, then score ``--n-score`` tokens one decode
step at a time against the uncompressed model (``veloxquant_mlx.eval.fidelity.next_token_fidelity``).
Prints mean next-token KL (nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes really held
after the run over mlx_lm's plain fp16 cache for the same tokens).

    python scripts/quality_quant_a.py
    python scripts/quality_quant_a.py --methods kitty skvq
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
    "kivi[2b]": ("kivi", lambda: KVCacheConfig(method="kivi", bit_width_inlier=2)),
    "kivi_sink[2b, S=5]": ("kivi_sink", lambda: KVCacheConfig(method="kivi_sink", bit_width_inlier=2,
                                                              options=O.KIVISinkOptions())),
    "kitty[25% 4b / 2b]": ("kitty", lambda: KVCacheConfig(method="kitty", options=O.KittyOptions())),
    "skvq[K2 V2, W=128, S=5]": ("skvq", lambda: KVCacheConfig(method="skvq", options=O.SKVQOptions())),
    "skvq[K2 V2, W=32, S=5]": ("skvq", lambda: KVCacheConfig(method="skvq", options=O.SKVQOptions(window=32))),
    "skvq[W=32, no reorder, no clip]": ("skvq", lambda: KVCacheConfig(method="skvq", options=O.SKVQOptions(
        window=32, reorder=False, clip_search=False))),
    "age_tiered[8/4/2 @128/1024]": ("age_tiered", lambda: KVCacheConfig(method="age_tiered",
                                                                         options=O.AgeTieredOptions())),
    "age_tiered[8/4/2 @64/256]": ("age_tiered", lambda: KVCacheConfig(
        method="age_tiered", options=O.AgeTieredOptions(recent_boundary=64, mid_boundary=256))),
    "zipcache[20% 4b / 2b]": ("zipcache", lambda: KVCacheConfig(method="zipcache", options=O.ZipCacheOptions())),
}


def main(argv=None):
    fidelity_table.main(CONFIGS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
