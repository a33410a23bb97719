// The low-rank caches' (cache/lowrank.py: SVDq, KVTC) decode attention over their latents on the CPU, as an MLX
// primitive (the op path, ``LowRankKVCache._key_scores`` / ``_value_out``, is the reference it is checked against at
// first use).
//
// Latents (primitives/lowrank_fit.py, ``encode_latents``): per head group and G-token group, the quantized latent
// channels in runs of equal width, each channel's G codes one little-endian bit stream of ceil(G bits / 32) words
// (codes may straddle words), a float16 scale and bias a channel and group; the first rf channels float16 a token.
// A block of 64 tokens is decoded channel-major and scored against the projected queries q W (plus q . mu: bias);
// values are latents too (decoded token-major: acc = sum p z, the caller applies W^T and the mean) or KIVI's
// per-token rows (SVDq's: ``decode_row``, acc in its slot order). xKV's latents are KIVI's key layout instead
// (channel_major: each channel's codes one stream over all tokens, one width); AMC's tiers hold keys as rows
// (k_rows_per_group: a row's codes one stream, each channel's range and minimum shared by a group of rows), and so do
// AdaKV's (ranges group-major; value rows on their groups' ranges, found by rank: v_scale_rows). Palu's keys are
// rebuilt instead (rebuild: k = W_h z + mu_h per head of the group, pre-RoPE, turned per block as waterfill's), then
// scored against the model's queries.
#include "common.h"

