// KVQuant's decode attention over its codes on the CPU, as an MLX primitive (the op path in
// methods/quantization/kvquant.py, which decodes the whole past every step, is the reference it is checked against at
// first use).
//
// Keys per channel in groups of G tokens (KIVI's layout), each code a non-uniform level of its (channel, fit): a
// block of 64 rows decodes each channel's codes through a table of the group's 2^BITS values (level * scale + bias),
// puts the block's exact outliers back, turns the pre-RoPE keys by each row's offset in the block (TurnTable: the
// queries turned to the block's first position), and the first n_sink rows by their float16 post-RoPE copies; values
// per token (KIVI's rows, codes of any width) with their outliers and sinks likewise. One pass over the codes, one
// online-softmax update per block. CacheGen's codes take the same path: uniform levels (code * scale + bias, no
// level table) at the layer's width, each group's first row an anchor (8-bit per-token codes) the other rows are
// deltas against, on both sides.
#include "common.h"

namespace veloxquant {
namespace {

struct KvqDims {
  int B, H, R, D, DV, n, G, gv, bits, nsink;
  int kw, kg, lcap, vcap, vw, vg;  // per channel: key words, groups, levels; value rows, words and groups a row
  int ko, vo;                      // outliers a group (keys, values)
  size_t kocap, vocap;             // outlier entries a head holds
  bool rotate, uniform;            // uniform: code * scale + bias (CacheGen's), no level table
  int acg = 0, kaw = 0, vaw = 0, acap = 0;  // anchors (CacheGen's): channels a scale, words a key / value row, rows
};

struct KvqInputs {
  const float* q;  // [B, H, R, D] scaled, model order
  const uint32_t* kc;
  const mx::float16_t *ks, *kb, *lv;
  const int32_t* fit;  // [groups] the level fit each group was coded with
  const uint32_t* koi;
  const mx::float16_t* kov;
  const uint32_t* vc;
  const mx::float16_t *vs, *vb;
  const uint32_t* voi;
  const mx::float16_t* vov;
  const mx::float16_t *sk, *sv;  // [B, H, nsink, D / DV] float16, post-RoPE
  const uint32_t *kac = nullptr, *vac = nullptr;  // anchors: [B, H, groups, words] 8-bit codes, scales, biases
  const mx::float16_t *kas = nullptr, *kab = nullptr, *vas = nullptr, *vab = nullptr;
};

// Group g's anchor row of one side (width channels, words a row, 8-bit codes in groups of acg channels) into u.
inline void anchor_row(const KvqDims& d, const uint32_t* codes, const mx::float16_t* sc, const mx::float16_t* bi,
                       int bh, int g, int width, int words, float* u) {
  const size_t row = size_t(bh) * d.acap + g;
  decode_row_any<8>(codes + row * words, sc + row * (width / d.acg), bi + row * (width / d.acg), width, 8, d.acg,
                    1.f, u);
}

// CacheGen's rows of a block from their deltas: each group's first row its anchor, the others anchor + delta
// (x(c, j) the block's entry of channel c, row j).
template <class At>
inline void apply_anchors(const KvqDims& d, const uint32_t* codes, const mx::float16_t* sc, const mx::float16_t* bi,
                          int bh, int b0, int rows, int width, int words, At x) {
  float a[MAX_D];
  for (int g = b0 / d.G; g * d.G < b0 + rows; ++g) {
    anchor_row(d, codes, sc, bi, bh, g, width, words, a);
    const int j0 = g * d.G - b0, j1 = std::min(rows, j0 + d.G);
    for (int c = 0; c < width; ++c) {
      x(c, j0) = a[c];
      for (int j = j0 + 1; j < j1; ++j) x(c, j) += a[c];
    }
  }
}

// Channel ch's 64 keys of the block at b0 (whole groups of 32 codes), each code's value from its group's table
// (uniform codes: code * scale + bias directly).
template <int BITS>
inline void key_channel_levels(const KvqDims& d, const KvqInputs& in, size_t ch, int b0, int rows, float* out) {
  constexpr int L = 1 << BITS;
  float tbl[L];
  int group = -1;
  uint32_t v[32];
  for (int i0 = 0; i0 < rows; i0 += 32) {
    const int t = b0 + i0, g = t / d.G;
    const uint32_t* w = in.kc + ch * d.kw + size_t(t) / 32 * BITS;
    if (d.uniform) {  // code * scale + bias: no table
      decode_group32<BITS>(w, f16(in.ks[ch * d.kg + g]), f16(in.kb[ch * d.kg + g]), out + i0, 1);
      continue;
    }
    if (g != group) {  // the group's values: level * scale + bias
      group = g;
      const float s = f16(in.ks[ch * d.kg + g]), z = f16(in.kb[ch * d.kg + g]);
      const mx::float16_t* lv = in.lv + ch * d.lcap + size_t(in.fit[g]) * L;
      for (int c = 0; c < L; ++c) tbl[c] = f16(lv[c]) * s + z;
    }
    codes_group32<BITS>(w, v);
    for (int i = 0; i < 32; ++i) out[i0 + i] = tbl[v[i]];
  }
  for (int j = rows; j < BLOCK; ++j) out[j] = 0.f;
}

template <int BITS>
void kvquant_rows(const KvqDims& d, const KvqInputs& in, const TurnTable& tt, int bh, int t0, int t1, float* m,
                  float* l, float* acc) {
  const int D = d.D, DV = d.DV, R = d.R, np = int(tt.first.size());
  std::vector<float> buf(size_t(D) * BLOCK + size_t(R) * D + size_t(R) * BLOCK + 2 * BLOCK + size_t(BLOCK) * DV, 0.f);
  float* keys = buf.data();             // [D, BLOCK]: the block's keys, turned, channel-major
  float* qt = keys + size_t(D) * BLOCK;  // [R, D]: the queries turned to the block's first position
  float* sc = qt + size_t(R) * D;        // [R, BLOCK]
  float* ka = sc + size_t(R) * BLOCK;    // [BLOCK] x 2: a pair's decoded channels
  float* kb = ka + BLOCK;
  float* vals = kb + BLOCK;              // [BLOCK, DV]
  const float* q = in.q + size_t(bh) * R * D;
  std::vector<double> cb(np), sb(np);
  tt.start(t0, cb.data(), sb.data());
  empty_partials(R, DV, m, l, acc);
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0), g0 = b0 / d.G, g1 = (b0 + rows - 1) / d.G;
    tt.turn_queries(q, R, D, cb.data(), sb.data(), qt);
    for (int c = 0; c < D; ++c)  // pre-RoPE keys, decoded in place (the pairs turned below)
      key_channel_levels<BITS>(d, in, size_t(bh) * D + c, b0, rows, keys + size_t(c) * BLOCK);
    for (int g = g0; g <= g1; ++g)  // the exact outliers: index c * G + i of the group's [D, G] block
      for (int e = 0; e < d.ko; ++e) {
        const size_t at = size_t(bh) * d.kocap + size_t(g) * d.ko + e;
        const int c = int(in.koi[at] / d.G), j = g * d.G + int(in.koi[at] % d.G) - b0;
        if (j >= 0 && j < rows) keys[size_t(c) * BLOCK + j] = f16(in.kov[at]);
      }
    if (d.acg)
      apply_anchors(d, in.kac, in.kas, in.kab, bh, b0, rows, D, d.kaw,
                    [&](int c, int j) -> float& { return keys[size_t(c) * BLOCK + j]; });
    for (int i = 0; i < np; ++i) {
      float* a = keys + size_t(tt.first[i]) * BLOCK;
      float* b = keys + size_t(tt.second[i]) * BLOCK;
      std::copy(a, a + BLOCK, ka), std::copy(b, b + BLOCK, kb);
      tt.turn_pair(i, ka, kb, a, b);
    }
    for (int j = 0; j < d.nsink - b0 && j < rows; ++j)  // sink rows: their post-RoPE copies (q' = q at block 0)
      for (int c = 0; c < D; ++c) keys[size_t(c) * BLOCK + j] = f16(in.sk[(size_t(bh) * d.nsink + j) * D + c]);
    block_scores(qt, keys, R, D, sc);
    softmax_update(sc, R, DV, [rows](int j) { return j < rows; }, m, l, acc);
    for (int j = 0; j < rows; ++j) {
      const size_t row = size_t(bh) * d.vcap + b0 + j;
      decode_row_any<BITS>(in.vc + row * d.vw, in.vs + row * d.vg, in.vb + row * d.vg, DV, d.bits, d.gv, 1.f,
                        vals + size_t(j) * DV);
    }
    for (int g = g0; g <= g1; ++g)  // value outliers: index i * DV + c of the group's [G, DV] block
      for (int e = 0; e < d.vo; ++e) {
        const size_t at = size_t(bh) * d.vocap + size_t(g) * d.vo + e;
        const int j = g * d.G + int(in.voi[at] / DV) - b0;
        if (j >= 0 && j < rows) vals[size_t(j) * DV + in.voi[at] % DV] = f16(in.vov[at]);
      }
    for (int j = 0; j < d.nsink - b0 && j < rows; ++j)
      for (int c = 0; c < DV; ++c) vals[size_t(j) * DV + c] = f16(in.sv[(size_t(bh) * d.nsink + j) * DV + c]);
    if (d.acg)
      apply_anchors(d, in.vac, in.vas, in.vab, bh, b0, rows, DV, d.vaw,
                    [&](int c, int j) -> float& { return vals[size_t(j) * DV + c]; });
    weighted_sum(sc, vals, R, rows, DV, acc);
    tt.advance(cb.data(), sb.data());
  }
}

