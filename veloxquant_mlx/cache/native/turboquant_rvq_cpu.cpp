// TurboQuant-RVQ's decode attention over its codes on the CPU, as an MLX primitive (the op path in
// methods/quantization/turboquant_rvq.py is the reference it is checked against at first use).
//
// Keys: a row's score is g_t * sum_s (T1[s, i_ts] + sigma[i_ts] T2[s, j_ts]), T1 and T2 the rotated query's pieces
// against the stage-1 and stage-2 centroids (tables built per call, small enough for L1). Values: the weights
// p_t g_t are summed per (piece, centroid) -- a histogram -- and multiplied by the codebooks once at the end, so a
// stored row's values cost one add per piece and query head instead of a codeword's decoding. A thread's rows take
// two passes (scores and their max; then exp and the histograms), so the histograms are never rescaled. Returns the
// partials (m, l, acc) with acc in the rotated domain (the caller turns it back).
//
// NSNQuant's layout takes the same pass: two float16 norms a row (n1, n2: a row is n1 (n2 y + mu) before the
// rotation) and both stages' codes in one row (stage 2 from word `word2`). Its key scores are n1 n2 (q.y) +
// n1 (q.mu) (q.mu given per query head: `bias`); its value weights p n1 n2 go to the bins and sum(p n1), the mean's
// weight, to acc's extra last column (joined across the ranges like the rest of acc).
//
// VecInfer's layout takes it as joint sides: one codebook cb1 of 2^(bits1 + bits2) rows indexed by c1 | c2 << bits1,
// c2 the codes' high bits (bits1 = 8 then; no high plane with up to 8 bits), no stage 2 and no sigma; its rows have
// no norms, passed as unit norms (shape [B, H, 0]: every row's gain 1). A joint side's key scores read a table over
// all its codewords where a range's rows pay for building it, else each row's codewords (q . c a piece); its values'
// bins span all the codewords.
#include "common.h"

namespace veloxquant {
namespace {

// One side's (keys' or values') codes, norms and codebooks.
struct Side {
  const uint32_t* c1;           // [B, H, cap1, w1] packed stage-1 codes
  const uint32_t* c2;           // [B, H, cap2, w2] packed stage-2 codes, null with one stage
  const mx::float16_t* norms;   // [B, H, capn]
  const float *cb1, *sigma, *cb2;  // [K1, sd], [K1], [K2, sd] (cb2 null with one stage)
  int cap1, cap2, capn, w1, w2, bits1, bits2, sd, S;
  int pair = 0, word2 = 0;       // norms (n1, n2) a row; stage 2's first word in its rows
  bool joint = false, unit = false;  // c2 the high bits of an index into cb1 (joint); every row's gain 1 (unit)
  int k1() const { return 1 << (joint ? bits1 + bits2 : bits1); }
  int k2() const { return c2 && !joint ? 1 << bits2 : 0; }
  bool wide() const { return joint && bits2; }  // indices past 8 bits, composed per block (BlockCodes::idx)
  // the row's scale of its codes' sum (n1 n2 with a pair) and, with a pair, the mean's (n1)
  float gain(int bh, int t, float* n1) const {
    if (unit) return 1.f;
    const mx::float16_t* x = norms + (size_t(bh) * capn + t) * (pair ? 2 : 1);
    if (!pair) return f16(x[0]);
    *n1 = f16(x[0]);
    return *n1 * f16(x[1]);
  }
};

struct RvqDims {
  int B, H, R, D, DV, n;
  int DA;  // acc's columns: DV, plus the mean's weight with the values' norm pairs
};

// A row's S codes of `bits` bits from its packed words (one little-endian bit stream; codes may straddle words).
inline void unpack_row(const uint32_t* __restrict w, int S, int bits, uint8_t* __restrict out) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(w);
  if (bits == 8) {
    std::memcpy(out, b, size_t(S));
  } else if (bits == 4) {  // two codes a byte, low nibble first: eight bytes at a time, the nibbles interleaved
    typedef uint8_t vb16 __attribute__((vector_size(16)));
    int i = 0;
    for (; 2 * i + 16 <= S; i += 8) {
      uint64_t x[2];
      std::memcpy(&x[0], b + i, 8);
      x[1] = (x[0] >> 4) & 0x0f0f0f0f0f0f0f0full, x[0] &= 0x0f0f0f0f0f0f0f0full;
      vb16 v;
      std::memcpy(&v, x, 16);
      const vb16 o = __builtin_shufflevector(v, v, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
      std::memcpy(out + 2 * i, &o, 16);
    }
    for (; 2 * i < S; ++i) {
      out[2 * i] = b[i] & 15;
      if (2 * i + 1 < S) out[2 * i + 1] = b[i] >> 4;
    }
  } else {
    for (int s = 0; s < S; ++s) out[s] = uint8_t(code_at(w, s * bits, bits));
  }
}

// A block's codes of one side, row-major: c1[j * S + s], c2 likewise (a stage-2 term's scale is sigma[c1], read
// where it is used: a table of K1 floats in L1, cheaper than a block-sized copy of it). Byte-wide codes filling
// their rows' words exactly (8-bit codes, S a multiple of 4: the defaults' stage 1) are read where they are stored.
// A wide joint side's indices c1 | c2 << bits1 go to idx.
struct BlockCodes {
  std::vector<uint8_t> i1, i2;
  std::vector<uint16_t> ij;
  const uint8_t *c1 = nullptr, *c2 = nullptr;
  const uint16_t* idx = nullptr;
  BlockCodes(int S, bool wide) : i1(size_t(S) * BLOCK), i2(size_t(S) * BLOCK), ij(wide ? size_t(S) * BLOCK : 0) {}
  void load(const Side& x, int bh, int t0, int rows) {
    c1 = stage(x.c1, x.cap1, x.w1, 0, x.bits1, x.S, bh, t0, rows, i1);
    if (x.c2) c2 = stage(x.c2, x.cap2, x.w2, x.word2, x.bits2, x.S, bh, t0, rows, i2);
    if (!x.wide()) return;
    for (size_t i = 0, m = size_t(rows) * x.S; i < m; ++i) ij[i] = uint16_t(c1[i] | unsigned(c2[i]) << x.bits1);
    idx = ij.data();
  }

