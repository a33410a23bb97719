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


def tiny_gemma3(seed=0, window=8):
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
                                 intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB, sliding_window=window,
                                 sliding_window_pattern=2)
    return _init(gemma3_text.Model(args), seed)


ARCHS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}


def greedy(model, prompt, cache, max_tokens=8, prefill_step_size=2048):
    """Token ids generated greedily by mlx_lm's own generation loop (``generate_step``)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                          prefill_step_size=prefill_step_size)
    return [int(t) for t, _ in steps]


# ---- more architectures (tests/test_architectures.py): mlx_lm's own classes, random weights, no downloads
def _seeded(model_cls, args, seed):
    """``_init`` of a model constructed under ``seed`` too, so its 1-D parameters (biases, sinks) do not
    depend on what drew random numbers before."""
    mx.random.seed(seed)
    return _init(model_cls(args), seed)

def tiny_qwen3(seed=0):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           max_position_embeddings=512, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)
    return _seeded(qwen3.Model, args, seed)


def tiny_ministral(seed=0, window=8):
    """Ministral-3 style: sliding-window layers interleaved with a full-attention one."""
    from mlx_lm.models import ministral3

    rope = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 512}
    args = ministral3.ModelArgs(model_type="ministral3", hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                                head_dim=16, max_position_embeddings=512, rope_parameters=rope, sliding_window=window,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return _seeded(ministral3.Model, args, seed)


def tiny_phi3(seed=0):
    from mlx_lm.models import phi3

    args = phi3.ModelArgs(model_type="phi3", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)
    return _seeded(phi3.Model, args, seed)


def tiny_gpt_oss(seed=0, window=8):
    """gpt-oss: a sliding and a full layer, attention sinks, a 4-expert MoE."""
    from mlx_lm.models import gpt_oss

    args = gpt_oss.ModelArgs(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                             hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                             num_key_value_heads=2, sliding_window=window, rope_theta=10000,
                             layer_types=["sliding_attention", "full_attention"])
    model = _seeded(gpt_oss.Model, args, seed)
    for layer in model.model.layers:  # non-zero sink logits, so the sinks matter
        layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model


def tiny_mamba(seed=0):
    """A pure state-space model (no K/V cache): for_model must refuse it."""
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(model_type="mamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, state_size=8,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    return _seeded(mamba.Model, args, seed)


def tiny_lfm2(seed=0):
    """A hybrid: short-convolution (state) layers and attention layers."""
    from mlx_lm.models import lfm2

    args = lfm2.ModelArgs(model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
                          conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
                          block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=96,
                          full_attn_idxs=[1])
    return _seeded(lfm2.Model, args, seed)


def tiny_deepseek(version=3, seed=0):
    """Multi-head latent attention (DeepSeek-V2 / V3: ``kv_lora_rank``): for_model must refuse it."""
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.deepseek_v{version}")
    args = mod.ModelArgs(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         n_routed_experts=None, max_position_embeddings=512,
                         rope_scaling={"factor": 1.0} if version == 2 else None)  # V2 reads its YaRN settings
    return _seeded(mod.Model, args, seed)


#: the architectures tests/test_architectures.py covers (name -> builder)
ARCHITECTURES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "gemma3_text": tiny_gemma3,
                 "ministral3": tiny_ministral, "phi3": tiny_phi3, "gpt_oss": tiny_gpt_oss}