class KvquantDecode : public mx::Primitive {
 public:
  KvquantDecode(mx::Stream s, KvqDims d) : mx::Primitive(s), d_(d) {}

  // inputs: q, k codes, scales, biases, levels, fit, outlier indices, values, v codes, scales, biases, outlier
  // indices, values, sink keys, sink values, angle, partner, sign
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    auto u32 = [&](int i) { return inputs[i].data<uint32_t>(); };
    auto h = [&](int i) { return inputs[i].data<mx::float16_t>(); };
    KvqInputs in{inputs[0].data<float>(), u32(1), h(2), h(3), h(4), inputs[5].data<int32_t>(), u32(6), h(7),
                 u32(8), h(9), h(10), u32(11), h(12), h(13), h(14)};
    if (d_.acg)
      in.kac = u32(18), in.kas = h(19), in.kab = h(20), in.vac = u32(21), in.vas = h(22), in.vab = h(23);
    const float *w = inputs[15].data<float>(), *sign = inputs[17].data<float>();
    const int32_t* partner = inputs[16].data<int32_t>();
    enc.dispatch([d = d_, in, w, partner, sign, m = outputs[0].data<float>(), l = outputs[1].data<float>(),
                  acc = outputs[2].data<float>()]() {
      const TurnTable tt(partner, sign, w, d.D, d.rotate);
      const int BH = d.B * d.H;
      if (!tt.ok) {  // not rotary pairs: NaN (the first-use check then keeps the op path)
        nan_partials(size_t(BH) * d.R, d.DV, m, l, acc);
        return;
      }
      auto go = [&](auto rows) { split_and_join(BH, d.R, d.DV, d.n, rows, [](int c) { return c; }, m, l, acc); };
      auto width = [&](auto bits) {
        go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
          kvquant_rows<decltype(bits)::value>(d, in, tt, bh, a, b, pm, pl, pa);
        });
      };
      switch (d.bits) {
        case 2: width(std::integral_constant<int, 2>{}); break;
        case 3: width(std::integral_constant<int, 3>{}); break;
        case 4: width(std::integral_constant<int, 4>{}); break;
        case 5: width(std::integral_constant<int, 5>{}); break;
        case 6: width(std::integral_constant<int, 6>{}); break;
        default: width(std::integral_constant<int, 8>{});
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant kvquant_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantKvquantDecode"; }

 private:
  KvqDims d_;
};

}  // namespace

