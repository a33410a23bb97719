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
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int BLOCK = 64;    // rows per softmax update (and the turn table's rows)
constexpr int MAX_D = 256;   // key and value head dims
constexpr int MAX_R = 32;    // query heads per KV head
constexpr int MIN_ROWS_PER_PART = 512;  // a thread's share of a step is at least this many rows

// A persistent pool: run(n, f) calls f(0 .. n-1), f(0) on the caller, the rest on sleeping workers.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }
  void run(int n, const std::function<void(int)>& f) {
    n = std::min(n, size());
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (n <= 1 || !busy.owns_lock()) {  // another stream's call holds the pool: this one runs alone
      for (int i = 0; i < n; ++i) f(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &f;
      active_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    cv_.notify_all();
    f(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int idx) {
    long seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (idx >= active_) continue;
        job = job_;
      }
      (*job)(idx);
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* job_ = nullptr;
  long generation_ = 0;
  int active_ = 0, pending_ = 0;
  bool stop_ = false;
};

// The process's pool, made at first use (as MLX's own CPU streams, it does not survive a fork).
Pool& pool() {
  static Pool p(int(std::max(1u, std::min(16u, std::thread::hardware_concurrency()))));
  return p;
}

// 16-lane vectors (GCC/Clang vector extensions: AVX-512, AVX2 or NEON, whatever the build machine has).
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
constexpr int VL = 16;
inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
inline vu loadu(const uint32_t* p) { return *reinterpret_cast<const vu*>(p); }
inline vf splat(float x) { return vf{} + x; }

// exp(x) for x <= 0 on 16 lanes (-inf and below -87 give e^-87): 2^k e^r, |r| <= ln2/2, a degree-7 polynomial.
inline vf exp_neg(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vi ki = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  // k rounded half up (x <= 0)
  const vf k = __builtin_convertvector(ki, vf);
  const vf r = (x - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  vf p = splat(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * reinterpret_cast<vf>((ki + 127) << 23);
}

inline float exp_neg(float x) { return exp_neg(splat(x))[0]; }

struct Dims {
  int B, H, R, D, DV;
  int kcap, wk, vcap, wv, scap;  // rows held by the buffers and 32-bit words a row
  int n;                          // quantized rows attended
  long pos0;                      // position of quantized row 0
  int vbits;
  bool rotate;
};

struct Inputs {
  const float* q;           // [B, H, R, D], scaled
  const uint32_t* kw;       // [B, H, kcap, wk] words
  const int32_t* ktab;      // [H, D]: stream bit of the code | width << 16
  const float* lo;          // [B, H, D]
  const float* step;        // [B, H, D]
  const float* w;           // [D] angle per position (0: not rotated)
  const int32_t* partner;   // [D] rotary partner
  const float* sign;        // [D] +1 first of a pair, -1 second, 0 not rotated
  const uint8_t* vw;        // [B, H, vcap, wv] words, read as bytes
  const mx::float16_t* vs;  // [B, H, scap] row scales
  const float* poly;        // [3] the centroids' odd polynomial
};

// Per call: RoPE's pairs (first channel a, second b = partner(a), angle w_a), the channels it leaves alone, and
// (cos, sin)(j w) of every pair for the rows j < BLOCK of a block, plus (cos, sin)(BLOCK w) to advance a block.
struct TurnTable {
  std::vector<int> first, second, alone;
  std::vector<float> c, s;  // [pairs, BLOCK]
  std::vector<double> bc, bs, w;
  bool ok = true;
  TurnTable(const Inputs& in, int D, bool rotate) {
    for (int ch = 0; ch < D; ++ch) {
      const int p = in.partner[ch];
      if (!rotate || in.sign[ch] == 0.f) {
        alone.push_back(ch);
      } else if (in.sign[ch] > 0.f) {
        if (p < 0 || p >= D || in.partner[p] != ch || !(in.sign[p] < 0.f) || in.w[p] != in.w[ch]) {
          ok = false;  // not rotary pairs: the call returns NaN (its first-use check then turns the kernel off)
          return;
        }
        first.push_back(ch);
        second.push_back(p);
      }
    }
    const int np = int(first.size());
    c.resize(size_t(np) * BLOCK);
    s.resize(size_t(np) * BLOCK);
    bc.resize(np), bs.resize(np), w.resize(np);
    for (int i = 0; i < np; ++i) {  // (cos, sin)(j w) by repeated turns of w in double (64 steps: ~1e-14 off)
      w[i] = in.w[first[i]];
      const double c1 = std::cos(w[i]), s1 = std::sin(w[i]);
      double cj = 1.0, sj = 0.0;
      for (int j = 0; j < BLOCK; ++j) {
        c[size_t(i) * BLOCK + j] = float(cj);
        s[size_t(i) * BLOCK + j] = float(sj);
        const double x = cj * c1 - sj * s1;
        sj = sj * c1 + cj * s1;
        cj = x;
      }
      bc[i] = cj;  // after BLOCK turns: (cos, sin)(BLOCK w)
      bs[i] = sj;
    }
  }
};

// Channel c's keys of a block (64 rows): code at stream bit off, width bits, from the block's words transposed
// (words [w][j]), as lo + step * code.
inline void decode_channel(const uint32_t* __restrict words, uint32_t entry, float lo, float step,
                           float* __restrict out) {
  const int off = int(entry & 0xffff), width = int(entry >> 16);
  const int sh = off & 31;
  const uint32_t mask = (1u << width) - 1;
  const uint32_t* a = words + size_t(off >> 5) * BLOCK;
  for (int j = 0; j < BLOCK; j += VL) {
    vu x = loadu(a + j) >> sh;
    if (sh + width > 32) x |= loadu(a + BLOCK + j) << (32 - sh);
    store(out + j, lo + step * __builtin_convertvector(reinterpret_cast<vi>(x & mask), vf));
  }
}

// The values' centroids: the odd polynomial u (a + u^2 (b + c u^2)) of the code centred at (2^bits - 1) / 2.
struct Centroids {
  float half, a, b, c;
  float operator()(float code) const {
    const float u = code - half, u2 = u * u;
    return u * (a + u2 * (b + c * u2));
  }
  vf8 operator()(vf8 code) const {
    const vf8 u = code - half, u2 = u * u;
    return u * (a + u2 * (b + c * u2));
  }
};

// Where value_row puts channel c: 4-bit codes in whole 8-word groups go nibble-major (word w's nibble k, channel
// 8w + k, at k * words + w: one shift and mask per nibble for 8 words at once); other widths in order.
inline int value_slot(int c, int dv, int vbits, int words) {
  return vbits == 4 && dv == 8 * words && words % 8 == 0 ? (c & 7) * words + (c >> 3) : c;
}

// One row's centroids into u[dv], channel c at value_slot(c).
inline void value_row(const uint8_t* __restrict src, int words, int dv, int vbits, const Centroids& cent,
                      float* __restrict u) {
  if (vbits == 4 && dv == 8 * words && words % 8 == 0) {
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

// acc[R, dv] += w[R, BLOCK] @ u[rows, dv]: two query heads and 4 x 16 channels at a time held in registers over
// the rows (eight independent sums: the adds' latency hidden).
inline void weighted_sum(const float* __restrict w, const float* __restrict u, int R, int rows, int dv,
                         float* __restrict acc) {
  int c0 = 0;
  for (; c0 + 4 * VL <= dv; c0 += 4 * VL) {
    int r = 0;
    for (; r + 2 <= R; r += 2) {
      const float *w0 = w + size_t(r) * BLOCK, *w1 = w0 + BLOCK;
      float *a0p = acc + size_t(r) * dv + c0, *a1p = a0p + dv;
      vf a00 = load(a0p), a01 = load(a0p + VL), a02 = load(a0p + 2 * VL), a03 = load(a0p + 3 * VL);
      vf a10 = load(a1p), a11 = load(a1p + VL), a12 = load(a1p + 2 * VL), a13 = load(a1p + 3 * VL);
      for (int j = 0; j < rows; ++j) {
        const float* uj = u + size_t(j) * dv + c0;
        const vf u0 = load(uj), u1 = load(uj + VL), u2 = load(uj + 2 * VL), u3 = load(uj + 3 * VL);
        const float x = w0[j], y = w1[j];
        a00 += x * u0, a01 += x * u1, a02 += x * u2, a03 += x * u3;
        a10 += y * u0, a11 += y * u1, a12 += y * u2, a13 += y * u3;
      }
      store(a0p, a00), store(a0p + VL, a01), store(a0p + 2 * VL, a02), store(a0p + 3 * VL, a03);
      store(a1p, a10), store(a1p + VL, a11), store(a1p + 2 * VL, a12), store(a1p + 3 * VL, a13);
    }
    for (; r < R; ++r) {
      const float* w0 = w + size_t(r) * BLOCK;
      float* a0p = acc + size_t(r) * dv + c0;
      vf a00 = load(a0p), a01 = load(a0p + VL), a02 = load(a0p + 2 * VL), a03 = load(a0p + 3 * VL);
      for (int j = 0; j < rows; ++j) {
        const float* uj = u + size_t(j) * dv + c0;
        const float x = w0[j];
        a00 += x * load(uj), a01 += x * load(uj + VL), a02 += x * load(uj + 2 * VL), a03 += x * load(uj + 3 * VL);
      }
      store(a0p, a00), store(a0p + VL, a01), store(a0p + 2 * VL, a02), store(a0p + 3 * VL, a03);
    }
  }
  for (int r = 0; r < R; ++r) {  // the channels past the last 64
    const float* wr = w + size_t(r) * BLOCK;
    float* ar = acc + size_t(r) * dv;
    for (int c = c0; c < dv; ++c) {
      float a = ar[c];
      for (int j = 0; j < rows; ++j) a += wr[j] * u[size_t(j) * dv + c];
      ar[c] = a;
    }
  }
}

// sc[R, BLOCK] = q[R, D] @ keys[D, BLOCK] (keys channel-major), two query heads a pass (eight independent sums).
inline void block_scores(const float* qt, const float* keys, int R, int D, float* sc) {
  static_assert(BLOCK == 4 * VL, "a block's scores are four vectors");
  for (int r = 0; r < R; r += 2) {
    const bool two = r + 1 < R;
    const float* q0 = qt + size_t(r) * D;
    const float* q1 = two ? q0 + D : q0;
    vf s0{}, s1{}, s2{}, s3{}, t0{}, t1{}, t2{}, t3{};
    for (int c = 0; c < D; ++c) {
      const float* kc = keys + size_t(c) * BLOCK;
      const vf k0 = load(kc), k1 = load(kc + VL), k2 = load(kc + 2 * VL), k3 = load(kc + 3 * VL);
      const float x = q0[c], y = q1[c];
      s0 += x * k0, s1 += x * k1, s2 += x * k2, s3 += x * k3;
      t0 += y * k0, t1 += y * k1, t2 += y * k2, t3 += y * k3;
    }
    float* s_0 = sc + size_t(r) * BLOCK;
    store(s_0, s0), store(s_0 + VL, s1), store(s_0 + 2 * VL, s2), store(s_0 + 3 * VL, s3);
    if (two) store(s_0 + BLOCK, t0), store(s_0 + BLOCK + VL, t1), store(s_0 + BLOCK + 2 * VL, t2),
        store(s_0 + BLOCK + 3 * VL, t3);
  }
}

// One online-softmax update per block: the scores sc[R, BLOCK] (slots where valid(j) is false left out) become
// exp(s - m) with m the new running max; l and acc[R, dv] rescaled to it.
template <class Valid>
inline void softmax_update(float* sc, int R, int dv, Valid valid, float* m, float* l, float* acc) {
  for (int r = 0; r < R; ++r) {
    float* __restrict sr = sc + size_t(r) * BLOCK;
    for (int j = 0; j < BLOCK; ++j)
      if (!valid(j)) sr[j] = -INFINITY;
    vf mv = load(sr);
    for (int j = VL; j < BLOCK; j += VL) {
      const vf x = load(sr + j);
      mv = x > mv ? x : mv;
    }
    float mb = m[r];
    for (int k = 0; k < VL; ++k) mb = std::max(mb, mv[k]);
    const float alpha = exp_neg(m[r] - mb);  // the running max moved: rescale what was summed
    m[r] = mb;
    vf sum{};
    for (int j = 0; j < BLOCK; j += VL) {
      vf e = exp_neg(load(sr + j) - mb);
      for (int k = 0; k < VL; ++k)
        if (!valid(j + k)) e[k] = 0.f;  // (exp_neg(-inf) is e^-87, not 0)
      store(sr + j, e);
      sum += e;
    }
    float total = 0.f;
    for (int k = 0; k < VL; ++k) total += sum[k];
    l[r] = l[r] * alpha + total;
    if (alpha != 1.f) {
      float* ar = acc + size_t(r) * dv;
      for (int c = 0; c < dv; ++c) ar[c] *= alpha;
    }
  }
}

// The partials of no rows: m = -inf, l = 0, acc = 0.
inline void empty_partials(int R, int dv, float* m, float* l, float* acc) {
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + size_t(R) * dv, 0.f);
}

// The partials of rows [t0, t1) of one (batch row, KV head) into m[R], l[R], acc[R * DV] (acc: channel c at
// value_slot(c)).
void attend_rows(const Dims& d, const Inputs& in, const TurnTable& tt, int bh, int t0, int t1, float* m, float* l,
                 float* acc) {
  const int D = d.D, DV = d.DV, R = d.R, h = bh % d.H, np = int(tt.first.size());
  const float* q = in.q + size_t(bh) * R * D;
  const float* lo = in.lo + size_t(bh) * D;
  const float* st = in.step + size_t(bh) * D;
  const int32_t* tab = in.ktab + size_t(h) * D;
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
  for (int i = 0; i < np; ++i) {
    const double a = std::fmod(double(d.pos0 + t0) * tt.w[i], 2 * M_PI);
    cb[i] = std::cos(a);
    sb[i] = std::sin(a);
  }
  empty_partials(R, DV, m, l, acc);

  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    for (int r = 0; r < R; ++r) {  // q' = R(t)^T q at t = pos0 + b0: q . R(t + j) k = q' . R(j) k
      const float* qr = q + size_t(r) * D;
      float* o = qt + size_t(r) * D;
      for (int c : tt.alone) o[c] = qr[c];
      for (int i = 0; i < np; ++i) {
        const int a = tt.first[i], b = tt.second[i];
        o[a] = float(qr[a] * cb[i] + qr[b] * sb[i]);
        o[b] = float(qr[b] * cb[i] - qr[a] * sb[i]);
      }
    }
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
      const float* __restrict cj = tt.c.data() + size_t(i) * BLOCK;
      const float* __restrict sj = tt.s.data() + size_t(i) * BLOCK;
      float* __restrict oa = keys + size_t(a) * BLOCK;
      float* __restrict ob = keys + size_t(b) * BLOCK;
      for (int j = 0; j < BLOCK; j += VL) {
        const vf x = load(ka + j), y = load(kb + j), c = load(cj + j), sn = load(sj + j);
        store(oa + j, x * c - y * sn);
        store(ob + j, y * c + x * sn);
      }
    }
    block_scores(qt, keys, R, D, sc);
    softmax_update(sc, R, DV, [rows](int j) { return j < rows; }, m, l, acc);
    for (int j = 0; j < rows; ++j) {  // values: each code's centroid; the weights p * s_t
      value_row(vw + size_t(b0 + j) * d.wv * 4, d.wv, DV, d.vbits, cent, cents + size_t(j) * DV);
      const float scale = float(vs[b0 + j]);
      for (int r = 0; r < R; ++r) sc[size_t(r) * BLOCK + j] *= scale;
    }
    weighted_sum(sc, cents, R, rows, DV, acc);
    for (int i = 0; i < np; ++i) {  // advance the block turn by BLOCK rows
      const double x = cb[i] * tt.bc[i] - sb[i] * tt.bs[i];
      sb[i] = sb[i] * tt.bc[i] + cb[i] * tt.bs[i];
      cb[i] = x;
    }
  }
}

// Each (batch row, KV head)'s rows [0, n) in at most as many ranges as threads (each >= MIN_ROWS_PER_PART rows),
// rows(bh, t0, t1, m, l, acc) run over the pool, the ranges' partials joined into m, l [BH, R] and acc [BH, R, dv]
// (acc's channel c read from slot(c) of the ranges' sums).
template <class Rows, class Slot>
void split_and_join(int BH, int R, int dv, int n, Rows rows, Slot slot, float* m, float* l, float* acc) {
  const int threads = pool().size();
  int parts = std::max(1, std::min((threads + BH - 1) / BH, n / MIN_ROWS_PER_PART));
  const int per = std::max(BLOCK, ((n + parts - 1) / parts + BLOCK - 1) / BLOCK * BLOCK);
  parts = std::max(1, (n + per - 1) / per);
  const int items = BH * parts;
  std::vector<float> pm(size_t(items) * R), pl(size_t(items) * R), pa(size_t(items) * R * dv);
  auto work = [&](int tid) {
    for (int it = tid; it < items; it += threads) {
      const int t0 = (it % parts) * per, t1 = std::min(n, t0 + per);
      rows(it / parts, t0, t1, &pm[size_t(it) * R], &pl[size_t(it) * R], &pa[size_t(it) * R * dv]);
    }
  };
  pool().run(std::min(items, threads), work);
  for (int bh = 0; bh < BH; ++bh) {
    for (int r = 0; r < R; ++r) {
      float mm = -INFINITY;
      for (int p = 0; p < parts; ++p) mm = std::max(mm, pm[size_t(bh * parts + p) * R + r]);
      float ll = 0.f;
      float* a = acc + (size_t(bh) * R + r) * dv;
      std::fill(a, a + dv, 0.f);
      for (int p = 0; p < parts; ++p) {
        const size_t it = size_t(bh * parts + p);
        const float wgt = mm == -INFINITY ? 0.f : exp_neg(pm[it * R + r] - mm);  // (no rows: l = acc = 0)
        ll += wgt * pl[it * R + r];
        const float* src = &pa[(it * R + r) * dv];
        for (int c = 0; c < dv; ++c) a[c] += wgt * src[slot(c)];
      }
      m[size_t(bh) * R + r] = mm;
      l[size_t(bh) * R + r] = ll;
    }
  }
}

// The stream's CPU encoder with the outputs allocated and the arrays registered (both primitives' first steps).
mx::cpu::CommandEncoder& encoder(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  return enc;
}

class WaterfillDecode : public mx::Primitive {
 public:
  WaterfillDecode(mx::Stream s, Dims d) : mx::Primitive(s), d_(d) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    Inputs in{inputs[0].data<float>(),   inputs[1].data<uint32_t>(), inputs[2].data<int32_t>(),
              inputs[3].data<float>(),   inputs[4].data<float>(),   inputs[5].data<float>(),
              inputs[6].data<int32_t>(), inputs[7].data<float>(),   inputs[8].data<uint8_t>(),
              inputs[9].data<mx::float16_t>(), inputs[10].data<float>()};
    enc.dispatch([d = d_, in, m = outputs[0].data<float>(), l = outputs[1].data<float>(),
                  acc = outputs[2].data<float>()]() { run(d, in, m, l, acc); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant waterfill_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantWaterfillDecode"; }

 private:
  static void run(const Dims& d, const Inputs& in, float* m, float* l, float* acc) {
    const TurnTable tt(in, d.D, d.rotate);
    const int BH = d.B * d.H;
    if (!tt.ok) {
      std::fill(m, m + size_t(BH) * d.R, NAN);
      std::fill(l, l + size_t(BH) * d.R, NAN);
      std::fill(acc, acc + size_t(BH) * d.R * d.DV, NAN);
      return;
    }
    split_and_join(BH, d.R, d.DV, d.n, [&](int bh, int t0, int t1, float* pm, float* pl, float* pa) {
      attend_rows(d, in, tt, bh, t0, t1, pm, pl, pa);
    }, [&](int c) { return value_slot(c, d.DV, d.vbits, d.wv); }, m, l, acc);
  }
  Dims d_;
};

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("veloxquant waterfill_decode: ") + what);
}

std::vector<mx::array> waterfill_decode(const mx::array& q, const mx::array& k_words, const mx::array& ktab,
                                        const mx::array& lo, const mx::array& step, const mx::array& w,
                                        const mx::array& partner, const mx::array& sign, const mx::array& v_words,
                                        const mx::array& v_scales, const mx::array& poly, int n, long pos0,
                                        int vbits, int dv, bool rotate) {
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
  check(k_words.shape(0) == d.B && k_words.shape(1) == d.H && v_words.shape(0) == d.B && v_words.shape(1) == d.H,
        "batch or heads differ");
  check(ktab.shape(0) == d.H && ktab.shape(1) == d.D && lo.size() == size_t(d.B * d.H * d.D) &&
            step.size() == lo.size() && w.size() == size_t(d.D) && partner.size() == w.size() &&
            sign.size() == w.size() && poly.size() == 3,
        "table shapes");
  auto s = mx::default_stream(mx::Device::cpu);
  auto c = [&](const mx::array& a, mx::Dtype t) { return mx::contiguous(mx::astype(a, t, s), false, s); };
  std::vector<mx::array> ins{c(q, mx::float32),       c(k_words, mx::uint32), c(ktab, mx::int32),
                             c(lo, mx::float32),      c(step, mx::float32),   c(w, mx::float32),
                             c(partner, mx::int32),   c(sign, mx::float32),   c(v_words, mx::uint32),
                             c(v_scales, mx::float16), c(poly, mx::float32)};
  mx::Shape ml{d.B, d.H, d.R};
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, d.DV}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<WaterfillDecode>(s, d), ins);
}

// ---------------------------------------------------------------------------------------------- KIVI
// KIVI's layout (cache/grouped.py): keys per channel in groups of G tokens ([B, H, D, words] codes, each channel's
// tokens one bit stream; [B, H, D, groups] float16 scales and biases), values per token in groups of gv channels
// ([B, H, rows, words], [B, H, rows, dv / gv]); value = code * scale + bias.
struct KiviDims {
  int B, H, R, D, DV, kw, kg, vcap, vw, vg;  // kw / kg: words and groups a channel's buffer holds
  int n, bits, G, gv;
};

struct KiviInputs {
  const float* q;
  const uint32_t* kc;
  const mx::float16_t *ks, *kb;
  const uint32_t* vc;
  const mx::float16_t *vs, *vb;
};

// A block's keys of one channel in slot order (slot k * WB + w: token w * (32 / BITS) + k, word w's k-th code),
// scale and bias per lane (the block's two halves may lie in two groups).
template <int BITS>
inline void kivi_key_channel(const uint32_t* words, int nwords, const float* sc, const float* bi,
                             float* __restrict out) {
  constexpr int WB = 2 * BITS, CPW = 32 / BITS;  // words a block of 64 tokens takes, codes a word
  uint32_t w[WB] = {};
  for (int i = 0; i < nwords; ++i) w[i] = words[i];
  for (int k = 0; k < CPW; ++k)
    for (int i = 0; i < WB; ++i)
      out[k * WB + i] = float(int32_t((w[i] >> (k * BITS)) & ((1u << BITS) - 1))) * sc[i] + bi[i];
}

template <int BITS>
void kivi_rows(const KiviDims& d, const KiviInputs& in, int bh, int t0, int t1, float* m, float* l, float* acc) {
  constexpr int WB = 2 * BITS, CPW = 32 / BITS;
  const int D = d.D, DV = d.DV, R = d.R;
  const float* q = in.q + size_t(bh) * R * D;
  std::vector<float> buf(size_t(D) * BLOCK + 2 * size_t(R) * BLOCK + size_t(BLOCK) * DV, 0.f);
  float* keys = buf.data();
  float* sc = keys + size_t(D) * BLOCK;
  float* wt = sc + size_t(R) * BLOCK;  // [R, BLOCK]: the weights in token order
  float* vals = wt + size_t(R) * BLOCK;
  const bool nibbles = BITS == 4 && DV == 8 * d.vw && d.vw % 8 == 0 && d.gv % 8 == 0;
  const uint32_t vmask = (1u << BITS) - 1;
  empty_partials(R, DV, m, l, acc);
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    const int g0 = b0 / d.G, g1 = (b0 + BLOCK / 2) / d.G;  // the groups of the block's two halves
    const int nwords = (rows * BITS + 31) / 32;
    for (int c = 0; c < D; ++c) {
      const size_t ch = size_t(bh) * D + c;
      const float s0 = float(in.ks[ch * d.kg + g0]), z0 = float(in.kb[ch * d.kg + g0]);
      const bool second = rows > BLOCK / 2 && g1 != g0;
      const float s1 = second ? float(in.ks[ch * d.kg + g1]) : s0, z1 = second ? float(in.kb[ch * d.kg + g1]) : z0;
      float scl[WB], bia[WB];
      for (int i = 0; i < WB; ++i) {
        scl[i] = i < WB / 2 ? s0 : s1;
        bia[i] = i < WB / 2 ? z0 : z1;
      }
      kivi_key_channel<BITS>(in.kc + ch * d.kw + size_t(b0) * BITS / 32, nwords, scl, bia, keys + size_t(c) * BLOCK);
    }
    block_scores(q, keys, R, D, sc);
    softmax_update(sc, R, DV, [rows](int slot) { return (slot % WB) * CPW + slot / WB < rows; }, m, l, acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < rows; ++j) wt[size_t(r) * BLOCK + j] = sc[size_t(r) * BLOCK + (j % CPW) * WB + j / CPW];
    for (int j = 0; j < rows; ++j) {  // each row's values: code * scale + bias of its channel's group
      const size_t row = size_t(bh) * d.vcap + b0 + j;
      const uint32_t* v = in.vc + row * d.vw;
      const mx::float16_t* vsr = in.vs + row * d.vg;
      const mx::float16_t* vbr = in.vb + row * d.vg;
      float* u = vals + size_t(j) * DV;
      if (nibbles) {  // channel 8w + k at slot k * words + w (value_slot), as waterfill's
        for (int w0 = 0; w0 < d.vw; w0 += 8) {
          vu8 x;
          std::memcpy(&x, v + w0, sizeof(x));
          vf8 gs, gb;
          for (int i = 0; i < 8; ++i) {
            gs[i] = float(vsr[8 * (w0 + i) / d.gv]);
            gb[i] = float(vbr[8 * (w0 + i) / d.gv]);
          }
          for (int k = 0; k < 8; ++k) {
            const vf8 y = __builtin_convertvector(reinterpret_cast<vi8>((x >> (4 * k)) & 15u), vf8) * gs + gb;
            std::memcpy(u + k * d.vw + w0, &y, sizeof(y));
          }
        }
      } else {  // codes of BITS in {2, 4, 8} never straddle a word
        for (int c = 0; c < DV; ++c) {
          const int bit = c * BITS;
          const float code = float(int32_t((v[bit >> 5] >> (bit & 31)) & vmask));
          u[c] = code * float(vsr[c / d.gv]) + float(vbr[c / d.gv]);
        }
      }
    }
    weighted_sum(wt, vals, R, rows, DV, acc);
  }
}

