// The XLA FFI handlers of the CUDA module (built for sm_90 where nvcc exists) and its nanobind
// registrations. The kernels are in quantize_tiles.cuh and dequantize.cuh.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <algorithm>

#include "dequantize.cuh"
#include "ffi_common.h"
#include "fp8_math.h"
#include "quantize_tiles.cuh"

namespace jf {
namespace {

ffi::Error QuantizeCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> o0,
                            ffi::Result<ffi::AnyBuffer> o1, ffi::Result<ffi::AnyBuffer> o2,
                            ffi::Result<ffi::AnyBuffer> o3, int64_t fp8, int64_t scale_kind, int64_t row_block,
                            int64_t col_block, int64_t tile_block, bool pow2, float eps) {
  QuantizeArgs a;
  if (auto e = make_quantize_args(x, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps, &a); e.failure())
    return e;
  if (a.B * a.M * a.K == 0) return ffi::Error::Success();
  uint8_t* d[2] = {static_cast<uint8_t*>(o0->untyped_data()), static_cast<uint8_t*>(o2->untyped_data())};
  void* s[2] = {o1->untyped_data(), o3->untyped_data()};
  const void* none[2] = {nullptr, nullptr};
  const Span sp = dense_span(a.M, a.K);
  if (auto e = run_tiles<kQuantize>(stream, a, x.untyped_data(), sp, d, s, none); e.failure()) return e;
  return check_launch();
}

__global__ void scale_inv_kernel(const float* __restrict__ amax, float* __restrict__ scale_inv, int64_t n,
                                 BlockRule rule) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i < n) {
    float mult;
    rule(amax[i], scale_inv[i], mult);
  }
}

ffi::Error PartialAmaxCudaImpl(cudaStream_t stream, ffi::AnyBuffer shard, ffi::AnyBuffer offset, ffi::AnyBuffer length,
                               ffi::Result<ffi::AnyBuffer> o0, ffi::Result<ffi::AnyBuffer> o1, int64_t M, int64_t K,
                               int64_t fp8, int64_t scale_kind, int64_t row_block, int64_t col_block,
                               int64_t tile_block) {
  QuantizeArgs a;
  int64_t L_;
  if (auto e = make_shard_args(shard, offset, length, M, K, fp8, scale_kind, row_block, col_block, tile_block, false,
                               0.0f, &a, &L_);
      e.failure())
    return e;
  uint8_t* d[2] = {nullptr, nullptr};
  void* s[2] = {o0->untyped_data(), o1->untyped_data()};
  const void* none[2] = {nullptr, nullptr};
  // blocks outside the launched tiles hold none of the shard: partial value 0 (E8M0 0 / amax 0.0)
  const size_t item = a.scale_kind == kScaleE8M0 ? 1 : 4;
  Usage u[2];
  const int n_usages = usages_of(a, u);
  for (int i = 0; i < n_usages; ++i) cudaMemsetAsync(s[i], 0, u[i].blocks(a) * item, stream);
  if (a.M * a.K == 0) return check_launch();
  const Span sp = shard_span(a.M, a.K, L_, offset.untyped_data(), length.untyped_data());
  if (auto e = run_tiles<kAmax>(stream, a, shard.untyped_data(), sp, d, s, none); e.failure()) return e;
  return check_launch();
}

// Zeros bytes [end, L) of the cast outputs, end = the number of shard elements inside the weight
// (read from device memory): 16-byte stores, bytewise at the edges.
__global__ void zero_padding_kernel(uint8_t* d0, uint8_t* d1, int64_t L, const int32_t* offset, const int32_t* length,
                                    int64_t MK) {
  const int64_t end = max(int64_t(0), min(min(int64_t(*length), MK - *offset), L));
  const auto zero16 = [&](uint8_t* d, int64_t i) {
    if (i >= end && i + 16 <= L) {
      *reinterpret_cast<uint4*>(d + i) = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t j = max(i, end); j < min(i + 16, L); ++j) d[j] = 0;
    }
  };
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t w = end / 16 + blockIdx.x * int64_t(kThreads) + threadIdx.x; w * 16 < L; w += stride) {
    zero16(d0, w * 16);
    if (d1) zero16(d1, w * 16);
  }
}