std::vector<mx::array> kvquant_decode(const mx::array& q, const std::vector<mx::array>& keys,
                                      const std::vector<mx::array>& values, const mx::array& sink_k,
                                      const mx::array& sink_v, const std::vector<mx::array>& rope, int n, int bits,
                                      int group, int value_group, int key_outliers, int value_outliers, bool rotate,
                                      const std::vector<mx::array>& anchors) {
  auto check = [](bool ok, const char* what) { veloxquant::check(ok, "kvquant_decode", what); };
  check(keys.size() == 7 && values.size() == 5 && rope.size() == 3,
        "keys = (codes, scales, biases, levels, fit, outlier indices, outlier values), values = (codes, scales, "
        "biases, outlier indices, outlier values), rope = (angle, partner, sign)");
  check(anchors.empty() || anchors.size() == 6,
        "anchors = (key codes, scales, biases, value codes, scales, biases) of 8-bit rows, one a group");
  const mx::array &kc = keys[0], &ks = keys[1], &lv = keys[3], &fit = keys[4], &koi = keys[5];
  const mx::array &vc = values[0], &vs = values[1], &voi = values[3];
  check(q.ndim() == 4 && kc.ndim() == 4 && ks.ndim() == 4 && lv.ndim() == 4 && vc.ndim() == 4 && vs.ndim() == 4 &&
            koi.ndim() == 3 && voi.ndim() == 3 && sink_k.ndim() == 4 && sink_v.ndim() == 4,
        "ranks");
  KvqDims d{};
  d.B = q.shape(0), d.H = q.shape(1), d.R = q.shape(2), d.D = q.shape(3), d.DV = sink_v.shape(3);
  d.n = n, d.G = group, d.gv = value_group, d.bits = bits, d.nsink = sink_k.shape(2), d.rotate = rotate;
  d.kw = kc.shape(3), d.kg = ks.shape(3), d.lcap = lv.shape(3), d.vcap = vc.shape(2), d.vw = vc.shape(3);
  d.vg = vs.shape(3), d.kocap = koi.shape(2), d.vocap = voi.shape(2);
  const int g = n / std::max(group, 1);
  d.ko = key_outliers, d.vo = value_outliers;
  d.uniform = lv.size() == 0;
  check((d.uniform ? bits >= 2 && bits <= 8 && bits != 7 : bits >= 2 && bits <= 4) && group % 32 == 0 &&
            n % group == 0 && n >= 0,
        "2-4-bit codes on levels or 2-6- or 8-bit uniform ones (no levels), groups of 32k tokens");
  check(d.D <= MAX_D && d.DV <= MAX_D && d.R <= MAX_R && d.D % 2 == 0, "head dims or query heads");
  check(kc.shape(0) == d.B && kc.shape(1) == d.H && kc.shape(2) == d.D && ks.shape() == keys[2].shape() &&
            ks.shape(2) == d.D && g <= d.kg && size_t(n) * bits <= size_t(d.kw) * 32 &&
            (d.uniform || (lv.shape(2) == d.D && fit.ndim() == 1 && fit.shape(0) >= g)) &&
            keys[6].shape() == koi.shape() && values[4].shape() == voi.shape(),
        "key codes [B, H, D, words], scales and biases [B, H, D, groups], levels [B, H, D, fits * 2^bits], fit "
        "[groups]");
  check(vc.shape(0) == d.B && vc.shape(1) == d.H && n <= d.vcap && vs.shape() == values[2].shape() &&
            vs.shape(2) == d.vcap && value_group > 0 && d.DV % value_group == 0 && d.vg == d.DV / value_group &&
            (value_group * bits) % 32 == 0 && d.vw * 32 == d.DV * bits,
        "value rows [B, H, rows, words] with a scale and bias per group of whole words");
  check(sink_k.shape(0) == d.B && sink_k.shape(1) == d.H && sink_k.shape(3) == d.D && sink_v.shape(2) == d.nsink &&
            d.nsink <= std::max(group, 1) && koi.shape(0) == d.B && koi.shape(1) == d.H && voi.shape(0) == d.B &&
            voi.shape(1) == d.H && d.ko >= 0 && d.vo >= 0 && size_t(d.ko) * g <= d.kocap && size_t(d.vo) * g <= d.vocap &&
            rope[0].size() == size_t(d.D) && rope[1].size() == size_t(d.D) && rope[2].size() == size_t(d.D),
        "sinks [B, H, n_sink, D], outliers [B, H, groups * entries] for the n / group groups, rope tables [D]");
  if (!anchors.empty()) {
    const mx::array &kac = anchors[0], &kas = anchors[1], &vac = anchors[3], &vas = anchors[4];
    d.acg = kas.ndim() == 4 && kas.shape(3) > 0 ? d.D / kas.shape(3) : 0;
    check(kac.ndim() == 4 && vac.ndim() == 4 && vas.ndim() == 4 && d.acg > 0 && d.D % kas.shape(3) == 0 &&
              d.DV % d.acg == 0 && vas.shape(3) * d.acg == d.DV && (d.acg * 8) % 32 == 0 &&
              kac.shape(3) * 4 == d.D && vac.shape(3) * 4 == d.DV && kas.shape() == anchors[2].shape() &&
              vas.shape() == anchors[5].shape() && kac.shape(2) >= g && vac.shape(2) == kac.shape(2) &&
              kas.shape(2) == kac.shape(2) && vas.shape(2) == kac.shape(2) && kac.shape(0) == d.B &&
              kac.shape(1) == d.H && !rotate && d.ko == 0 && d.vo == 0 && d.nsink == 0,
          "anchors: 8-bit rows [B, H, groups, width / 4 words], a scale and bias a group of whole words, one width "
          "for keys and values; no RoPE, outliers or sinks beside them");
    d.kaw = kac.shape(3), d.vaw = vac.shape(3), d.acap = kac.shape(2);
  }
  auto s = mx::default_stream(mx::Device::cpu);
  auto c = contiguous_as;
  auto f16 = mx::float16;
  std::vector<mx::array> ins{c(q, mx::float32),   c(kc, mx::uint32),         c(ks, f16),        c(keys[2], f16),
                             c(lv, f16),          c(fit, mx::int32),         c(koi, mx::uint32), c(keys[6], f16),
                             c(vc, mx::uint32),   c(vs, f16),                c(values[2], f16), c(voi, mx::uint32),
                             c(values[4], f16),   c(sink_k, f16),            c(sink_v, f16),    c(rope[0], mx::float32),
                             c(rope[1], mx::int32), c(rope[2], mx::float32)};
  for (size_t i = 0; i < anchors.size(); ++i) ins.push_back(c(anchors[i], i % 3 ? f16 : mx::uint32));
  mx::Shape ml{d.B, d.H, d.R};
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, d.DV}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<KvquantDecode>(s, d), ins);
}

}  // namespace veloxquant
