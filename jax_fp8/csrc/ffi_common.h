// Argument decoding shared by the CPU and CUDA FFI handlers: the call's Scheme, decoded once by XLA,
// and the buffers checked against it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp8_math.h"
#include "groups.h"
#include "xla/ffi/api/ffi.h"

namespace jf {
namespace ffi = xla::ffi;

enum class InType { kF32, kBF16, kF16 };

// The quantization format of a call: jax_fp8/formats.py's Format.kernel_id. What differs between the
// formats is decided by the functions below (and by fp8_math.h's rules, picked in with_rule), each a
// switch over this enum; a new format is a new value and a case in each.
enum class Format : int32_t { kMxfp8 = 0, kBlockwise = 1 };

// The quantization scheme of a call: jax_fp8/scheme.py's Scheme.ffi_attrs(), passed as one dictionary
// attribute, "scheme", that XLA decodes into this struct (registered at the end of this file).
struct Scheme {
  int32_t fp8;         // Fp8Kind (fp8_math.h): 0 = E4M3, 1 = E5M2
  Format format;       // checked by check_scheme (XLA decodes any int32)
  bool pow2;           // blockwise: scales rounded down to powers of two
  float eps;           // blockwise: lower bound of every block amax
  bool saturate_inf;   // blockwise: TE's rule; false: an infinite amax stores scale_inv inf
  // The kernels' outputs in result order (Scheme.kernel_usages), four int32 each: bm, bk (the block),
  // data transposed (stored (B, K, M)), scales transposed (a stored scale row is a block column).
  // Every size (a stored scale row's length included) comes from the buffers of the call.
  ffi::Span<const int32_t> outputs;
};

// One output of a call, as Scheme::outputs describes it.
struct Output {
  int bm, bk;
  bool data_transposed;    // data stored (B, K, M): GEMM-ready columnwise data
  bool scales_transposed;  // stored scale row = block column j (else block row i)
  // The columnwise output (the kernels' `col` slot): columns of bm x 1 blocks, or transposed tiles;
  // compact 128x128 tiles, which serve both usages, are laid out as the rowwise output.
  bool colwise() const { return bk == 1 || data_transposed; }
};
inline int64_t n_blocks(int64_t M, int64_t K, int bm, int bk) { return cdiv(M, bm) * cdiv(K, bk); }

// Where one output of a quantize call puts its data and scales: data (B, M, K), or (B, K, M) when
// transposed; the scale of block (i, j) of matrix b at scale[b * s_batch + i * s_row + j * s_col].
// The scale buffer (B, rows, ld) holds the grid, or its transpose, one stored row per grid row (or
// column); each stored row's entries [pad_from, ld), past the grid, hold kGemmScalePad (pad_rows: the
// stored rows, 0 when no row is padded).
constexpr float kGemmScalePad = 1.0f;  // the scale_inv of an all-zero block (scheme.py's GEMM_SCALE_PAD)
struct OutLayout : Output {
  int64_t s_batch, s_row, s_col;
  int64_t pad_rows, pad_from, ld;
  int64_t data_cols;  // the data's row length: K, or for transposed data M (col_count(M, G) in groups)
};
// The layout of output o of an (M, K) matrix whose scale buffer has stored rows of ld entries;
// row_blocks: its block rows where they are not the cdiv(M, bm) of even blocks (rows in groups, groups.h).
inline OutLayout out_layout(const Output& o, int64_t M, int64_t K, int64_t ld, int64_t row_blocks = -1,
                            int64_t transposed_cols = -1) {
  const int64_t sm = row_blocks >= 0 ? row_blocks : cdiv(M, o.bm), sk = cdiv(K, o.bk);
  const int64_t rows = o.scales_transposed ? sk : sm, row_len = o.scales_transposed ? sm : sk;
  OutLayout l;
  static_cast<Output&>(l) = o;
  l.s_batch = rows * ld;
  l.s_row = o.scales_transposed ? 1 : ld;
  l.s_col = o.scales_transposed ? ld : 1;
  l.pad_rows = ld > row_len ? rows : 0;
  l.pad_from = row_len;
  l.ld = ld;
  l.data_cols = o.data_transposed ? (transposed_cols >= 0 ? transposed_cols : M) : K;
  return l;
}

// A quantize-style call: its scheme, outputs and an input of shape (B, M, K) and type `in`.
struct QuantizeArgs : Scheme {
  int n_out;
  OutLayout out[2];  // quantize: the layouts read from the result buffers; shards: the blocks alone
  // Float8 scales in GEMM-ready order (transposed or padded rows): the kernels that store them, which
  // also store Float8 columnwise data transposed
  bool gemm_scales;
  InType in;
  int64_t B, M, K;
  float inf_value;  // the input dtype's largest finite value (TE's scale for an infinite quotient)
};

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fp8: " + msg);
}