namespace veloxquant {
namespace {

struct Latents {
  const uint32_t* codes = nullptr;
  const mx::float16_t *scales = nullptr, *biases = nullptr, *raw = nullptr;
  int r = 0, rf = 0, rq = 0, W = 0, capg = 0, capt = 0;  // channels, float16 ones, quantized ones, words a group
  std::vector<int> runs;  // (bits, first channel, end channel, first word) per run of equal widths
  bool cm = false;        // channel-major (xKV's, KIVI's key layout): [B, H, r, W] codes, [B, H, r, capg] scales
  int rpg = 0;            // > 0: rows (AMC's tiers): [B, H, capt, W] codes a row, ranges and minima [B, H, r, capg]
  bool gm = false;        // rows' ranges and minima group-major, [B, H, capg, r] (AdaKV's)
};

// KIVI's per-token value rows (SVDq's values; AMC's and AdaKV's tiers). ``div``: what a stored scale is divided by
// (2^bits - 1 where the row stores its groups' ranges, AdaKV's; else 1).
struct Rows {
  const uint32_t* codes = nullptr;
  const mx::float16_t *scales = nullptr, *biases = nullptr;
  int bits = 0, group = 0, words = 0, groups = 0, cap = 0, scap = 0;  // rows the codes / the scales hold a head
  float div = 1.f;
  int per = 0, stride = 0, first = 0;  // per > 0: row i's scales at row (i / per) * stride + first + i % per
  size_t scale_row(size_t i) const { return per ? i / per * stride + first + i % per : i; }
};

struct LatentDims {
  int B, H, R, DK, DA, n, G;  // DK: key latent channels (q's last dim but with rebuild); DA: acc's columns
  bool bias;                  // q . mu given
  int DQ = 0, hpg = 0, wb = 0;  // rebuild: q's channels (the heads'), heads a group, the basis' batch rows
  bool mean = false, rotate = false;
};

// Palu's keys rebuilt per head of a head group: W [wb, H, hpg * DQ, DK] and mu [wb, H, 1, hpg * DQ] (float16).
struct Rebuild {
  const mx::float16_t *w = nullptr, *mu = nullptr;
  const TurnTable* tt = nullptr;
};

// Keys as rows (AMC's tiers): a row's r codes one stream, channel c at range / (2^bits - 1) and minimum of the row's
// group (computed once a group, as the op path does); BITS 0: the width read at run time (codes may straddle words).
template <int BITS>
void decode_rows(const Latents& x, int bh, int b0, int rows, float* __restrict out, size_t cs, size_t js) {
  const int bits = BITS ? BITS : x.runs[0];
  const uint32_t mask = (1u << bits) - 1;
  float s[MAX_D], z[MAX_D];
  int cur = -1;
  for (int j = 0; j < rows; ++j) {
    const int i = b0 + j;
    if (i / x.rpg != cur) {
      cur = i / x.rpg;
      for (int c = 0; c < x.r; ++c) {
        const size_t si = x.gm ? (size_t(bh) * x.capg + cur) * x.r + c : (size_t(bh) * x.r + c) * x.capg + cur;
        s[c] = f16(x.scales[si]) / float(mask), z[c] = f16(x.biases[si]);
      }
    }
    const uint32_t* w = x.codes + (size_t(bh) * x.capt + i) * x.W;
    if (BITS && x.r % 32 == 0) {  // 32 codes a chunk of BITS words, their words and shifts constants
      float f[32];
      for (int c0 = 0; c0 < x.r; c0 += 32) {
        decode_group32<BITS ? BITS : 1>(w + c0 / 32 * bits, 1.f, 0.f, f, 1);
        for (int c = c0; c < c0 + 32; ++c) out[c * cs + j * js] = f[c - c0] * s[c] + z[c];
      }
    } else
      for (int c = 0; c < x.r; ++c) out[c * cs + j * js] = float(code_at(w, c * bits, bits)) * s[c] + z[c];
  }
}

// Latent channels of rows [b0, b0 + rows) (whole token groups) of head group bh into out[c * cs + j * js].
void decode_latents(const Latents& x, int bh, int b0, int rows, int G, float* __restrict out, size_t cs, size_t js) {
  if (x.rpg) {
    switch (x.runs[0]) {
      case 2: return decode_rows<2>(x, bh, b0, rows, out, cs, js);
      case 3: return decode_rows<3>(x, bh, b0, rows, out, cs, js);
      case 4: return decode_rows<4>(x, bh, b0, rows, out, cs, js);
      case 8: return decode_rows<8>(x, bh, b0, rows, out, cs, js);
      default: return decode_rows<0>(x, bh, b0, rows, out, cs, js);
    }
  }
  for (int j = 0; j < rows; ++j)
    for (int c = 0; c < x.rf; ++c) out[c * cs + j * js] = f16(x.raw[(size_t(bh) * x.capt + b0 + j) * x.rf + c]);
  for (size_t i = 0; i + 3 < x.runs.size(); i += 4) {
    const int bits = x.runs[i], c0 = x.runs[i + 1], c1 = x.runs[i + 2], w0 = x.runs[i + 3];
    const int wpg = (G * bits + 31) / 32;
    for (int g = b0 / G; g < (b0 + rows) / G; ++g) {
      const size_t at = size_t(bh) * x.capg + g;
      float* o = out + size_t(g * G - b0) * js;
      for (int c = c0; c < c1; ++c) {
        const size_t ch = size_t(bh) * x.r + c;  // (channel-major)
        const uint32_t* w = x.codes + (x.cm ? ch * x.W + size_t(g) * wpg : at * x.W + w0 + size_t(c - c0) * wpg);
        const size_t si = x.cm ? ch * x.capg + g : at * x.rq + c - x.rf;
        const float s = f16(x.scales[si]), z = f16(x.biases[si]);
        float* oc = o + c * cs;
        switch (bits) {
          case 1: decode_codes<1>(w, G, s, z, oc, js); break;
          case 2: decode_codes<2>(w, G, s, z, oc, js); break;
          case 3: decode_codes<3>(w, G, s, z, oc, js); break;
          case 4: decode_codes<4>(w, G, s, z, oc, js); break;
          case 5: decode_codes<5>(w, G, s, z, oc, js); break;
          case 6: decode_codes<6>(w, G, s, z, oc, js); break;
          case 7: decode_codes<7>(w, G, s, z, oc, js); break;
          default: decode_codes<8>(w, G, s, z, oc, js);
        }
      }
    }
  }
}

// The values' columns are padded to whole passes of weighted_sum (whose remainder is a scalar loop: xKV's 59 value
// latents took 1.8 ms a step at 4k unpadded); the padding stays zero and is dropped at the end.
// Rebuild mode's scores of a block: per head h of the group, its keys W_h z + mu_h [DQ, BLOCK] from the latents z
// [DK, BLOCK], each rotary pair turned by its row's offset in the block, scored against the head's queries turned
// to the block's first position (cb, sb) into its rows of sc. w: the group's W as float [hpg * DQ, DK].
void rebuilt_scores(const LatentDims& d, const Rebuild& rb, const float* w, const float* mu, const float* q,
                    const float* z, const double* cb, const double* sb, float* kh, float* qt, float* pair, float* sc) {
  const int DQ = d.DQ, Rh = d.R / d.hpg, np = int(rb.tt->first.size());
  for (int h = 0; h < d.hpg; ++h) {
    // four channels by two vectors of rows at a time: eight independent sums (the adds' latency hidden), each
    // latent vector loaded once for four channels
    for (int c = 0; c < DQ; c += 4) {
      const float* wc = w + (size_t(h) * DQ + c) * d.DK;
      const size_t K = d.DK;
      for (int j = 0; j < BLOCK; j += 2 * NL) {
        vn x[8];
        for (int i = 0; i < 4; ++i) x[i] = x[4 + i] = vn{} + (mu ? mu[size_t(h) * DQ + c + i] : 0.f);
        for (size_t k = 0; k < K; ++k) {
          const vn a = loadn(z + k * BLOCK + j), b = loadn(z + k * BLOCK + j + NL);
          const float w0 = wc[k], w1 = wc[K + k], w2 = wc[2 * K + k], w3 = wc[3 * K + k];
          x[0] += a * w0, x[1] += a * w1, x[2] += a * w2, x[3] += a * w3;
          x[4] += b * w0, x[5] += b * w1, x[6] += b * w2, x[7] += b * w3;
        }
        for (int i = 0; i < 4; ++i) {
          storen(kh + size_t(c + i) * BLOCK + j, x[i]);
          storen(kh + size_t(c + i) * BLOCK + j + NL, x[4 + i]);
        }
      }
    }
    for (int i = 0; i < np; ++i) {
      float* a = kh + size_t(rb.tt->first[i]) * BLOCK;
      float* b = kh + size_t(rb.tt->second[i]) * BLOCK;
      std::copy(a, a + BLOCK, pair), std::copy(b, b + BLOCK, pair + BLOCK);
      rb.tt->turn_pair(i, pair, pair + BLOCK, a, b);
    }
    rb.tt->turn_queries(q + size_t(h) * Rh * DQ, Rh, DQ, cb, sb, qt);
    block_scores(qt, kh, Rh, DQ, sc + size_t(h) * Rh * BLOCK);
  }
}

template <int BITS>
void latent_rows(const LatentDims& d, const float* q, const float* bias, const Latents& k, const Latents& v,
                 const Rows& vr, const Rebuild& rb, int bh, int t0, int t1, float* m, float* l, float* acc) {
  const int R = d.R, DP = (d.DA + PASS - 1) / PASS * PASS, DQ = d.hpg ? d.DQ : d.DK;
  const int lanes = vr.codes ? value_lanes(d.DA, BITS && vr.group % (32 / BITS) == 0 ? BITS : 0, vr.words) : 0;
  const size_t wsize = d.hpg ? size_t(d.hpg) * DQ * (d.DK + 1) : 0;  // rebuild: the group's W and mu as float
  std::vector<float> buf(size_t(d.DK) * BLOCK + size_t(R) * BLOCK + size_t(BLOCK) * DP + size_t(R) * DP + wsize +
                             (d.hpg ? size_t(DQ) * BLOCK + size_t(R) * DQ + 2 * BLOCK : 0), 0.f);
  float *keys = buf.data(), *sc = keys + size_t(d.DK) * BLOCK, *vals = sc + size_t(R) * BLOCK;
  float* sum = vals + size_t(BLOCK) * DP;
  float *w = sum + size_t(R) * DP, *mu = w + size_t(d.hpg) * DQ * d.DK;
  float *kh = mu + size_t(d.hpg) * DQ, *qt = kh + size_t(DQ) * BLOCK, *pair = qt + size_t(R) * DQ;
  q += size_t(bh) * R * DQ;
  std::vector<double> cb, sb;
  if (d.hpg) {
    const size_t g = size_t(d.wb == 1 ? 0 : bh / d.H) * d.H + bh % d.H, F = size_t(d.hpg) * DQ;
    for (size_t i = 0; i < F * d.DK; ++i) w[i] = f16(rb.w[g * F * d.DK + i]);
    for (size_t i = 0; d.mean && i < F; ++i) mu[i] = f16(rb.mu[g * F + i]);
    cb.resize(rb.tt->first.size()), sb.resize(rb.tt->first.size());
    rb.tt->start(t0, cb.data(), sb.data());
  }
  empty_partials(R, DP, m, l, sum);
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    decode_latents(k, bh, b0, rows, d.G, keys, BLOCK, 1);
    if (d.hpg) {
      for (int j = rows; j < BLOCK; ++j)  // past the rows: zero latents (their scores are left out)
        for (int c = 0; c < d.DK; ++c) keys[size_t(c) * BLOCK + j] = 0.f;
      rebuilt_scores(d, rb, w, d.mean ? mu : nullptr, q, keys, cb.data(), sb.data(), kh, qt, pair, sc);
      rb.tt->advance(cb.data(), sb.data());
    } else
      block_scores(q, keys, R, d.DK, sc);
    for (int r = 0; bias && r < R; ++r)
      for (int j = 0; j < rows; ++j) sc[size_t(r) * BLOCK + j] += bias[size_t(bh) * R + r];
    softmax_update(sc, R, DP, [rows](int j) { return j < rows; }, m, l, sum);
    if (vr.codes)
      for (int j = 0; j < rows; ++j) {
        const uint32_t* w = vr.codes + (size_t(bh) * vr.cap + b0 + j) * vr.words;
        const size_t srow = size_t(bh) * vr.scap + vr.scale_row(b0 + j);
        const mx::float16_t *sc = vr.scales + srow * vr.groups, *bi = vr.biases + srow * vr.groups;
        if constexpr (BITS != 2 && BITS != 4 && BITS != 8)
          decode_row_any<BITS>(w, sc, bi, d.DA, vr.bits, vr.group, vr.div, vals + size_t(j) * DP);
        else
          decode_row<BITS>(w, sc, bi, d.DA, vr.words, vr.group, lanes, vals + size_t(j) * DP, vr.div);
      }
    else
      decode_latents(v, bh, b0, rows, d.G, vals, 1, DP);
    weighted_sum(sc, vals, R, rows, DP, sum);
  }
  for (int r = 0; r < R; ++r) std::copy(sum + size_t(r) * DP, sum + size_t(r) * DP + d.DA, acc + size_t(r) * d.DA);
}

class LatentDecode : public mx::Primitive {
 public:
  LatentDecode(mx::Stream s, LatentDims d, Latents k, Latents v, Rows vr)
      : mx::Primitive(s), d_(d), k_(std::move(k)), v_(std::move(v)), vr_(vr) {}
  size_t rebuild_at = 0;  // rebuild: the index of W (then mu, angle, partner, sign) among the inputs

