// The CPU kernels' Python module: each kernel's entry point (defined in its own source) bound with nanobind.
#include <nanobind/stl/optional.h>

#include "common.h"

using namespace veloxquant;

NB_MODULE(_veloxquant_cpu, m) {
  m.doc() = "VeloxQuant-MLX CPU kernels (MLX primitives)";
  m.def("waterfill_decode", &waterfill_decode, nb::arg("q"), nb::arg("k_words"), nb::arg("ktab"), nb::arg("lo"),
        nb::arg("step"), nb::arg("w"), nb::arg("partner"), nb::arg("sign"), nb::arg("v_words"), nb::arg("v_scales"),
        nb::arg("poly"), nb::arg("n"), nb::arg("pos0"), nb::arg("vbits"), nb::arg("dv"), nb::arg("rotate"),
        nb::arg("counts") = std::vector<int>{},
        "Partials (m, l, acc) of waterfill's decode attention over its first n quantized rows (counts: batch row "
        "b's first counts[b] instead).");
  m.def("kivi_decode", &kivi_decode, nb::arg("q"), nb::arg("k_codes"), nb::arg("k_scales"), nb::arg("k_biases"),
        nb::arg("v_codes"), nb::arg("v_scales"), nb::arg("v_biases"), nb::arg("n"), nb::arg("bits"), nb::arg("group"),
        nb::arg("value_group"), nb::arg("dv"), nb::arg("counts") = std::vector<int>{},
        nb::arg("hi") = std::vector<mx::array>{}, nb::arg("hi_bits") = 0, nb::arg("key_rows") = false,
        nb::arg("fixes") = std::vector<std::optional<mx::array>>{}, nb::arg("fix_sizes") = std::vector<int>{},
        nb::arg("fix_group") = 0, nb::arg("fix_refs") = std::vector<mx::array>{}, nb::arg("fix_ref_bits") = 0,
        "Partials (m, l, acc) of KIVI's decode attention over its first n rows (counts: batch row b's first "
        "counts[b] instead); hi = (codes, scales, biases) of a second key store at hi_bits bits holding the first "
        "channels of q's order (Kitty's), the main store the rest; key_rows: keys per token in groups of `group` "
        "channels, laid out as the values (SKVQ's); fixes = (a, bt, oidx, oval) of the keys then the values (None "
        "where absent), fix_sizes = (rank, key entries, value entries) a group: GEAR's corrections, applied to each "
        "decoded block (entries put back, then A_t B_g^T added); fix_group: the tokens a group of the fixes spans "
        "(with key_rows, whose group is channels); fix_refs = (references, anchor rows) of keys then values: "
        "AnchorKV's anchors, A_t the one-hot of row t's fix_ref_bits-bit reference, B^T the anchors, put back on the "
        "anchor rows.");
  m.def("turboquant_rvq_decode", &turboquant_rvq_decode, nb::arg("q"), nb::arg("k_codes1"), nb::arg("k_codes2").none(),
        nb::arg("k_norms"), nb::arg("k_c1"), nb::arg("k_sigma"), nb::arg("k_c2").none(), nb::arg("v_codes1"),
        nb::arg("v_codes2").none(), nb::arg("v_norms"), nb::arg("v_c1"), nb::arg("v_sigma"), nb::arg("v_c2").none(),
        nb::arg("n"), nb::arg("dv"), nb::arg("counts") = std::vector<int>{}, nb::arg("k_bias").none() = nb::none(),
        nb::arg("k_word2") = 0, nb::arg("v_word2") = 0, nb::arg("k_joint") = false, nb::arg("v_joint") = false,
        "Partials (m, l, acc) of TurboQuant-RVQ's decode attention over its first n quantized rows (counts: batch "
        "row b's first counts[b] instead), for rotated scaled queries q (acc in the rotated value domain). NSNQuant's "
        "layout: norms [B, H, rows, 2] (n1, n2), k_bias = q.mu [B, H, R], stage 2 from word k_word2 / v_word2 of "
        "the codes' rows, and with value pairs acc's extra last column sum(p n1). Norms [B, H, 0]: unit norms (every "
        "row's gain 1). k_joint / v_joint (VecInfer's): one codebook c1 of 2^bits rows indexed by codes1 | codes2 << "
        "8, codes2 the high bits (9-16 bits; None with up to 8), no c2, sigma not read.");
  m.def("latent_decode", &latent_decode, nb::arg("q"), nb::arg("bias").none(), nb::arg("n"), nb::arg("group"),
        nb::arg("k_codes").none(), nb::arg("k_scales").none(), nb::arg("k_biases").none(), nb::arg("k_raw").none(),
        nb::arg("k_bits"), nb::arg("v_codes").none(), nb::arg("v_scales").none(), nb::arg("v_biases").none(),
        nb::arg("v_raw").none(), nb::arg("v_bits") = std::vector<int>{}, nb::arg("v_row_bits") = 0,
        nb::arg("v_row_group") = 0, nb::arg("dv") = 0, nb::arg("channel_major") = false,
        nb::arg("k_rows_per_group") = 0, nb::arg("v_row_ranges") = false, nb::arg("k_group_major") = false,
        nb::arg("v_scale_rows") = std::vector<int>{}, nb::arg("k_rebuild").none() = nb::none(),
        nb::arg("k_rebuild_mean").none() = nb::none(), nb::arg("rope") = std::vector<mx::array>{},
        nb::arg("rotate") = false,
        "Partials (m, l, acc) of a low-rank cache's decode attention over its first n rows' latents, for projected "
        "scaled queries q [B, Hg, R, r_k] (plus bias = q . mu [B, Hg, R]): values as latents (acc = sum p z, v_bits "
        "their widths) or, with v_row_bits, KIVI's per-token rows of dv channels in groups of v_row_group; "
        "channel_major: latents in KIVI's key layout (xKV's), one width; k_rows_per_group > 0: keys as rows (AMC's "
        "tiers: k_scales ranges, k_biases minima [B, H, channels, groups], row i in group i / k_rows_per_group); "
        "v_row_ranges: value rows' scales are their groups' ranges (scale = range / (2^v_row_bits - 1), AdaKV's); "
        "k_group_major: keys as rows with ranges and minima [B, H, groups, channels]; v_scale_rows (per, stride, "
        "first): value row i's scales at row (i / per) * stride + first + i % per (AdaKV's tiers in rank order); "
        "k_rebuild (Palu's): keys rebuilt per head of the group, W_h z + mu_h (W [1 or B, H, heads * D, latents], "
        "k_rebuild_mean [.., H, 1, heads * D]), turned by RoPE when rotate (rope = (angle, partner, sign) [D]) and "
        "scored against the model's queries q [B, H, heads * R, D].");
  m.def("drop_row", &drop_row, nb::arg("keys"), nb::arg("values"), nb::arg("positions"), nb::arg("scores"),
        nb::arg("rows"), nb::arg("spare"), nb::arg("n_sink"), nb::arg("recent_start"),
        "(keys, values, positions) of an eviction cache with each head's first least-scoring unprotected row of the "
        "first `rows` dropped (protected: position < n_sink or >= recent_start), `spare` rows after the rows - 1 kept "
        "repeating the last (TOVA's, MorphKV's decode step).");
  m.def("turboquant_rvq_encode", &turboquant_rvq_encode, nb::arg("z"), nb::arg("c1"), nb::arg("sigma"),
        nb::arg("c2").none(), nb::arg("beam"),
        "TurboQuant-RVQ's codes of rotated rows z [.., dim]: stage-1 words, stage-2 words (with c2), float16 norms.");
  m.def("joint_finish", &joint_finish, nb::arg("q"), nb::arg("m"), nb::arg("l"), nb::arg("acc"), nb::arg("keys"),
        nb::arg("values"), nb::arg("rows"), nb::arg("sinks").none(), nb::arg("like"),
        nb::arg("spans") = std::vector<int>{},
        "A decode step's attention output [B, H * R, 1, DV] (like's dtype): the partials (m, l, acc) of scaled "
        "queries q [B, H, R, D] joined with the first rows[i] of each exact group keys[i] / values[i] and the sinks; "
        "spans (a batch form's, [groups, B, 2] flat): group i's rows of batch row b are start .. start + count.");
  m.def("softmax_rows", &softmax_rows, nb::arg("scores"), nb::arg("offset"), nb::arg("sinks").none(),
        nb::arg("heads"),
        "Softmax over the last axis of float32 scores [..., N, M]: row i's columns past offset + i (offset >= 0) "
        "and -inf scores get 0; sinks [heads] join the normalizer of each of their head's rows.");
  m.def("vq_vote", &vq_vote, nb::arg("lut"), nb::arg("codes"), nb::arg("n"), nb::arg("bits"),
        "A2ATS's vote [B, H, n]: per query row r, scores s_r[t] = sum_j lut[.., r, j, code_j(t)] over the first n "
        "rows' codes [B, H, cap, words] (m codes of `bits` bits a row), softmaxed over t and summed over r.");
  m.def("kvquant_decode", &kvquant_decode, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("sink_k"),
        nb::arg("sink_v"), nb::arg("rope"), nb::arg("n"), nb::arg("bits"), nb::arg("group"), nb::arg("value_group"),
        nb::arg("key_outliers"), nb::arg("value_outliers"), nb::arg("rotate"),
        nb::arg("anchors") = std::vector<mx::array>{},
        "Partials (m, l, acc) of KVQuant's decode attention over its first n quantized rows, for scaled queries q "
        "[B, H, R, D]: keys = (codes, scales, biases, levels, fit, outlier indices, outlier values) of its per-channel "
        "non-uniform codes (pre-RoPE when rotate: rope = (angle, partner, sign) per channel), values = (codes, "
        "scales, biases, outlier indices, outlier values) of KIVI's per-token rows; key_outliers / value_outliers "
        "entries a group; the first n_sink rows are sink_k / sink_v (float16, post-RoPE). CacheGen's: levels of size 0 "
        "(code * scale + bias, 2-6 or 8 bits), anchors = (key codes, scales, biases, value codes, scales, biases) of "
        "8-bit rows, one a group: its first row, the others deltas against it.");
  m.def("threads", [] { return pool().size(); }, "Threads a call uses.");
}

