// KIVI's decode attention over its own layout on the CPU, as an MLX primitive (the op path in cache/grouped.py is the
// reference it is checked against at first use).
#include "common.h"

namespace veloxquant {
namespace {

// KIVI's layout (cache/grouped.py): keys per channel in groups of G tokens ([B, H, D, words] codes, each channel's
// tokens one bit stream; [B, H, D, groups] float16 scales and biases), values per token in groups of gv channels
// ([B, H, rows, words], [B, H, rows, dv / gv]); value = code * scale + bias.
// A second key store (Kitty's): the first nh channels of the queries' order at hbits bits ([B, H, nh, hkw] codes,
// [B, H, nh, hkg] scales and biases); the main store then holds the other D - nh channels.
// Keys as rows (SKVQ's, key_rows): per token in groups of G channels, laid out as the values ([B, H, rows, kw] codes,
// [B, H, rows, kg] scales and biases).
struct KiviDims {
  int B, H, R, D, DV, kw, kg, vcap, vw, vg;  // kw / kg: words and groups a channel's (a key row's) buffer holds
  int n, bits, G, gv;
  int nh, hbits, hkw, hkg;
  bool key_rows;
  int kcap;  // key rows a head's buffer holds (key_rows)
  int fg;    // tokens a group of the corrections spans (G, or its own with key rows)
};

// GEAR's corrections of one side (its reconstruction, block by block): per group (fg tokens) `o` stored entries put
// back exactly into the decoded block (index t * width + c in the group's [G, width] block, then the value), then
// the rank-r term A_t B_g^T (A [B, H, acap, r] per token, B_g^T [r, width] per group) added in the block's products.
// AnchorKV's anchors (ref != nullptr): B_g^T the group's r anchors, A_t the one-hot of row t's reference (rbits-bit
// codes, 0: none, k: anchor k - 1; a group's fg codes one stream of rwords words) but zero on the anchor rows (the
// group's r positions apos), whose anchors are put back instead.
struct Fix {
  const mx::float16_t* a = nullptr;
  const mx::float16_t* bt = nullptr;
  const uint32_t* oidx = nullptr;
  const mx::float16_t* oval = nullptr;
  int r = 0, o = 0;               // rank and entries per group (0: none)
  size_t acap = 0, bcap = 0, ocap = 0;  // per head: A's rows, B^T's elements, the entries
  const uint32_t* ref = nullptr;
  const uint8_t* apos = nullptr;
  int rbits = 0, rwords = 0;
  size_t rcap = 0, pcap = 0;  // per head: reference words, anchor positions
};

// Row t's anchor (1 + its index) under AnchorKV's corrections, 0 for none or an anchor row (t: the head's row).
inline int anchor_of(const Fix& f, int bh, int t, int G) {
  const int g = t / G, i = t % G;
  const uint8_t* ap = f.apos + size_t(bh) * f.pcap + size_t(g) * f.r;
  for (int a = 0; a < f.r; ++a)
    if (ap[a] == i) return 0;
  return int(code_at(f.ref + size_t(bh) * f.rcap + size_t(g) * f.rwords, i * f.rbits, f.rbits));
}

struct KiviInputs {
  const float* q;
  const uint32_t* kc;
  const mx::float16_t *ks, *kb;
  const uint32_t* vc;
  const mx::float16_t *vs, *vb;
  const uint32_t* hc;
  const mx::float16_t *hs, *hb;
  Fix kf, vf;  // GEAR's corrections (none: r = o = 0)
};

// The entries of groups g0..g1 that lie in block rows [0, rows) (block start b0): put(j, c, value) for each.
template <class Put>
inline void put_entries(const Fix& f, int bh, int g0, int g1, int b0, int rows, int G, int width, Put put) {
  for (int g = g0; g <= g1 && f.ref; ++g)  // AnchorKV: the anchor rows, the anchors themselves
    for (int a = 0; a < f.r; ++a) {
      const int j = g * G + f.apos[size_t(bh) * f.pcap + size_t(g) * f.r + a] - b0;
      const mx::float16_t* x = f.bt + size_t(bh) * f.bcap + (size_t(g) * f.r + a) * width;
      if (j >= 0 && j < rows)
        for (int c = 0; c < width; ++c) put(j, c, f16(x[c]));
    }
  for (int g = g0; g <= g1; ++g)
    for (int e = 0; e < f.o; ++e) {
      const size_t at = size_t(bh) * f.ocap + size_t(g) * f.o + e;
      const int j = g * G + int(f.oidx[at] / width) - b0;
      if (j >= 0 && j < rows) put(j, int(f.oidx[at] % width), f16(f.oval[at]));
    }
}

// GEAR's rank-r term where it is cheapest, in the products (scores and values are linear in the rows): a block's
// scores sc [R, BLOCK] (token j at slot slot_of(j)) gain (q B_g^T) . A_t, and the weighted sum acc [R, DV] (channel c
// at slot(c)) gains (sum_t w_t A_t) B_g^T for each group g, w [R, BLOCK] the block's weights in token order;
// qa: R * r floats of scratch.
template <class SlotOf>
void low_rank_scores(const Fix& f, int bh, int b0, int rows, int G, int D, int R, const float* q, SlotOf slot_of,
                     float* sc, float* qa) {
  for (int g = b0 / G; g <= (b0 + rows - 1) / G; ++g) {
    const mx::float16_t* bt = f.bt + size_t(bh) * f.bcap + size_t(g) * f.r * D;
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < f.r; ++k) {
        float x = 0.f;
        for (int c = 0; c < D; ++c) x += q[size_t(r) * D + c] * f16(bt[size_t(k) * D + c]);
        qa[size_t(r) * f.r + k] = x;
      }
    for (int j = std::max(0, g * G - b0); j < std::min(rows, (g + 1) * G - b0); ++j) {
      if (f.ref) {  // a one-hot A_t: its anchor's product
        const int k = anchor_of(f, bh, b0 + j, G);
        for (int r = 0; k && r < R; ++r) sc[size_t(r) * BLOCK + slot_of(j)] += qa[size_t(r) * f.r + k - 1];
        continue;
      }
      const mx::float16_t* a = f.a + (size_t(bh) * f.acap + b0 + j) * f.r;
      for (int r = 0; r < R; ++r) {
        float x = 0.f;
        for (int k = 0; k < f.r; ++k) x += qa[size_t(r) * f.r + k] * f16(a[k]);
        sc[size_t(r) * BLOCK + slot_of(j)] += x;
      }
    }
  }
}

template <class Slot>
void low_rank_values(const Fix& f, int bh, int b0, int rows, int G, int DV, int R, const float* w, Slot slot,
                     float* acc, float* wa) {
  for (int g = b0 / G; g <= (b0 + rows - 1) / G; ++g) {
    std::fill(wa, wa + size_t(R) * f.r, 0.f);
    for (int j = std::max(0, g * G - b0); j < std::min(rows, (g + 1) * G - b0); ++j) {
      if (f.ref) {  // a one-hot A_t: its weight to its anchor
        const int k = anchor_of(f, bh, b0 + j, G);
        for (int r = 0; k && r < R; ++r) wa[size_t(r) * f.r + k - 1] += w[size_t(r) * BLOCK + j];
        continue;
      }
      const mx::float16_t* a = f.a + (size_t(bh) * f.acap + b0 + j) * f.r;
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < f.r; ++k) wa[size_t(r) * f.r + k] += w[size_t(r) * BLOCK + j] * f16(a[k]);
    }
    const mx::float16_t* bt = f.bt + size_t(bh) * f.bcap + size_t(g) * f.r * DV;
    for (int c = 0; c < DV; ++c) {
      const int s = slot(c);
      for (int r = 0; r < R; ++r) {
        float x = 0.f;
        for (int k = 0; k < f.r; ++k) x += wa[size_t(r) * f.r + k] * f16(bt[size_t(k) * DV + c]);
        acc[size_t(r) * DV + s] += x;
      }
    }
  }
}

