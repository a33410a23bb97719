// What the CPU kernels share: the thread pool, 16-lane vectors, exp, the block scores / online-softmax update /
// weighted value sums of a block of 64 rows, and the split of a step's rows over the threads with the join of their
// partials (m, l, acc). Functions are inline in namespace veloxquant (one pool per process across the sources).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace veloxquant {

namespace nb = nanobind;
namespace mx = mlx::core;


constexpr int BLOCK = 64;    // rows per softmax update (and the turn table's rows)
constexpr int MAX_D = 256;   // key and value head dims
constexpr int MAX_R = 32;    // query heads per KV head
constexpr int MIN_ROWS_PER_PART = 512;  // a thread's share of a step is at least this many rows

// A float16 as a float: one instruction where the CPU converts (x86's F16C; on arm64 MLX's float16_t is the native
// __fp16 already), where MLX's x86 float16_t converts in ~15 integer instructions (AMD EPYC, session 47: KIVI's
// kernel spent most of its value rows there).
inline float f16(mx::float16_t x) {
#if defined(__F16C__)
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return _cvtsh_ss(bits);
#else
  return float(x);
#endif
}

// The `bits`-bit code at bit `bit` of a little-endian stream of words (it may straddle two words; the second is read
// only then).
inline uint32_t code_at(const uint32_t* w, int bit, int bits) {
  const int sh = bit & 31;
  uint64_t x = w[bit >> 5];
  if (sh + bits > 32) x |= uint64_t(w[(bit >> 5) + 1]) << 32;
  return uint32_t(x >> sh) & ((1u << bits) - 1);
}

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

