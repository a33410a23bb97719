"""Probes of waterfill's quantizers (each patches ``WaterfillKVCache`` in this process only; op path, CPU); prints
next-token KLD on the embedded model as the quality gate measures it (16-row window, 32 scored tokens).

- ``seg``: pre-RoPE key ranges per prefill chunk instead of once: each chunk of >= 256 rows stored after calibration
  gets its own lo/step (same widths); decode rows take the last chunk's.
- ``lsscale``: each value row's scale refitted by least squares to the codes chosen at its RMS scale.

    python scripts/waterfill_probe.py stock 4096 4   # the cache as it is
    python scripts/waterfill_probe.py seg 4096 4
    python scripts/waterfill_probe.py lsscale 4096 4
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import veloxquant_mlx  # noqa
import mlx.core as mx
from veloxquant_mlx.assets import essays_text
from veloxquant_mlx.cache import KVCacheConfig
from veloxquant_mlx.cache.options import WaterfillOptions
from veloxquant_mlx.eval.fidelity import next_token_fidelity
from veloxquant_mlx.model import load_model
from veloxquant_mlx.cache.methods.quantization import waterfill as W
from veloxquant_mlx.cache.primitives.keygrid import key_grid, range_margin

MODE = sys.argv[1]  # stock | seg | lsscale
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
BITS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
MIN_ROWS = 256

if MODE == "seg":
    C = W.WaterfillKVCache

    def _key_codes(self, keys, pos, mask):
        pre = self._pre_rope(keys, pos).astype(mx.float32)
        segs = self.__dict__.setdefault("_segs", [])  # per appended quantized row block: (lo, step) [B,H,1,D]
        if keys.shape[2] >= MIN_ROWS and getattr(self, "_calib_done", False):
            lo, hi = pre.min(axis=2, keepdims=True), pre.max(axis=2, keepdims=True)
            widths = self.k_bits[0, :, 0].astype(mx.int32)
            glo, gst = key_grid(lo, hi, widths, range_margin(self.bit_width))
            cur = (glo.astype(mx.float32), gst.astype(mx.float32))
        else:
            cur = segs[-1][1] if segs else (self.k_lo.astype(mx.float32), self.k_step.astype(mx.float32))
        self._calib_done = True
        segs.append((keys.shape[2], cur))
        lo, step = cur
        codes = mx.round((pre - lo) / mx.where(step > 0, step, 1.0))
        return mx.clip(codes, 0, mask.astype(mx.float32)).astype(mx.uint32)

    def _pre_keys(self, a, b):
        segs = self.__dict__.get("_segs", [])
        los, sts = [], []
        for n, (lo, st) in segs:
            los.append(mx.broadcast_to(lo, (*lo.shape[:2], n, lo.shape[3])))
            sts.append(mx.broadcast_to(st, (*st.shape[:2], n, st.shape[3])))
        LO, ST = mx.concatenate(los, axis=2)[:, :, a:b], mx.concatenate(sts, axis=2)[:, :, a:b]
        # the codes themselves (a unit grid), then each row's own lo/step
        x = W.dequantize_pairs(self.k_words[:, :, a:b], *self._pair_table(), mx.zeros(self.k_lo.shape, mx.float32),
                               mx.ones(self.k_step.shape, mx.float32))
        return LO + x * ST

    C._key_codes = _key_codes
    C._pre_keys = _pre_keys

if MODE == "lsscale":
    def _encode_values(self, values):
        y = W.rotate_values(values.astype(mx.float32), self.seed)
        rms = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True))
        cb = W.odd_poly_gaussian(self.bit_width)[0]
        codes = W.nearest_code(y / mx.maximum(rms, W._TINY), cb)
        c = cb[codes.astype(mx.int32)]
        s = (y * c).sum(-1, keepdims=True) / mx.maximum((c * c).sum(-1, keepdims=True), 1e-30)
        return W.pack_bits(codes, self.bit_width), mx.where(s > 0, s, rms).astype(mx.float16)[..., 0]

    W.WaterfillKVCache._encode_values = _encode_values

model, tok = load_model()
n = CTX + 32
ids = tok.encode(essays_text(max_chars=8 * n), add_special_tokens=False)[:n]
cfg = KVCacheConfig(method="waterfill", bit_width_inlier=BITS, options=WaterfillOptions(residual_length=16))
r = next_token_fidelity(model, ids, CTX, 32, cfg)
print(MODE, CTX, BITS, f"KLD {r.kld:.5f} top1 {r.top1_agree:.3f} kv/fp16 {r.compression:.3f}", flush=True)
