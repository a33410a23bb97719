// The end of a CPU decode step, as one MLX primitive: a kernel's partials over the quantized rows (m, l, acc, acc
// already in the values' own domain) joined with the exact rows (the sink rows, the window before the call, the
// call's own row: float16 / bfloat16 / float32 rows read in place, strided views included) and the sinks' logits in
// one softmax, normalized: the attention output [B, H * R, 1, DV] in the queries' dtype. The op path
// (window.joint_attention) builds the same from ~25 small MLX ops a layer, whose dispatch cost a 4k-token step about
// as much as the kernel's own pass over the codes (docs/RESULTS.md). A batch form's rows differ per batch row
// (left-aligned sinks, a right-aligned window): `spans` gives each group's (start, count) per batch row.
#include "common.h"

namespace veloxquant {
namespace {

struct Rows {  // one group of exact rows: the first n of a [B, H, T, D] array (any strides)
  const void* ptr;
  mx::Dtype dtype;
  int64_t s0, s1, s2, s3;
  int n;
};

Rows rows_of(const mx::array& a, int n) {
  return Rows{a.data<void>(), a.dtype(), a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3], n};
}

// row t of (b, h) as floats
void read_row(const Rows& g, int b, int h, int t, int D, float* out) {
  const int64_t o = b * g.s0 + h * g.s1 + t * g.s2;
  if (g.dtype == mx::float32) {
    const float* p = static_cast<const float*>(g.ptr) + o;
    for (int c = 0; c < D; ++c) out[c] = p[c * g.s3];
  } else if (g.dtype == mx::float16) {
    const mx::float16_t* p = static_cast<const mx::float16_t*>(g.ptr) + o;
    int c = 0;
#if defined(__F16C__) && defined(__AVX__)
    if (g.s3 == 1) {  // a contiguous row (MiniCache's raw rows, A2ATS's and RocketKV's gathered ones): 8 at a time
      for (; c + 8 <= D; c += 8)
        _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c))));
    }
#endif
    for (; c < D; ++c) out[c] = f16(p[c * g.s3]);
  } else {
    const mx::bfloat16_t* p = static_cast<const mx::bfloat16_t*>(g.ptr) + o;
    for (int c = 0; c < D; ++c) out[c] = float(p[c * g.s3]);
  }
}

void write_out(void* out, mx::Dtype t, size_t i, int DV, const float* v) {
  if (t == mx::float32) {
    std::copy(v, v + DV, static_cast<float*>(out) + i);
  } else if (t == mx::float16) {
    for (int c = 0; c < DV; ++c) static_cast<mx::float16_t*>(out)[i + c] = mx::float16_t(v[c]);
  } else {
    for (int c = 0; c < DV; ++c) static_cast<mx::bfloat16_t*>(out)[i + c] = mx::bfloat16_t(v[c]);
  }
}

struct Dims {
  int B, H, R, D, DV;
  bool has_sinks;
};

