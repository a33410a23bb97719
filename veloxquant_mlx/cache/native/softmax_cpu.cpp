// Row softmax of float32 attention scores on the CPU, as an MLX primitive: the exponential vectorized (common.h's
// exp_neg), the rows spread over the pool's threads, the result written over the scores where MLX can donate their
// buffer. MLX's CPU softmax on x86 Linux takes one scalar exp per element through libm's fmaf on one thread: about
// half of a CPU prompt's time (docs/RESULTS.md), the plain cache's included. A row's columns past `offset + i` (row
// i of its N, `offset` >= 0: a bottom-right causal mask) take no part and get 0, as do -inf scores; with `sinks`
// (one logit per query head, rows [.., heads, N, M]) a head's sink joins each of its rows' normalizer.
// vq_vote: A2ATS's retrieval vote -- per (batch row, KV head) and query row, approximate scores of every coded row
// from a lookup table over its codewords (a row's m codes, `bits` each, one little-endian stream), softmaxed over the
// rows and summed over the query rows -- in one pass (the op path: a [B, H, R, m, n] gather, a softmax, a sum).
#include "common.h"

namespace veloxquant {
namespace {

struct SoftmaxDims {
  int64_t rows;
  int N, M, heads, offset;
};

// y = softmax(x[0, valid)) with zeros after; x and y may be the same row.
void softmax_row(const float* x, float* y, int M, int valid, bool has_sink, float sink) {
  float top = has_sink ? sink : -INFINITY;
  vf mv = splat(-INFINITY);
  int j = 0;
  for (; j + VL <= valid; j += VL) {
    const vf v = load(x + j);
    mv = v > mv ? v : mv;
  }
  for (int c = 0; c < VL; ++c) top = std::max(top, mv[c]);
  for (; j < valid; ++j) top = std::max(top, x[j]);
  if (top == -INFINITY) {  // nothing visible: no weight anywhere
    std::fill(y, y + M, 0.f);
    return;
  }
  vf sum{};
  for (j = 0; j + VL <= valid; j += VL) {
    const vf v = load(x + j);
    const vf e = v == splat(-INFINITY) ? splat(0.f) : exp_neg(v - top);  // (exp_neg(-inf) is e^-87, not 0)
    store(y + j, e);
    sum += e;
  }
  float total = has_sink ? exp_neg(sink - top) : 0.f;
  for (int c = 0; c < VL; ++c) total += sum[c];
  for (; j < valid; ++j) total += y[j] = x[j] == -INFINITY ? 0.f : exp_neg(x[j] - top);
  const float inv = 1.f / total;
  for (j = 0; j + VL <= valid; j += VL) store(y + j, load(y + j) * inv);
  for (; j < valid; ++j) y[j] *= inv;
  std::fill(y + valid, y + M, 0.f);
}

class RowSoftmax : public mx::Primitive {
 public:
  RowSoftmax(mx::Stream s, SoftmaxDims d, bool has_sinks) : mx::Primitive(s), d_(d), has_sinks_(has_sinks) {}

