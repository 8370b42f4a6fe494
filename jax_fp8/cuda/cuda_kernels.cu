// The XLA FFI handlers of the CUDA module (built for sm_90 where nvcc exists) and its nanobind
// registrations. The kernels are in quantize_tiles.cuh and dequantize.cuh.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <vector>

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
  if (auto e = quantize_tiles(stream, a, x.untyped_data(), d, s); e.failure()) return e;
  return check_launch();
}

// The group's weights as the shard kernel's inputs and outputs; `scales` is the packed buffer of
// partial values (amax) or scale_inv (cast, fp32 only), `global` the packed reduced values (cast).
std::vector<ShardIO> shard_io(const QuantizeArgs& a, const std::vector<GroupWeight>& g, const void* windows,
                              void* scales, const void* global, const std::vector<uint8_t*>& data) {
  const size_t item = a.scale_kind == kScaleE8M0 ? 1 : 4;
  Usage u[2];
  const int nu = usages_of(a, u);
  const auto at = [&](const void* base, int64_t k) -> const void* {
    return base ? static_cast<const char*>(base) + k * item : nullptr;
  };
  std::vector<ShardIO> io;
  for (size_t i = 0; i < g.size(); ++i) {
    ShardIO w{g[i].x, g[i].L, g[i].M, g[i].K, static_cast<const int32_t*>(windows) + 2 * i, {}, {}, {}};
    for (int k = 0; k < nu; ++k) {
      w.data[k] = data.empty() ? nullptr : data[i * nu + k];
      w.scale[k] = const_cast<void*>(at(scales, g[i].at[k]));
      w.global[k] = at(global, g[i].at[k]);
    }
    io.push_back(w);
  }
  return io;
}

ffi::Error PartialAmaxCudaImpl(cudaStream_t stream, ffi::AnyBuffer windows, ffi::RemainingArgs shards,
                               ffi::Result<ffi::AnyBuffer> packed, ffi::Span<const int64_t> Ms,
                               ffi::Span<const int64_t> Ks, int64_t fp8, int64_t scale_kind, int64_t row_block,
                               int64_t col_block, int64_t tile_block) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  if (auto e = make_amax_group(windows, shards, packed, Ms, Ks, fp8, scale_kind, row_block, col_block, tile_block, &a,
                               &g);
      e.failure())
    return e;
  const auto io = shard_io(a, g, windows.untyped_data(), packed->untyped_data(), nullptr, {});
  if (auto e = launch_shards<kAmax>(stream, a, io.data(), int(io.size())); e.failure()) return e;
  return check_launch();
}

ffi::Error PartialCastCudaImpl(cudaStream_t stream, ffi::AnyBuffer windows, ffi::AnyBuffer global,
                               ffi::RemainingArgs shards, ffi::Result<ffi::AnyBuffer> scale_inv,
                               ffi::RemainingRets datas, ffi::Span<const int64_t> Ms, ffi::Span<const int64_t> Ks,
                               int64_t fp8, int64_t scale_kind, int64_t row_block, int64_t col_block,
                               int64_t tile_block, bool pow2, float eps) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  std::vector<uint8_t*> data;
  if (auto e = make_cast_group(windows, global, shards, scale_inv, datas, Ms, Ks, fp8, scale_kind, row_block,
                               col_block, tile_block, pow2, eps, &a, &g, &data);
      e.failure())
    return e;
  const bool fp32 = a.scale_kind == kScaleFp32;
  const auto io = shard_io(a, g, windows.untyped_data(), fp32 ? scale_inv->untyped_data() : nullptr,
                           global.untyped_data(), data);
  if (auto e = launch_shards<kCast>(stream, a, io.data(), int(io.size())); e.failure()) return e;
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