  // inputs: q, bias (or q again), then keys' codes, scales, biases, raw, then the values' (latents: the same four;
  // rows: codes, scales, biases); an absent array is q in its place
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    Latents k = k_, v = v_;
    Rows vr = vr_;
    auto side = [&](Latents& x, int i) {
      if (x.rq) x.codes = inputs[i].data<uint32_t>(), x.scales = inputs[i + 1].data<mx::float16_t>(),
                x.biases = inputs[i + 2].data<mx::float16_t>();
      if (x.rf) x.raw = inputs[i + 3].data<mx::float16_t>();
    };
    side(k, 2);
    if (vr.bits)
      vr.codes = inputs[6].data<uint32_t>(), vr.scales = inputs[7].data<mx::float16_t>(),
      vr.biases = inputs[8].data<mx::float16_t>();
    else
      side(v, 6);
    const float* bias = d_.bias ? inputs[1].data<float>() : nullptr;
    Rebuild rb;
    const int32_t* partner = nullptr;
    const float *angle = nullptr, *sign = nullptr;
    if (d_.hpg) {
      const size_t i = rebuild_at;
      rb.w = inputs[i].data<mx::float16_t>(), rb.mu = inputs[i + 1].data<mx::float16_t>();
      angle = inputs[i + 2].data<float>(), partner = inputs[i + 3].data<int32_t>(), sign = inputs[i + 4].data<float>();
    }
    enc.dispatch([d = d_, k, v, vr, bias, rb, angle, partner, sign, q = inputs[0].data<float>(),
                  m = outputs[0].data<float>(), l = outputs[1].data<float>(), acc = outputs[2].data<float>()]() mutable {
      std::optional<TurnTable> tt;
      if (d.hpg) {
        tt.emplace(partner, sign, angle, d.DQ, d.rotate);
        if (!tt->ok) {  // not rotary pairs: NaN (the first-use check then keeps the op path)
          nan_partials(size_t(d.B) * d.H * d.R, d.DA, m, l, acc);
          return;
        }
        rb.tt = &*tt;
      }
      const int bits = vr.bits ? vr.bits : 2;  // the template's width matters for value rows only
      auto slot = [&](int c) {
        return vr.bits ? value_slot(c, d.DA, vr.group % (32 / bits) == 0 ? bits : 0, vr.words) : c;
      };
      auto go = [&](auto rows) { split_and_join(d.B * d.H, d.R, d.DA, d.n, rows, slot, m, l, acc); };
      if (bits == 2) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        latent_rows<2>(d, q, bias, k, v, vr, rb, bh, a, b, pm, pl, pa); });
      else if (bits == 4) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        latent_rows<4>(d, q, bias, k, v, vr, rb, bh, a, b, pm, pl, pa); });
      else if (bits == 8) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        latent_rows<8>(d, q, bias, k, v, vr, rb, bh, a, b, pm, pl, pa); });
      else if (bits == 3) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {  // AdaKV's middle tier
        latent_rows<3>(d, q, bias, k, v, vr, rb, bh, a, b, pm, pl, pa); });
      else go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {  // other widths: a code at a time
        latent_rows<0>(d, q, bias, k, v, vr, rb, bh, a, b, pm, pl, pa); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant latent_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantLatentDecode"; }

 private:
  LatentDims d_;
  Latents k_, v_;
  Rows vr_;
};