// The value rows' bits as value_lanes / value_slot read them: 0 (a code at a time) unless each word's codes lie in
// one value group (one scale a lane).
inline int kivi_vector_bits(const KiviDims& d) { return d.gv % (32 / d.bits) == 0 ? d.bits : 0; }

// A block's keys of one channel in slot order (slot k * WB + w: token w * (32 / BITS) + k, word w's k-th code),
// scale and bias per lane (the block's two halves may lie in two groups).
template <int BITS>
inline void kivi_key_channel(const uint32_t* words, int nwords, const float* sc, const float* bi,
                             float* __restrict out) {
  constexpr int WB = 2 * BITS, CPW = 32 / BITS;  // words a block of 64 tokens takes, codes a word
  uint32_t w[WB] = {};
  if (nwords == WB)
    std::memcpy(w, words, sizeof(w));  // a whole block: a fixed-size copy (a counted loop became `rep movs`, slow)
  else
    for (int i = 0; i < nwords; ++i) w[i] = words[i];
  for (int k = 0; k < CPW; ++k)
    for (int i = 0; i < WB; ++i)
      out[k * WB + i] = float(int32_t((w[i] >> (k * BITS)) & ((1u << BITS) - 1))) * sc[i] + bi[i];
}

// Slot s of a block decoded at `bits` holds token (s % WB) * CPW + s / WB (kivi_key_channel).
inline int slot_token(int s, int bits) { return (s % (2 * bits)) * (32 / bits) + s / (2 * bits); }

