// Waterfill's decode attention over its codes on the CPU, as an MLX primitive (the op path in
// methods/quantization/waterfill.py is the reference this is checked against at first use).
//
// One call: every (batch row, KV head)'s quantized rows in blocks of 64, split over the CPU's threads. A block:
// its key words transposed to [word][row], each channel's 64 codes decoded at once (lo + step * code), each rotary
// pair turned by RoPE's angle of the row's offset in the block (a 64-row table), scored against the query turned to
// the block's first position (so no angle is computed per row); one online-softmax update per block; the values'
// centroids (the codebook's odd polynomial) summed with weights p * s. Returns the partials (m, l, acc): the running
// max, sum of exp(s - m) and sum of exp(s - m) s_t centroid(v_t) per query head (values in the rotated domain).
// Hot loops use GCC/Clang vector extensions (16 lanes), so the compiler emits the build machine's SIMD.
#include "common.h"

namespace veloxquant {
namespace {

struct Dims {
  int B, H, R, D, DV;
  int kcap, wk, vcap, wv, scap;  // rows held by the buffers and 32-bit words a row
  int n;                          // quantized rows attended
  long pos0;                      // position of quantized row 0
  int vbits;
  bool rotate;
  bool tab_per_row;  // the key table has a row per (batch row, KV head) (a batch form's), not per KV head
};

struct Inputs {
  const float* q;           // [B, H, R, D], scaled
  const uint32_t* kw;       // [B, H, kcap, wk] words
  const int32_t* ktab;      // [H, D] or [B * H, D]: stream bit of the code | width << 16
  const float* lo;          // [B, H, D]
  const float* step;        // [B, H, D]
  const float* w;           // [D] angle per position (0: not rotated)
  const int32_t* partner;   // [D] rotary partner
  const float* sign;        // [D] +1 first of a pair, -1 second, 0 not rotated
  const uint8_t* vw;        // [B, H, vcap, wv] words, read as bytes
  const mx::float16_t* vs;  // [B, H, scap] row scales
  const float* poly;        // [3] the centroids' odd polynomial
};

// Channel c's keys of a block (64 rows): code at stream bit off, width bits, from the block's words transposed
// (words [w][j]), as lo + step * code.
inline void decode_channel(const uint32_t* __restrict words, uint32_t entry, float lo, float step,
                           float* __restrict out) {
  const int off = int(entry & 0xffff), width = int(entry >> 16);
  const int sh = off & 31;
  const uint32_t mask = (1u << width) - 1;
  const uint32_t* a = words + size_t(off >> 5) * BLOCK;
  for (int j = 0; j < BLOCK; j += NL) {  // (the hardware's own vectors: 16-lane ones spill on AVX2)
    vun x = loadun(a + j) >> sh;
    if (sh + width > 32) x |= loadun(a + BLOCK + j) << (32 - sh);
    storen(out + j, lo + step * __builtin_convertvector(reinterpret_cast<vin>(x & mask), vn));
  }
}

// The values' centroids: the odd polynomial u (a + u^2 (b + c u^2)) of the code centred at (2^bits - 1) / 2.
struct Centroids {
  float half, a, b, c;
  template <class V>  // float or a vector of floats
  V operator()(V code) const {
    const V u = code - half, u2 = u * u;
    return u * (a + u2 * (b + c * u2));
  }
};

// One row's centroids into u[dv], channel c at value_slot(c).
inline void value_row(const uint8_t* __restrict src, int words, int dv, int vbits, const Centroids& cent,
                      float* __restrict u) {
  const int lanes = value_lanes(dv, vbits, words);
  if (lanes == 4) {  // 2- or 8-bit codes, 4 words at a time
    const int cpw = 32 / vbits;
    const uint32_t mask = (1u << vbits) - 1;
    for (int w0 = 0; w0 < words; w0 += 4) {
      vu4 x;
      std::memcpy(&x, src + 4 * w0, sizeof(x));
      for (int k = 0; k < cpw; ++k) {
        const vf4u y = cent(__builtin_convertvector(reinterpret_cast<vi4>((x >> (vbits * k)) & mask), vf4u));
        std::memcpy(u + k * words + w0, &y, sizeof(y));
      }
    }
    return;
  }
  if (lanes == 8) {
    for (int w0 = 0; w0 < words; w0 += 8) {
      vu8 x;
      std::memcpy(&x, src + 4 * w0, sizeof(x));
      for (int k = 0; k < 8; ++k) {
        const vf8 code = __builtin_convertvector(reinterpret_cast<vi8>((x >> (4 * k)) & 15u), vf8);
        const vf8 y = cent(code);
        std::memcpy(u + k * words + w0, &y, sizeof(y));
      }
    }
    return;
  }
  alignas(64) uint8_t v[4 * 32 + 1];
  std::memcpy(v, src, 4 * words);
  v[4 * words] = 0;
  const uint32_t mask = (1u << vbits) - 1;
  for (int c = 0; c < dv; ++c) {
    const int bit = c * vbits;
    const uint32_t pair = uint32_t(v[bit >> 3]) | (uint32_t(v[(bit >> 3) + 1]) << 8);
    u[c] = cent(float(int32_t((pair >> (bit & 7)) & mask)));
  }
}

// The partials of rows [t0, t1) of one (batch row, KV head) into m[R], l[R], acc[R * DV] (acc: channel c at
// value_slot(c)).
void attend_rows(const Dims& d, const Inputs& in, const TurnTable& tt, int bh, int t0, int t1, float* m, float* l,
                 float* acc) {
  const int D = d.D, DV = d.DV, R = d.R, h = bh % d.H, np = int(tt.first.size());
  const float* q = in.q + size_t(bh) * R * D;
  const float* lo = in.lo + size_t(bh) * D;
  const float* st = in.step + size_t(bh) * D;
  const int32_t* tab = in.ktab + size_t(d.tab_per_row ? bh : h) * D;
  const uint32_t* kw = in.kw + size_t(bh) * d.kcap * d.wk;
  const uint8_t* vw = in.vw + size_t(bh) * d.vcap * d.wv * 4;
  const mx::float16_t* vs = in.vs + size_t(bh) * d.scap;
  const Centroids cent{float((1 << d.vbits) - 1) * 0.5f, in.poly[0], in.poly[1], in.poly[2]};

  std::vector<float> buf(size_t(D) * BLOCK + size_t(R) * D + size_t(R) * BLOCK + 2 * BLOCK + size_t(BLOCK) * DV, 0.f);
  float* keys = buf.data();             // [D, BLOCK]: turned keys of the block, channel-major
  float* qt = keys + size_t(D) * BLOCK;  // [R, D]: the query turned to the block's first position
  float* sc = qt + size_t(R) * D;        // [R, BLOCK]: scores, then exp(s - m)
  float* ka = sc + size_t(R) * BLOCK;    // [BLOCK] x 2: a pair's decoded channels
  float* kb = ka + BLOCK;
  float* cents = kb + BLOCK;             // [BLOCK, DV]: the block's value centroids
  std::vector<uint32_t> words(size_t(d.wk + 1) * BLOCK, 0u);  // [wk + 1, BLOCK]: the block's words, transposed

  std::vector<double> cb(np), sb(np);  // the turn of the block's first position, advanced by BLOCK w per block
  tt.start(d.pos0 + t0, cb.data(), sb.data());
  empty_partials(R, DV, m, l, acc);

  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    tt.turn_queries(q, R, D, cb.data(), sb.data(), qt);
    const uint32_t* src = kw + size_t(b0) * d.wk;
    for (int j = 0; j < rows; ++j)
      for (int w = 0; w < d.wk; ++w) words[size_t(w) * BLOCK + j] = src[size_t(j) * d.wk + w];
    for (int j = rows; j < BLOCK; ++j)
      for (int w = 0; w < d.wk; ++w) words[size_t(w) * BLOCK + j] = 0u;
    for (int c : tt.alone) decode_channel(words.data(), tab[c], lo[c], st[c], keys + size_t(c) * BLOCK);
    for (int i = 0; i < np; ++i) {  // a rotary pair: decoded, then turned by each row's offset in the block
      const int a = tt.first[i], b = tt.second[i];
      decode_channel(words.data(), tab[a], lo[a], st[a], ka);
      decode_channel(words.data(), tab[b], lo[b], st[b], kb);
      tt.turn_pair(i, ka, kb, keys + size_t(a) * BLOCK, keys + size_t(b) * BLOCK);
    }
    block_scores(qt, keys, R, D, sc);
    softmax_update(sc, R, DV, [rows](int j) { return j < rows; }, m, l, acc);
    for (int j = 0; j < rows; ++j) {  // values: each code's centroid; the weights p * s_t
      value_row(vw + size_t(b0 + j) * d.wv * 4, d.wv, DV, d.vbits, cent, cents + size_t(j) * DV);
      const float scale = f16(vs[b0 + j]);
      for (int r = 0; r < R; ++r) sc[size_t(r) * BLOCK + j] *= scale;
    }
    weighted_sum(sc, cents, R, rows, DV, acc);
    tt.advance(cb.data(), sb.data());
  }
}

class WaterfillDecode : public mx::Primitive {
 public:
  WaterfillDecode(mx::Stream s, Dims d, std::vector<int> counts)
      : mx::Primitive(s), d_(d), counts_(std::move(counts)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    Inputs in{inputs[0].data<float>(),   inputs[1].data<uint32_t>(), inputs[2].data<int32_t>(),
              inputs[3].data<float>(),   inputs[4].data<float>(),   inputs[5].data<float>(),
              inputs[6].data<int32_t>(), inputs[7].data<float>(),   inputs[8].data<uint8_t>(),
              inputs[9].data<mx::float16_t>(), inputs[10].data<float>()};
    enc.dispatch([d = d_, in, counts = counts_, m = outputs[0].data<float>(), l = outputs[1].data<float>(),
                  acc = outputs[2].data<float>()]() { run(d, in, counts, m, l, acc); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant waterfill_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantWaterfillDecode"; }

 private:
  static void run(const Dims& d, const Inputs& in, const std::vector<int>& counts, float* m, float* l, float* acc) {
    const TurnTable tt(in.partner, in.sign, in.w, d.D, d.rotate);
    const int BH = d.B * d.H;
    if (!tt.ok) {
      nan_partials(size_t(BH) * d.R, d.DV, m, l, acc);
      return;
    }
    split_and_join(BH, d.R, d.DV, d.n, [&](int bh, int t0, int t1, float* pm, float* pl, float* pa) {
      attend_rows(d, in, tt, bh, t0, t1, pm, pl, pa);
    }, [&](int c) { return value_slot(c, d.DV, d.vbits, d.wv); }, m, l, acc, counts, d.H);
  }
  Dims d_;
  std::vector<int> counts_;
};

void check(bool ok, const char* what) { veloxquant::check(ok, "waterfill_decode", what); }

}  // namespace

std::vector<mx::array> waterfill_decode(const mx::array& q, const mx::array& k_words, const mx::array& ktab,
                                        const mx::array& lo, const mx::array& step, const mx::array& w,
                                        const mx::array& partner, const mx::array& sign, const mx::array& v_words,
                                        const mx::array& v_scales, const mx::array& poly, int n, long pos0,
                                        int vbits, int dv, bool rotate, const std::vector<int>& counts) {
  check(q.ndim() == 4 && k_words.ndim() == 4 && v_words.ndim() == 4 && v_scales.ndim() == 3, "ranks");
  Dims d{};
  d.B = q.shape(0), d.H = q.shape(1), d.R = q.shape(2), d.D = q.shape(3);
  d.kcap = k_words.shape(2), d.wk = k_words.shape(3), d.vcap = v_words.shape(2), d.wv = v_words.shape(3);
  d.scap = v_scales.shape(2), d.n = n, d.pos0 = pos0, d.vbits = vbits, d.rotate = rotate;
  d.DV = dv;
  check(d.D <= MAX_D && d.R <= MAX_R && d.wk * 4 <= 128 && d.wv * 4 <= 128, "head dims or query heads too large");
  check(vbits >= 1 && vbits <= 8 && dv > 0 && dv <= MAX_D && dv * vbits <= d.wv * 32 && (vbits != 4 || dv % 2 == 0),
        "value width or dim");
  check(n >= 0 && n <= d.kcap && n <= d.vcap && n <= d.scap, "rows beyond the buffers");
  check(counts.empty() || (int(counts.size()) == d.B &&
                           std::all_of(counts.begin(), counts.end(), [n](int c) { return c >= 0 && c <= n; })),
        "counts: one per batch row, each in 0..n");
  check(k_words.shape(0) == d.B && k_words.shape(1) == d.H && v_words.shape(0) == d.B && v_words.shape(1) == d.H,
        "batch or heads differ");
  d.tab_per_row = ktab.ndim() == 2 && ktab.shape(0) == d.B * d.H && d.B > 1;
  check(ktab.ndim() == 2 && (ktab.shape(0) == d.H || d.tab_per_row) && ktab.shape(1) == d.D &&
            lo.size() == size_t(d.B * d.H * d.D) &&
            step.size() == lo.size() && w.size() == size_t(d.D) && partner.size() == w.size() &&
            sign.size() == w.size() && poly.size() == 3,
        "table shapes");
  auto s = mx::default_stream(mx::Device::cpu);
  auto c = contiguous_as;
  std::vector<mx::array> ins{c(q, mx::float32),       c(k_words, mx::uint32), c(ktab, mx::int32),
                             c(lo, mx::float32),      c(step, mx::float32),   c(w, mx::float32),
                             c(partner, mx::int32),   c(sign, mx::float32),   c(v_words, mx::uint32),
                             c(v_scales, mx::float16), c(poly, mx::float32)};
  mx::Shape ml{d.B, d.H, d.R};
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, d.DV}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<WaterfillDecode>(s, d, counts), ins);
}

}  // namespace veloxquant