  // inputs: scores (float32, row-contiguous), then the sinks [heads] if any
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    auto& y = outputs[0];
    if (x.is_donatable()) {
      y.copy_shared_buffer(x);  // in place: no second scores-sized buffer
    } else {
      y.set_data(mx::allocator::malloc(y.nbytes()));
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(y);
    enc.dispatch([d = d_, xs = x.data<float>(), ys = y.data<float>(),
                  sinks = has_sinks_ ? inputs[1].data<float>() : nullptr]() {
      const int threads = int(std::min<int64_t>(pool().size(), std::max<int64_t>(1, d.rows / 8)));
      const int64_t per = (d.rows + threads - 1) / threads;
      pool().run(threads, [&](int tid) {
        for (int64_t r = tid * per; r < std::min(d.rows, (tid + 1) * per); ++r) {
          const int i = int(r % d.N);
          const int valid = d.offset < 0 ? d.M : std::max(0, std::min(d.M, d.offset + i + 1));
          softmax_row(xs + r * d.M, ys + r * d.M, d.M, valid, sinks != nullptr,
                      sinks ? sinks[(r / d.N) % d.heads] : 0.f);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant softmax_rows: CPU only");
  }
  const char* name() const override { return "VeloxquantRowSoftmax"; }

 private:
  SoftmaxDims d_;
  bool has_sinks_;
};

struct VoteDims {
  int BH, R, m, K, n, bits, words, cap;
};

class VqVote : public mx::Primitive {
 public:
  VqVote(mx::Stream s, VoteDims d) : mx::Primitive(s), d_(d) {}

  // inputs: lut [B, H, R, m, K] float32, codes [B, H, cap, words] uint32; output: votes [B, H, n] float32
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    enc.dispatch([d = d_, lut = inputs[0].data<float>(), codes = inputs[1].data<uint32_t>(),
                  out = outputs[0].data<float>()]() {
      const int threads = std::min(pool().size(), d.BH);
      pool().run(threads, [&](int tid) {
        std::vector<float> s(size_t(d.R) * d.n);
        std::vector<int> code(d.m);
        for (int bh = tid; bh < d.BH; bh += threads) {
          const float* tab = lut + size_t(bh) * d.R * d.m * d.K;
          const uint32_t* rows = codes + size_t(bh) * d.cap * d.words;
          for (int t = 0; t < d.n; ++t) {
            for (int j = 0; j < d.m; ++j) code[j] = int(code_at(rows + size_t(t) * d.words, j * d.bits, d.bits));
            for (int r = 0; r < d.R; ++r) {
              const float* tr = tab + size_t(r) * d.m * d.K;
              float acc = 0.f;
              for (int j = 0; j < d.m; ++j) acc += tr[size_t(j) * d.K + code[j]];
              s[size_t(r) * d.n + t] = acc;
            }
          }
          float* w = out + size_t(bh) * d.n;
          std::fill(w, w + d.n, 0.f);
          for (int r = 0; r < d.R; ++r) {
            float* sr = &s[size_t(r) * d.n];
            softmax_row(sr, sr, d.n, d.n, false, 0.f);
            for (int t = 0; t < d.n; ++t) w[t] += sr[t];
          }
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant vq_vote: CPU only");
  }
  const char* name() const override { return "VeloxquantVqVote"; }

 private:
  VoteDims d_;
};

}  // namespace

mx::array vq_vote(const mx::array& lut, const mx::array& codes, int n, int bits) {
  auto need = [](bool ok, const char* what) { check(ok, "vq_vote", what); };
  need(lut.ndim() == 5 && codes.ndim() == 4 && codes.dtype() == mx::uint32, "lut [B, H, R, m, K], codes uint32 "
       "[B, H, cap, words]");
  const int B = lut.shape(0), H = lut.shape(1), R = lut.shape(2), m = lut.shape(3), K = lut.shape(4);
  need(codes.shape(0) == B && codes.shape(1) == H, "codes' batch and heads differ from the table's");
  need(bits >= 1 && bits <= 16 && K >= 1 && K <= (1 << bits), "bits in 1..16 and at most 2^bits codewords");
  need(codes.shape(3) * 32 >= m * bits, "codes' words hold fewer than m codes of `bits` bits");
  need(n >= 1 && n <= codes.shape(2), "n in 1 .. the codes' rows");
  VoteDims d{B * H, R, m, K, n, bits, int(codes.shape(3)), int(codes.shape(2))};
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> ins{contiguous_as(lut, mx::float32), mx::contiguous(codes, false, s)};
  return mx::array({B, H, n}, mx::float32, std::make_shared<VqVote>(s, d), ins);
}

mx::array softmax_rows(const mx::array& scores, int offset, const opt_array& sinks, int heads) {
  auto need = [](bool ok, const char* what) { check(ok, "softmax_rows", what); };
  need(scores.ndim() >= 2 && scores.dtype() == mx::float32, "scores must be float32 [..., N, M]");
  const int N = scores.shape(-2), M = scores.shape(-1);
  need(N > 0 && M > 0 && heads > 0 && (scores.size() / M / N) % heads == 0, "rows: a multiple of heads x N");
  need(!sinks || (sinks->ndim() == 1 && sinks->shape(0) == heads), "sinks: one logit per head");
  SoftmaxDims d{int64_t(scores.size() / M), N, M, heads, offset};
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> ins{mx::contiguous(scores, false, s)};
  if (sinks) ins.push_back(contiguous_as(*sinks, mx::float32));
  return mx::array(scores.shape(), mx::float32, std::make_shared<RowSoftmax>(s, d, sinks.has_value()), ins);
}

}  // namespace veloxquant