// What differs between the formats, for the handlers (formats.py's Format objects say the same).
struct FormatTraits {
  bool known;                // a value some format has
  int block;                 // the block length: MXFP8 1x32 / 32x1, Float8 1x128 / 128x1
  bool tiles;                // 2-D tiles (block x block) that serve both usages: Float8 128x128
  bool gemm_ready_scales;    // GEMM-ready scales rearranged (Float8: transposed / padded rows); else compact
  ffi::DataType scale_type;  // stored scales, and the master-weight cast's partial and reduced values
  size_t scale_bytes;
  const char* scale_name;
  bool partials_are_scales;  // the reduced partial values are the stored scales (E8M0 bytes); else the
                             // partial cast writes an fp32 scale_inv
};
// One case per format: a new format is a new enumerator and its case here (-Wswitch names a missing
// one), its scale rule in fp8_math.h and with_rule / with_rule_type below.
inline FormatTraits traits(Format f) {
  switch (f) {
    case Format::kMxfp8: return {true, 32, false, false, ffi::DataType::U8, 1, "uint8", true};
    case Format::kBlockwise: return {true, 128, true, true, ffi::DataType::F32, 4, "float32", false};
  }
  return {false, 0, false, false, ffi::DataType::INVALID, 0, "", false};  // rejected by check_scheme
}
inline bool gemm_ready_scales(Format f) { return traits(f).gemm_ready_scales; }
inline ffi::DataType scale_type(Format f) { return traits(f).scale_type; }
inline size_t scale_bytes(Format f) { return traits(f).scale_bytes; }
inline bool partials_are_scales(Format f) { return traits(f).partials_are_scales; }

inline ffi::Error in_type_of(ffi::DataType t, InType* out, float* max_finite) {
  switch (t) {
    case ffi::DataType::F32: *out = InType::kF32; *max_finite = 3.40282347e38f; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = InType::kBF16; *max_finite = 3.38953139e38f; return ffi::Error::Success();
    case ffi::DataType::F16: *out = InType::kF16; *max_finite = 65504.0f; return ffi::Error::Success();
    default: return bad("input must be float32, bfloat16 or float16");
  }
}

// (B, M, K) of a rank-3 buffer.
inline ffi::Error dims3(const ffi::AnyBuffer& x, int64_t* B, int64_t* M, int64_t* K) {
  auto d = x.dimensions();
  if (d.size() != 3) return bad("kernels take rank-3 (batch, rows, cols) buffers");
  *B = d[0];
  *M = d[1];
  *K = d[2];
  return ffi::Error::Success();
}