// One channel of a block from a store of BITS-bit codes (its channel ch; kw words and kg groups a channel), in
// kivi_key_channel's slot order for BITS, each half of the block with its own group's scale and bias.
template <int BITS>
inline void key_channel(const uint32_t* codes, const mx::float16_t* sc, const mx::float16_t* bi, size_t ch, int kw,
                        int kg, int b0, int rows, int G, float* __restrict out) {
  constexpr int WB = 2 * BITS;
  const int g0 = b0 / G, g1 = (b0 + BLOCK / 2) / G;  // the groups of the block's two halves
  const float s0 = f16(sc[ch * kg + g0]), z0 = f16(bi[ch * kg + g0]);
  const bool second = rows > BLOCK / 2 && g1 != g0;
  const float s1 = second ? f16(sc[ch * kg + g1]) : s0, z1 = second ? f16(bi[ch * kg + g1]) : z0;
  float scl[WB], bia[WB];
  for (int i = 0; i < WB; ++i) {
    scl[i] = i < WB / 2 ? s0 : s1;
    bia[i] = i < WB / 2 ? z0 : z1;
  }
  kivi_key_channel<BITS>(codes + ch * kw + size_t(b0) * BITS / 32, (rows * BITS + 31) / 32, scl, bia, out);
}

// A channel of the second key store (runtime width hbits), re-slotted to the main store's order.
inline void hi_key_channel(const KiviDims& d, const KiviInputs& in, const int* from, size_t ch, int b0, int rows,
                           float* __restrict out) {
  float tmp[BLOCK];
  if (d.hbits == 2) key_channel<2>(in.hc, in.hs, in.hb, ch, d.hkw, d.hkg, b0, rows, d.G, tmp);
  else if (d.hbits == 4) key_channel<4>(in.hc, in.hs, in.hb, ch, d.hkw, d.hkg, b0, rows, d.G, tmp);
  else key_channel<8>(in.hc, in.hs, in.hb, ch, d.hkw, d.hkg, b0, rows, d.G, tmp);
  for (int s = 0; s < BLOCK; ++s) out[s] = tmp[from[s]];
}