class JointFinish : public mx::Primitive {
 public:
  JointFinish(mx::Stream s, Dims d, std::vector<int> rows, std::vector<int> spans)
      : mx::Primitive(s), d_(d), rows_(std::move(rows)), spans_(std::move(spans)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    const int G = int(rows_.size());
    std::vector<Rows> keys, values;
    for (int g = 0; g < G; ++g) {
      keys.push_back(rows_of(inputs[4 + g], rows_[g]));
      values.push_back(rows_of(inputs[4 + G + g], rows_[g]));
    }
    const float* sinks = d_.has_sinks ? inputs.back().data<float>() : nullptr;
    enc.dispatch([d = d_, q = inputs[0].data<float>(), m = inputs[1].data<float>(), l = inputs[2].data<float>(),
                  acc = inputs[3].data<float>(), keys, values, spans = spans_, sinks, out = outputs[0].data<void>(),
                  t = outputs[0].dtype()]() { run(d, q, m, l, acc, keys, values, spans, sinks, out, t); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant joint_finish: CPU only");
  }
  const char* name() const override { return "VeloxquantJointFinish"; }

 private:
  // Per (batch row, KV head): the partials copied, each group's rows in blocks of BLOCK through the kernels' own
  // block scores / online-softmax update / weighted sum (keys read channel-major into the block), the sinks' logits,
  // the division.
  static void run(const Dims& d, const float* q, const float* m, const float* l, const float* acc,
                  const std::vector<Rows>& keys, const std::vector<Rows>& values, const std::vector<int>& spans,
                  const float* sinks, void* out, mx::Dtype t) {
    const int BH = d.B * d.H, threads = std::min(BH, pool().size());
    pool().run(threads, [&](int tid) {
      std::vector<float> kb(size_t(d.D) * BLOCK), vb(size_t(BLOCK) * d.DV), row(std::max(d.D, d.DV));
      std::vector<float> sc(size_t(d.R) * BLOCK), pm(d.R), pl(d.R), pa(size_t(d.R) * d.DV);
      for (int bh = tid; bh < BH; bh += threads) {
        const int b = bh / d.H, h = bh % d.H;
        const size_t i0 = size_t(bh) * d.R;
        std::copy(m + i0, m + i0 + d.R, pm.begin());
        std::copy(l + i0, l + i0 + d.R, pl.begin());
        std::copy(acc + i0 * d.DV, acc + (i0 + d.R) * d.DV, pa.begin());
        for (size_t g = 0; g < keys.size(); ++g) {
          const size_t sp = 2 * (g * d.B + b);
          const int first = spans.empty() ? 0 : spans[sp], n = spans.empty() ? keys[g].n : spans[sp + 1];
          for (int t0 = 0; t0 < n; t0 += BLOCK) {
            const int rows = std::min(BLOCK, n - t0);
            std::fill(kb.begin(), kb.end(), 0.f);
            for (int j = 0; j < rows; ++j) {
              read_row(keys[g], b, h, first + t0 + j, d.D, row.data());
              for (int c = 0; c < d.D; ++c) kb[size_t(c) * BLOCK + j] = row[c];
              read_row(values[g], b, h, first + t0 + j, d.DV, &vb[size_t(j) * d.DV]);
            }
            block_scores(q + i0 * d.D, kb.data(), d.R, d.D, sc.data());
            softmax_update(sc.data(), d.R, d.DV, [rows](int j) { return j < rows; }, pm.data(), pl.data(),
                           pa.data());
            weighted_sum(sc.data(), vb.data(), d.R, rows, d.DV, pa.data());
          }
        }
        for (int r = 0; r < d.R; ++r) {
          float* a = &pa[size_t(r) * d.DV];
          float den = pl[r];
          if (sinks) {  // a sink logit: mass in the denominator, no value
            const float z = sinks[h * d.R + r], top = std::max(pm[r], z), w = exp_neg(pm[r] - top);
            den = den * w + exp_neg(z - top);
            for (int c = 0; c < d.DV; ++c) a[c] *= w;
          }
          for (int c = 0; c < d.DV; ++c) a[c] /= den;
          write_out(out, t, (i0 + r) * d.DV, d.DV, a);  // [B, H * R, 1, DV]: row (b, h * R + r)
        }
      }
    });
  }
  Dims d_;
  std::vector<int> rows_, spans_;
};

void check(bool ok, const char* what) { veloxquant::check(ok, "joint_finish", what); }

bool float_rows(const mx::array& a) {
  return a.dtype() == mx::float32 || a.dtype() == mx::float16 || a.dtype() == mx::bfloat16;
}

}  // namespace

mx::array joint_finish(const mx::array& q, const mx::array& m, const mx::array& l, const mx::array& acc,
                       const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                       const std::vector<int>& rows, const opt_array& sinks, const mx::array& like,
                       const std::vector<int>& spans) {
  check(q.ndim() == 4 && m.ndim() == 3 && l.ndim() == 3 && acc.ndim() == 4, "ranks");
  Dims d{int(q.shape(0)), int(q.shape(1)), int(q.shape(2)), int(q.shape(3)), int(acc.shape(3)), sinks.has_value()};
  check(m.shape() == mx::Shape({d.B, d.H, d.R}) && l.shape() == m.shape() && acc.shape(0) == d.B &&
            acc.shape(1) == d.H && acc.shape(2) == d.R,
        "partials' shapes differ from the queries'");
  check(d.D <= MAX_D && d.DV <= MAX_D && d.R <= MAX_R, "head dims or query heads too large");
  check(keys.size() == rows.size() && values.size() == rows.size() && !rows.empty() && rows.size() <= 4,
        "one row count per group of keys and values (1 to 4 groups)");
  check(spans.empty() || spans.size() == 2 * rows.size() * d.B, "spans: (start, count) per group and batch row");
  for (size_t g = 0; g < rows.size(); ++g) {
    const auto &k = keys[g], &v = values[g];
    check(k.ndim() == 4 && v.ndim() == 4 && k.shape(0) == d.B && k.shape(1) == d.H && v.shape(0) == d.B &&
              v.shape(1) == d.H && k.shape(3) == d.D && v.shape(3) == d.DV,
          "exact rows' shapes differ from the queries'");
    check(rows[g] >= 0 && rows[g] <= k.shape(2) && rows[g] <= v.shape(2), "more rows than a group holds");
    for (int b = 0; b < (spans.empty() ? 0 : d.B); ++b) {
      const int first = spans[2 * (g * d.B + b)], n = spans[2 * (g * d.B + b) + 1];
      check(first >= 0 && n >= 0 && first + n <= k.shape(2) && first + n <= v.shape(2),
            "a span beyond its group's rows");
    }
    check(float_rows(k) && float_rows(v), "exact rows must be float32, float16 or bfloat16");
  }
  check(!sinks || sinks->size() == size_t(d.H) * d.R, "one sink logit per query head");
  check(float_rows(like), "the output dtype must be float32, float16 or bfloat16");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> ins{contiguous_as(q, mx::float32), contiguous_as(m, mx::float32),
                             contiguous_as(l, mx::float32), contiguous_as(acc, mx::float32)};
  ins.insert(ins.end(), keys.begin(), keys.end());
  ins.insert(ins.end(), values.begin(), values.end());
  if (sinks) ins.push_back(contiguous_as(*sinks, mx::float32));
  return mx::array({d.B, d.H * d.R, 1, d.DV}, like.dtype(), std::make_shared<JointFinish>(s, d, rows, spans), ins);
}

}  // namespace veloxquant
