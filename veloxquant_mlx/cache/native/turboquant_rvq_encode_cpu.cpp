// TurboQuant-RVQ's encoder on the CPU, as an MLX primitive (the op path, cache/primitives/rvq.py's
// RVQCodebook.encode with methods/quantization/turboquant_rvq.py's norms and bit packing, is the reference it is
// checked against at first use).
//
// Rotated rows z = Pi x [m, dim]: each row's norm |z| (= |x|) in float16, its unit vector cut into pieces of sd
// coordinates, each piece's stage-1 code the nearest of K1 centroids or, with a second stage, the best of the BEAM
// nearest completed by the nearest cell-scaled stage-2 centroid (distance (|r|^2 + |c2|^2 - 2 r.c2) sigma^2 with
// r = (y - c1) / sigma, the op path's formula); codes packed into each row's little-endian bit stream. Distances to
// a codebook run 16 centroids a vector over the codebook transposed; rows are split over the pool.
#include <memory>

#include "common.h"

namespace veloxquant {
namespace {

// A codebook [K, sd] transposed to [sd][Kp] (K rounded up to whole vectors) with |c|^2 (padding: +inf, never nearest).
struct Transposed {
  int K, Kp, sd;
  std::vector<float> t, sq;
  Transposed(const float* c, int K, int sd) : K(K), Kp((K + VL - 1) / VL * VL), sd(sd) {
    t.assign(size_t(sd) * Kp, 0.f);
    sq.assign(size_t(Kp), INFINITY);
    for (int k = 0; k < K; ++k) {
      float s = 0.f;
      for (int e = 0; e < sd; ++e) {
        t[size_t(e) * Kp + k] = c[size_t(k) * sd + e];
        s += c[size_t(k) * sd + e] * c[size_t(k) * sd + e];
      }
      sq[k] = s;
    }
  }
  // d[k] = |c_k|^2 - 2 y . c_k for the Kp slots
  void distances(const float* y, float* d) const {
    for (int k0 = 0; k0 < Kp; k0 += VL) {
      vf a{};
      for (int e = 0; e < sd; ++e) a += y[e] * load(&t[size_t(e) * Kp + k0]);
      store(d + k0, load(&sq[k0]) - 2.f * a);
    }
  }
};

// The running argmin of values offered 16 lanes at a time (each lane keeps its first smallest; the lowest index of
// the equal smallest wins at the end, as MLX's argmin): no branch per entry.
struct ArgMin {
  vf best = splat(INFINITY);
  vi at{};
  void add(vf x, int base) {
    static_assert(VL == 16, "the lane numbers below");
    const vi lane = vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + base;
    const vi lt = x < best;
    best = lt ? x : best;
    at = lt ? lane : at;
  }
  int index() const {  // 0 when nothing was smaller than +inf
    float m = best[0];
    for (int l = 1; l < VL; ++l) m = std::min(m, best[l]);
    int first = INT32_MAX;
    for (int l = 0; l < VL; ++l) first = best[l] == m && m < INFINITY ? std::min(first, int(at[l])) : first;
    return first == INT32_MAX ? 0 : first;
  }
};

inline int argmin(const float* d, int n) {
  ArgMin a;
  for (int k0 = 0; k0 < n; k0 += VL) a.add(load(d + k0), k0);
  return a.index();
}

struct EncodeDims {
  int m, dim, sd, S, bits1, bits2, w1, w2, beam;
};

// Code s of `bits` bits into a row's bit stream (words zeroed beforehand).
inline void put_code(uint32_t* words, int s, int bits, uint32_t code) {
  const int bit = s * bits, sh = bit & 31;
  words[bit >> 5] |= code << sh;
  if (sh + bits > 32) words[(bit >> 5) + 1] |= code >> (32 - sh);
}

void encode_rows(const EncodeDims& d, const float* z, const Transposed& cb1, const float* c1, const float* sigma,
                 const Transposed* cb2, int r0, int r1, uint32_t* p1, uint32_t* p2, mx::float16_t* norms) {
  std::vector<float> y(d.dim), d1(cb1.Kp), d2(cb2 ? cb2->Kp : 0), r(d.sd);
  std::vector<int> cand(d.beam);
  for (int row = r0; row < r1; ++row) {
    const float* zr = z + size_t(row) * d.dim;
    double ss = 0.0;
    for (int e = 0; e < d.dim; ++e) ss += double(zr[e]) * zr[e];
    const float g = float(std::sqrt(ss)), inv = 1.f / std::max(g, 1e-30f);
    for (int e = 0; e < d.dim; ++e) y[e] = zr[e] * inv;
    norms[row] = mx::float16_t(std::min(g, 65504.f));
    uint32_t* w1 = p1 + size_t(row) * d.w1;
    uint32_t* w2 = cb2 ? p2 + size_t(row) * d.w2 : nullptr;
    std::fill(w1, w1 + d.w1, 0u);
    if (w2) std::fill(w2, w2 + d.w2, 0u);
    for (int s = 0; s < d.S; ++s) {
      const float* ys = y.data() + size_t(s) * d.sd;
      cb1.distances(ys, d1.data());
      if (!cb2) {
        put_code(w1, s, d.bits1, uint32_t(argmin(d1.data(), cb1.Kp)));
        continue;
      }
      for (int b = 0; b < d.beam; ++b) {  // the beam nearest stage-1 centroids, nearest first
        cand[b] = argmin(d1.data(), cb1.Kp);
        d1[cand[b]] = INFINITY;
      }
      ArgMin best;  // over (candidate, stage-2 centroid), flattened as b * Kp + j
      for (int b = 0; b < d.beam; ++b) {
        const int i = cand[b];
        const float sig = sigma[i];
        float rr = 0.f;
        for (int e = 0; e < d.sd; ++e) {
          r[e] = (ys[e] - c1[size_t(i) * d.sd + e]) / sig;
          rr += r[e] * r[e];
        }
        cb2->distances(r.data(), d2.data());
        for (int k0 = 0; k0 < cb2->Kp; k0 += VL) best.add((rr + load(&d2[k0])) * (sig * sig), b * cb2->Kp + k0);
      }
      const int flat = best.index(), bi = cand[flat / cb2->Kp], bj = flat % cb2->Kp;
      put_code(w1, s, d.bits1, uint32_t(bi));
      put_code(w2, s, d.bits2, uint32_t(bj));
    }
  }
}

class RvqEncode : public mx::Primitive {
 public:
  RvqEncode(mx::Stream s, EncodeDims d) : mx::Primitive(s), d_(d) {}