template <int BITS>
void kivi_rows(const KiviDims& d, const KiviInputs& in, int bh, int t0, int t1, float* m, float* l, float* acc) {
  constexpr int WB = 2 * BITS, CPW = 32 / BITS;
  const int D = d.D, DV = d.DV, R = d.R;
  std::vector<float> buf(size_t(D) * BLOCK + 2 * size_t(R) * BLOCK + size_t(BLOCK) * DV + size_t(R) * D +
                         size_t(R) * std::max(in.kf.r, in.vf.r), 0.f);
  float* keys = buf.data();
  float* sc = keys + size_t(D) * BLOCK;
  float* wt = sc + size_t(R) * BLOCK;  // [R, BLOCK]: the weights in token order
  float* vals = wt + size_t(R) * BLOCK;
  const float* q = in.q + size_t(bh) * R * D;
  const float* qn = q;  // the queries in the model's channel order (the corrections' rank-r term reads them)
  const int lanes = value_lanes(DV, kivi_vector_bits(d), d.vw);
  const int key_bits = d.G % CPW == 0 ? BITS : 0;  // key rows (key_rows) as value rows: vectors where groups allow
  const int key_lanes = d.key_rows ? value_lanes(D, key_bits, d.kw) : 0;
  if (d.key_rows) {  // key rows decode in value_slot's order: the queries' channels likewise
    float* qs = vals + size_t(BLOCK) * DV;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < D; ++c) qs[size_t(r) * D + value_slot(c, D, key_bits, d.kw)] = q[r * D + c];
    q = qs;
  }
  // slot s of a block's scores holds token token_at(s), token j lies at slot_of(j): kivi_key_channel's order (rows:
  // in order)
  auto token_at = [&d](int s) { return d.key_rows ? s : (s % WB) * CPW + s / WB; };
  auto slot_of = [&d](int j) { return d.key_rows ? j : (j % CPW) * WB + j / CPW; };
  auto vslot = [&d](int c) { return value_slot(c, d.DV, kivi_vector_bits(d), d.vw); };
  auto kslot = [&](int c) { return d.key_rows ? value_slot(c, D, key_bits, d.kw) : c; };
  float* scratch = vals + size_t(BLOCK) * DV + size_t(R) * D;  // past the key rows' queries: GEAR's rank-r sums
  int from[BLOCK] = {};  // main-order slot s: where its token lies in a second-store block (hbits order)
  for (int s = 0; s < BLOCK && d.nh; ++s) {
    const int t = slot_token(s, BITS), hcpw = 32 / d.hbits;
    from[s] = (t % hcpw) * (2 * d.hbits) + t / hcpw;
  }
  empty_partials(R, DV, m, l, acc);
  for (int b0 = t0; b0 < t1; b0 += BLOCK) {
    const int rows = std::min(BLOCK, t1 - b0);
    if (d.key_rows) {
      float u[MAX_D];
      for (int j = 0; j < rows; ++j) {  // each row decoded, then written channel-major
        const size_t row = size_t(bh) * d.kcap + b0 + j;
        decode_row<BITS>(in.kc + row * d.kw, in.ks + row * d.kg, in.kb + row * d.kg, D, d.kw, d.G, key_lanes, u);
        for (int c = 0; c < D; ++c) keys[size_t(c) * BLOCK + j] = u[c];
      }
    } else {
      for (int c = 0; c < d.nh; ++c)  // the second store's channels first (the queries' order), re-slotted
        hi_key_channel(d, in, from, size_t(bh) * d.nh + c, b0, rows, keys + size_t(c) * BLOCK);
      for (int c = d.nh; c < D; ++c)
        key_channel<BITS>(in.kc, in.ks, in.kb, size_t(bh) * (D - d.nh) + (c - d.nh), d.kw, d.kg, b0, rows, d.G,
                          keys + size_t(c) * BLOCK);
    }
    if (in.kf.o || in.kf.ref)  // GEAR's key entries (AnchorKV's anchor rows) put back in the block
      put_entries(in.kf, bh, b0 / d.fg, (b0 + rows - 1) / d.fg, b0, rows, d.fg, D,
                  [&](int j, int c, float x) { keys[size_t(kslot(c)) * BLOCK + slot_of(j)] = x; });
    block_scores(q, keys, R, D, sc);
    if (in.kf.r) low_rank_scores(in.kf, bh, b0, rows, d.fg, D, R, qn, slot_of, sc, scratch);
    softmax_update(sc, R, DV, [&](int slot) { return token_at(slot) < rows; }, m, l, acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < rows; ++j)
        wt[size_t(r) * BLOCK + j] = sc[size_t(r) * BLOCK + slot_of(j)];
    for (int j = 0; j < rows; ++j) {  // each row's values: code * scale + bias of its channel's group
      const size_t row = size_t(bh) * d.vcap + b0 + j;
      decode_row<BITS>(in.vc + row * d.vw, in.vs + row * d.vg, in.vb + row * d.vg, DV, d.vw, d.gv, lanes,
                       vals + size_t(j) * DV);
    }
    if (in.vf.o || in.vf.ref)  // GEAR's value entries (AnchorKV's anchor rows) likewise
      put_entries(in.vf, bh, b0 / d.fg, (b0 + rows - 1) / d.fg, b0, rows, d.fg, DV,
                  [&](int j, int c, float x) { vals[size_t(j) * DV + vslot(c)] = x; });
    weighted_sum(wt, vals, R, rows, DV, acc);
    if (in.vf.r) low_rank_values(in.vf, bh, b0, rows, d.fg, DV, R, wt, vslot, acc, scratch);
  }
}