// The process's pool, made at first use (as MLX's own CPU streams, it does not survive a fork; one across sources).
inline Pool& pool() {
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

typedef uint32_t vu4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t vi4 __attribute__((vector_size(16), aligned(4)));
typedef float vf4u __attribute__((vector_size(16), aligned(4)));

// The words a value row of vbits-bit codes is decoded by at once: 8 for 4-bit codes, 4 for 2- and 8-bit ones, when
// the codes fill the row's words and the words make whole vectors; else 0 (a code at a time).
inline int value_lanes(int dv, int vbits, int words) {
  if (vbits != 2 && vbits != 4 && vbits != 8) return 0;
  const int lanes = vbits == 4 ? 8 : 4;
  return dv == 32 / vbits * words && words % lanes == 0 ? lanes : 0;
}

// Where a value row decoded by vectors of words puts channel c: channel-major (word w's k-th code, channel
// CPW * w + k, at k * words + w: one shift and mask per code position for a vector of words); other rows in order.
inline int value_slot(int c, int dv, int vbits, int words) {
  if (!value_lanes(dv, vbits, words)) return c;
  const int cpw = 32 / vbits;
  return (c % cpw) * words + c / cpw;
}

// A row of `width` BITS-bit codes (`words` words, one float16 scale and bias per `group` channels; a scale divided by
// `div`) decoded into u: `lanes` words at a time in value_slot's order (value_lanes), else a code at a time in order.
template <int BITS>
inline void decode_row(const uint32_t* v, const mx::float16_t* sc, const mx::float16_t* bi, int width, int words,
                       int group, int lanes, float* __restrict u, float div = 1.f) {
  constexpr int CPW = 32 / BITS;
  constexpr uint32_t vmask = (1u << BITS) - 1;
  float rs[MAX_D], rb[MAX_D];  // the row's scales and biases, one per group
  for (int g = 0; g < width / group; ++g) {
    rs[g] = f16(sc[g]) / div;
    rb[g] = f16(bi[g]);
  }
  if (lanes == 8) {  // 4-bit codes: channel 8w + k at slot k * words + w (value_slot), as waterfill's
    for (int w0 = 0; w0 < words; w0 += 8) {
      vu8 x;
      std::memcpy(&x, v + w0, sizeof(x));
      vf8 gs, gb;
      for (int i = 0; i < 8; ++i) {
        gs[i] = rs[8 * (w0 + i) / group];
        gb[i] = rb[8 * (w0 + i) / group];
      }
      for (int k = 0; k < 8; ++k) {
        const vf8 y = __builtin_convertvector(reinterpret_cast<vi8>((x >> (4 * k)) & 15u), vf8) * gs + gb;
        std::memcpy(u + k * words + w0, &y, sizeof(y));
      }
    }
  } else if (lanes == 4) {  // likewise 4 words at a time: channel CPW * w + k at slot k * words + w
    for (int w0 = 0; w0 < words; w0 += 4) {
      vu4 x;
      std::memcpy(&x, v + w0, sizeof(x));
      vf4u gs, gb;
      for (int i = 0; i < 4; ++i) {
        gs[i] = rs[CPW * (w0 + i) / group];
        gb[i] = rb[CPW * (w0 + i) / group];
      }
      for (int k = 0; k < CPW; ++k) {
        const vf4u y = __builtin_convertvector(reinterpret_cast<vi4>((x >> (BITS * k)) & vmask), vf4u) * gs + gb;
        std::memcpy(u + k * words + w0, &y, sizeof(y));
      }
    }
  } else {  // codes of BITS in {2, 4, 8} never straddle a word
    for (int c = 0; c < width; ++c) {
      const int bit = c * BITS;
      u[c] = float(int32_t((v[bit >> 5] >> (bit & 31)) & vmask)) * rs[c / group] + rb[c / group];
    }
  }
}

// The hardware's own vector (NL lanes: 16 with AVX-512, 8 with AVX2, 4 on SSE-only x86 or NEON) for the two
// register-blocked products below: each pass holds 2 query heads x 4 vectors of sums and 4 vectors of inputs, which
// fit the registers of every ISA. (With the 16-lane vf an AVX2 machine split each sum in two and spilled them to the
// stack: session 47, an AMD EPYC, where KIVI's kernel ran slower than its op path.)
#if defined(__AVX512F__)
constexpr int NL = 16;
#elif defined(__AVX__)
constexpr int NL = 8;
#else
constexpr int NL = 4;
#endif
typedef float vn __attribute__((vector_size(4 * NL), aligned(4)));
typedef int32_t vin __attribute__((vector_size(4 * NL), aligned(4)));
typedef uint32_t vun __attribute__((vector_size(4 * NL), aligned(4)));
constexpr int PASS = 4 * NL;  // rows (block_scores) or channels (weighted_sum) a pass takes
inline vn loadn(const float* p) { return *reinterpret_cast<const vn*>(p); }
inline void storen(float* p, vn x) { *reinterpret_cast<vn*>(p) = x; }
inline vun loadun(const uint32_t* p) { return *reinterpret_cast<const vun*>(p); }

// acc[R, dv] += w[R, BLOCK] @ u[rows, dv]: two query heads and PASS channels at a time held in registers over the
// rows (eight independent sums: the adds' latency hidden).
inline void weighted_sum(const float* __restrict w, const float* __restrict u, int R, int rows, int dv,
                         float* __restrict acc) {
  int c0 = 0;
  for (; c0 + PASS <= dv; c0 += PASS)
    for (int r = 0; r < R; r += 2) {
      const bool two = r + 1 < R;
      const float *w0 = w + size_t(r) * BLOCK, *w1 = two ? w0 + BLOCK : w0;
      float* a0p = acc + size_t(r) * dv + c0;
      float* a1p = two ? a0p + dv : a0p;
      vn a0 = loadn(a0p), a1 = loadn(a0p + NL), a2 = loadn(a0p + 2 * NL), a3 = loadn(a0p + 3 * NL);
      vn b0 = loadn(a1p), b1 = loadn(a1p + NL), b2 = loadn(a1p + 2 * NL), b3 = loadn(a1p + 3 * NL);
      for (int j = 0; j < rows; ++j) {
        const float* uj = u + size_t(j) * dv + c0;
        const vn u0 = loadn(uj), u1 = loadn(uj + NL), u2 = loadn(uj + 2 * NL), u3 = loadn(uj + 3 * NL);
        const float x = w0[j], y = w1[j];
        a0 += x * u0, a1 += x * u1, a2 += x * u2, a3 += x * u3;
        b0 += y * u0, b1 += y * u1, b2 += y * u2, b3 += y * u3;
      }
      if (two) storen(a1p, b0), storen(a1p + NL, b1), storen(a1p + 2 * NL, b2), storen(a1p + 3 * NL, b3);
      storen(a0p, a0), storen(a0p + NL, a1), storen(a0p + 2 * NL, a2), storen(a0p + 3 * NL, a3);
    }
  for (int r = 0; r < R; ++r) {  // the channels past the last pass
    const float* wr = w + size_t(r) * BLOCK;
    float* ar = acc + size_t(r) * dv;
    for (int c = c0; c < dv; ++c) {
      float a = ar[c];
      for (int j = 0; j < rows; ++j) a += wr[j] * u[size_t(j) * dv + c];
      ar[c] = a;
    }
  }
}

// sc[R, BLOCK] = q[R, D] @ keys[D, BLOCK] (keys channel-major), two query heads and PASS rows a pass (eight
// independent sums).
inline void block_scores(const float* qt, const float* keys, int R, int D, float* sc) {
  static_assert(BLOCK % PASS == 0, "a block's scores are whole passes");
  for (int j0 = 0; j0 < BLOCK; j0 += PASS)
    for (int r = 0; r < R; r += 2) {
      const bool two = r + 1 < R;
      const float* q0 = qt + size_t(r) * D;
      const float* q1 = two ? q0 + D : q0;
      vn s0{}, s1{}, s2{}, s3{}, t0{}, t1{}, t2{}, t3{};
      for (int c = 0; c < D; ++c) {
        const float* kc = keys + size_t(c) * BLOCK + j0;
        const vn k0 = loadn(kc), k1 = loadn(kc + NL), k2 = loadn(kc + 2 * NL), k3 = loadn(kc + 3 * NL);
        const float x = q0[c], y = q1[c];
        s0 += x * k0, s1 += x * k1, s2 += x * k2, s3 += x * k3;
        t0 += y * k0, t1 += y * k1, t2 += y * k2, t3 += y * k3;
      }
      float* s_0 = sc + size_t(r) * BLOCK + j0;
      storen(s_0, s0), storen(s_0 + NL, s1), storen(s_0 + 2 * NL, s2), storen(s_0 + 3 * NL, s3);
      if (two) storen(s_0 + BLOCK, t0), storen(s_0 + BLOCK + NL, t1), storen(s_0 + BLOCK + 2 * NL, t2),
          storen(s_0 + BLOCK + 3 * NL, t3);
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

// NaN partials for `rows` query rows: a call whose tables are not what the kernel reads (e.g. RoPE tables that are
// not rotary pairs), so that its first-use check turns the kernel off and the op path runs.
inline void nan_partials(size_t rows, int dv, float* m, float* l, float* acc) {
  std::fill(m, m + rows, NAN);
  std::fill(l, l + rows, NAN);
  std::fill(acc, acc + rows * dv, NAN);
}

// Each (batch row, KV head)'s rows [0, n) in at most as many ranges as threads (each >= MIN_ROWS_PER_PART rows),
// rows(bh, t0, t1, m, l, acc) run over the pool, the ranges' partials joined into m, l [BH, R] and acc [BH, R, dv]
// (acc's channel c read from slot(c) of the ranges' sums). With `counts` (a batch form's, one per batch row: bh / H)
// batch row b's rows are [0, counts[b]) instead, counts[b] <= n; a range past them holds no rows.
template <class Rows, class Slot>
void split_and_join(int BH, int R, int dv, int n, Rows rows, Slot slot, float* m, float* l, float* acc,
                    const std::vector<int>& counts = {}, int H = 1) {
  const int threads = pool().size();
  // parts making BH * parts a multiple of the threads (3 heads on 2 threads: 6 ranges, not 3), each >= 512 rows
  int parts = std::max(1, std::min(threads / std::gcd(BH, threads), n / MIN_ROWS_PER_PART));
  const int per = std::max(BLOCK, ((n + parts - 1) / parts + BLOCK - 1) / BLOCK * BLOCK);
  parts = std::max(1, (n + per - 1) / per);
  const int items = BH * parts;
  std::vector<float> pm(size_t(items) * R), pl(size_t(items) * R), pa(size_t(items) * R * dv);
  auto work = [&](int tid) {
    for (int it = tid; it < items; it += threads) {
      const int bh = it / parts, t0 = (it % parts) * per;
      const int t1 = std::min(counts.empty() ? n : counts[bh / H], t0 + per);
      if (t0 < t1)
        rows(bh, t0, t1, &pm[size_t(it) * R], &pl[size_t(it) * R], &pa[size_t(it) * R * dv]);
      else
        empty_partials(R, dv, &pm[size_t(it) * R], &pl[size_t(it) * R], &pa[size_t(it) * R * dv]);
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
inline mx::cpu::CommandEncoder& encoder(mx::Stream s, const std::vector<mx::array>& inputs,
                                         std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  return enc;
}

inline void check(bool ok, const char* kernel, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("veloxquant ") + kernel + ": " + what);
}

// A group of 32 codes (the families' default group: BITS words, codes may straddle two) as integers, unrolled so
// that every code's word and shift are constants.
template <int BITS>
inline void codes_group32(const uint32_t* __restrict w, uint32_t* __restrict out) {
  uint32_t x[BITS + 1];
  std::memcpy(x, w, sizeof(uint32_t) * BITS);
  x[BITS] = 0;
#pragma GCC unroll 32
  for (int i = 0; i < 32; ++i) {
    const int p = i * BITS, k = p >> 5, sh = p & 31;
    uint32_t v = x[k] >> sh;
    if (sh + BITS > 32) v |= x[k + 1] << (32 - sh);
    out[i] = v & ((1u << BITS) - 1);
  }
}

// A group of 32 codes as code * s + z into out[i * step] (codes_group32).
template <int BITS>
inline void decode_group32(const uint32_t* __restrict w, float s, float z, float* __restrict out, size_t step) {
  uint32_t v[32];
  codes_group32<BITS>(w, v);
  float f[32];
  for (int i = 0; i < 32; ++i) f[i] = float(v[i]);
  for (int i = 0; i < 32; ++i) out[i * step] = f[i] * s + z;
}

// The G codes of one channel's group (a little-endian bit stream from w) as code * s + z into out[i * step]: 32 at a
// time (BITS words each, decode_group32) where G is a multiple of 32, else a code at a time.
template <int BITS>
inline void decode_codes(const uint32_t* w, int G, float s, float z, float* out, size_t step) {
  if (G % 32 == 0) {
    for (int i = 0; i < G; i += 32) decode_group32<BITS>(w + i / 32 * BITS, s, z, out + i * step, step);
    return;
  }
  for (int i = 0; i < G; ++i) out[i * step] = float(code_at(w, i * BITS, BITS)) * s + z;
}

// A value row of 1-8-bit codes (they may straddle words; each group starts a word) in channel order: code * scale /
// div + bias, a group at a time by decode_codes (BITS 0: the width read at run time, a code at a time).
template <int BITS>
inline void decode_row_any(const uint32_t* v, const mx::float16_t* sc, const mx::float16_t* bi, int width, int vbits,
                           int group, float div, float* __restrict u) {
  for (int g = 0; g < width / group; ++g) {
    const float s = f16(sc[g]) / div, z = f16(bi[g]);
    if constexpr (BITS > 0)
      decode_codes<BITS>(v + size_t(g) * group * BITS / 32, group, s, z, u + g * group, 1);
    else
      for (int c = g * group; c < (g + 1) * group; ++c) u[c] = float(code_at(v, c * vbits, vbits)) * s + z;
  }
}

// RoPE per call (waterfill's and KVQuant's pre-RoPE keys): its pairs (first channel a, second b = partner(a), angle
// w_a per position), the channels it leaves alone, and (cos, sin)(j w) of every pair for the rows j < BLOCK of a
// block, plus (cos, sin)(BLOCK w) to advance a block. A block at position t is scored as q' . R(j) k with q' =
// R(t)^T q (turn_queries), so no angle is computed per row. `ok` false: the tables are not rotary pairs.
struct TurnTable {
  std::vector<int> first, second, alone;
  std::vector<float> c, s;  // [pairs, BLOCK]
  std::vector<double> bc, bs, w;
  bool ok = true;
  TurnTable(const int32_t* partner, const float* sign, const float* angle, int D, bool rotate) {
    for (int ch = 0; ch < D; ++ch) {
      const int p = partner[ch];
      if (!rotate || sign[ch] == 0.f) {
        alone.push_back(ch);
      } else if (sign[ch] > 0.f) {
        if (p < 0 || p >= D || partner[p] != ch || !(sign[p] < 0.f) || angle[p] != angle[ch]) {
          ok = false;
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
      w[i] = angle[first[i]];
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
  // (cos, sin)(pos w) of every pair into cb, sb (double: a position's angle reduced before its cosine).
  void start(long pos, double* cb, double* sb) const {
    for (size_t i = 0; i < first.size(); ++i) {
      const double a = std::fmod(double(pos) * w[i], 2 * M_PI);
      cb[i] = std::cos(a);
      sb[i] = std::sin(a);
    }
  }
  // cb, sb advanced by BLOCK positions.
  void advance(double* cb, double* sb) const {
    for (size_t i = 0; i < first.size(); ++i) {
      const double x = cb[i] * bc[i] - sb[i] * bs[i];
      sb[i] = sb[i] * bc[i] + cb[i] * bs[i];
      cb[i] = x;
    }
  }
  // qt[R, D] = R(t)^T q for the queries q[R, D], (cb, sb) the turn of position t.
  void turn_queries(const float* q, int R, int D, const double* cb, const double* sb, float* qt) const {
    for (int r = 0; r < R; ++r) {
      const float* qr = q + size_t(r) * D;
      float* o = qt + size_t(r) * D;
      for (int c : alone) o[c] = qr[c];
      for (size_t i = 0; i < first.size(); ++i) {
        const int a = first[i], b = second[i];
        o[a] = float(qr[a] * cb[i] + qr[b] * sb[i]);
        o[b] = float(qr[b] * cb[i] - qr[a] * sb[i]);
      }
    }
  }
  // Pair i's channels x, y of a block's BLOCK rows turned by each row's offset in the block, into oa, ob.
  void turn_pair(int i, const float* x, const float* y, float* __restrict oa, float* __restrict ob) const {
    const float* __restrict cj = c.data() + size_t(i) * BLOCK;
    const float* __restrict sj = s.data() + size_t(i) * BLOCK;
    for (int j = 0; j < BLOCK; j += NL) {
      const vn a = loadn(x + j), b = loadn(y + j), cs = loadn(cj + j), sn = loadn(sj + j);
      storen(oa + j, a * cs - b * sn);
      storen(ob + j, b * cs + a * sn);
    }
  }
};

// The CPU stream's contiguous copy of a in dtype t (each primitive's inputs).
inline mx::array contiguous_as(const mx::array& a, mx::Dtype t) {
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::contiguous(mx::astype(a, t, s), false, s);
}

// The kernels' entry points (each in its own source; bound in module.cpp).
std::vector<mx::array> waterfill_decode(const mx::array& q, const mx::array& k_words, const mx::array& ktab,
                                        const mx::array& lo, const mx::array& step, const mx::array& w,
                                        const mx::array& partner, const mx::array& sign, const mx::array& v_words,
                                        const mx::array& v_scales, const mx::array& poly, int n, long pos0,
                                        int vbits, int dv, bool rotate, const std::vector<int>& counts);
std::vector<mx::array> drop_row(const mx::array& keys, const mx::array& values, const mx::array& positions,
                                const mx::array& scores, int rows, int spare, int n_sink, int recent_start);
std::vector<mx::array> kivi_decode(const mx::array& q, const mx::array& k_codes, const mx::array& k_scales,
                                   const mx::array& k_biases, const mx::array& v_codes, const mx::array& v_scales,
                                   const mx::array& v_biases, int n, int bits, int group, int value_group, int dv,
                                   const std::vector<int>& counts, const std::vector<mx::array>& hi, int hi_bits,
                                   bool key_rows, const std::vector<std::optional<mx::array>>& fixes,
                                   const std::vector<int>& fix_sizes, int fix_group,
                                   const std::vector<mx::array>& fix_refs, int fix_ref_bits);
using opt_array = std::optional<mx::array>;
std::vector<mx::array> turboquant_rvq_decode(const mx::array& q, const mx::array& k1, const opt_array& k2,
                                             const mx::array& k_norms, const mx::array& k_cb1, const mx::array& k_sigma,
                                             const opt_array& k_cb2, const mx::array& v1, const opt_array& v2,
                                             const mx::array& v_norms, const mx::array& v_cb1, const mx::array& v_sigma,
                                             const opt_array& v_cb2, int n, int dv, const std::vector<int>& counts,
                                             const opt_array& k_bias, int k_word2, int v_word2, bool k_joint,
                                             bool v_joint);
std::vector<mx::array> latent_decode(const mx::array& q, const opt_array& bias, int n, int group,
                                     const opt_array& k_codes, const opt_array& k_scales, const opt_array& k_biases,
                                     const opt_array& k_raw, const std::vector<int>& k_bits, const opt_array& v_codes,
                                     const opt_array& v_scales, const opt_array& v_biases, const opt_array& v_raw,
                                     const std::vector<int>& v_bits, int v_row_bits, int v_row_group, int dv,
                                     bool channel_major, int k_rows_per_group, bool v_row_ranges,
                                     bool k_group_major, const std::vector<int>& v_scale_rows,
                                     const opt_array& k_rebuild, const opt_array& k_rebuild_mean,
                                     const std::vector<mx::array>& rope, bool rotate);
mx::array joint_finish(const mx::array& q, const mx::array& m, const mx::array& l, const mx::array& acc,
                       const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                       const std::vector<int>& rows, const opt_array& sinks, const mx::array& like,
                       const std::vector<int>& spans);
std::vector<mx::array> turboquant_rvq_encode(const mx::array& z, const mx::array& c1, const mx::array& sigma,
                                             const opt_array& c2, int beam);
mx::array softmax_rows(const mx::array& scores, int offset, const opt_array& sinks, int heads);
mx::array vq_vote(const mx::array& lut, const mx::array& codes, int n, int bits);
std::vector<mx::array> kvquant_decode(const mx::array& q, const std::vector<mx::array>& keys,
                                      const std::vector<mx::array>& values, const mx::array& sink_k,
                                      const mx::array& sink_v, const std::vector<mx::array>& rope, int n, int bits,
                                      int group, int value_group, int key_outliers, int value_outliers, bool rotate,
                                      const std::vector<mx::array>& anchors);

}  // namespace veloxquant