class KiviDecode : public mx::Primitive {
 public:
  KiviDecode(mx::Stream s, KiviDims d) : mx::Primitive(s), d_(d) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    KiviInputs in{inputs[0].data<float>(),         inputs[1].data<uint32_t>(),      inputs[2].data<mx::float16_t>(),
                  inputs[3].data<mx::float16_t>(), inputs[4].data<uint32_t>(),      inputs[5].data<mx::float16_t>(),
                  inputs[6].data<mx::float16_t>()};
    enc.dispatch([d = d_, in, m = outputs[0].data<float>(), l = outputs[1].data<float>(),
                  acc = outputs[2].data<float>()]() {
      auto slot = [&](int c) { return value_slot(c, d.DV, d.gv % 8 == 0 ? d.bits : 0, d.vw); };
      auto go = [&](auto rows) { split_and_join(d.B * d.H, d.R, d.DV, d.n, rows, slot, m, l, acc); };
      if (d.bits == 2) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        kivi_rows<2>(d, in, bh, a, b, pm, pl, pa); });
      else if (d.bits == 4) go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        kivi_rows<4>(d, in, bh, a, b, pm, pl, pa); });
      else go([&](int bh, int a, int b, float* pm, float* pl, float* pa) {
        kivi_rows<8>(d, in, bh, a, b, pm, pl, pa); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant kivi_decode: CPU only");
  }
  const char* name() const override { return "VeloxquantKiviDecode"; }

 private:
  KiviDims d_;
};

