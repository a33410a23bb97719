"""Array primitives of the caches: bit packing, codebooks, rotations, sketches, low-rank fits."""

import numpy as np


def check_int(name: str, v, lo=None, hi=None) -> int:
    """``int(v)``, or a ``ValueError`` naming ``name``, the value and the allowed range."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (lo is not None and v < lo) \
            or (hi is not None and v > hi):
        allowed = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}" if lo is not None else "an int"
        raise ValueError(f"{name}={v!r} is invalid: expected {allowed}")
    return int(v)