// The outputs of a scheme (Scheme::outputs), checked against the kernels that exist: MXFP8 1x32 and/or
// 32x1 blocks; Float8 1x128 and/or 128x1 blocks, or 128x128 tiles (one output, or a rowwise output and
// a transposed columnwise one), rowwise first. Rowwise data is never stored transposed, columnwise
// scales never; MXFP8 scales never. An unknown format is an error naming its value.
inline ffi::Error check_scheme(const Scheme& s, Output* out, int* n) {
  if (s.fp8 != kE4M3 && s.fp8 != kE5M2) return bad("scheme.fp8 must be 0 (e4m3) or 1 (e5m2)");
  if (!traits(s.format).known)
    return bad("scheme.format must be 0 (mxfp8) or 1 (blockwise), got " + std::to_string(int32_t(s.format)));
  const size_t size = s.outputs.size();
  if (size != 4 && size != 8) return bad("scheme.outputs must hold one or two outputs of four int32 each");
  *n = int(size / 4);
  for (int k = 0; k < *n; ++k) {
    const int32_t* e = &s.outputs[4 * k];
    if ((e[2] != 0 && e[2] != 1) || (e[3] != 0 && e[3] != 1)) return bad("scheme.outputs: flags must be 0 or 1");
    out[k] = Output{e[0], e[1], e[2] == 1, e[3] == 1};
  }
  const FormatTraits f = traits(s.format);
  const int b = f.block;
  const bool gemm_scales = f.gemm_ready_scales;
  const auto row = [&](const Output& o) {
    return o.bm == 1 && o.bk == b && !o.data_transposed && (gemm_scales || !o.scales_transposed);
  };
  const auto col = [&](const Output& o) { return o.bm == b && o.bk == 1 && !o.scales_transposed; };
  const auto tile = [&](const Output& o, bool cols) {
    return f.tiles && o.bm == b && o.bk == b && o.data_transposed == cols && o.scales_transposed == cols;
  };
  const Output& o0 = out[0];
  const bool ok = *n == 1 ? row(o0) || col(o0) || tile(o0, false) || tile(o0, true)
                          : (row(o0) && col(out[1])) || (tile(o0, false) && tile(out[1], true));
  if (!ok) return bad("unsupported block configuration");
  return ffi::Error::Success();
}

// Validates and fills the arguments shared by every quantize-style target (the layouts' strides are
// the quantize call's: make_quantize_args).
inline ffi::Error fill_quantize_args(ffi::DataType in, int64_t B, int64_t M, int64_t K, const Scheme& s,
                                     QuantizeArgs* a) {
  Output out[2];
  if (auto e = check_scheme(s, out, &a->n_out); e.failure()) return e;
  if (B < 0 || M < 0 || K < 0) return bad("negative dimension");
  static_cast<Scheme&>(*a) = s;
  for (int k = 0; k < a->n_out; ++k) a->out[k] = out_layout(out[k], M, K, 0);
  a->gemm_scales = false;
  a->B = B;
  a->M = M;
  a->K = K;
  return in_type_of(in, &a->in, &a->inf_value);
}

// The type of stored scales, partial and global values: E8M0 bytes or fp32.
inline ffi::DataType scale_type(const Scheme& s) { return scale_type(s.format); }

// The CUDA tile writes a stored scale row's padding with one CTA, one entry per thread.
constexpr int64_t kMaxScalePad = 256;

// Output o of a quantize call against its buffers: uint8 data (B, M, K), or (B, K, M) transposed;
// scales (B, rows, ld), one stored row per block row (per block column when transposed), each at least
// as long as the grid's row (MXFP8: exactly); row_blocks as out_layout's. Returns the output's layout.
inline ffi::Error check_output(const QuantizeArgs& a, const Output& o, const ffi::AnyBuffer& data,
                               const ffi::AnyBuffer& scale, OutLayout* l, int64_t row_blocks = -1,
                               int64_t transposed_cols = -1) {
  const auto d = data.dimensions(), s = scale.dimensions();
  const int64_t rows = o.data_transposed ? a.K : a.M;
  const int64_t cols = o.data_transposed ? (transposed_cols >= 0 ? transposed_cols : a.M) : a.K;
  const auto shape = [](int64_t b, int64_t r, int64_t c) {
    return "(" + std::to_string(b) + ", " + std::to_string(r) + ", " + std::to_string(c) + ")";
  };
  if (data.element_type() != ffi::DataType::U8 || d.size() != 3 || d[0] != a.B || d[1] != rows || d[2] != cols)
    return bad("quantize: the data output of " + std::to_string(o.bm) + "x" + std::to_string(o.bk) +
               " blocks must be uint8 " + shape(a.B, rows, cols) + (o.data_transposed ? " (transposed)" : ""));
  const int64_t sm = row_blocks >= 0 ? row_blocks : cdiv(a.M, o.bm), sk = cdiv(a.K, o.bk);
  const int64_t stored = o.scales_transposed ? sk : sm, row_len = o.scales_transposed ? sm : sk;
  const FormatTraits f = traits(a.format);  // compact scales (MXFP8) are never padded
  if (scale.element_type() != f.scale_type || s.size() != 3 || s[0] != a.B || s[1] != stored || s[2] < row_len ||
      s[2] - row_len >= kMaxScalePad || (!f.gemm_ready_scales && s[2] != row_len))
    return bad("quantize: the scales of " + std::to_string(o.bm) + "x" + std::to_string(o.bk) + " blocks" +
               (o.scales_transposed ? " (transposed)" : "") + " must be " + f.scale_name + " " +
               shape(a.B, stored, row_len) +
               (f.gemm_ready_scales ? ", each stored row padded by at most " + std::to_string(kMaxScalePad - 1) +
                                          " entries"
                                    : ""));
  *l = out_layout(o, a.M, a.K, s[2], row_blocks, transposed_cols);
  return ffi::Error::Success();
}

