// CPU kernels behind the XLA FFI targets, for the host platform (CI runs these).
// The per-element math comes from fp8_math.h; this file only walks blocks.
#include <nanobind/nanobind.h>
#include <xmmintrin.h>

#include <algorithm>
#include <vector>

#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

// XLA may run host code with flush-to-zero / denormals-are-zero set; our numbers are IEEE.
struct IeeeFpEnv {
  unsigned saved = _mm_getcsr();
  IeeeFpEnv() { _mm_setcsr(saved & ~(0x8000u | 0x0040u)); }
  ~IeeeFpEnv() { _mm_setcsr(saved); }
};

struct LoadF32 {
  using T = float;
  static float get(const T* p, int64_t i) { return p[i]; }
};
struct LoadBF16 {
  using T = uint16_t;
  static float get(const T* p, int64_t i) { return bf16_to_float(p[i]); }
};
struct LoadF16 {
  using T = uint16_t;
  static float get(const T* p, int64_t i) { return f16_to_float(p[i]); }
};

// Quantize one usage: blocks of bm rows x bk cols of every (M, K) matrix in the batch.
// Walks one block-row at a time, rows contiguous, so the loops stream through memory.
template <class L, class Rule>
void quantize_blocks(const typename L::T* x, int64_t B, int64_t M, int64_t K, int bm, int bk,
                     const Rule& rule, int fp8, uint8_t* data, typename Rule::ScaleT* scale) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  std::vector<float> amax(sk), mult(sk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < sm; ++i) {
      const int64_t r0 = i * bm, r1 = std::min(M, r0 + bm);
      std::fill(amax.begin(), amax.end(), 0.0f);
      for (int64_t r = r0; r < r1; ++r) {
        const typename L::T* row = x + (b * M + r) * K;
        for (int64_t k = 0; k < K; ++k) amax[k / bk] = amax_step(amax[k / bk], L::get(row, k));
      }
      typename Rule::ScaleT* srow = scale + (b * sm + i) * sk;
      for (int64_t j = 0; j < sk; ++j) rule(amax[j], srow[j], mult[j]);
      for (int64_t r = r0; r < r1; ++r) {
        const typename L::T* row = x + (b * M + r) * K;
        uint8_t* out = data + (b * M + r) * K;
        for (int64_t k = 0; k < K; ++k) out[k] = fp8_from_float(L::get(row, k) * mult[k / bk], fp8);
      }
    }
  }
}

template <class L, class Rule>
void quantize_all(const QuantizeArgs& a, const void* x, const Rule& rule, uint8_t* const* data,
                  void* const* scale) {
  const auto* in = static_cast<const typename L::T*>(x);
  using S = typename Rule::ScaleT;
  int u = 0;
  if (a.row_block) {
    quantize_blocks<L>(in, a.B, a.M, a.K, 1, a.row_block, rule, a.fp8, data[u], static_cast<S*>(scale[u]));
    ++u;
  }
  if (a.col_block) {
    quantize_blocks<L>(in, a.B, a.M, a.K, a.col_block, 1, rule, a.fp8, data[u], static_cast<S*>(scale[u]));
    ++u;
  }
  if (a.tile_block)
    quantize_blocks<L>(in, a.B, a.M, a.K, a.tile_block, a.tile_block, rule, a.fp8, data[u],
                       static_cast<S*>(scale[u]));
}

template <class Rule>
void quantize_dispatch_in(const QuantizeArgs& a, const void* x, const Rule& rule, uint8_t* const* d,
                          void* const* s) {
  switch (a.in) {
    case InType::kF32: return quantize_all<LoadF32>(a, x, rule, d, s);
    case InType::kBF16: return quantize_all<LoadBF16>(a, x, rule, d, s);
    case InType::kF16: return quantize_all<LoadF16>(a, x, rule, d, s);
  }
}

