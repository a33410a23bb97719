"""``DeferredStart``: a grouped cache whose compressed form has a large per-layer fixed part (a fitted basis)
keeps every row in its float16 residual until ``start_rows``, the smallest multiple of G at which fixed part +
codes undercut the float16 rows they replace (so a short chat stays within ``SHORT_PROMPT_SLACK_ROWS``).
"""

from __future__ import annotations

import math

NEVER = 1 << 62  # start when the compressed form is never smaller


class DeferredStart:
    """Mixin before a ``GroupedQuantCache`` subclass; the subclass gives ``_compressed_cost(H, D, Dv)``: (fixed
    bytes, bytes per token) of the compressed form, per batch row, at most."""

    def start_rows(self, H: int, D: int, Dv: int) -> int:
        """Stored rows at which the first block is compressed (a multiple of G)."""
        fixed, per_token = self._compressed_cost(H, D, Dv)
        saved = 2 * H * (D + Dv) - per_token  # float16 bytes a compressed token saves
        if saved <= 0:
            return NEVER
        G = self.group
        return max(G, math.ceil(math.ceil(fixed / saved) / G) * G)

    def _holds_back(self, total: int, d: int, dv: int) -> bool:
        return self.n_quant == 0 and total < self.start_rows(self.res_k.shape[1], d, dv)