// The result buffers of one output of a quantize call.
struct QuantizeResult {
  const ffi::AnyBuffer* data;
  const ffi::AnyBuffer* scale;
};

// The result buffers of every output of a quantize-style call (res[k]) against its filled arguments:
// each output's layout read from its buffers; col_blocks: the block rows of columnwise (bm x 1) blocks
// where they are not even, and transposed_cols the columns of its transposed data (rows in groups, groups.h).
inline ffi::Error check_quantize_outputs(const QuantizeResult* res, QuantizeArgs* a, int64_t col_blocks = -1,
                                         int64_t transposed_cols = -1) {
  for (int k = 0; k < a->n_out; ++k) {
    const int64_t row_blocks = a->out[k].bk == 1 ? col_blocks : -1;
    if (auto e = check_output(*a, a->out[k], *res[k].data, *res[k].scale, &a->out[k], row_blocks, transposed_cols);
        e.failure())
      return e;
    const OutLayout& o = a->out[k];
    a->gemm_scales |= gemm_ready_scales(a->format) && (o.data_transposed || o.scales_transposed || o.pad_rows > 0);
  }
  // Float8 kernels store the columnwise data transposed exactly when the scales are in GEMM order
  for (int k = 0; k < a->n_out; ++k)
    if (gemm_ready_scales(a->format) && a->out[k].bk == 1 && a->out[k].data_transposed != a->gemm_scales)
      return bad("unsupported block configuration: Float8 columnwise data is stored transposed exactly when the "
                 "scales are transposed or padded");
  return ffi::Error::Success();
}

// A quantize call: x (B, M, K) and, per output of the scheme, its result buffers (res[k]).
inline ffi::Error make_quantize_args(const ffi::AnyBuffer& x, const QuantizeResult* res, const Scheme& s,
                                     QuantizeArgs* a) {
  int64_t B, M, K;
  if (auto e = dims3(x, &B, &M, &K); e.failure()) return e;
  if (auto e = fill_quantize_args(x.element_type(), B, M, K, s, a); e.failure()) return e;
  return check_quantize_outputs(res, a);
}

// jf_quantize_grouped: x (B, M, K), group sizes (B, G) int32 (one set per matrix), and the result buffers
// of the scheme's outputs (Float8 blockwise, GEMM-ready 1x128 blocks): rowwise as jf_quantize's;
// columnwise data (B, K, col_count(M, G)) and scales (B, S, ld) of block_slots(M, G, 128) slots. Sets *G.
inline ffi::Error make_grouped_quantize_args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& sizes,
                                             const QuantizeResult* res, const Scheme& s, QuantizeArgs* a,
                                             int64_t* G) {
  int64_t B, M, K;
  if (auto e = dims3(x, &B, &M, &K); e.failure()) return e;
  const auto d = sizes.dimensions();
  if (sizes.element_type() != ffi::DataType::S32 || d.size() != 2 || d[0] != B)
    return bad("quantize_grouped: the group sizes must be int32 (batch, groups), one set per matrix");
  *G = d[1];
  if (auto e = fill_quantize_args(x.element_type(), B, M, K, s, a); e.failure()) return e;
  for (int k = 0; k < a->n_out; ++k) {
    const Output& o = a->out[k];
    if (a->format != Format::kBlockwise || o.bm * o.bk != traits(a->format).block || o.data_transposed != (o.bk == 1))
      return bad("quantize_grouped takes Float8 blockwise 1x128 blocks, GEMM-ready");
  }
  return check_quantize_outputs(res, a, block_slots(M, *G, traits(a->format).block), col_count(M, *G));
}

