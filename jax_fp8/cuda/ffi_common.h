// Argument decoding shared by the CPU and CUDA FFI handlers: the call's Scheme, decoded once by XLA,
// and the buffers checked against it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp8_math.h"
#include "xla/ffi/api/ffi.h"

namespace jf {
namespace ffi = xla::ffi;

enum class InType { kF32, kBF16, kF16 };

// The quantization scheme of a call: jax_fp8/scheme.py's Scheme.ffi_attrs(), passed as one dictionary
// attribute, "scheme", that XLA decodes into this struct (registered at the end of this file).
struct Scheme {
  int32_t fp8;         // Fp8Kind (fp8_math.h): 0 = E4M3, 1 = E5M2
  bool e8m0;           // E8M0 scales (MXFP8); else fp32 scale_inv (Float8 blockwise)
  int32_t row_block;   // rowwise 1 x row_block blocks (0: not asked for)
  int32_t col_block;   // columnwise col_block x 1 blocks (0: not asked for)
  int32_t tile_block;  // tile_block x tile_block tiles (0: none)
  bool pow2;           // blockwise: scales rounded down to powers of two
  float eps;           // blockwise: lower bound of every block amax
  bool gemm_ready;     // columnwise data transposed; blockwise scales in GEMM order (OutLayout)
  bool tile_rows;      // tiles: the rowwise usage asked for (a GEMM-ready output of its own)
  bool tile_cols;      // tiles: the columnwise usage asked for (likewise)
  bool saturate_inf = true;  // blockwise: TE's rule; false: an infinite amax stores scale_inv inf
};

// A quantize-style call: its scheme and an input of shape (B, M, K) and type `in`.
struct QuantizeArgs : Scheme {
  InType in;
  int64_t B, M, K;
  float inf_value;  // the input dtype's largest finite value (TE's scale for an infinite quotient)
};

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fp8: " + msg);
}

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

// The block configurations the kernels implement: MXFP8 1x32 and/or 32x1; Float8 1x128 and/or 128x1,
// or 128x128 tiles alone.
inline ffi::Error check_scheme(const Scheme& s) {
  if (s.fp8 != kE4M3 && s.fp8 != kE5M2) return bad("scheme.fp8 must be 0 (e4m3) or 1 (e5m2)");
  const int want = s.e8m0 ? 32 : 128;
  if ((s.row_block && s.row_block != want) || (s.col_block && s.col_block != want) ||
      (s.tile_block && (s.e8m0 || s.tile_block != 128)) || (s.tile_block && (s.row_block || s.col_block)) ||
      !(s.row_block || s.col_block || s.tile_block) ||
      (s.tile_block && s.gemm_ready && !(s.tile_rows || s.tile_cols)))
    return bad("unsupported block configuration");
  return ffi::Error::Success();
}

// Validates and fills the arguments shared by every quantize-style target.
inline ffi::Error fill_quantize_args(ffi::DataType in, int64_t B, int64_t M, int64_t K, const Scheme& s,
                                     QuantizeArgs* a) {
  if (auto e = check_scheme(s); e.failure()) return e;
  if (B < 0 || M < 0 || K < 0) return bad("negative dimension");
  static_cast<Scheme&>(*a) = s;
  a->B = B;
  a->M = M;
  a->K = K;
  return in_type_of(in, &a->in, &a->inf_value);
}

inline ffi::Error make_quantize_args(const ffi::AnyBuffer& x, const Scheme& s, QuantizeArgs* a) {
  int64_t B, M, K;
  if (auto e = dims3(x, &B, &M, &K); e.failure()) return e;
  return fill_quantize_args(x.element_type(), B, M, K, s, a);
}

// Calls f(rule) with the scheme's scale rule (fp8_math.h): the one place that dispatches on it.
// SATURATE_ONLY: for callers that take TE's rule alone and checked saturate_inf (the master-weight
// shards), which then build no kernels for the other rule.
template <bool SATURATE_ONLY = false, class F>
auto with_rule(const QuantizeArgs& a, F&& f) {
  if (a.e8m0) return f(MxRule{a.fp8});
  if constexpr (!SATURATE_ONLY) {
    if (!a.saturate_inf) return f(BlockRuleT<true>{a.fp8, a.pow2, a.eps, a.inf_value});
  }
  return f(BlockRule{a.fp8, a.pow2, a.eps, a.inf_value});
}

// The usages of a call, each as (bm, bk) blocks, in the kernels' output order: row, col, tile.
struct Usage {
  int bm, bk;
  int64_t blocks(int64_t M, int64_t K) const { return cdiv(M, bm) * cdiv(K, bk); }
  int64_t blocks(const QuantizeArgs& a) const { return blocks(a.M, a.K); }
};
inline int usages_of(const Scheme& s, Usage* u) {
  int n = 0;
  if (s.row_block) u[n++] = {1, s.row_block};
  if (s.col_block) u[n++] = {s.col_block, 1};
  if (s.tile_block) u[n++] = {s.tile_block, s.tile_block};
  return n;
}

