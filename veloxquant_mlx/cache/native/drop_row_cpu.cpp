// The one-row drop of an eviction cache that evicts a row every decode step (TOVA, MorphKV) on the CPU, as an MLX
// primitive (cache/kernels/drop_row.py: its CUDA form; the op path in cache/eviction.py is the reference it is
// checked against at first use). Each (batch row, KV head) finds its first row of least score among the unprotected
// ones (protected: position below n_sink or at least recent_start; mx.argmin's choice, every row protected: row 0),
// then copies its rows around that one into buffers of out_rows rows; the rows past rows - 1 repeat the last held row
// (never read). The op path takes a guard, an argmin, an index and three gathers of every held row, each a pass of
// its own (on this 2-core CPU ~1.2 ms a layer at a budget of 512 rows: the most of a MorphKV step's).
#include "common.h"

namespace veloxquant {
namespace {

struct DropDims {
  int BH, n, cap, out_rows, n_sink, recent_start;
  size_t krow, vrow;  // bytes a key / value row takes
};

class DropRow : public mx::Primitive {
 public:
  DropRow(mx::Stream s, DropDims d) : mx::Primitive(s), d_(d) {}

  // inputs: keys [B, H, cap, D], values [B, H, cap, DV] (any float dtype: rows copied as bytes), positions [B, H,
  // cap] int32, scores [B, H, n] float32; outputs: keys, values, positions of out_rows rows
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    enc.dispatch([d = d_, k = inputs[0].data<char>(), v = inputs[1].data<char>(), pos = inputs[2].data<int32_t>(),
                  s = inputs[3].data<float>(), ok = outputs[0].data<char>(), ov = outputs[1].data<char>(),
                  op = outputs[2].data<int32_t>()]() {
      const int tasks = std::min(pool().size(), d.BH), per = (d.BH + tasks - 1) / tasks;
      pool().run(tasks, [&](int tid) {
        for (int bh = tid * per; bh < std::min(d.BH, (tid + 1) * per); ++bh) {
          const int32_t* p = pos + size_t(bh) * d.cap;
          const float* sc = s + size_t(bh) * d.n;
          int j = 0;
          float best = INFINITY;
          for (int m = 0; m < d.n; ++m) {
            const float x = (p[m] < d.n_sink || p[m] >= d.recent_start) ? INFINITY : sc[m];
            if (x < best) best = x, j = m;
          }
          // rows [0, j) as they are, [j, n - 1) from one row later, the rest repeat row n - 1
          auto copy = [&](const char* src, char* dst, size_t row) {
            const char* a = src + size_t(bh) * d.cap * row;
            char* o = dst + size_t(bh) * d.out_rows * row;
            const int kept = std::min(d.out_rows, d.n - 1);
            std::memcpy(o, a, std::min(j, kept) * row);
            if (kept > j) std::memcpy(o + j * row, a + (j + 1) * row, (kept - j) * row);
            for (int r = kept; r < d.out_rows; ++r) std::memcpy(o + r * row, a + size_t(d.n - 1) * row, row);
          };
          copy(k, ok, d.krow);
          copy(v, ov, d.vrow);
          copy(reinterpret_cast<const char*>(pos), reinterpret_cast<char*>(op), sizeof(int32_t));
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("veloxquant drop_row: CPU only");
  }
  const char* name() const override { return "VeloxquantDropRow"; }

 private:
  DropDims d_;
};

}  // namespace

std::vector<mx::array> drop_row(const mx::array& keys, const mx::array& values, const mx::array& positions,
                                const mx::array& scores, int rows, int spare, int n_sink, int recent_start) {
  auto check = [](bool ok, const char* what) { veloxquant::check(ok, "drop_row", what); };
  check(keys.ndim() == 4 && values.ndim() == 4 && positions.ndim() == 3 && scores.ndim() == 3,
        "keys, values [B, H, rows, dims], positions and scores [B, H, rows]");
  const int B = keys.shape(0), H = keys.shape(1), cap = keys.shape(2);
  check(values.shape(0) == B && values.shape(1) == H && values.shape(2) == cap && positions.shape() ==
            mx::Shape{B, H, cap} && positions.dtype() == mx::int32 && scores.shape(0) == B && scores.shape(1) == H &&
            scores.shape(2) >= rows && values.dtype() == keys.dtype() && mx::issubdtype(keys.dtype(), mx::floating),
        "values and positions (int32) as the keys' buffer, float rows of one dtype, scores for the rows");
  check(rows >= 2 && rows <= cap && spare >= 0, "rows: 2 .. the buffer's rows; spare >= 0");
  const int out_rows = rows - 1 + spare;
  DropDims d{B * H, rows, cap, out_rows, n_sink, recent_start, size_t(keys.shape(3)) * keys.itemsize(),
             size_t(values.shape(3)) * values.itemsize()};
  auto c = [](const mx::array& a, mx::Dtype t) { return contiguous_as(a, t); };
  std::vector<mx::array> ins{c(keys, keys.dtype()), c(values, values.dtype()), c(positions, mx::int32),
                             c(mx::slice(scores, {0, 0, 0}, {B, H, rows}, mx::default_stream(mx::Device::cpu)),
                               mx::float32)};
  return mx::array::make_arrays({{B, H, out_rows, keys.shape(3)}, {B, H, out_rows, values.shape(3)}, {B, H, out_rows}},
                                {keys.dtype(), values.dtype(), mx::int32},
                                std::make_shared<DropRow>(mx::default_stream(mx::Device::cpu), d), ins);
}

}  // namespace veloxquant
