"""Benchmarks of TurboQuant-RVQ (``turboquant_rvq``, the default method).

    python scripts/bench_turboquant_rvq.py speed   [--model tinyish|smollm2] [--contexts 1024 4096]
    python scripts/bench_turboquant_rvq.py quality [--n-context 1024 --n-score 64]
    python scripts/bench_turboquant_rvq.py stage2  (second-stage study at the same bits)
    python scripts/bench_turboquant_rvq.py ops     (attention kernels on one layer's shape)

speed: decode tokens/s after a prompt of each context length, with mlx_lm's plain ``KVCache`` and with
``KVCacheBuilder.for_model(model, KVCacheConfig())`` in the same run; the two are timed alternately,
``--repeats`` rounds of ``--steps`` greedy decode steps each (one ``mx.eval`` per step, as mlx_lm's
generation loop does), and the median per-step time is reported with its spread (min..max of the
round medians). ``tinyish`` is a random-weight llama with the embedded SmolLM2-135M's attention shape
(hidden 576, 9 query / 3 KV heads, head_dim 64) and 8 layers; ``smollm2`` is the embedded model.

quality: next-token KL divergence vs the uncompressed cache (``eval.fidelity.next_token_fidelity``)
on the embedded SmolLM2-135M over an essay prompt, for the defaults and other settings, with the
measured bytes (``nbytes`` of every cache, constants once) vs mlx_lm's fp16 cache, and the
bytes per quantized token vs fp16.

stage2: KL divergence of second-stage options at the same bits, keys only quantized (values exact)
so that the key quantizer is what differs: the two-stage RVQ (8+4 bits per 4 coordinates), an 8-bit
VQ + 1-bit QJL sketch of the residual (m = 48 signs + a float16 residual norm, the same 12 bits per 4
coordinates), an 8-bit VQ + a 1-bit sign stage (4 bits, per-cell magnitude), the paper's scalar
Lloyd-Max at 3 bits, and the 8-bit VQ alone (2 bits per coordinate).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, TurboQuantRVQOptions, dispatch  # noqa: E402
from veloxquant_mlx.cache.methods.quantization import turboquant_rvq as tq  # noqa: E402


# ------------------------------------------------------------------------------------------ models
def tinyish_model(n_layers=8, vocab=2048, seed=0):
    from mlx_lm.models import llama
    import mlx.utils

    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=n_layers, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    mx.random.seed(seed)
    model.update(mlx.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.02 if p.ndim > 1 else p,
                                    model.parameters()))
    mx.eval(model.parameters())
    return model, vocab


def load(name):
    if name == "tinyish":
        return tinyish_model()
    from veloxquant_mlx.model import load_model

    model, _ = load_model()
    return model, model.args.vocab_size


# ------------------------------------------------------------------------------------------ speed
def prefill(model, caches, tokens, step=2048):
    for s in range(0, tokens.shape[1], step):
        model(tokens[:, s : s + step], cache=caches)
        mx.eval([c.state for c in caches])


def decode_round(model, caches, y, steps):
    """Median wall-clock and process-CPU seconds per decode step over ``steps`` steps."""
    wall, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(y)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return (statistics.median(wall), statistics.median(cpu)), y


def speed(args):
    model, vocab = load(args.model)
    print(f"model={args.model} steps={args.steps} repeats={args.repeats}")
    for ctx in args.contexts:
        mx.random.seed(1)
        toks = mx.random.randint(0, vocab, (1, ctx))
        kinds = {"plain KVCache": make_prompt_cache(model),
                 "turboquant_rvq": KVCacheBuilder.for_model(model, KVCacheConfig())}
        state = {}
        for name, caches in kinds.items():
            prefill(model, caches, toks)
            state[name] = [mx.array([[1]]), []]
        for _ in range(args.repeats):  # alternate the two caches round by round
            for name, caches in kinds.items():
                med, state[name][0] = decode_round(model, caches, state[name][0], args.steps)
                state[name][1].append(med)
        base = statistics.median(w for w, _ in state["plain KVCache"][1])
        base_cpu = statistics.median(c for _, c in state["plain KVCache"][1])
        for name, (_, meds) in state.items():
            walls = [w for w, _ in meds]
            m, mc = statistics.median(walls), statistics.median(c for _, c in meds)
            print(f"ctx={ctx:5d} {name:15s} {1 / m:7.1f} tok/s  ({m * 1e3:6.1f} ms/step wall, rounds "
                  f"{min(walls) * 1e3:.1f}..{max(walls) * 1e3:.1f}; {mc * 1e3:6.1f} ms/step CPU)  "
                  f"speed vs plain: wall {base / m:.2f}, CPU {base_cpu / mc:.2f}")
        rvq = kinds["turboquant_rvq"]
        fp16 = sum(2 * c.win_k.shape[1] * c.offset * c.win_k.shape[-1] * 2 for c in rvq)
        print(f"           bytes: turboquant_rvq {sum(c.nbytes for c in rvq)} vs fp16 {fp16} "
              f"(plain KVCache holds {sum(c.nbytes for c in kinds['plain KVCache'])} in float32)")


# ------------------------------------------------------------------------------------------ quality
QUALITY = {
    "defaults K12/4 V8/8 (2-bit class)": {},
    "K8/4 V16/8 (2-bit class, same bytes)": dict(key_codebook_bits=8, value_codebook_bits=16),
    "K10/4 V16/8 (2-bit class)": dict(key_codebook_bits=10, value_codebook_bits=16),
    "K12/4 V12/8 (2-bit class)": dict(value_codebook_bits=12),
    "K16/4 V16/4 (4-bit class)": dict(key_codebook_bits=16, value_sub_dim=4, value_codebook_bits=16),
    "K16/4 V12/4 (3.5-bit class)": dict(key_codebook_bits=16, value_sub_dim=4, value_codebook_bits=12),
    "K10/2 V12/4 (4-bit class)": dict(key_sub_dim=2, key_codebook_bits=10, value_sub_dim=4, value_codebook_bits=12),
    "K10/2 V16/4 (4.5-bit class)": dict(key_sub_dim=2, key_codebook_bits=10, value_sub_dim=4, value_codebook_bits=16),
}


def essay_ids(n):
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.model import load_model

    _, tok = load_model()
    return tok.encode(essays_text(max_chars=40_000), add_special_tokens=False)[:n]


def quality(args):
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, _ = load_model()
    ids = essay_ids(args.n_context + args.n_score)
    print(f"SmolLM2-135M, essay prompt {args.n_context} tokens, {args.n_score} scored decode steps")
    for name, kw in QUALITY.items():
        if args.only and not any(s in name for s in args.only):
            continue
        cfg = KVCacheConfig(head_dim=64, options=TurboQuantRVQOptions(**kw))
        t = time.time()
        r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg)
        one = tq.TurboQuantRVQKVCache(cfg)
        kb, vb = one.bits_per_coordinate(64)
        per_tok = one.bytes_per_token(64) / (2 * 64 * 2)
        print(f"{name:38s} KLD {r.kld:.4f}  top1 {r.top1_agree:.3f}  ppl {r.ppl:.2f} (ref {r.ppl_ref:.2f})  "
              f"bits/coord K {kb:.2f} V {vb:.2f}  quantized token {per_tok:.3f}x fp16  "
              f"whole cache {r.compression:.3f}x fp16  ({time.time() - t:.0f}s)", flush=True)


# ------------------------------------------------------------------------------------------ stage-2 study
def stage2(args):
    """Keys quantized by each variant (dense path of a fake-quantizing cache with the same window and
    sink rows), values exact."""
    from veloxquant_mlx.cache.primitives.codebook import lloyd_max_codebook, nearest_code
    from veloxquant_mlx.cache.primitives.rotation import seeded_rng
    from veloxquant_mlx.cache.primitives.sketch import gaussian_jl
    from veloxquant_mlx.eval import fidelity
    from veloxquant_mlx.model import load_model

    model, _ = load_model()
    ids = essay_ids(args.n_context + args.n_score)
    d, seed = 64, 42
    cb12, cb8 = tq.rvq_codebook(d, 4, 12, seed), tq.rvq_codebook(d, 4, 8, seed)
    # 1-bit sign stage: per stage-1 cell, the mean |residual| per coordinate (estimated on samples)
    g = seeded_rng(99, 1).standard_normal((20000, d))
    x = mx.array((g / np.linalg.norm(g, axis=1, keepdims=True)).astype(np.float32))
    i8, _ = cb8.encode(x)
    i8 = i8.reshape(-1).astype(mx.int32)
    res = mx.abs(x.reshape(-1, 4) - cb8.c1[i8]).mean(-1)
    oh = (i8[:, None] == mx.arange(256)[None]).astype(mx.float32)
    alpha = (oh.T @ res) / mx.maximum(oh.sum(0), 1.0)
    S = gaussian_jl(48, d, 7)

    def vq8(y):
        i, _ = cb8.encode(y)
        return i, cb8.decode(i, None)

    def qjl(y):
        _, y1 = vq8(y)
        r = y - y1
        rn = mx.sqrt((r * r).sum(-1, keepdims=True)).astype(mx.float16).astype(mx.float32)
        return y1 + math.sqrt(math.pi / 2) / 48 * rn * (mx.where(r @ S.T >= 0, 1.0, -1.0) @ S)

    def sign(y):
        i, y1 = vq8(y)
        sg = mx.where(y - y1 >= 0, 1.0, -1.0).reshape(*y.shape[:-1], -1, 4)
        return y1 + (mx.take(alpha, i.astype(mx.int32))[..., None] * sg).reshape(y.shape)

    def lm3(y):
        c = lloyd_max_codebook(3, d)
        return mx.take(c, nearest_code(y, c).astype(mx.int32))

    variants = {
        "RVQ 8+4 bits / 4 coords (chosen)": lambda y: cb12.decode(*cb12.encode(y)),
        "VQ 8 bits + QJL 48 signs + fp16 norm": qjl,
        "VQ 8 bits + 1-bit sign stage": sign,
        "scalar Lloyd-Max 3 bits (paper)": lm3,
        "VQ 8 bits alone (2 bits/coord)": lambda y: vq8(y)[1],
    }
    rot_t = tq._quantizer(d, 4, 12, seed, None).rot_t

    class FakeKeys(tq.TurboQuantRVQKVCache):
        key_fn = None

        def _append_quantized(self, keys, values):
            xf = keys.astype(mx.float32)
            n = mx.sqrt((xf * xf).sum(-1, keepdims=True))
            y = (xf / mx.maximum(n, 1e-30)) @ rot_t
            k = (type(self).key_fn(y) @ rot_t.T) * n.astype(mx.float16).astype(mx.float32)
            self.fk = tq.grow_rows(getattr(self, "fk", None), self.n_quant, k)
            self.fv = tq.grow_rows(getattr(self, "fv", None), self.n_quant, values.astype(mx.float32))

        def _quantized_dense(self, n):
            return self.fk[:, :, :n], self.fv[:, :, :n]

        def _quantized_part(self, q, n):
            k, v = self._quantized_dense(n)
            return q @ k.swapaxes(-1, -2), (lambda p: p @ v)

    cfg = KVCacheConfig(head_dim=d)
    n_layers = len(model.layers)
    print(f"keys only quantized (values exact), SmolLM2-135M, {args.n_context}+{args.n_score} tokens")
    for name, fn in variants.items():
        cls = type("V", (FakeKeys,), {"key_fn": staticmethod(fn)})
        fidelity.make_caches = lambda model, config, cls=cls: [cls(cfg) for _ in range(n_layers)]
        dispatch.install()
        r = fidelity.next_token_fidelity(model, ids, args.n_context, args.n_score, cfg)
        print(f"{name:40s} KLD {r.kld:.4f}  top1 {r.top1_agree:.3f}", flush=True)


# ------------------------------------------------------------------------------------------ kernels
def ops(args):
    """One decode step's attention on the quantized rows of one layer (B=1, 3 KV heads, 9 query
    heads, head_dim 64, T tokens): LUT gather vs decoding the keys; value gather+matmul vs the
    scatter-add histogram; against mx.fast sdpa over float32 rows (what mlx_lm's plain cache does)."""
    def bench(name, f, n=20):
        for _ in range(3):
            mx.eval(f())
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            mx.eval(f())
            ts.append(time.perf_counter() - t)
        print(f"  {name:44s} {statistics.median(ts) * 1e3:8.3f} ms")

    for T in args.contexts:
        c = KVCacheBuilder.for_model(tinyish_model(n_layers=1)[0], KVCacheConfig())[0]
        x = mx.random.normal((1, 3, T + 128, 64))
        c.update_and_fetch(x, x)
        kq, vq = c._qs()
        n = c.n_quant
        q = mx.random.normal((1, 3, 3, 64))
        i, j = kq.codes(*c._planes("k_", n))
        mx.eval(i, j)
        p = mx.softmax(mx.random.normal((1, 3, 3, n)), axis=-1)
        K, V = mx.random.normal((1, 3, T, 64)), mx.random.normal((1, 3, T, 64))
        print(f"T={T}")
        bench("plain sdpa over float32 rows", lambda: mx.fast.scaled_dot_product_attention(
            q.reshape(1, 9, 1, 64), K, V, scale=0.125))
        bench("unpack key codes (8-bit + 4-bit planes)", lambda: kq.codes(*c._planes("k_", n)))
        bench("key scores: LUT gather (codes unpacked)", lambda: c._lut_scores(kq, q, i, j))
        bench("key scores: decode rows + matmul", lambda: q @ kq.cb.decode(i, j).swapaxes(-1, -2))
        vi, _ = vq.codes(*c._planes("v_", n))
        mx.eval(vi)
        bench("values: gather centroids + matmul", lambda: p @ vq.cb.decode(vi, None))

        def hist():
            S, K1 = vq.cb.n_sub, vq.cb.k1
            idx = (vi.astype(mx.int32) + mx.arange(S, dtype=mx.int32) * K1).reshape(3, n * S)
            w = mx.broadcast_to(p.reshape(3, 3, n, 1), (3, 3, n, S)).reshape(3, 3, n * S)
            h = mx.zeros((3, 3, S * K1))
            h = h.at[mx.arange(3)[:, None, None], mx.arange(3)[None, :, None], idx[:, None, :]].add(w)
            return h.reshape(3, 3, S, K1) @ vq.cb.c1
        bench("values: scatter-add histogram x codebook", hist)
        bench("whole quantized part (scores + softmax-free values)", lambda: (
            lambda s, f: (s, f(p)))(*c._quantized_part(q, n)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("speed", "quality", "stage2", "ops"))
    ap.add_argument("--model", default="tinyish", choices=("tinyish", "smollm2"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-context", type=int, default=1024)
    ap.add_argument("--n-score", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    {"speed": speed, "quality": quality, "stage2": stage2, "ops": ops}[args.what](args)


if __name__ == "__main__":
    main()
