// Argument decoding shared by the CPU and CUDA FFI handlers.
#pragma once

#include <cstdint>
#include <string>

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
  int64_t blocks(const QuantizeArgs& a) const { return cdiv(a.M, bm) * cdiv(a.K, bk); }
};
inline int usages_of(const QuantizeArgs& a, Usage* u) {
  int n = 0;
  if (a.row_block) u[n++] = {1, a.row_block};
  if (a.col_block) u[n++] = {a.col_block, 1};
  if (a.tile_block) u[n++] = {a.tile_block, a.tile_block};
  return n;
}

// A master-weight shard: elements [offset, offset + length) of a row-major (M, K) weight, held in a
// flat buffer of L elements (elements past `length` or past the weight are padding). offset and
// length are int32 scalars in the platform's memory (device memory on GPU).
inline ffi::Error make_shard_args(const ffi::AnyBuffer& shard, const ffi::AnyBuffer& offset,
                                  const ffi::AnyBuffer& length, int64_t M, int64_t K, int64_t fp8,
                                  int64_t scale_kind, int64_t row_block, int64_t col_block, int64_t tile_block,
                                  bool pow2, float eps, QuantizeArgs* a, int64_t* L) {
  if (shard.dimensions().size() != 1) return bad("a master-weight shard must be a flat (rank-1) buffer");
  if (offset.element_type() != ffi::DataType::S32 || length.element_type() != ffi::DataType::S32 ||
      offset.element_count() != 1 || length.element_count() != 1)
    return bad("shard offset and length must be int32 scalars");
  *L = shard.dimensions()[0];
  return fill_quantize_args(shard.element_type(), 1, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2,
                            eps, a);
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
#define JF_SHARD_ATTRS .Attr<int64_t>("M").Attr<int64_t>("K") JF_BLOCK_ATTRS
// x -> (data, scale) x 2
#define JF_BIND_QUANTIZE(b) b JF_ARG JF_RET JF_RET JF_RET JF_RET JF_BLOCK_ATTRS JF_SCALE_OPTIONS
// data, scale -> out
#define JF_BIND_DEQUANTIZE(b) \
  b JF_ARG JF_ARG JF_RET.Attr<int64_t>("fp8").Attr<int64_t>("block_m").Attr<int64_t>("block_k")
// shard, offset, length -> partial-value grids x 2
#define JF_BIND_PARTIAL_AMAX(b) b JF_ARG JF_ARG JF_ARG JF_RET JF_RET JF_SHARD_ATTRS
// shard, offset, length, global grids x 2 -> data x 2, scale_inv x 2
#define JF_BIND_PARTIAL_CAST(b) \
  b JF_ARG JF_ARG JF_ARG JF_ARG JF_ARG JF_RET JF_RET JF_RET JF_RET JF_SHARD_ATTRS JF_SCALE_OPTIONS