ffi::Error PartialCastCudaImpl(cudaStream_t stream, ffi::AnyBuffer shard, ffi::AnyBuffer offset, ffi::AnyBuffer length,
                               ffi::AnyBuffer g0, ffi::AnyBuffer g1, ffi::Result<ffi::AnyBuffer> d0,
                               ffi::Result<ffi::AnyBuffer> d1, ffi::Result<ffi::AnyBuffer> s0,
                               ffi::Result<ffi::AnyBuffer> s1, int64_t M, int64_t K, int64_t fp8, int64_t scale_kind,
                               int64_t row_block, int64_t col_block, int64_t tile_block, bool pow2, float eps) {
  QuantizeArgs a;
  int64_t L_;
  if (auto e = make_shard_args(shard, offset, length, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2,
                               eps, &a, &L_);
      e.failure())
    return e;
  uint8_t* d[2] = {static_cast<uint8_t*>(d0->untyped_data()), static_cast<uint8_t*>(d1->untyped_data())};
  void* s[2] = {s0->untyped_data(), s1->untyped_data()};
  const void* global[2] = {g0.untyped_data(), g1.untyped_data()};
  Usage u[2];
  const int n_usages = usages_of(a, u);
  if (L_ > 0) {  // the tile kernel writes the shard's elements; zero only the padding after them
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t grid = std::min<int64_t>(cdiv(cdiv(L_, 16), kThreads), 4 * int64_t(sms));
    zero_padding_kernel<<<unsigned(grid), kThreads, 0, stream>>>(
        d[0], n_usages > 1 ? d[1] : nullptr, L_, static_cast<const int32_t*>(offset.untyped_data()),
        static_cast<const int32_t*>(length.untyped_data()), a.M * a.K);
  }
  if (a.scale_kind == kScaleFp32) {  // every rank derives the same scale_inv grids from the global amaxes
    const BlockRule rule{a.fp8, a.pow2, a.eps, a.inf_value};
    for (int i = 0; i < n_usages; ++i) {
      const int64_t n = u[i].blocks(a);
      if (n > 0)
        scale_inv_kernel<<<unsigned(cdiv(n, kThreads)), kThreads, 0, stream>>>(
            static_cast<const float*>(global[i]), static_cast<float*>(s[i]), n, rule);
    }
  }
  if (a.M * a.K == 0) return check_launch();
  const Span sp = shard_span(a.M, a.K, L_, offset.untyped_data(), length.untyped_data());
  if (auto e = run_tiles<kCast>(stream, a, shard.untyped_data(), sp, d, s, global); e.failure()) return e;
  return check_launch();
}

template <class Rule>
ffi::Error dequantize_rule(cudaStream_t st, const void* d, const void* s, ffi::Result<ffi::AnyBuffer>& out, int64_t B,
                           int64_t M, int64_t K, int bm, int bk, int fp8) {
  void* o = out->untyped_data();
  switch (out->element_type()) {
    case ffi::DataType::F32: launch_dequantize<Rule, StoreF32>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    case ffi::DataType::BF16: launch_dequantize<Rule, Store16<false>>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    case ffi::DataType::F16: launch_dequantize<Rule, Store16<true>>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    default: return bad("dequantize output must be float32, bfloat16 or float16");
  }
  return check_launch();
}

ffi::Error DequantizeCudaImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                              ffi::Result<ffi::AnyBuffer> out, int64_t fp8, int64_t block_m, int64_t block_k) {
  int64_t B, M, K;
  if (auto e = dims3(data, &B, &M, &K); e.failure()) return e;
  const auto pow2 = [](int64_t v) { return v >= 1 && (v & (v - 1)) == 0; };
  if (!pow2(block_m) || !pow2(block_k) || (block_k != 1 && block_k % 8 != 0)) return bad("unsupported block size");
  if (B * M * K == 0) return ffi::Error::Success();
  if (scale.element_type() == ffi::DataType::U8)
    return dequantize_rule<MxRule>(stream, data.untyped_data(), scale.untyped_data(), out, B, M, K, int(block_m),
                                   int(block_k), int(fp8));
  if (scale.element_type() == ffi::DataType::F32)
    return dequantize_rule<BlockRule>(stream, data.untyped_data(), scale.untyped_data(), out, B, M, K, int(block_m),
                                      int(block_k), int(fp8));
  return bad("scales must be uint8 (E8M0) or float32");
}

}  // namespace
}  // namespace jf

namespace ffi = xla::ffi;
#define JF_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQuantizeCuda, jf::QuantizeCudaImpl, JF_BIND_QUANTIZE(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfDequantizeCuda, jf::DequantizeCudaImpl, JF_BIND_DEQUANTIZE(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfPartialAmaxCuda, jf::PartialAmaxCudaImpl, JF_BIND_PARTIAL_AMAX(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfPartialCastCuda, jf::PartialCastCudaImpl, JF_BIND_PARTIAL_CAST(JF_CUDA_BIND));

// Device-to-device copy (cudaMemcpyAsync): the benchmark's bandwidth roofline, not part of the API.
ffi::Error CopyCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  return jf::check_launch();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfCopyCuda, CopyCudaImpl,
                              JF_CUDA_BIND JF_ARG JF_RET);

NB_MODULE(_jax_fp8_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["jf_quantize"] = nanobind::capsule(reinterpret_cast<void*>(JfQuantizeCuda));
    d["jf_dequantize"] = nanobind::capsule(reinterpret_cast<void*>(JfDequantizeCuda));
    d["jf_partial_amax"] = nanobind::capsule(reinterpret_cast<void*>(JfPartialAmaxCuda));
    d["jf_partial_cast"] = nanobind::capsule(reinterpret_cast<void*>(JfPartialCastCuda));
    d["jf_device_copy"] = nanobind::capsule(reinterpret_cast<void*>(JfCopyCuda));
    return d;
  });
}