// Where one output of a quantize call puts its data and scales (jax_fp8/scheme.py's data_shape and
// scale_shape). Data: (B, M, K), or its transpose (B, K, M) for GEMM-ready columnwise data. The scale
// of block (i, j) of matrix b: scale[b * s_batch + i * s_row + j * s_col]. Compact: the grid row-major.
// GEMM-ready Float8 blockwise (TE's GEMM_READY): the grid, or its transpose (1x128 rowwise, 128x128
// columnwise), with each stored row padded to a multiple of 4 entries; entries [pad_from, ld) of
// each of the pad_rows stored rows hold kGemmScalePad.
constexpr float kGemmScalePad = 1.0f;  // the scale_inv of an all-zero block
struct OutLayout {
  int bm, bk;
  bool col;                      // the columnwise usage's output (compact shared tiles count as rowwise)
  bool transposed;               // data stored (B, K, M)
  bool scales_transposed;        // stored row = block column j (else block row i)
  int64_t s_batch, s_row, s_col;
  int64_t pad_rows, pad_from, ld;
};
inline int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }
inline OutLayout out_layout(const Scheme& s, Usage u, bool col, int64_t M, int64_t K) {
  const int64_t sm = cdiv(M, u.bm), sk = cdiv(K, u.bk);
  const bool transposed = s.gemm_ready && col;
  if (!s.gemm_ready || s.e8m0) return {u.bm, u.bk, col, transposed, false, sm * sk, sk, 1, 0, 0, 0};
  if (col == (u.bm == u.bk)) {  // 1x128 rowwise, 128x128 columnwise: the grid transposed
    const int64_t ld = round4(sm);
    return {u.bm, u.bk, col, transposed, true, sk * ld, 1, ld, sk, sm, ld};
  }
  const int64_t ld = round4(sk);
  return {u.bm, u.bk, col, transposed, false, sm * ld, ld, 1, sm, sk, ld};
}
// The outputs of a quantize call, in its result order; returns their number (1 or 2).
inline int outputs_of(const QuantizeArgs& a, OutLayout* o) {
  Usage u[2];
  const int nu = usages_of(a, u);
  if (a.tile_block && a.gemm_ready) {  // GEMM-ready tiles: a rowwise and a transposed columnwise output
    int n = 0;
    if (a.tile_rows) o[n++] = out_layout(a, u[0], false, a.M, a.K);
    if (a.tile_cols) o[n++] = out_layout(a, u[0], true, a.M, a.K);
    return n;
  }
  for (int k = 0; k < nu; ++k) o[k] = out_layout(a, u[k], u[k].bk == 1, a.M, a.K);
  return nu;
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
  Usage u[2];
  const int nu = usages_of(*a, u);
  for (GroupWeight& w : *g)
    for (int k = 0; k < nu; ++k) {
      w.at[k] = *n_packed;
      *n_packed += u[k].blocks(w.M, w.K);
    }
  return ffi::Error::Success();
}

// Checks a packed buffer: n_packed elements of type `want`.
inline ffi::Error check_packed(ffi::DataType t, size_t count, ffi::DataType want, int64_t n_packed, const char* what) {
  if (t != want || int64_t(count) != n_packed)
    return bad(std::string(what) + " does not match the weights' packed scale grids");
  return ffi::Error::Success();
}
// The type of partial and global values: E8M0 bytes or fp32 amaxes.
inline ffi::DataType partial_type(const Scheme& s) { return s.e8m0 ? ffi::DataType::U8 : ffi::DataType::F32; }

// A partial-amax call: the group and its packed partial-value output.
inline ffi::Error make_amax_group(const ffi::AnyBuffer& windows, const ffi::RemainingArgs& shards,
                                  const ffi::AnyBuffer& packed, ffi::Span<const int64_t> Ms,
                                  ffi::Span<const int64_t> Ks, const Scheme& s, QuantizeArgs* a,
                                  std::vector<GroupWeight>* g) {
  int64_t n_packed;
  if (auto e = make_group(windows, shards, Ms, Ks, s, a, g, &n_packed); e.failure()) return e;
  return check_packed(packed.element_type(), packed.element_count(), partial_type(*a), n_packed,
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
  if (auto e = check_packed(global.element_type(), global.element_count(), partial_type(*a), n_packed,
                            "the global scale input");
      e.failure())
    return e;
  if (auto e = check_packed(scale_inv.element_type(), scale_inv.element_count(), ffi::DataType::F32,
                            a->e8m0 ? 0 : n_packed, "the scale_inv output");
      e.failure())
    return e;
  Usage u[2];
  const size_t nu = usages_of(*a, u);
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

// A dequantize call: uint8 data (B, M, K) and the scale grid of the scheme's one usage, whose blocks
// it returns; the scale type must match the scheme's.
inline ffi::Error make_dequantize_args(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale, const Scheme& s,
                                       int64_t* B, int64_t* M, int64_t* K, Usage* u) {
  if (auto e = check_scheme(s); e.failure()) return e;
  if (usages_of(s, u) != 1) return bad("dequantize takes a scheme of one usage");
  if (auto e = dims3(data, B, M, K); e.failure()) return e;
  if (data.element_type() != ffi::DataType::U8) return bad("dequantize data must be uint8 FP8 bytes");
  if (scale.element_type() != partial_type(s)) return bad("dequantize scales must be uint8 (E8M0) or float32, as the scheme says");
  if (int64_t(scale.element_count()) != *B * u->blocks(*M, *K)) return bad("dequantize scales do not match the data's blocks");
  return ffi::Error::Success();
}

}  // namespace jf

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jf::Scheme, ::xla::ffi::StructMember<int32_t>("fp8"),
                                      ::xla::ffi::StructMember<bool>("e8m0"),
                                      ::xla::ffi::StructMember<int32_t>("row_block"),
                                      ::xla::ffi::StructMember<int32_t>("col_block"),
                                      ::xla::ffi::StructMember<int32_t>("tile_block"),
                                      ::xla::ffi::StructMember<bool>("pow2"), ::xla::ffi::StructMember<float>("eps"),
                                      ::xla::ffi::StructMember<bool>("gemm_ready"),
                                      ::xla::ffi::StructMember<bool>("tile_rows"),
                                      ::xla::ffi::StructMember<bool>("tile_cols"),
                                      ::xla::ffi::StructMember<bool>("saturate_inf"));