std::vector<mx::array> kivi_decode(const mx::array& q, const mx::array& k_codes, const mx::array& k_scales,
                                   const mx::array& k_biases, const mx::array& v_codes, const mx::array& v_scales,
                                   const mx::array& v_biases, int n, int bits, int group, int value_group, int dv) {
  auto check = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("veloxquant kivi_decode: ") + what);
  };
  check(q.ndim() == 4 && k_codes.ndim() == 4 && k_scales.ndim() == 4 && v_codes.ndim() == 4 && v_scales.ndim() == 4,
        "ranks");
  KiviDims d{};
  d.B = q.shape(0), d.H = q.shape(1), d.R = q.shape(2), d.D = q.shape(3), d.DV = dv;
  d.kw = k_codes.shape(3), d.kg = k_scales.shape(3), d.vcap = v_codes.shape(2), d.vw = v_codes.shape(3);
  d.vg = v_scales.shape(3), d.n = n, d.bits = bits, d.G = group, d.gv = value_group;
  check(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  check(group > 0 && group % 32 == 0 && value_group > 0 && dv % value_group == 0 && (value_group * bits) % 32 == 0,
        "groups");
  check(d.D <= MAX_D && dv <= MAX_D && d.R <= MAX_R && d.vw * 32 == dv * bits && d.vg == dv / value_group,
        "head dims, query heads or value words");
  check(n >= 0 && n % group == 0 && size_t(n) * bits <= size_t(d.kw) * 32 && n / group <= d.kg && n <= d.vcap,
        "rows beyond the buffers");
  check(k_codes.shape(0) == d.B && k_codes.shape(1) == d.H && k_codes.shape(2) == d.D && v_codes.shape(0) == d.B &&
            v_codes.shape(1) == d.H && k_scales.shape(2) == d.D && k_biases.shape() == k_scales.shape() &&
            v_biases.shape() == v_scales.shape() && v_scales.shape(2) == d.vcap,
        "batch, heads or tables differ");
  auto s = mx::default_stream(mx::Device::cpu);
  auto c = [&](const mx::array& a, mx::Dtype t) { return mx::contiguous(mx::astype(a, t, s), false, s); };
  std::vector<mx::array> ins{c(q, mx::float32),       c(k_codes, mx::uint32),  c(k_scales, mx::float16),
                             c(k_biases, mx::float16), c(v_codes, mx::uint32), c(v_scales, mx::float16),
                             c(v_biases, mx::float16)};
  mx::Shape ml{d.B, d.H, d.R};
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, dv}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<KiviDecode>(s, d), ins);
}

}  // namespace

NB_MODULE(_veloxquant_cpu, m) {
  m.doc() = "VeloxQuant-MLX CPU kernels (MLX primitives)";
  m.def("waterfill_decode", &waterfill_decode, nb::arg("q"), nb::arg("k_words"), nb::arg("ktab"), nb::arg("lo"),
        nb::arg("step"), nb::arg("w"), nb::arg("partner"), nb::arg("sign"), nb::arg("v_words"), nb::arg("v_scales"),
        nb::arg("poly"), nb::arg("n"), nb::arg("pos0"), nb::arg("vbits"), nb::arg("dv"), nb::arg("rotate"),
        "Partials (m, l, acc) of waterfill's decode attention over its first n quantized rows.");
  m.def("kivi_decode", &kivi_decode, nb::arg("q"), nb::arg("k_codes"), nb::arg("k_scales"), nb::arg("k_biases"),
        nb::arg("v_codes"), nb::arg("v_scales"), nb::arg("v_biases"), nb::arg("n"), nb::arg("bits"), nb::arg("group"),
        nb::arg("value_group"), nb::arg("dv"),
        "Partials (m, l, acc) of KIVI's decode attention over its first n rows.");
  m.def("threads", [] { return pool().size(); }, "Threads a call uses.");
}