ffi::Error QuantizeCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> o0, ffi::Result<ffi::AnyBuffer> o1,
                           ffi::Result<ffi::AnyBuffer> o2, ffi::Result<ffi::AnyBuffer> o3, int64_t fp8,
                           int64_t scale_kind, int64_t row_block, int64_t col_block, int64_t tile_block,
                           bool pow2, float eps) {
  QuantizeArgs a;
  if (auto e = make_quantize_args(x, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps, &a);
      e.failure())
    return e;
  IeeeFpEnv env;
  uint8_t* data[2] = {static_cast<uint8_t*>(o0->untyped_data()), static_cast<uint8_t*>(o2->untyped_data())};
  void* scale[2] = {o1->untyped_data(), o3->untyped_data()};
  if (a.scale_kind == kScaleE8M0)
    quantize_dispatch_in(a, x.untyped_data(), MxRule{a.fp8}, data, scale);
  else
    quantize_dispatch_in(a, x.untyped_data(), BlockRule{a.fp8, a.pow2, a.eps, a.inf_value}, data, scale);
  return ffi::Error::Success();
}

// out[b, r, k] = decode(data[b, r, k]) * scale[b, r / bm, k / bk], rounded to the output dtype.
template <class Rule, class Store>
void dequantize_blocks(const uint8_t* data, const typename Rule::ScaleT* scale, int64_t B, int64_t M,
                       int64_t K, int bm, int bk, int fp8, Store store) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < M; ++r) {
      const typename Rule::ScaleT* srow = scale + (b * sm + r / bm) * sk;
      const int64_t base = (b * M + r) * K;
      for (int64_t k = 0; k < K; ++k)
        store(base + k, fp8_to_float(data[base + k], fp8) * Rule::dequant_scale(srow[k / bk]));
    }
}

template <class Rule>
ffi::Error dequantize_typed(const uint8_t* d, const void* s, ffi::Result<ffi::AnyBuffer>& out, int64_t B,
                            int64_t M, int64_t K, int bm, int bk, int fp8) {
  const auto* sc = static_cast<const typename Rule::ScaleT*>(s);
  void* o = out->untyped_data();
  switch (out->element_type()) {
    case ffi::DataType::F32:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<float*>(o)[i] = canonical_f32(v); });
      break;
    case ffi::DataType::BF16:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<uint16_t*>(o)[i] = bf16_from_float(v); });
      break;
    case ffi::DataType::F16:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<uint16_t*>(o)[i] = f16_from_float(v); });
      break;
    default:
      return bad("dequantize output must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeCpuImpl(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                             int64_t fp8, int64_t block_m, int64_t block_k) {
  int64_t B, M, K;
  if (auto e = dims3(data, &B, &M, &K); e.failure()) return e;
  if (block_m < 1 || block_k < 1) return bad("block sizes must be positive");
  IeeeFpEnv env;
  const auto* d = static_cast<const uint8_t*>(data.untyped_data());
  if (scale.element_type() == ffi::DataType::U8)
    return dequantize_typed<MxRule>(d, scale.untyped_data(), out, B, M, K, int(block_m), int(block_k), int(fp8));
  if (scale.element_type() == ffi::DataType::F32)
    return dequantize_typed<BlockRule>(d, scale.untyped_data(), out, B, M, K, int(block_m), int(block_k),
                                       int(fp8));
  return bad("scales must be uint8 (E8M0) or float32");
}

}  // namespace
}  // namespace jf

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQuantizeCpu, jf::QuantizeCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fp8")
                                  .Attr<int64_t>("scale_kind")
                                  .Attr<int64_t>("row_block")
                                  .Attr<int64_t>("col_block")
                                  .Attr<int64_t>("tile_block")
                                  .Attr<bool>("pow2")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfDequantizeCpu, jf::DequantizeCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fp8")
                                  .Attr<int64_t>("block_m")
                                  .Attr<int64_t>("block_k"));

NB_MODULE(_jax_fp8_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["jf_quantize"] = nanobind::capsule(reinterpret_cast<void*>(JfQuantizeCpu));
    d["jf_dequantize"] = nanobind::capsule(reinterpret_cast<void*>(JfDequantizeCpu));
    return d;
  });
}
