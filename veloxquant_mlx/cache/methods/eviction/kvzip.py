"""KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416).

A KV pair matters if the model needs it to reproduce the context. After the context is prefilled, the
model is run once more, with the cache, on a reconstruction prompt ("Repeat the previous context:"
followed by the context tokens); the importance of each cached KV pair is the largest attention it
receives from any reconstruction query (over the queries and the query heads of its GQA group). Each
KV head then keeps its ``kvzip_budget`` most important pairs plus the first ``kvzip_n_sink`` tokens,
whatever question comes later (query-agnostic).

The pass needs the model, so it is an explicit step::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", options=KVzipOptions(...)))
    model(context_ids[None], cache=caches)                       # prefill: nothing is evicted yet
    KVzipKVCache.compress_with_model(model, caches, context_ids, tokenizer=tok)   # or kvzip_compress

The reconstruction goes through the attention dispatch point, so the caches see its real queries;
its own K/V rows are appended only while a chunk runs and are dropped afterwards (rows and offset
restored; other layers' caches, e.g. sliding-window ones, work on copies). Without the dispatch point
the reconstruction's keys stand in for its queries (documented fallback).

``kvzip_probe``: ``"context"`` (default) is the paper's probe above; ``"repeat"`` feeds only the
instruction (a few tokens; the last ``chunk_size`` context tokens if there is no instruction) and
scores by its queries: much cheaper, much less informed.

Deviations from the paper:
* Budgets are per layer and equal for every KV head of a layer (the paper ranks all heads of all
  layers globally, giving heads different counts); mlx_lm shares one mask per forward pass.
* Long contexts are reconstructed chunk by chunk (``chunk_size`` context tokens after the instruction,
  each chunk seeing the full cache), as the paper does, but without the previous chunk's repeated
  tokens before it.
* Without a reconstruction pass (``compress_with_model`` never called) the importance is the largest
  attention each row received from the real queries seen so far (prompt and decode), so the cache
  still works as a plain max-attention eviction cache.
* Prefill chunks never evict (the context is held in full until ``compress_with_model``, the paper's
  setting); decoding evicts in batches: the cache grows to ``budget + slack`` rows
  (the slack of ``eviction.py``), then drops back to ``budget`` by importance; every decode query
  also raises the running max of the rows it sees, which is how decode rows get scored. Memory is
  bounded by ``budget + slack`` rows once decoding starts.
* ``trim`` drops the held rows of the trimmed tokens; the running statistic keeps the trimmed
  queries' contributions, and rows evicted while they were decoded are not restored
  (``exact_trim = False``).
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, check_budget, default_slack

REPEAT_PROMPT = "\n\nRepeat the previous context:"


@register_with_mlx_lm
@register("kvzip")
class KVzipKVCache(EvictionKVCache):
    """Query-agnostic eviction by context-reconstruction importance (max attention received)."""
    chunk_invariant = False  # prefill chunks never evict, decode steps evict (slack)
    exact_trim = False  # decode steps raise the importance and evict (slack)

    uses_attention_weights = True
    row_fields = ("importance",)
    array_fields = EvictionKVCache.array_fields + ("importance",)
    scalar_fields = EvictionKVCache.scalar_fields + ("compressed",)
    compressed = False
    _probe_rows = None  # rows held before a reconstruction chunk started (None: not probing)

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.probe = o.budget, o.n_sink, o.probe
        self.recent = 0
        check_budget("kvzip_budget", self.budget, self.n_sink + self.recent, "n_sink + recent")
        self.slack = default_slack(self.budget)

    def wants_eviction(self, n_new):
        return self._probe_rows is None and n_new == 1 and self.rows > self.budget + self.slack

    def observe(self, weights):
        rows = self.rows if self._probe_rows is None else self._probe_rows
        received = weights[..., :rows].max(axis=(2, 3))  # [B, H, rows]
        self.importance[:, :, :rows] = mx.maximum(self.importance[:, :, :rows], received)

    def score(self, obs_queries, obs_positions, scale):
        return self.importance[:, :, : self.rows]

    # ------------------------------------------------------------------ reconstruction
    def begin_reconstruction(self, reset: bool) -> None:
        """Start a reconstruction chunk: rows appended from now on are temporary and not scored.
        ``reset`` clears the importance of the held rows first (the first chunk)."""
        if reset and self.importance is not None:
            self.importance = mx.zeros_like(self.importance)
        self._probe_rows, self._probe_offset = self.rows, self.offset

    def end_reconstruction(self) -> None:
        """Drop the chunk's rows and restore the offset."""
        self.rows, self.offset = self._probe_rows, self._probe_offset
        self._probe_rows, self._pending = None, False

    def compress(self) -> None:
        """Keep the ``budget`` most important rows of each head (after the reconstruction)."""
        self.evict(self.importance[:, :, : self.rows])
        self.compressed = True

    @classmethod
    def compress_with_model(cls, model, caches, context_tokens, *, tokenizer=None, prompt_tokens=None,
                            chunk_size: int = 512) -> None:
        """Run the reconstruction pass of ``model`` over ``caches`` (already prefilled with
        ``context_tokens``) and evict every KVzip layer to its budget.

        The instruction is ``prompt_tokens`` if given, else ``REPEAT_PROMPT`` encoded with
        ``tokenizer``, else empty. Each chunk feeds instruction + ``chunk_size`` context tokens (just
        the instruction for ``kvzip_probe="repeat"``)."""
        ctx = [int(t) for t in (context_tokens.tolist() if isinstance(context_tokens, mx.array) else context_tokens)]
        if prompt_tokens is None:
            prompt_tokens = tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False) if tokenizer else []
        prompt_tokens = [int(t) for t in prompt_tokens]
        ours = [c for c in caches if isinstance(c, cls)]
        if not ours:
            return
        if ours[0].probe == "repeat":
            chunks = [prompt_tokens] if prompt_tokens else [ctx[-chunk_size:]]
        else:
            chunks = [prompt_tokens + ctx[i : i + chunk_size] for i in range(0, len(ctx), chunk_size)]
        for i, chunk in enumerate(chunks):
            # other layer types (sliding-window caches, ...) run the chunk on throwaway copies
            run = [c if isinstance(c, cls) else copy.deepcopy(c) for c in caches]
            for c in ours:
                c.begin_reconstruction(reset=i == 0)
            try:
                mx.eval(model(mx.array(chunk)[None], cache=run))
                mx.eval([c.importance for c in ours])
            finally:
                for c in ours:
                    c.end_reconstruction()
        for c in ours:
            c.compress()
        mx.eval([c.state for c in ours])


def kvzip_compress(model, caches, tokens, **kw) -> None:
    """Function form of ``KVzipKVCache.compress_with_model``."""
    KVzipKVCache.compress_with_model(model, caches, tokens, **kw)