void check(bool ok, const char* what) { veloxquant::check(ok, "latent_decode", what); }

// A side's latents checked against the call's (B, H, n, G), its arrays (q in an absent one's place) appended to ins.
Latents latents(const char* name, const mx::array& q, int n, int G, const opt_array& codes, const opt_array& scales,
                const opt_array& biases, const opt_array& raw, const std::vector<int>& bits, bool cm, int rpg,
                bool gm, std::vector<mx::array>& ins) {
  const std::string what = std::string(name) + ": ";
  auto need = [&](bool ok, const char* why) { check(ok, (what + why).c_str()); };
  const int B = q.shape(0), H = q.shape(1), groups = n / G;
  Latents x;
  x.r = int(bits.size());
  need(x.r > 0 && x.r <= MAX_D && std::is_sorted(bits.rbegin(), bits.rend()) && bits.back() >= 1 &&
           std::all_of(bits.begin(), bits.end(), [](int b) { return b <= 8 || b == 16; }),
       "bits: 1..256 non-increasing widths of 1-8 bits or 16 (float16)");
  x.rf = int(std::count(bits.begin(), bits.end(), 16)), x.rq = x.r - x.rf;
  int words = 0;
  for (int c = x.rf; c < x.r;) {
    int e = c;
    while (e < x.r && bits[e] == bits[c]) ++e;
    x.runs.insert(x.runs.end(), {bits[c], c, e, words});
    words += (e - c) * ((G * bits[c] + 31) / 32), c = e;
  }
  auto lead = [&](const opt_array& a) { return a && a->ndim() == 4 && a->shape(0) == B && a->shape(1) == H; };
  x.cm = cm, x.rpg = rpg, x.gm = gm;
  need(!gm || rpg, "group-major ranges are for keys as rows");
  if (rpg) {
    const int ra = gm ? 3 : 2, ga = gm ? 2 : 3;  // the ranges' channel and group axes
    need(!cm && x.rf == 0 && x.runs.size() == 4 && lead(codes) && lead(scales) && biases &&
             biases->shape() == scales->shape() && codes->shape(3) * 32 >= x.r * bits[0] && codes->shape(2) >= n &&
             scales->shape(ra) == x.r && scales->shape(ga) >= (n + rpg - 1) / rpg,
         "rows: one width, codes [B, H, rows, words], ranges and minima [B, H, channels, groups of rows] (group-major: "
         "[B, H, groups, channels])");
    x.W = codes->shape(3), x.capt = codes->shape(2), x.capg = scales->shape(ga);
  } else if (cm) {
    need(x.rf == 0 && x.runs.size() == 4 && lead(codes) && lead(scales) && biases &&
             biases->shape() == scales->shape() &&
             codes->shape(2) == x.r && scales->shape(2) == x.r && codes->shape(3) >= words / x.r * groups &&
             scales->shape(3) >= groups,
         "channel-major: one width, codes [B, H, channels, words], scales and biases [B, H, channels, groups]");
    x.W = codes->shape(3), x.capg = scales->shape(3);
  } else
  need(x.rq == 0 || (lead(codes) && lead(scales) && biases && biases->shape() == scales->shape() &&
                     codes->shape(3) == words && scales->shape(3) == x.rq && codes->shape(2) >= groups &&
                     scales->shape(2) >= groups),
       "codes [B, H, groups, words of the widths], scales and biases [B, H, groups, quantized channels]");
  need(x.rf == 0 || (lead(raw) && raw->shape(3) == x.rf && raw->shape(2) >= n),
       "raw [B, H, rows, float16 channels] for the float16 widths");
  if (x.rq && !cm && !rpg) x.W = words, x.capg = codes->shape(2);
  if (x.rf) x.capt = raw->shape(2);
  ins.push_back(x.rq ? contiguous_as(*codes, mx::uint32) : ins[0]);
  ins.push_back(x.rq ? contiguous_as(*scales, mx::float16) : ins[0]);
  ins.push_back(x.rq ? contiguous_as(*biases, mx::float16) : ins[0]);
  ins.push_back(x.rf ? contiguous_as(*raw, mx::float16) : ins[0]);
  return x;
}

}  // namespace