class KiviDecode : public mx::Primitive {
 public:
  KiviDecode(mx::Stream s, KiviDims d, std::vector<int> counts, Fix kf, Fix vf)
      : mx::Primitive(s), d_(d), counts_(std::move(counts)), kf_(kf), vf_(vf) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(stream(), inputs, outputs);
    const bool hi = d_.nh > 0;
    KiviInputs in{inputs[0].data<float>(),         inputs[1].data<uint32_t>(),      inputs[2].data<mx::float16_t>(),
                  inputs[3].data<mx::float16_t>(), inputs[4].data<uint32_t>(),      inputs[5].data<mx::float16_t>(),
                  inputs[6].data<mx::float16_t>(), hi ? inputs[7].data<uint32_t>() : nullptr,
                  hi ? inputs[8].data<mx::float16_t>() : nullptr, hi ? inputs[9].data<mx::float16_t>() : nullptr,
                  kf_, vf_};
    size_t next = hi ? 10 : 7;  // the corrections' arrays follow, those present in order (a, bt, oidx, oval)
    for (Fix* f : {&in.kf, &in.vf}) {
      if (f->r && !f->rbits) f->a = inputs[next++].data<mx::float16_t>();
      if (f->r) f->bt = inputs[next++].data<mx::float16_t>();
      if (f->o) f->oidx = inputs[next++].data<uint32_t>(), f->oval = inputs[next++].data<mx::float16_t>();
      if (f->rbits) f->ref = inputs[next++].data<uint32_t>(), f->apos = inputs[next++].data<uint8_t>();
    }
    enc.dispatch([d = d_, in, counts = counts_, m = outputs[0].data<float>(), l = outputs[1].data<float>(),
                  acc = outputs[2].data<float>()]() {
      auto slot = [&](int c) { return value_slot(c, d.DV, kivi_vector_bits(d), d.vw); };
      auto go = [&](auto rows) { split_and_join(d.B * d.H, d.R, d.DV, d.n, rows, slot, m, l, acc, counts, d.H); };
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
  std::vector<int> counts_;
  Fix kf_, vf_;  // sizes only; the arrays' pointers are taken at evaluation
};

}  // namespace

std::vector<mx::array> kivi_decode(const mx::array& q, const mx::array& k_codes, const mx::array& k_scales,
                                   const mx::array& k_biases, const mx::array& v_codes, const mx::array& v_scales,
                                   const mx::array& v_biases, int n, int bits, int group, int value_group, int dv,
                                   const std::vector<int>& counts, const std::vector<mx::array>& hi, int hi_bits,
                                   bool key_rows, const std::vector<std::optional<mx::array>>& fixes,
                                   const std::vector<int>& fix_sizes, int fix_group,
                                   const std::vector<mx::array>& fix_refs, int fix_ref_bits) {
  auto check = [](bool ok, const char* what) { veloxquant::check(ok, "kivi_decode", what); };
  check(q.ndim() == 4 && k_codes.ndim() == 4 && k_scales.ndim() == 4 && v_codes.ndim() == 4 && v_scales.ndim() == 4,
        "ranks");
  KiviDims d{};
  d.B = q.shape(0), d.H = q.shape(1), d.R = q.shape(2), d.D = q.shape(3), d.DV = dv;
  d.kw = k_codes.shape(3), d.kg = k_scales.shape(3), d.vcap = v_codes.shape(2), d.vw = v_codes.shape(3);
  d.vg = v_scales.shape(3), d.n = n, d.bits = bits, d.G = group, d.gv = value_group;
  d.key_rows = key_rows, d.kcap = k_codes.shape(2), d.fg = fix_group ? fix_group : group;
  Fix fx[2];  // keys', values'
  std::vector<mx::array> fix_ins;
  check(fixes.empty() || (fixes.size() == 8 && fix_sizes.size() == 3 && hi.empty() && counts.empty() &&
                          (key_rows ? fix_group > 0 && n % fix_group == 0 : fix_group == 0)),
        "fixes: (a, bt, oidx, oval) of keys then values, fix_sizes (rank, key entries, value entries) a group; no "
        "second store, no counts; with key rows a fix_group of tokens the rows fill (else the keys' group)");
  const bool refs = !fix_refs.empty();
  check(!refs || (fix_refs.size() == 4 && fix_ref_bits >= 1 && fix_ref_bits <= 8 && !fixes.empty() &&
                  fix_sizes[0] > 0 && (1 << fix_ref_bits) > fix_sizes[0] && fix_sizes[0] <= d.fg),
        "fixes: fix_refs (key references, key anchor rows, value references, value anchor rows) of fix_ref_bits "
        "1-8 bits naming one of fix_sizes[0] anchors, no more anchors than rows a group");
  for (int side = 0; side < 2 && !fixes.empty(); ++side) {
    const int width = side ? dv : d.D, r = fix_sizes[0], o = fix_sizes[1 + side], g = n / std::max(d.fg, 1);
    const auto &a = fixes[4 * side], &bt = fixes[4 * side + 1], &oi = fixes[4 * side + 2], &ov = fixes[4 * side + 3];
    auto lead = [&](const mx::array& x, size_t nd) { return x.ndim() == nd && x.shape(0) == d.B && x.shape(1) == d.H; };
    check(r >= 0 && o >= 0 && (!r || ((refs || (a && lead(*a, 4) && a->shape(3) == r && a->shape(2) >= n)) && bt &&
                                      lead(*bt, 3) && size_t(bt->shape(2)) >= size_t(g) * r * width)) &&
              (!o || (oi && ov && lead(*oi, 3) && oi->shape() == ov->shape() && size_t(oi->shape(2)) >= size_t(g) * o)),
          "fixes: A [B, H, rows, rank] for the n rows, B^T [B, H, groups * rank * width], entries [B, H, groups * "
          "count] (indices, values) for the n / group groups");
    Fix& f = fx[side];
    f.r = r, f.o = o;
    if (r && !refs) f.acap = a->shape(2), fix_ins.push_back(contiguous_as(*a, mx::float16));
    if (r) f.bcap = bt->shape(2), fix_ins.push_back(contiguous_as(*bt, mx::float16));
    if (o) {
      f.ocap = oi->shape(2);
      fix_ins.push_back(contiguous_as(*oi, mx::uint32)), fix_ins.push_back(contiguous_as(*ov, mx::float16));
    }
    if (refs) {
      const mx::array &rf = fix_refs[2 * side], &ap = fix_refs[2 * side + 1];
      f.rbits = fix_ref_bits, f.rwords = (d.fg * fix_ref_bits + 31) / 32;
      check(lead(rf, 4) && rf.shape(3) == f.rwords && rf.shape(2) >= g && lead(ap, 3) &&
                size_t(ap.shape(2)) >= size_t(g) * r,
            "fixes: references [B, H, groups, words of a group's codes], anchor rows [B, H, groups * anchors]");
      f.rcap = size_t(rf.shape(2)) * f.rwords, f.pcap = ap.shape(2);
      fix_ins.push_back(contiguous_as(rf, mx::uint32)), fix_ins.push_back(contiguous_as(ap, mx::uint8));
    }
  }
  check(!key_rows || (hi.empty() && d.kw * 32 == d.D * bits && d.kg == d.D / std::max(group, 1) && n <= d.kcap),
        "key_rows: no second store, key rows of D codes with a scale per group, n within the key buffer");
  check(hi.empty() || (hi.size() == 3 && (hi_bits == 2 || hi_bits == 4 || hi_bits == 8) && hi[0].ndim() == 4 &&
                       hi[1].ndim() == 4 && hi[1].shape() == hi[2].shape() && hi[0].shape(2) == hi[1].shape(2) &&
                       hi[0].shape(0) == d.B && hi[0].shape(1) == d.H && hi[1].shape(0) == d.B &&
                       hi[1].shape(1) == d.H && size_t(n) * hi_bits <= size_t(hi[0].shape(3)) * 32 &&
                       n / group <= hi[1].shape(3)),
        "hi: (codes, scales, biases) of 2, 4 or 8 bits, batch and heads as the queries', rows within the buffers");
  d.nh = hi.empty() ? 0 : hi[0].shape(2), d.hbits = hi_bits;
  d.hkw = hi.empty() ? 0 : hi[0].shape(3), d.hkg = hi.empty() ? 0 : hi[1].shape(3);
  check(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  check(group > 0 && (key_rows ? d.D % group == 0 : group % 32 == 0) && value_group > 0 && dv % value_group == 0 &&
            (value_group * bits) % 32 == 0,
        "groups");
  check(d.D <= MAX_D && dv <= MAX_D && d.R <= MAX_R && d.vw * 32 == dv * bits && d.vg == dv / value_group,
        "head dims, query heads or value words");
  check(n >= 0 && n <= d.vcap &&
            (key_rows || (n % group == 0 && size_t(n) * bits <= size_t(d.kw) * 32 && n / group <= d.kg)),
        "rows beyond the buffers");
  check(counts.empty() || (int(counts.size()) == d.B && std::all_of(counts.begin(), counts.end(), [&](int c) {
          return c >= 0 && c <= n && (key_rows || c % group == 0);
        })), "counts: one per batch row, each a multiple of the group in 0..n");
  check(k_codes.shape(0) == d.B && k_codes.shape(1) == d.H && v_codes.shape(0) == d.B && v_codes.shape(1) == d.H &&
            (key_rows ? k_scales.shape(2) == d.kcap
                      : k_codes.shape(2) + d.nh == d.D && k_scales.shape(2) + d.nh == d.D) &&
            k_biases.shape() == k_scales.shape() && v_biases.shape() == v_scales.shape() && v_scales.shape(2) == d.vcap,
        "batch, heads or tables differ");
  auto s = mx::default_stream(mx::Device::cpu);
  auto c = contiguous_as;
  std::vector<mx::array> ins{c(q, mx::float32),       c(k_codes, mx::uint32),  c(k_scales, mx::float16),
                             c(k_biases, mx::float16), c(v_codes, mx::uint32), c(v_scales, mx::float16),
                             c(v_biases, mx::float16)};
  if (!hi.empty())
    for (auto [a, t] : {std::pair{0, mx::uint32}, {1, mx::float16}, {2, mx::float16}}) ins.push_back(c(hi[a], t));
  ins.insert(ins.end(), fix_ins.begin(), fix_ins.end());
  mx::Shape ml{d.B, d.H, d.R};
  return mx::array::make_arrays({ml, ml, {d.B, d.H, d.R, dv}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<KiviDecode>(s, d, counts, fx[0], fx[1]), ins);
}

}  // namespace veloxquant
