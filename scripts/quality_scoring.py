"""Next-token fidelity of the attention-scoring eviction methods (H2O, TOVA, K-norm, Keyformer,
MorphKV) on the embedded SmolLM2-135M, over an essay context.

For each method and budget: prefill ``--n-context`` tokens through the method's caches, then score
the next ``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints the mean next-token KL divergence
(nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes the caches really hold after the run over
mlx_lm's plain fp16 cache for the same tokens). Methods run with their default options except the
budget; ``--variants`` adds paper-like settings as extra rows.

    python scripts/quality_scoring.py                 # budgets 256 and 512 of a 1024-token context
    python scripts/quality_scoring.py --variants      # + paper-like settings
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import budget_table  # noqa: E402  (scripts/budget_table.py)

from veloxquant_mlx.cache.options import (  # noqa: E402
    H2OOptions,
    KeyformerOptions,
    KNormOptions,
    MorphKVOptions,
    TOVAOptions,
)

METHODS = {
    "h2o": lambda b: H2OOptions(budget=b),
    "tova": lambda b: TOVAOptions(budget=b),
    "knorm": lambda b: KNormOptions(budget=b),
    "keyformer": lambda b: KeyformerOptions(budget=b),
    "morphkv": lambda b: MorphKVOptions(budget=b),
}

# Paper-like settings (extra rows with --variants).
VARIANTS = {
    "h2o[paper: decay=1, recent=b/2]": ("h2o", lambda b: H2OOptions(budget=b, decay=1.0, grace=b // 2)),
    "keyformer[recent=b/4, tau 1->2]": ("keyformer", lambda b: KeyformerOptions(
        budget=b, recent=b // 4, tau_init=1.0, tau_end=2.0, anneal_steps=64)),
    "knorm[recent=32]": ("knorm", lambda b: KNormOptions(budget=b, recent=32)),
    "morphkv[window=32]": ("morphkv", lambda b: MorphKVOptions(budget=b, window=32)),
}


def main(argv=None):
    budget_table.main(METHODS, VARIANTS, __doc__.splitlines()[0], argv, label_width=34)


if __name__ == "__main__":
    main()
