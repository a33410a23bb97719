"""KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416): a
KV pair matters if the model needs it to reproduce the context. After the prefill the model reruns, with the
cache, on "Repeat the previous context:" plus the context; a pair's importance is the largest attention any
reconstruction query (and GQA head) gives it, and each KV head keeps its ``kvzip_budget`` most important pairs plus
the first ``kvzip_n_sink`` tokens. The pass needs the model::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", options=KVzipOptions(...)))
    model(context_ids[None], cache=caches)                       # prefill: nothing is evicted yet
    KVzipKVCache.compress_with_model(model, caches, context_ids, tokenizer=tok)   # or kvzip_compress

The reconstruction's rows are dropped after each chunk (other layer types run on copies); without the dispatch
point its keys stand in for its queries. ``kvzip_probe="repeat"`` feeds only the instruction (else the last
``chunk_size`` tokens): much cheaper, much less informed.

Deviations: per-layer budgets, equal for a layer's heads (the paper ranks all heads globally; mlx_lm shares one
mask); chunks of ``chunk_size`` without the previous chunk's repeated tokens; without a reconstruction the
importance is the max attention from the real queries so far; prefill never evicts, decoding grows to ``budget +
slack`` rows and cuts back, decode queries raising the running max; trim keeps the trimmed queries' contributions.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache

REPEAT_PROMPT = "\n\nRepeat the previous context:"


@register_with_mlx_lm
@register("kvzip")
class KVzipKVCache(EvictionKVCache):
    """Query-agnostic eviction by context-reconstruction importance (max attention received)."""
    chunk_invariant, exact_trim = False, False  # only decode evicts (slack); it raises importance too
    uses_attention_weights = True
    row_fields = ("importance",)
    score_field = "importance"
    array_fields = EvictionKVCache.array_fields + ("importance",)
    scalar_fields = EvictionKVCache.scalar_fields + ("compressed",)
    compressed = False
    _probe_rows = None  # rows held before a reconstruction chunk started (None: not probing)

    def wants_eviction(self, n_new):
        return self._probe_rows is None and n_new == 1 and super().wants_eviction(n_new)

    def observe(self, weights, first=0, total=None):  # a max: tiles in any order
        rows = self.rows if self._probe_rows is None else self._probe_rows
        self.importance[:, :, :rows] = mx.maximum(self.importance[:, :, :rows], weights[..., :rows].max(axis=(2, 3)))

    def begin_reconstruction(self, reset: bool) -> None:
        """Rows appended from now on are temporary, not scored; ``reset`` clears the importance first."""
        if reset and self.importance is not None:
            self.importance = mx.zeros_like(self.importance)
        self._probe_rows, self._probe_offset = self.rows, self.offset

    def end_reconstruction(self) -> None:
        self.rows, self.offset = self._probe_rows, self._probe_offset
        self._probe_rows, self._pending = None, False

    def compress(self) -> None:
        """Keep the ``budget`` most important rows of each head (after the reconstruction)."""
        self.evict(self.importance[:, :, : self.rows])
        self.compressed = True

    @classmethod
    def compress_with_model(cls, model, caches, context_tokens, *, tokenizer=None, prompt_tokens=None,
                            chunk_size: int = 512) -> None:
        """Run the reconstruction of ``model`` over ``caches`` (prefilled with ``context_tokens``) and
        evict every KVzip layer to its budget. The instruction is ``prompt_tokens``, else
        ``REPEAT_PROMPT`` encoded with ``tokenizer``, else empty."""
        ctx = [int(t) for t in (context_tokens.tolist() if isinstance(context_tokens, mx.array) else context_tokens)]
        if prompt_tokens is None:
            prompt_tokens = tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False) if tokenizer else []
        prompt_tokens = [int(t) for t in prompt_tokens]
        ours = [c for c in caches if isinstance(c, cls)]
        if not ours:
            return
        if ours[0].config.options.probe == "repeat":
            chunks = [prompt_tokens] if prompt_tokens else [ctx[-chunk_size:]]
        else:
            chunks = [prompt_tokens + ctx[i : i + chunk_size] for i in range(0, len(ctx), chunk_size)]
        for i, chunk in enumerate(chunks):
            run = [c if isinstance(c, cls) else copy.deepcopy(c) for c in caches]  # other layer types: copies
            for c in ours:
                c.begin_reconstruction(reset=i == 0)
            try:
                mx.eval(model(mx.array(chunk)[None], cache=run), [c.importance for c in ours])
            finally:
                for c in ours:
                    c.end_reconstruction()
        for c in ours:
            c.compress()
        mx.eval([c.state for c in ours])


kvzip_compress = KVzipKVCache.compress_with_model  # the function form