std::vector<mx::array> latent_decode(const mx::array& q, const opt_array& bias, int n, int group,
                                     const opt_array& k_codes, const opt_array& k_scales, const opt_array& k_biases,
                                     const opt_array& k_raw, const std::vector<int>& k_bits, const opt_array& v_codes,
                                     const opt_array& v_scales, const opt_array& v_biases, const opt_array& v_raw,
                                     const std::vector<int>& v_bits, int v_row_bits, int v_row_group, int dv,
                                     bool channel_major, int k_rows_per_group, bool v_row_ranges,
                                     bool k_group_major, const std::vector<int>& v_scale_rows,
                                     const opt_array& k_rebuild, const opt_array& k_rebuild_mean,
                                     const std::vector<mx::array>& rope, bool rotate) {
  check(q.ndim() == 4 && q.shape(2) <= MAX_R && q.shape(3) <= MAX_D, "q must be [B, H, R <= 32, channels <= 256]");
  check(group > 0 && BLOCK % group == 0 && n >= 0 && n % group == 0, "group: a divisor of 64; n whole groups");
  LatentDims d{q.shape(0), q.shape(1), q.shape(2), q.shape(3), 0, n, group, bias.has_value()};
  mx::Shape ml{d.B, d.H, d.R};
  check(!bias || bias->shape() == ml, "bias: [B, H, R] (q . mu), one a query row");
  std::vector<mx::array> ins{contiguous_as(q, mx::float32)};
  ins.push_back(bias ? contiguous_as(*bias, mx::float32) : ins[0]);
  const Latents k = latents("keys", q, n, group, k_codes, k_scales, k_biases, k_raw, k_bits, channel_major,
                            k_rows_per_group, k_group_major, ins);
  if (k_rebuild) {  // Palu's: q's channels are the heads', the latents' count W's last dim
    const mx::array& w = *k_rebuild;
    const int DQ = d.DK;
    check(w.ndim() == 4 && (w.shape(0) == 1 || w.shape(0) == d.B) && w.shape(1) == d.H && w.shape(3) == k.r &&
              w.shape(2) % DQ == 0 && d.R % (w.shape(2) / DQ) == 0 &&
              (!k_rebuild_mean || k_rebuild_mean->shape() == mx::Shape{w.shape(0), d.H, 1, w.shape(2)}) &&
              !bias && !channel_major && !k_rows_per_group && rope.size() == 3 && DQ % 4 == 0 &&
              std::all_of(rope.begin(), rope.end(), [&](const mx::array& a) { return a.size() == size_t(DQ); }),
          "k_rebuild: W [1 or B, H, heads * q's channels (a multiple of 4), latents] (mean [.., H, 1, heads * "
          "channels]), the query rows a multiple of the heads, rope = (angle, partner, sign) of q's channels; no bias, "
          "no other key layout");
    d.DQ = DQ, d.DK = k.r, d.hpg = w.shape(2) / DQ, d.wb = w.shape(0), d.mean = bool(k_rebuild_mean);
    d.rotate = rotate;
  }
  check(k.r == d.DK, "keys: q's channels are the key latents'");
  Latents v;
  Rows vr;
  if (v_row_bits) {  // KIVI's per-token value rows
    check(v_row_bits >= 1 && v_row_bits <= 8 && v_codes && v_scales && v_biases &&
              v_codes->ndim() == 4 && v_scales->ndim() == 4 && v_biases->shape() == v_scales->shape() &&
              v_codes->shape(0) == d.B && v_codes->shape(1) == d.H && v_scales->shape(0) == d.B &&
              v_scales->shape(1) == d.H && dv > 0 && dv <= MAX_D && v_row_group > 0 && dv % v_row_group == 0 &&
              (v_row_group * v_row_bits) % 32 == 0 && v_codes->shape(3) * 32 == dv * v_row_bits &&
              v_scales->shape(3) == dv / v_row_group && v_codes->shape(2) >= n,
          "value rows: 1-8-bit codes [B, H, rows, dv bits / 32], a scale and bias a group of whole words");
    if (!v_scale_rows.empty()) {
      check(v_scale_rows.size() == 3 && v_scale_rows[0] > 0 && v_scale_rows[1] >= v_scale_rows[0] &&
                v_scale_rows[2] >= 0 && v_scale_rows[2] + v_scale_rows[0] <= v_scale_rows[1],
            "v_scale_rows: (per, stride, first), first + per <= stride");
      vr.per = v_scale_rows[0], vr.stride = v_scale_rows[1], vr.first = v_scale_rows[2];
    }
    check(n == 0 || v_scales->shape(2) > int(vr.scale_row(n - 1)), "value rows: scales for every row");
    vr.bits = v_row_bits, vr.group = v_row_group, vr.words = v_codes->shape(3), vr.groups = dv / v_row_group;
    vr.div = v_row_ranges ? float((1 << v_row_bits) - 1) : 1.f;
    vr.cap = v_codes->shape(2), vr.scap = v_scales->shape(2), d.DA = dv;
    for (auto [a, t] : {std::pair{&*v_codes, mx::uint32}, {&*v_scales, mx::float16}, {&*v_biases, mx::float16}})
      ins.push_back(contiguous_as(*a, t));
  } else {
    check(v_scale_rows.empty(), "v_scale_rows: for value rows");
    v = latents("values", q, n, group, v_codes, v_scales, v_biases, v_raw, v_bits, channel_major, 0, false, ins);
    d.DA = v.r;
  }
  auto prim = std::make_shared<LatentDecode>(mx::default_stream(mx::Device::cpu), d, k, v, vr);
  if (d.hpg) {
    prim->rebuild_at = ins.size();
    ins.push_back(contiguous_as(*k_rebuild, mx::float16));
    ins.push_back(k_rebuild_mean ? contiguous_as(*k_rebuild_mean, mx::float16) : ins[0]);
    ins.push_back(contiguous_as(rope[0], mx::float32)), ins.push_back(contiguous_as(rope[1], mx::int32));
    ins.push_back(contiguous_as(rope[2], mx::float32));
  }
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, d.DA}}, {mx::float32, mx::float32, mx::float32}, prim, ins);
}

}  // namespace veloxquant