// Calls f(rule) with the scheme's scale rule (fp8_math.h): the one place that dispatches on it.
// SATURATE_ONLY: for callers that take TE's rule alone and checked saturate_inf (the master-weight
// shards), which then build no kernels for the other rule.
template <bool SATURATE_ONLY = false, class F>
auto with_block_rule(const QuantizeArgs& a, F&& f) {  // Float8 blockwise alone (with_rule's other half)
  if constexpr (!SATURATE_ONLY) {
    if (!a.saturate_inf) return f(BlockRuleT<true>{a.fp8, a.pow2, a.eps, a.inf_value});
  }
  return f(BlockRule{a.fp8, a.pow2, a.eps, a.inf_value});
}
template <bool SATURATE_ONLY = false, class F>
auto with_rule(const QuantizeArgs& a, F&& f) {
  switch (a.format) {
    case Format::kMxfp8: return f(MxRule{a.fp8});
    case Format::kBlockwise: break;
  }
  return with_block_rule<SATURATE_ONLY>(a, f);
}

// Calls f(rule) with a default rule of the scheme's format: for code that needs only the rule's type
// (its ScaleT and dequant_scale, which ignore the scale options), such as dequantize.
template <class F>
auto with_rule_type(const Scheme& s, F&& f) {
  switch (s.format) {
    case Format::kMxfp8: return f(MxRule{});
    case Format::kBlockwise: break;
  }
  return f(BlockRule{});
}

// ---- master-weight groups ------------------------------------------------------------------------
// A partial-amax or partial-cast call covers N weights. Weight i's flat shard of L elements holds
// elements [offset, offset + length) of its row-major (M, K) weight; (offset, length) are
// windows[2i], windows[2i + 1] (int32, in the platform's memory); M, K come as array attributes. Every
// weight's grids, in usage order, are packed one after another in one buffer of partial values,
// global values or scale_inv.
struct GroupWeight {
  const void* x;
  int64_t L, M, K;
  int64_t at[2];  // each usage grid's first element in the packed buffer
};

inline ffi::Error make_group(const ffi::AnyBuffer& windows, const ffi::RemainingArgs& shards,
                             ffi::Span<const int64_t> Ms, ffi::Span<const int64_t> Ks, const Scheme& s,
                             QuantizeArgs* a, std::vector<GroupWeight>* g, int64_t* n_packed) {
  const size_t n = shards.size();
  if (Ms.size() != n || Ks.size() != n) return bad("one shape per master-weight shard");
  if (windows.element_type() != ffi::DataType::S32 || windows.element_count() != 2 * n)
    return bad("shard windows must be int32 (offset, length) pairs, one per shard");
  ffi::DataType in = ffi::DataType::F32;
  g->clear();
  *n_packed = 0;
  for (size_t i = 0; i < n; ++i) {
    auto x = shards.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return bad("master-weight shards must be buffers");
    if (x->dimensions().size() != 1) return bad("a master-weight shard must be a flat (rank-1) buffer");
    if (i == 0) in = x->element_type();
    if (x->element_type() != in) return bad("the shards of one call must share a dtype");
    if (Ms[i] < 0 || Ks[i] < 0) return bad("negative dimension");
    g->push_back(GroupWeight{x->untyped_data(), x->dimensions()[0], Ms[i], Ks[i], {0, 0}});
  }
  if (auto e = fill_quantize_args(in, 1, 0, 0, s, a); e.failure()) return e;
  for (int k = 0; k < a->n_out; ++k)
    if (a->out[k].data_transposed || a->out[k].scales_transposed) return bad("master-weight shards are compact");
  for (GroupWeight& w : *g)
    for (int k = 0; k < a->n_out; ++k) {
      w.at[k] = *n_packed;
      *n_packed += n_blocks(w.M, w.K, a->out[k].bm, a->out[k].bk);
    }
  return ffi::Error::Success();
}

// Checks a packed buffer: n_packed elements of type `want`.
inline ffi::Error check_packed(ffi::DataType t, size_t count, ffi::DataType want, int64_t n_packed, const char* what) {
  if (t != want || int64_t(count) != n_packed)
    return bad(std::string(what) + " does not match the weights' packed scale grids");
  return ffi::Error::Success();
}

