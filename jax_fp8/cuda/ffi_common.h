// Argument decoding shared by the CPU and CUDA FFI handlers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp8_math.h"
#include "xla/ffi/api/ffi.h"

namespace jf {
namespace ffi = xla::ffi;

enum class InType { kF32, kBF16, kF16 };

// A quantize call: x of shape (B, M, K); outputs per usage (data u8, scale u8 or f32), in the
// order row, col, tile, padded with unused (empty) results up to four.
struct QuantizeArgs {
  InType in;
  int64_t B, M, K;
  int fp8, scale_kind, row_block, col_block, tile_block;
  bool pow2;
  float eps, inf_value;
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

// Validates and fills the arguments shared by every quantize-style target.
inline ffi::Error fill_quantize_args(ffi::DataType in, int64_t B, int64_t M, int64_t K, int64_t fp8,
                                     int64_t scale_kind, int64_t row_block, int64_t col_block, int64_t tile_block,
                                     bool pow2, float eps, QuantizeArgs* a) {
  if (auto e = in_type_of(in, &a->in, &a->inf_value); e.failure()) return e;
  if (fp8 != kE4M3 && fp8 != kE5M2) return bad("fp8 must be 0 (e4m3) or 1 (e5m2)");
  if (scale_kind != kScaleE8M0 && scale_kind != kScaleFp32) return bad("unknown scale kind");
  if (B < 0 || M < 0 || K < 0) return bad("negative dimension");
  const bool mx = scale_kind == kScaleE8M0;
  const int want = mx ? 32 : 128;
  if ((row_block && row_block != want) || (col_block && col_block != want) ||
      (tile_block && (mx || tile_block != 128)) || (tile_block && (row_block || col_block)) ||
      !(row_block || col_block || tile_block))
    return bad("unsupported block configuration");
  *a = QuantizeArgs{a->in, B, M, K, int(fp8), int(scale_kind), int(row_block), int(col_block), int(tile_block),
                    pow2, eps, a->inf_value};
  return ffi::Error::Success();
}

inline ffi::Error make_quantize_args(const ffi::AnyBuffer& x, int64_t fp8, int64_t scale_kind, int64_t row_block,
                                     int64_t col_block, int64_t tile_block, bool pow2, float eps, QuantizeArgs* a) {
  int64_t B, M, K;
  if (auto e = dims3(x, &B, &M, &K); e.failure()) return e;
  return fill_quantize_args(x.element_type(), B, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps,
                            a);
}

// The usages of a call, each as (bm, bk) blocks, in the kernels' output order: row, col, tile.
struct Usage {
  int bm, bk;
  int64_t blocks(int64_t M, int64_t K) const { return cdiv(M, bm) * cdiv(K, bk); }
  int64_t blocks(const QuantizeArgs& a) const { return blocks(a.M, a.K); }
};
inline int usages_of(const QuantizeArgs& a, Usage* u) {
  int n = 0;
  if (a.row_block) u[n++] = {1, a.row_block};
  if (a.col_block) u[n++] = {a.col_block, 1};
  if (a.tile_block) u[n++] = {a.tile_block, a.tile_block};
  return n;
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
                             ffi::Span<const int64_t> Ms, ffi::Span<const int64_t> Ks, int64_t fp8,
                             int64_t scale_kind, int64_t row_block, int64_t col_block, int64_t tile_block, bool pow2,
                             float eps, QuantizeArgs* a, std::vector<GroupWeight>* g, int64_t* n_packed) {
  const size_t n = shards.size();
  if (Ms.size() != n || Ks.size() != n) return bad("one shape per master-weight shard");
  if (windows.element_type() != ffi::DataType::S32 || windows.element_count() != 2 * n)
    return bad("shard windows must be int32 (offset, length) pairs, one per shard");
  ffi::DataType in = ffi::DataType::F32;
  g->clear();
  *n_packed = 0;
  for (size_t i = 0; i < n; ++i) {
    auto s = shards.get<ffi::AnyBuffer>(i);
    if (!s.has_value()) return bad("master-weight shards must be buffers");
    if (s->dimensions().size() != 1) return bad("a master-weight shard must be a flat (rank-1) buffer");
    if (i == 0) in = s->element_type();
    if (s->element_type() != in) return bad("the shards of one call must share a dtype");
    if (Ms[i] < 0 || Ks[i] < 0) return bad("negative dimension");
    g->push_back(GroupWeight{s->untyped_data(), s->dimensions()[0], Ms[i], Ks[i], {0, 0}});
  }
  if (auto e = fill_quantize_args(in, 1, 0, 0, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps, a);
      e.failure())
    return e;
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
inline ffi::DataType partial_type(const QuantizeArgs& a) {
  return a.scale_kind == kScaleE8M0 ? ffi::DataType::U8 : ffi::DataType::F32;
}

// A partial-amax call: the group and its packed partial-value output.
inline ffi::Error make_amax_group(const ffi::AnyBuffer& windows, const ffi::RemainingArgs& shards,
                                  ffi::Result<ffi::AnyBuffer> packed, ffi::Span<const int64_t> Ms,
                                  ffi::Span<const int64_t> Ks, int64_t fp8, int64_t scale_kind, int64_t row_block,
                                  int64_t col_block, int64_t tile_block, QuantizeArgs* a,
                                  std::vector<GroupWeight>* g) {
  int64_t n_packed;
  if (auto e = make_group(windows, shards, Ms, Ks, fp8, scale_kind, row_block, col_block, tile_block, false, 0.0f, a,
                          g, &n_packed);
      e.failure())
    return e;
  return check_packed(packed->element_type(), packed->element_count(), partial_type(*a), n_packed,
                      "the partial-value output");
}

// A partial-cast call: the group, its packed global values, the packed scale_inv output (fp32 scales;
// empty for E8M0) and the data outputs, per weight and usage (its L FP8 bytes each).
inline ffi::Error make_cast_group(const ffi::AnyBuffer& windows, const ffi::AnyBuffer& global,
                                  const ffi::RemainingArgs& shards, ffi::Result<ffi::AnyBuffer> scale_inv,
                                  const ffi::RemainingRets& datas, ffi::Span<const int64_t> Ms,
                                  ffi::Span<const int64_t> Ks, int64_t fp8, int64_t scale_kind, int64_t row_block,
                                  int64_t col_block, int64_t tile_block, bool pow2, float eps, QuantizeArgs* a,
                                  std::vector<GroupWeight>* g, std::vector<uint8_t*>* data) {
  int64_t n_packed;
  if (auto e = make_group(windows, shards, Ms, Ks, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps, a, g,
                          &n_packed);
      e.failure())
    return e;
  if (auto e = check_packed(global.element_type(), global.element_count(), partial_type(*a), n_packed,
                            "the global scale input");
      e.failure())
    return e;
  const bool fp32 = a->scale_kind == kScaleFp32;
  if (auto e = check_packed(scale_inv->element_type(), scale_inv->element_count(), ffi::DataType::F32,
                            fp32 ? n_packed : 0, "the scale_inv output");
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

}  // namespace jf

// ---- FFI signatures, shared by the CPU handlers and the CUDA ones (which bind a stream first) -----
// Macros because a binding is a single move-only builder expression.
#define JF_ARG .Arg<::xla::ffi::AnyBuffer>()
#define JF_RET .Ret<::xla::ffi::AnyBuffer>()
#define JF_BLOCK_ATTRS                                                                                  \
  .Attr<int64_t>("fp8").Attr<int64_t>("scale_kind").Attr<int64_t>("row_block").Attr<int64_t>("col_block") \
      .Attr<int64_t>("tile_block")
#define JF_SCALE_OPTIONS .Attr<bool>("pow2").Attr<float>("eps")
#define JF_SHAPES_ATTRS .Attr<::xla::ffi::Span<const int64_t>>("Ms").Attr<::xla::ffi::Span<const int64_t>>("Ks")
// x -> (data, scale) x 2
#define JF_BIND_QUANTIZE(b) b JF_ARG JF_RET JF_RET JF_RET JF_RET JF_BLOCK_ATTRS JF_SCALE_OPTIONS
// data, scale -> out
#define JF_BIND_DEQUANTIZE(b) \
  b JF_ARG JF_ARG JF_RET.Attr<int64_t>("fp8").Attr<int64_t>("block_m").Attr<int64_t>("block_k")
// windows, shards... -> packed partial values
#define JF_BIND_PARTIAL_AMAX(b) b JF_ARG.RemainingArgs() JF_RET JF_SHAPES_ATTRS JF_BLOCK_ATTRS
// windows, packed global values, shards... -> packed scale_inv (fp32 scales; else empty), data per shard and usage
#define JF_BIND_PARTIAL_CAST(b) \
  b JF_ARG JF_ARG.RemainingArgs() JF_RET.RemainingRets() JF_SHAPES_ATTRS JF_BLOCK_ATTRS JF_SCALE_OPTIONS
