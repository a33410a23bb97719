"""Next-token fidelity of the layer-budget eviction methods (PyramidKV, SqueezeAttention, ChunkKV, CaM)
on the embedded SmolLM2-135M, over an essay context.

For each method and budget: prefill ``--n-context`` tokens through the method's caches (built by
``KVCacheBuilder.for_model``, so per-layer budgets and coordinators are in place), then score the next
``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints the mean next-token KL divergence (nats),
top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes the caches really hold after the run over mlx_lm's
plain fp16 cache for the same tokens). ``budget`` is the per-layer average (PyramidKV, Squeeze) or
per-layer budget (ChunkKV, CaM). SnapKV at the same budget is printed as a reference row;
``--variants`` adds paper-like settings as extra rows.

    python scripts/quality_layers.py                 # budgets 256 and 512 of a 1024-token context
    python scripts/quality_layers.py --variants      # + paper-like settings
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import budget_table  # noqa: E402  (scripts/budget_table.py)

from veloxquant_mlx.cache.options import (  # noqa: E402
    CaMOptions,
    ChunkKVOptions,
    PyramidKVOptions,
    SnapKVOptions,
    SqueezeOptions,
)

METHODS = {
    "pyramidkv": lambda b: PyramidKVOptions(budget=b),
    "squeeze": lambda b: SqueezeOptions(budget=b),
    "chunkkv": lambda b: ChunkKVOptions(budget=b),
    "cam": lambda b: CaMOptions(budget=b),
    "snapkv": lambda b: SnapKVOptions(budget=b),  # reference: uniform budget, prompt-only
}

# Paper-like settings (extra rows with --variants).
VARIANTS = {
    "pyramidkv[beta=20]": ("pyramidkv", lambda b: PyramidKVOptions(budget=b, beta=20.0)),
    "squeeze[strength=2]": ("squeeze", lambda b: SqueezeOptions(budget=b, strength=2.0)),
    "chunkkv[chunk=10, reuse=2]": ("chunkkv", lambda b: ChunkKVOptions(budget=b, chunk_size=10, reuse_layers=2)),
    "chunkkv[key_norm]": ("chunkkv", lambda b: ChunkKVOptions(budget=b, score="key_norm")),
    "cam[mean]": ("cam", lambda b: CaMOptions(budget=b, merge="mean")),
    "cam[drop]": ("cam", lambda b: CaMOptions(budget=b, merge="drop")),
    "cam[no gate]": ("cam", lambda b: CaMOptions(budget=b, merge_gate=False)),
}


def main(argv=None):
    budget_table.main(METHODS, VARIANTS, __doc__.splitlines()[0], argv, label_width=28)


if __name__ == "__main__":
    main()
