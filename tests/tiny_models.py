"""Tiny random-weight mlx_lm models of several architectures, for contract tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama, qwen2

VOCAB = 128


def _init(model, seed):
    mx.random.seed(seed)
    import mlx.utils

    params = mlx.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2 if p.ndim > 1 else p, model.parameters())
    model.update(params)
    mx.eval(model.parameters())
    model.eval()
    return model


def tiny_llama(seed=0, head_dim=16, n_layers=3):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=n_layers, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           head_dim=head_dim, rope_theta=10000.0, tie_word_embeddings=True)
    return _init(llama.Model(args), seed)


def tiny_qwen2(seed=0):
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           rope_theta=10000.0, tie_word_embeddings=True)
    return _init(qwen2.Model(args), seed)


def tiny_gemma3(seed=0):
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
                                 intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB, sliding_window=8,
                                 sliding_window_pattern=2)
    return _init(gemma3_text.Model(args), seed)


ARCHS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}


def greedy(model, prompt, cache, max_tokens=8, prefill_step_size=2048):
    """Token ids generated greedily by mlx_lm's own generation loop (``generate_step``)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                          prefill_step_size=prefill_step_size)
    return [int(t) for t, _ in steps]