// A partial-amax call: the group and its packed partial-value output.
inline ffi::Error make_amax_group(const ffi::AnyBuffer& windows, const ffi::RemainingArgs& shards,
                                  const ffi::AnyBuffer& packed, ffi::Span<const int64_t> Ms,
                                  ffi::Span<const int64_t> Ks, const Scheme& s, QuantizeArgs* a,
                                  std::vector<GroupWeight>* g) {
  int64_t n_packed;
  if (auto e = make_group(windows, shards, Ms, Ks, s, a, g, &n_packed); e.failure()) return e;
  return check_packed(packed.element_type(), packed.element_count(), scale_type(*a), n_packed,
                      "the partial-value output");
}

// A partial-cast call: the group, its packed global values, the packed scale_inv output (fp32 scales;
// empty for E8M0) and the data outputs, per weight and usage (its L FP8 bytes each).
inline ffi::Error make_cast_group(const ffi::AnyBuffer& windows, const ffi::AnyBuffer& global,
                                  const ffi::RemainingArgs& shards, const ffi::AnyBuffer& scale_inv,
                                  const ffi::RemainingRets& datas, ffi::Span<const int64_t> Ms,
                                  ffi::Span<const int64_t> Ks, const Scheme& s, QuantizeArgs* a,
                                  std::vector<GroupWeight>* g, std::vector<uint8_t*>* data) {
  int64_t n_packed;
  if (auto e = make_group(windows, shards, Ms, Ks, s, a, g, &n_packed); e.failure()) return e;
  if (auto e = check_packed(global.element_type(), global.element_count(), scale_type(*a), n_packed,
                            "the global scale input");
      e.failure())
    return e;
  if (auto e = check_packed(scale_inv.element_type(), scale_inv.element_count(), ffi::DataType::F32,
                            partials_are_scales(a->format) ? 0 : n_packed, "the scale_inv output");
      e.failure())
    return e;
  const size_t nu = size_t(a->n_out);
  if (datas.size() != g->size() * nu) return bad("one data output per shard and usage");
  data->clear();
  for (size_t i = 0; i < datas.size(); ++i) {
    auto r = datas.get<ffi::AnyBuffer>(i);
    if (!r.has_value() || (*r)->element_type() != ffi::DataType::U8 ||
        int64_t((*r)->element_count()) != (*g)[i / nu].L)
      return bad("each data output must be uint8 of the shard's length");
    data->push_back(static_cast<uint8_t*>((*r)->untyped_data()));
  }
  return ffi::Error::Success();
}

// A dequantize call: compact uint8 data (B, M, K) and the compact scale grid (B, rows, cols) of the
// scheme's one output, whose blocks it returns; the scale type must match the scheme's.
inline ffi::Error make_dequantize_args(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale, const Scheme& s,
                                       int64_t* B, int64_t* M, int64_t* K, Output* o) {
  Output out[2];
  int n;
  if (auto e = check_scheme(s, out, &n); e.failure()) return e;
  if (n != 1) return bad("dequantize takes a scheme of one output");
  *o = out[0];
  if (o->data_transposed || o->scales_transposed) return bad("dequantize takes compact data and scales");
  if (auto e = dims3(data, B, M, K); e.failure()) return e;
  if (data.element_type() != ffi::DataType::U8) return bad("dequantize data must be uint8 FP8 bytes");
  if (scale.element_type() != scale_type(s))
    return bad("dequantize scales must be uint8 (E8M0) or float32, as the scheme says");
  const auto sd = scale.dimensions();
  if (sd.size() != 3 || sd[0] != *B || sd[1] != cdiv(*M, o->bm) || sd[2] != cdiv(*K, o->bk))
    return bad("dequantize: the scales of " + std::to_string(o->bm) + "x" + std::to_string(o->bk) +
               " blocks must be the compact grid (" + std::to_string(*B) + ", " + std::to_string(cdiv(*M, o->bm)) +
               ", " + std::to_string(cdiv(*K, o->bk)) + ")");
  return ffi::Error::Success();
}

}  // namespace jf

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jf::Format);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jf::Scheme, ::xla::ffi::StructMember<int32_t>("fp8"),
                                      ::xla::ffi::StructMember<jf::Format>("format"),
                                      ::xla::ffi::StructMember<bool>("pow2"),
                                      ::xla::ffi::StructMember<float>("eps"),
                                      ::xla::ffi::StructMember<bool>("saturate_inf"),
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int32_t>>("outputs"));