 private:
  static const uint8_t* stage(const uint32_t* w, int cap, int wpr, int word, int bits, int S, int bh, int t0,
                              int rows, std::vector<uint8_t>& buf) {
    const uint32_t* first = w + (size_t(bh) * cap + t0) * wpr + word;
    if (bits == 8 && 4 * wpr == S) return reinterpret_cast<const uint8_t*>(first);
    for (int j = 0; j < rows; ++j) unpack_row(first + size_t(j) * wpr, S, bits, &buf[size_t(j) * S]);
    return buf.data();
  }
};

// Query heads go four to a vector through the tables and bins (lanes past R are zero).
typedef float vf4 __attribute__((vector_size(16)));
constexpr int QL = 4;

// The four query heads' pieces s of group g as lanes: qv[e] = q[4g + lane, s * sd + e].
inline void query_lanes(const float* q, int R, int D, int g, int s, int sd, vf4* qv) {
  for (int e = 0; e < sd; ++e)
    for (int lane = 0; lane < QL; ++lane) {
      const int r = g * QL + lane;
      qv[e][lane] = r < R ? q[size_t(r) * D + size_t(s) * sd + e] : 0.f;
    }
}

// tab[(g * S + s) * K + c] = (q[4g + lane, piece s] . cb[c]) over the lanes, for a codebook cb [K, sd].
void lookup_table(const float* q, int R, int D, const float* cb, int K, int sd, vf4* tab) {
  const int S = D / sd, G = (R + QL - 1) / QL;
  std::vector<vf4> qv(sd);
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) {
      query_lanes(q, R, D, g, s, sd, qv.data());
      vf4* out = tab + (size_t(g) * S + s) * K;
      for (int c = 0; c < K; ++c) {
        vf4 a{};
        for (int e = 0; e < sd; ++e) a += qv[e] * cb[size_t(c) * sd + e];
        out[c] = a;
      }
    }
}

// sum_s tab[s * K + code[s]] (each term times sigma[cell[s]] when SCALED: a stage-2 code's scale by its stage-1
// cell), in four independent sums; codes of 8 bits, or a wide joint side's 16-bit indices.
template <bool SCALED, class Code>
inline vf4 lookup_sum(const vf4* __restrict tab, int K, const Code* __restrict code, const float* sigma,
                      const uint8_t* __restrict cell, int S) {
  vf4 a0{}, a1{}, a2{}, a3{};
  auto term = [&](int s) { return SCALED ? sigma[cell[s]] * tab[s * K + code[s]] : tab[s * K + code[s]]; };
  int s = 0;
  for (; s + 4 <= S; s += 4) {
    a0 += term(s);
    a1 += term(s + 1);
    a2 += term(s + 2);
    a3 += term(s + 3);
  }
  for (; s < S; ++s) a0 += term(s);
  return (a0 + a1) + (a2 + a3);
}

// sum_s q_s . cb[idx[s]] over the lanes (q_s = qv[s * sd ..]: a piece's sd coordinates as lanes): a wide joint
// side's key score read from its codewords, where a range is too short to pay for a table of them. SD: sd known at
// compile time (2, 4, 8: the loops unrolled), else 0.
template <int SD>
inline vf4 codeword_sum(const vf4* __restrict qv, const float* __restrict cb, const uint16_t* __restrict idx, int S,
                        int sd) {
  if constexpr (SD > 0) sd = SD;
  vf4 a0{}, a1{};
  for (int s = 0; s < S; ++s) {
    const float* c = cb + size_t(idx[s]) * sd;
    const vf4* qs = qv + size_t(s) * sd;
    int e = 0;
    for (; e + 2 <= sd; e += 2) a0 += qs[e] * c[e], a1 += qs[e + 1] * c[e + 1];
    if (e < sd) a0 += qs[e] * c[e];
  }
  return a0 + a1;
}

// Table entries (vf4) up to which a wide joint side's key scores may read a table (4 MiB), and its values' bins
// (pieces x codewords, 1 MiB) a group of query heads.
constexpr size_t MAX_JOINT_TABLE = size_t(1) << 18, MAX_JOINT_BINS = size_t(1) << 16;

// The partials of rows [t0, t1) of one (batch row, KV head) into m[R], l[R], acc[R * DV] (rotated domain).
void rvq_rows(const RvqDims& d, const float* q, const float* bias, const Side& k, const Side& v, int bh, int t0,
              int t1, float* m, float* l, float* acc) {
  const int R = d.R, G = (R + QL - 1) / QL, len = t1 - t0, K1 = k.k1(), K2 = k.k2(), V1 = v.k1(), V2 = v.k2();
  empty_partials(R, d.DA, m, l, acc);
  if (len <= 0) return;
  const float* qb = q + size_t(bh) * R * d.D;
  std::vector<vf4> qmu(G, vf4{});  // q.mu of each group's four query heads (norm pairs)
  for (int r = 0; k.pair && r < R; ++r) qmu[r / QL][r % QL] = bias[size_t(bh) * R + r];
  // a wide joint side's table costs K1 D to build against D a row read from the codewords (S from the table)
  const bool kw = k.wide(), table = !kw || (size_t(K1) * k.sd < size_t(len) * (k.sd - 1) &&
                                            size_t(G) * k.S * K1 <= MAX_JOINT_TABLE);
  std::vector<vf4> lut1(table ? size_t(G) * k.S * K1 : 0), lut2(size_t(G) * k.S * K2), qv(table ? 0 : size_t(G) * d.D);
  std::vector<vf4> sc(size_t(G) * len);  // [group, row]: four query heads' scores, then exp(s - m)
  if (table) lookup_table(qb, R, d.D, k.cb1, K1, k.sd, lut1.data());
  for (int g = 0; !table && g < G; ++g)
    for (int s = 0; s < k.S; ++s) query_lanes(qb, R, d.D, g, s, k.sd, qv.data() + size_t(g) * d.D + size_t(s) * k.sd);
  if (K2) lookup_table(qb, R, d.D, k.cb2, K2, k.sd, lut2.data());
  BlockCodes kc(k.S, kw), vc(v.S, v.wide());
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {  // pass 1: scores g_t sum_s (T1 + sigma T2)
    const int rows = std::min(BLOCK, t1 - b0);
    kc.load(k, bh, b0, rows);
    for (int j = 0; j < rows; ++j) {
      const size_t e = size_t(j) * k.S;
      float n1 = 0.f;
      const float gt = k.gain(bh, b0 + j, &n1);
      for (int g = 0; g < G; ++g) {
        vf4 a;
        if (!kw) {
          a = lookup_sum<false>(lut1.data() + size_t(g) * k.S * K1, K1, kc.c1 + e, nullptr, nullptr, k.S);
          if (K2) a += lookup_sum<true>(lut2.data() + size_t(g) * k.S * K2, K2, kc.c2 + e, k.sigma, kc.c1 + e, k.S);
        } else if (table) {
          a = lookup_sum<false>(lut1.data() + size_t(g) * k.S * K1, K1, kc.idx + e, nullptr, nullptr, k.S);
        } else {
          const vf4* qg = qv.data() + size_t(g) * d.D;
          a = k.sd == 4   ? codeword_sum<4>(qg, k.cb1, kc.idx + e, k.S, 4)
              : k.sd == 2 ? codeword_sum<2>(qg, k.cb1, kc.idx + e, k.S, 2)
              : k.sd == 8 ? codeword_sum<8>(qg, k.cb1, kc.idx + e, k.S, 8)
                          : codeword_sum<0>(qg, k.cb1, kc.idx + e, k.S, k.sd);
        }
        sc[size_t(g) * len + (b0 - t0 + j)] = k.pair ? a * gt + qmu[g] * n1 : a * gt;
      }
    }
  }
  for (int g = 0; g < G; ++g) {  // exp(s - m), l: a group's rows as one float stream, lane = position % 4
    vf4* sg = sc.data() + size_t(g) * len;
    vf4 m4 = sg[0];
    for (int j = 1; j < len; ++j) m4 = sg[j] > m4 ? sg[j] : m4;
    float* f = reinterpret_cast<float*>(sg);
    vf mrep;
    for (int c = 0; c < VL; ++c) mrep[c] = m4[c % QL];
    vf sum{};
    int i = 0;
    for (; i + VL <= QL * len; i += VL) {
      const vf e = exp_neg(load(f + i) - mrep);
      store(f + i, e);
      sum += e;
    }
    vf4 l4{};
    for (int c = 0; c < VL; ++c) l4[c % QL] += sum[c];
    for (; i < QL * len; ++i) l4[i % QL] += f[i] = exp_neg(f[i] - m4[i % QL]);
    for (int lane = 0; lane < QL && g * QL + lane < R; ++lane) m[g * QL + lane] = m4[lane], l[g * QL + lane] = l4[lane];
  }
  // pass 2: each row's weights p g_v added to its codes' bins (stage 2's times its cell's sigma; a wide joint side's
  // to its indices' bins)
  std::vector<vf4> h1(size_t(G) * v.S * V1, vf4{}), h2(size_t(G) * v.S * V2, vf4{}), mean(G, vf4{});
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    vc.load(v, bh, b0, rows);
    for (int j = 0; j < rows; ++j) {
      const size_t e = size_t(j) * v.S;
      float n1 = 0.f;
      const float gt = v.gain(bh, b0 + j, &n1);
      for (int g = 0; g < G; ++g) {
        const vf4 p = sc[size_t(g) * len + (b0 - t0 + j)], w = p * gt;  // lanes past R: never read back
        if (v.pair) mean[g] += p * n1;
        vf4* __restrict b1 = h1.data() + size_t(g) * v.S * V1;
        if (vc.idx) {
          for (int s = 0; s < v.S; ++s) b1[s * V1 + vc.idx[e + s]] += w;
          continue;
        }
        for (int s = 0; s < v.S; ++s) b1[s * V1 + vc.c1[e + s]] += w;
        if (!V2) continue;
        vf4* __restrict b2 = h2.data() + size_t(g) * v.S * V2;
        for (int s = 0; s < v.S; ++s) b2[s * V2 + vc.c2[e + s]] += w * v.sigma[vc.c1[e + s]];
      }
    }
  }
  std::vector<vf4> piece(v.sd);  // acc[piece s] = bins1 @ cb1 + bins2 @ cb2, four query heads a vector
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < v.S; ++s) {
      std::fill(piece.begin(), piece.end(), vf4{});
      for (int stage = 0; stage < (V2 ? 2 : 1); ++stage) {
        const int K = stage ? V2 : V1;
        const vf4* bins = (stage ? h2.data() : h1.data()) + (size_t(g) * v.S + s) * K;
        const float* cb = stage ? v.cb2 : v.cb1;
        for (int c = 0; c < K; ++c)
          for (int e = 0; e < v.sd; ++e) piece[e] += bins[c] * cb[size_t(c) * v.sd + e];
      }
      for (int lane = 0; lane < QL && g * QL + lane < R; ++lane)
        for (int e = 0; e < v.sd; ++e) acc[size_t(g * QL + lane) * d.DA + size_t(s) * v.sd + e] = piece[e][lane];
    }
  for (int r = 0; v.pair && r < R; ++r) acc[size_t(r) * d.DA + d.DV] = mean[r / QL][r % QL];
}

