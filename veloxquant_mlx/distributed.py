"""Compressed caches on a model sharded with MLX's own distributed engine (``mx.distributed``).

mlx_lm shards a model's attention heads across the ranks of a group (``model.shard(group)``, e.g.
llama: q/k/v projections "all-to-sharded", the output projection "sharded-to-all", and each
attention module's ``n_heads``/``n_kv_heads`` divided by the group size). Every cache of this
library takes its head count from the keys it is given, so ``KVCacheBuilder.for_model`` on a sharded
model builds, on each rank, the compressed cache of that rank's own KV heads: nothing else changes,
and no bytes cross ranks except mlx_lm's own all-sums of the sharded projections.

Launch (two processes on one machine, ring backend over loopback)::

    mlx.launch --backend ring -n 2 --python "$(which python)" my_script.py

where ``my_script.py`` calls ``group = init_group()``, loads the model, ``shard_model(model, group)``
and builds the caches with ``KVCacheBuilder.for_model``. This module only validates and wraps MLX's
engine; it has no transport of its own.
"""

from __future__ import annotations

import mlx.core as mx

from .cache.errors import QuantizerConfigError
from .cache.factory import _attention, _layers


def init_group(backend: str = "any", strict: bool = False):
    """``mx.distributed.init``: the group of this process (size 1 when not launched by mlx.launch
    and ``strict`` is False)."""
    return mx.distributed.init(strict=strict, backend=backend)


def kv_heads(model) -> list[int]:
    """KV heads per attention layer as the model computes them now (per rank once sharded)."""
    out = []
    for layer in _layers(model):
        attn = _attention(layer)
        n = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
        if n is not None:
            out.append(int(n))
    return out


def shard_model(model, group=None):
    """Shard ``model``'s heads across ``group`` with mlx_lm's own ``model.shard``, after checking
    that every layer's query and KV heads divide evenly (else each rank's cache would silently hold a
    wrong head count). Returns ``model``; a group of size 1 leaves it unchanged."""
    group = group if group is not None else init_group()
    n = group.size()
    if n == 1:
        return model
    if not callable(getattr(model, "shard", None)):
        raise QuantizerConfigError("model", type(model).__name__,
                                   "an mlx_lm model with a shard() method (its architecture supports "
                                   "tensor parallelism in mlx_lm)")
    for i, layer in enumerate(_layers(model)):
        attn = _attention(layer)
        for field in ("n_heads", "n_kv_heads"):
            h = getattr(attn, field, None)
            if h is not None and h % n:
                raise QuantizerConfigError(f"layers[{i}].{field}", h,
                                           f"a multiple of the distributed group size {n}")
    model.shard(group)
    return model