  // inputs: z [m, dim], c1 [K1, sd], sigma [K1], c2 [K2, sd] (c1 again with one stage)
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    const bool two = d_.bits2 > 0;
    enc.dispatch([d = d_, two, z = inputs[0].data<float>(), c1 = inputs[1].data<float>(),
                  sigma = inputs[2].data<float>(), c2 = inputs[3].data<float>(), p1 = outputs[0].data<uint32_t>(),
                  p2 = two ? outputs[1].data<uint32_t>() : nullptr,
                  norms = outputs[two ? 2 : 1].data<mx::float16_t>()]() {
      const Transposed cb1(c1, 1 << d.bits1, d.sd);
      std::unique_ptr<Transposed> cb2;
      if (two) cb2 = std::make_unique<Transposed>(c2, 1 << d.bits2, d.sd);
      const int threads = pool().size(), per = std::max(64, (d.m + threads - 1) / threads);
      pool().run((d.m + per - 1) / per, [&](int t) {
        encode_rows(d, z, cb1, c1, sigma, cb2.get(), t * per, std::min(d.m, (t + 1) * per), p1, p2, norms);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant turboquant_rvq_encode: CPU only");
  }
  const char* name() const override { return "VeloxquantTurboQuantRVQEncode"; }

 private:
  EncodeDims d_;
};

int log2_exact(int k) {
  int b = 0;
  while ((1 << b) < k) ++b;
  return (1 << b) == k ? b : -1;
}

}  // namespace

std::vector<mx::array> turboquant_rvq_encode(const mx::array& z, const mx::array& c1, const mx::array& sigma,
                                             const opt_array& c2, int beam) {
  auto need = [](bool ok, const char* what) { check(ok, "turboquant_rvq_encode", what); };
  need(z.ndim() >= 1 && c1.ndim() == 2 && sigma.ndim() == 1, "ranks");
  EncodeDims d{};
  d.dim = z.shape(-1), d.sd = c1.shape(1), d.m = d.dim ? int(z.size() / d.dim) : 0;
  need(d.sd > 0 && d.dim % d.sd == 0, "piece size must divide the row's dim");
  d.S = d.dim / d.sd, d.bits1 = log2_exact(c1.shape(0));
  need(d.bits1 >= 1 && d.bits1 <= 8 && sigma.shape(0) == c1.shape(0), "stage-1 codebook size");
  if (c2) {
    d.bits2 = log2_exact(c2->shape(0));
    need(c2->ndim() == 2 && c2->shape(1) == d.sd && d.bits2 >= 1 && d.bits2 <= 8, "stage-2 codebook");
  }
  d.beam = std::min(beam, c1.shape(0));
  need(beam >= 1, "beam must be >= 1");
  d.w1 = (d.S * d.bits1 + 31) / 32, d.w2 = (d.S * d.bits2 + 31) / 32;
  std::vector<mx::array> ins{contiguous_as(z, mx::float32), contiguous_as(c1, mx::float32),
                             contiguous_as(sigma, mx::float32), contiguous_as(c2.value_or(c1), mx::float32)};
  mx::Shape lead(z.shape().begin(), z.shape().end() - 1), s1 = lead, s2 = lead;
  s1.push_back(d.w1);
  s2.push_back(d.w2);
  std::vector<mx::Shape> shapes{s1};
  std::vector<mx::Dtype> types{mx::uint32};
  if (c2) shapes.push_back(s2), types.push_back(mx::uint32);
  shapes.push_back(lead), types.push_back(mx::float16);
  return mx::array::make_arrays(shapes, types, std::make_shared<RvqEncode>(mx::default_stream(mx::Device::cpu), d),
                                ins);
}

}  // namespace veloxquant
