// The XLA FFI handlers of the CUDA module (built for sm_90 where nvcc exists) and its nanobind
// registrations. The kernels: quantize_dense.cuh (dense tensors), quantize_shards.cuh (master-weight
// shards), both over the tile of quantize_tile.cuh, grouped_tile.cuh (rows in groups) and dequantize.cuh; produce_tile.cuh (producers fused
// with quantization) and norm_grad.cuh (the norms' backward); the FP8 GEMM is cuBLASLt's
// (cublaslt_gemm.h, loaded at run time through cublaslt.h).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "dequantize.cuh"
#include "ffi_bindings.h"
#include "ffi_common.h"
#include "cublaslt_gemm.h"
#include "produce_tile.cuh"
#include "norm_grad.cuh"
#include "quantize_dense.cuh"
#include "grouped_tile.cuh"
#include "quantize_shards.cuh"

namespace jf {
namespace {

// x: (B, M, K) float32 / bfloat16 / float16. Per output of the scheme (Scheme::outputs, rowwise
// first): its FP8 data, uint8 (B, M, K), or (B, K, M) for transposed (GEMM-ready columnwise) data,
// and its scales, uint8 E8M0 or fp32 scale_inv: the (B, ceil(M/bm), ceil(K/bk)) grid, or for GEMM-ready
// Float8 scales the grid or its transpose with each stored row padded as the scale buffer is wide. The
// second pair is empty when the scheme has one output.
ffi::Error QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data0,
                        ffi::Result<ffi::AnyBuffer> scale0, ffi::Result<ffi::AnyBuffer> data1,
                        ffi::Result<ffi::AnyBuffer> scale1, Scheme scheme) {
  QuantizeArgs a;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_quantize_args(x, res, scheme, &a); e.failure()) return e;
  if (a.B * a.M * a.K == 0) return ffi::Error::Success();
  uint8_t* d[2] = {static_cast<uint8_t*>(data0->untyped_data()), static_cast<uint8_t*>(data1->untyped_data())};
  void* s[2] = {scale0->untyped_data(), scale1->untyped_data()};
  if (auto e = quantize_tiles(stream, a, x.untyped_data(), d, s); e.failure()) return e;
  return check_launch();
}

// x (B, M, K), its rows in the groups of sizes (B, G) int32: as QuantizeGroupedCpu (grouped_tile.cuh).
ffi::Error QuantizeGroupedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer sizes,
                               ffi::Result<ffi::AnyBuffer> data0, ffi::Result<ffi::AnyBuffer> scale0,
                               ffi::Result<ffi::AnyBuffer> data1, ffi::Result<ffi::AnyBuffer> scale1, Scheme scheme) {
  QuantizeArgs a;
  int64_t G;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_grouped_quantize_args(x, sizes, res, scheme, &a, &G); e.failure()) return e;
  uint8_t* d[2] = {static_cast<uint8_t*>(data0->untyped_data()), static_cast<uint8_t*>(data1->untyped_data())};
  void* s[2] = {scale0->untyped_data(), scale1->untyped_data()};
  if (auto e = quantize_grouped(stream, a, G, x.untyped_data(), static_cast<const int32_t*>(sizes.untyped_data()), d, s);
      e.failure())
    return e;
  return check_launch();
}

// The producer's inputs (produce_args.h); y: its tensor in y's dtype (NaNs canonical), and a norm's statistics.
ffi::Error ProduceCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> extra, int32_t producer, float eps) {
  ProduceArgs p;
  int64_t B, M, K;
  if (auto e = make_produce_only(args, *y, *extra, producer, eps, &B, &M, &K, &p); e.failure()) return e;
  if (auto e = produce_values(stream, p, B, M, K, y->untyped_data()); e.failure()) return e;
  return check_launch();
}

// The producer's inputs (produce_args.h), its quantize outputs as jf_quantize's, and a norm's statistics.
ffi::Error ProduceQuantizeCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> data0,
                               ffi::Result<ffi::AnyBuffer> scale0, ffi::Result<ffi::AnyBuffer> data1,
                               ffi::Result<ffi::AnyBuffer> scale1, ffi::Result<ffi::AnyBuffer> extra, Scheme scheme,
                               int32_t producer, int32_t dtype, float eps) {
  QuantizeArgs a;
  ProduceArgs p;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_produce_args(args, res, *extra, scheme, producer, dtype, eps, &a, &p); e.failure()) return e;
  if (a.B * a.M * a.K == 0) return ffi::Error::Success();
  uint8_t* d[2] = {static_cast<uint8_t*>(data0->untyped_data()), static_cast<uint8_t*>(data1->untyped_data())};
  void* s[2] = {scale0->untyped_data(), scale1->untyped_data()};
  if (auto e = produce_tiles(stream, a, p, d, s); e.failure()) return e;
  return check_launch();
}

// A norm's backward (produce_args.h's NormGradArgs; norm_grad.cuh).
ffi::Error NormGradCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer stats,
                        ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> sums,
                        ffi::Result<ffi::AnyBuffer> work, int32_t producer) {
  NormGradArgs a;
  if (auto e = make_norm_grad(x, gamma, stats, dy, *dx, *sums, *work, producer, &a); e.failure()) return e;
  if (auto e = norm_grad(stream, a); e.failure()) return e;
  return check_launch();
}

