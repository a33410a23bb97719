"""Compressed caches on a model sharded with ``mx.distributed`` (README.md, "Sharded models"): every cache takes
its head count from its keys, so ``for_model`` on a sharded model builds each rank the cache of its own KV heads.
"""

from __future__ import annotations

import mlx.core as mx

from .cache.errors import QuantizerConfigError
from .cache.factory import _attention, _layers

#: This process's group: ``init_group(strict=False, backend="any")``, size 1 when not started by ``mlx.launch``.
init_group = mx.distributed.init


def kv_heads(model) -> list[int]:
    """KV heads per attention layer as the model computes them now (per rank once sharded)."""
    heads = (getattr(a, "n_kv_heads", None) or getattr(a, "num_key_value_heads", None)
             for a in map(_attention, _layers(model)))
    return [int(n) for n in heads if n is not None]


def shard_model(model, group=None):
    """``model.shard(group)`` once every layer's heads divide evenly (else a rank's cache would hold a wrong head
    count); a group of size 1 leaves ``model`` unchanged."""
    group = group if group is not None else init_group()
    n = group.size()
    if n == 1:
        return model
    if not callable(getattr(model, "shard", None)):
        raise QuantizerConfigError("model", type(model).__name__, "an mlx_lm model with a shard() method (its "
                                   "architecture supports tensor parallelism in mlx_lm)")
    for i, layer in enumerate(_layers(model)):
        attn = _attention(layer)
        for field in ("n_heads", "n_kv_heads"):
            h = getattr(attn, field, None)
            if h is not None and h % n:
                raise QuantizerConfigError(f"layers[{i}].{field}", h,
                                           f"a multiple of the distributed group size {n}")
    model.shard(group)
    return model