class RvqDecode : public mx::Primitive {
 public:
  RvqDecode(mx::Stream s, RvqDims d, Side k, Side v, std::vector<int> counts)
      : mx::Primitive(s), d_(d), k_(k), v_(v), counts_(std::move(counts)) {}

  // inputs: q, then per side (keys, values): codes1, codes2 (or codes1 again), norms, cb1, sigma, cb2 (or cb1 again),
  // then the keys' q.mu with norm pairs
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    Side k = k_, v = v_;
    for (int i = 0; i < 2; ++i) {
      Side& x = i ? v : k;
      const auto* in = &inputs[1 + 6 * i];
      x.c1 = in[0].data<uint32_t>();
      x.c2 = x.bits2 ? in[1].data<uint32_t>() : nullptr;
      x.norms = in[2].data<mx::float16_t>();
      x.cb1 = in[3].data<float>();
      x.sigma = in[4].data<float>();
      x.cb2 = x.k2() ? in[5].data<float>() : nullptr;
    }
    const float* bias = k.pair ? inputs[13].data<float>() : nullptr;
    enc.dispatch([d = d_, k, v, bias, counts = counts_, q = inputs[0].data<float>(), m = outputs[0].data<float>(),
                  l = outputs[1].data<float>(), acc = outputs[2].data<float>()]() {
      split_and_join(d.B * d.H, d.R, d.DA, d.n, [&](int bh, int t0, int t1, float* pm, float* pl, float* pa) {
        rvq_rows(d, q, bias, k, v, bh, t0, t1, pm, pl, pa);
      }, [](int c) { return c; }, m, l, acc, counts, d.H);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant turboquant_rvq_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantTurboQuantRVQDecode"; }

 private:
  RvqDims d_;
  Side k_, v_;
  std::vector<int> counts_;
};

void check(bool ok, const char* what) { veloxquant::check(ok, "turboquant_rvq_decode", what); }

// A side's shapes checked against the call's, its arrays appended to ins (stage 2 absent: stage 1's in its place).
// Norms [B, H, rows] (one a row), [B, H, rows, 2] (NSNQuant's pairs) or [B, H, 0] (unit norms); stage 2 from word
// `word2` of c2's rows. Joint: c2 (if any) the high bits of an index into cb1 (no cb2; sigma not read).
Side side(const char* name, int B, int H, int dim, int n, const mx::array& c1, const opt_array& c2,
          const mx::array& norms, const mx::array& cb1, const mx::array& sigma, const opt_array& cb2, int word2,
          bool joint, std::vector<mx::array>& ins) {
  const std::string what = std::string(name) + ": ";
  auto need = [&](bool ok, const char* why) { check(ok, (what + why).c_str()); };
  const bool pair = norms.ndim() == 4 && norms.shape(3) == 2;
  need(c1.ndim() == 4 && (norms.ndim() == 3 || pair) && cb1.ndim() == 2 && sigma.ndim() == 1, "ranks");
  if (joint)
    need(!cb2, "joint: no stage-2 codebook (the high-bit codes index the stage-1 codebook)");
  else
    need(c2.has_value() == cb2.has_value(), "stage-2 codes and codebook go together");
  need(word2 >= 0 && (c2 || word2 == 0), "word2: a stage-2 word offset >= 0, only with stage-2 codes");
  Side x{};
  x.pair = pair, x.word2 = word2, x.joint = joint, x.unit = norms.ndim() == 3 && norms.shape(2) == 0;
  x.sd = cb1.shape(1), x.S = x.sd > 0 && dim % x.sd == 0 ? dim / x.sd : 0;
  need(x.S > 0 && x.S <= MAX_D, "piece size must divide the head dim");
  const int K1 = cb1.shape(0);
  int bits = 0;
  while (bits < 17 && (1 << bits) < K1) ++bits;
  if (joint) {  // 1-8 bits in one plane, or 9-16: 8 low bits and the high ones in c2
    need((1 << bits) == K1 && bits >= 1 && bits <= 16 && (c2 ? bits > 8 : bits <= 8),
         "joint codebook size: 2^bits rows, 1-8 bits without a high-bit plane, 9-16 with one");
    x.bits1 = std::min(bits, 8), x.bits2 = bits - x.bits1;
  } else {
    x.bits1 = bits;
    need((1 << bits) == K1 && bits >= 1 && bits <= 8 && sigma.shape(0) == K1, "stage-1 codebook size");
  }
  x.cap1 = c1.shape(2), x.w1 = c1.shape(3), x.capn = norms.shape(2);
  need(c1.shape(0) == B && c1.shape(1) == H && norms.shape(0) == B && norms.shape(1) == H, "batch or heads differ");
  need(x.w1 * 32 >= x.S * x.bits1 && n <= x.cap1 && (x.unit || n <= x.capn), "stage-1 words or rows");
  if (c2 && !joint) {
    const int K2 = cb2->shape(0);
    while ((1 << x.bits2) < K2) ++x.bits2;
    need(cb2->ndim() == 2 && (1 << x.bits2) == K2 && x.bits2 >= 1 && x.bits2 <= 8 && cb2->shape(1) == x.sd,
         "stage-2 codebook");
  }
  if (c2) {
    need(c2->ndim() == 4 && c2->shape(0) == B && c2->shape(1) == H && (c2->shape(3) - word2) * 32 >= x.S * x.bits2 &&
             n <= c2->shape(2), "stage-2 codes");
    x.cap2 = c2->shape(2), x.w2 = c2->shape(3);
  }
  for (auto [a, t] : {std::pair{c1, mx::uint32}, {c2.value_or(c1), mx::uint32}, {norms, mx::float16},
                      {cb1, mx::float32}, {sigma, mx::float32}, {cb2.value_or(cb1), mx::float32}})
    ins.push_back(contiguous_as(a, t));
  return x;
}

}  // namespace

// Each side's joint mode (k_joint, v_joint): VecInfer's one codebook indexed by both code planes.
std::vector<mx::array> turboquant_rvq_decode(const mx::array& q, const mx::array& k1, const opt_array& k2,
                                             const mx::array& k_norms, const mx::array& k_cb1, const mx::array& k_sigma,
                                             const opt_array& k_cb2, const mx::array& v1, const opt_array& v2,
                                             const mx::array& v_norms, const mx::array& v_cb1, const mx::array& v_sigma,
                                             const opt_array& v_cb2, int n, int dv, const std::vector<int>& counts,
                                             const opt_array& k_bias, int k_word2, int v_word2, bool k_joint,
                                             bool v_joint) {
  check(q.ndim() == 4, "q must be [B, H, R, D]");
  RvqDims d{q.shape(0), q.shape(1), q.shape(2), q.shape(3), dv, n, dv};
  check(d.D <= MAX_D && dv > 0 && dv <= MAX_D && d.R <= MAX_R && n >= 0, "head dims, query heads or rows");
  check(counts.empty() || (int(counts.size()) == d.B &&
                           std::all_of(counts.begin(), counts.end(), [n](int c) { return c >= 0 && c <= n; })),
        "counts: one per batch row, each in 0..n");
  std::vector<mx::array> ins{contiguous_as(q, mx::float32)};
  const Side k = side("keys", d.B, d.H, d.D, n, k1, k2, k_norms, k_cb1, k_sigma, k_cb2, k_word2, k_joint, ins);
  const Side v = side("values", d.B, d.H, dv, n, v1, v2, v_norms, v_cb1, v_sigma, v_cb2, v_word2, v_joint, ins);
  check(!v.wide() || size_t(v.S) * v.k1() <= MAX_JOINT_BINS, "values: joint bins (pieces x codewords) up to 2^16");
  mx::Shape ml{d.B, d.H, d.R};
  check(k.pair == k_bias.has_value() && (!k_bias || k_bias->shape() == ml),
        "k_bias: [B, H, R] (q.mu) exactly when the keys' norms are pairs");
  if (k_bias) ins.push_back(contiguous_as(*k_bias, mx::float32));
  d.DA = dv + v.pair;
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, d.DA}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<RvqDecode>(mx::default_stream(mx::Device::cpu), d, k, v, counts), ins);
}

}  // namespace veloxquant