// The group's weights as the shard kernel's inputs and outputs; `scales` is the packed buffer of
// partial values (amax) or scale_inv (cast, fp32 only), `global` the packed reduced values (cast).
std::vector<ShardIO> shard_io(const QuantizeArgs& a, const std::vector<GroupWeight>& g, const void* windows,
                              void* scales, const void* global, const std::vector<uint8_t*>& data) {
  const size_t item = scale_bytes(a.format);
  const int nu = a.n_out;
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

// windows: (N, 2) int32 (offset, length) per shard; shards: N flat buffers of one dtype. packed: every
// weight's partial values (E8M0 bytes or fp32 amaxes), packed as Scheme.packed_grids lays them out.
ffi::Error PartialAmaxCuda(cudaStream_t stream, ffi::AnyBuffer windows, ffi::RemainingArgs shards,
                           ffi::Result<ffi::AnyBuffer> packed, ffi::Span<const int64_t> Ms,
                           ffi::Span<const int64_t> Ks, Scheme scheme) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  if (auto e = make_amax_group(windows, shards, *packed, Ms, Ks, scheme, &a, &g); e.failure()) return e;
  const auto io = shard_io(a, g, windows.untyped_data(), packed->untyped_data(), nullptr, {});
  if (auto e = launch_shards<kAmax>(stream, a, io.data(), int(io.size())); e.failure()) return e;
  return check_launch();
}

// windows, shards: as above; global: the packed reduced values. scale_inv: the packed fp32 scale_inv
// (empty for E8M0 scales); datas: each shard's FP8 bytes per output (zeros past its elements).
ffi::Error PartialCastCuda(cudaStream_t stream, ffi::AnyBuffer windows, ffi::AnyBuffer global,
                           ffi::RemainingArgs shards, ffi::Result<ffi::AnyBuffer> scale_inv, ffi::RemainingRets datas,
                           ffi::Span<const int64_t> Ms, ffi::Span<const int64_t> Ks, Scheme scheme) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  std::vector<uint8_t*> data;
  if (auto e = make_cast_group(windows, global, shards, *scale_inv, datas, Ms, Ks, scheme, &a, &g, &data);
      e.failure())
    return e;
  const auto io = shard_io(a, g, windows.untyped_data(),
                           partials_are_scales(a.format) ? nullptr : scale_inv->untyped_data(),
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

// data: (B, M, K) uint8 FP8 bytes; scale: the compact scale grid of the scheme's one output (GEMM-ready
// tensors are compacted before they are dequantized). out: (B, M, K) float32 / bfloat16 / float16.
ffi::Error DequantizeCuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> out, Scheme scheme) {
  int64_t B, M, K;
  Output u;
  if (auto e = make_dequantize_args(data, scale, scheme, &B, &M, &K, &u); e.failure()) return e;
  if (B * M * K == 0) return ffi::Error::Success();
  if (!dequantize_fits(B, M, K)) return bad("dequantize: 2**30 or more rows or columns");
  return with_rule_type(scheme, [&](auto rule) {
    return dequantize_rule<decltype(rule)>(stream, data.untyped_data(), scale.untyped_data(), out, B, M, K, u.bm,
                                           u.bk, scheme.fp8);
  });
}

}  // namespace
}  // namespace jf

namespace ffi = xla::ffi;

// The CUDA handlers' binding: XLA's stream first, then the handler's own (ffi_bindings.h).
static auto cuda_binding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
// Every handler may run inside a CUDA graph (XLA's command buffers): each only launches kernels (and
// cuBLASLt's) on XLA's stream, with no host sync, no allocation (the GEMM's workspace is a result
// buffer), and caches filled outside capture (the cuBLASLt handles: cublaslt_prepare, at lowering).
#define JF_GRAPH_SAFE {ffi::Traits::kCmdBufferCompatible}

// Every handler of ffi_bindings.h's list (jf::<Name>Cuda above), then the CUDA-only GEMM.
JF_FFI_DEFINE_HANDLERS(Cuda, cuda_binding(), JF_GRAPH_SAFE)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfCublasltGemm, jf::CublasltGemm, jf::bind_cublaslt_gemm(cuda_binding()), JF_GRAPH_SAFE);

NB_MODULE(_jax_fp8_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    JF_FFI_REGISTER_HANDLERS(Cuda, d)
    d["jf_cublaslt_gemm"] = nanobind::capsule(reinterpret_cast<void*>(JfCublasltGemm));
    return d;
  });
  // Loads cuBLASLt for jf_cublaslt_gemm (once): (version, path), or (0, why not).
  m.def("cublaslt_load", [](const std::vector<std::string>& paths) {
    std::string message;
    const size_t version = jf::lt::load(paths, &message);
    return std::make_pair(version, message);
  });
  // Makes the cuBLASLt handles of these devices now, outside any CUDA graph capture: "" or what failed.
  m.def("cublaslt_prepare", [](const std::vector<int32_t>& devices) { return jf::prepare_handles(devices); });
  m.attr("cublaslt_header_checked") = bool(JF_CUBLASLT_HEADER_CHECKED);
  // The workspace result jf_cublaslt_gemm's lowering allocates, and how many candidates `algo` picks from.
  m.attr("cublaslt_workspace_bytes") = jf::kGemmWorkspaceBytes + 256;
  m.attr("cublaslt_candidates") = jf::kGemmCandidates;
}
