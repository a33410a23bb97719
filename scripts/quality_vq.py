"""Next-token fidelity of the vector-quantization caches (vecinfer, a2ats where registered) on the
embedded SmolLM2-135M over an essay context.

Prefill ``--n-context`` tokens through the method's caches, then score ``--n-score`` tokens one decode
step at a time against the uncompressed model (``veloxquant_mlx.eval.fidelity.next_token_fidelity``).
Prints mean next-token KL (nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes really held
after the run over mlx_lm's plain fp16 cache for the same tokens).

    python scripts/quality_vq.py
    python scripts/quality_vq.py --methods vecinfer
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import fidelity_table  # noqa: E402  (scripts/fidelity_table.py)
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache import options as O  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)  # key_sub_dim & co. are shared flat fields

CONFIGS = {
    "vecinfer[K 4d/12b, V 8d/8b] (2 bits/coord)": ("vecinfer", lambda: KVCacheConfig(
        method="vecinfer", options=O.VecInferOptions())),
    "vecinfer[K 4d/8b, V 4d/8b] (2/2 bits/coord)": ("vecinfer", lambda: KVCacheConfig(
        method="vecinfer", key_codebook_bits=8, value_sub_dim=4, value_codebook_bits=8, options=O.VecInferOptions())),
    "a2ats[default, 20% + W=128]": ("a2ats", lambda: KVCacheConfig(method="a2ats", options=O.A2ATSOptions())),
}


def main(argv=None):
    fidelity_table.main(CONFIGS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
