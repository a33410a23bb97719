"""Caches for a model, prompt encoding and greedy generation with timings (the CLI's ``generate``/``demo``)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from .cache import KVCacheBuilder
from .cache.base import method_info

__all__ = ["make_caches", "method_class", "has_batch_form", "encode_prompt", "encode_turn", "run_generation"]


def make_caches(model, method: str, config=None) -> list:
    """One cache per layer: mlx_lm's plain caches for ``"none"``, else ``KVCacheBuilder.for_model``."""
    if method == "none":
        return make_prompt_cache(model)
    return KVCacheBuilder.for_model(model, config)


def method_class(method: str):
    """The cache class of ``method`` (None for ``"none"``, mlx_lm's plain cache, or one not implemented)."""
    return None if method == "none" else method_info(method).cls


def has_batch_form(method: str) -> bool:
    """Whether ``method``'s caches merge into one batch cache: ``none`` (mlx_lm's ``BatchKVCache``) and the
    methods whose class declares a batch form (``batchable``)."""
    cls = method_class(method)
    return method == "none" or bool(cls is not None and cls.__dict__.get("batchable", False))


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn of the chat template when the tokenizer has one."""
    if _has_template(tokenizer):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if hasattr(ids, "keys"):  # a BatchEncoding from some transformers versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(text)]


def encode_turn(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one more user turn after tokens already in a cache: the turn and the assistant
    prompt without BOS or default system message (plain ``encode`` where the template cannot do that)."""
    plain = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if not _has_template(tokenizer):
        return plain
    system = [{"role": "system", "content": "-"}]
    try:
        head = tokenizer.apply_chat_template(system, tokenize=False)
        full = tokenizer.apply_chat_template(system + [{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that refuses a system message
        return plain
    if not full.startswith(head):
        return plain
    return [int(i) for i in tokenizer.encode(full[len(head):], add_special_tokens=False)]


def run_generation(model, tokenizer, prompt_ids: list[int], caches: list, max_tokens: int,
                   on_prefill: Optional[Callable[[int, int], None]] = None) -> dict:
    """Greedy ``mlx_lm.stream_generate`` into ``caches``: tokens, text and timings (EOS excluded);
    ``on_prefill(done, total)`` after each prefill chunk."""
    tokens, text = [], []
    t0 = time.perf_counter()
    t_first = t_last = None
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens,
                                       prompt_cache=caches, prompt_progress_callback=on_prefill):
        now = time.perf_counter()
        text.append(resp.text)
        if resp.finish_reason == "stop":  # this response carries the EOS token
            break
        tokens.append(int(resp.token))
        t_first, t_last = t_first or now, now
    end = time.perf_counter()
    decode_tps = (len(tokens) - 1) / (t_last - t_first) if len(tokens) >= 2 and t_last > t_first else None
    return {"text": "".join(text), "tokens": tokens, "prompt_tokens": len(prompt_ids), "generated_tokens": len(tokens),
            "prefill_s": (t_first if t_first is not None else end) - t0, "decode_tps": decode_tps}
