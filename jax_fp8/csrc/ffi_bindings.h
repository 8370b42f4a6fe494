// The XLA FFI handlers, written once for both platforms: their list (JF_FFI_HANDLERS, at the end: the
// FFI target names, the handler names, their signatures) and their signatures. bind_X(binding) appends
// handler X's arguments, results and attributes to `binding`, which is ffi::Ffi::Bind() on the CPU and
// ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>() on CUDA (cpu_kernels.cc, cuda_kernels.cu).
// The handlers take them in this order, after the binding's own contexts.
//
// A new kernel: one line in JF_FFI_HANDLERS, its bind_ function here, and its handler in each platform
// module (jf::<Name>Cpu in cpu_kernels.cc, jf::<Name>Cuda in cuda_kernels.cu); both modules define and
// register every listed handler through JF_FFI_DEFINE_HANDLERS / JF_FFI_REGISTER_HANDLERS.
#pragma once

#include <utility>

#include "ffi_common.h"
#include "produce_args.h"

namespace jf {

// jf_quantize: x, then per output of the scheme (Scheme::outputs) its data and its scales; the results
// of a second output are empty when the scheme has one.
template <class Binding>
auto bind_quantize(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // x (B, M, K) float32 / bfloat16 / float16
      .template Ret<ffi::AnyBuffer>()  // first output: data, uint8 (B, M, K), or (B, K, M) transposed
      .template Ret<ffi::AnyBuffer>()  // first output: scales (B, rows, ld): E8M0 bytes or fp32 scale_inv
      .template Ret<ffi::AnyBuffer>()  // second output: data (empty if none)
      .template Ret<ffi::AnyBuffer>()  // second output: scales (empty if none)
      .template Attr<Scheme>("scheme");
}

// jf_quantize_grouped: x's rows in groups (groups.h), quantized as jf_quantize's outputs but for the
// columnwise blocks, which restart at every group start (one scale row per block slot).
template <class Binding>
auto bind_quantize_grouped(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // x (B, M, K) float32 / bfloat16 / float16
      .template Arg<ffi::AnyBuffer>()  // group sizes (B, G) int32
      .template Ret<ffi::AnyBuffer>()  // first output: data (rowwise (B, M, K); columnwise (B, K, M))
      .template Ret<ffi::AnyBuffer>()  // first output: fp32 scales (columnwise: (B, slots, ld))
      .template Ret<ffi::AnyBuffer>()  // second output: data (empty if none)
      .template Ret<ffi::AnyBuffer>()  // second output: scales (empty if none)
      .template Attr<Scheme>("scheme");
}

// jf_produce_quantize: a producer's (B, M, K) tensor (producers.h; produce_args.h has the inputs'
// shapes) quantized as jf_quantize quantizes an input of that shape and dtype, never stored in high
// precision; then the producer's extra output.
template <class Binding>
auto bind_produce_quantize(Binding b) {
  return std::move(b)
      .RemainingArgs()                 // the producer's inputs
      .template Ret<ffi::AnyBuffer>()  // first output: data
      .template Ret<ffi::AnyBuffer>()  // first output: scales
      .template Ret<ffi::AnyBuffer>()  // second output: data (empty if none)
      .template Ret<ffi::AnyBuffer>()  // second output: scales (empty if none)
      .template Ret<ffi::AnyBuffer>()  // the norms: statistics (rmsnorm rstd (B, M), layernorm (B, M, 2)); else empty
      .template Attr<Scheme>("scheme")
      .template Attr<int32_t>("producer")  // producers.h's Producer
      .template Attr<int32_t>("dtype")     // the produced dtype: 0 float32, 1 bfloat16, 2 float16
      .template Attr<float>("eps");        // the norms' epsilon
}

// jf_produce: a producer's (B, M, K) tensor (producers.h), rounded to the output's dtype, NaNs canonical;
// then the producer's extra output. The unfused ops, and what the fused kernels do not take.
template <class Binding>
auto bind_produce(Binding b) {
  return std::move(b)
      .RemainingArgs()                     // the producer's inputs
      .template Ret<ffi::AnyBuffer>()      // y (B, M, K) float32 / bfloat16 / float16
      .template Ret<ffi::AnyBuffer>()      // the norms: statistics (as jf_produce_quantize's); else empty
      .template Attr<int32_t>("producer")  // producers.h's Producer
      .template Attr<float>("eps");        // the norms' epsilon
}

// jf_norm_grad: a norm's backward (producers.h; the arguments as produce_args.h's NormGradArgs).
template <class Binding>
auto bind_norm_grad(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()      // x (B, M, K) float32 / bfloat16 / float16
      .template Arg<ffi::AnyBuffer>()      // gamma (K,)
      .template Arg<ffi::AnyBuffer>()      // the forward's statistics: rstd (B, M), or (mean, rstd) (B, M, 2)
      .template Arg<ffi::AnyBuffer>()      // dy (B, M, K)
      .template Ret<ffi::AnyBuffer>()      // dx (B, M, K)
      .template Ret<ffi::AnyBuffer>()      // the column sums (n, K) float32: dgamma; layernorm: then dbeta
      .template Ret<ffi::AnyBuffer>()      // float32 workspace (NormGradArgs::work_needed on CUDA)
      .template Attr<int32_t>("producer");  // producers.h's Producer: kRmsNorm or kLayerNorm
}

// jf_dequantize: one compact output of the scheme back to high precision.
template <class Binding>
auto bind_dequantize(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // data (B, M, K) uint8
      .template Arg<ffi::AnyBuffer>()  // its compact scale grid (B, ceil(M/bm), ceil(K/bk))
      .template Ret<ffi::AnyBuffer>()  // out (B, M, K) float32 / bfloat16 / float16
      .template Attr<Scheme>("scheme");
}

// jf_partial_amax: a group of master-weight shards' partial values (ffi_common.h, master-weight groups).
template <class Binding>
auto bind_partial_amax(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // windows (N, 2) int32: (offset, length) per shard
      .RemainingArgs()                 // N flat shards of one dtype
      .template Ret<ffi::AnyBuffer>()  // packed partial values (E8M0 bytes or fp32 amaxes)
      .template Attr<ffi::Span<const int64_t>>("Ms")  // the weights' rows
      .template Attr<ffi::Span<const int64_t>>("Ks")  // the weights' columns
      .template Attr<Scheme>("scheme");
}

// jf_partial_cast: the shards cast with the reduced (global) values.
template <class Binding>
auto bind_partial_cast(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // windows (N, 2) int32: (offset, length) per shard
      .template Arg<ffi::AnyBuffer>()  // packed global values
      .RemainingArgs()                 // N flat shards of one dtype
      .template Ret<ffi::AnyBuffer>()  // packed scale_inv (fp32 scales; else empty)
      .RemainingRets()                 // per shard and output: its FP8 bytes
      .template Attr<ffi::Span<const int64_t>>("Ms")  // the weights' rows
      .template Attr<ffi::Span<const int64_t>>("Ks")  // the weights' columns
      .template Attr<Scheme>("scheme");
}

// jf_cublaslt_gemm (CUDA only): out = a · bᵀ [+ c] on cuBLASLt (cublaslt_gemm.h).
template <class Binding>
auto bind_cublaslt_gemm(Binding b) {
  return std::move(b)
      .template Ctx<ffi::DeviceOrdinal>()     // keys the handle and algorithm caches
      .template Arg<ffi::AnyBuffer>()         // a (M, K) fp8
      .template Arg<ffi::AnyBuffer>()         // a_scale, GEMM-ready fp32
      .template Arg<ffi::AnyBuffer>()         // b (N, K) fp8
      .template Arg<ffi::AnyBuffer>()         // b_scale, GEMM-ready fp32
      .RemainingArgs()                        // c (M, N), only when accumulating
      .template Ret<ffi::AnyBuffer>()         // out (M, N) bfloat16 / float32
      .template Ret<ffi::AnyBuffer>()         // the cuBLASLt workspace, uint8 (cublaslt_gemm.h)
      .template Attr<int64_t>("a_block_rows")  // rows per scale block of a: 1 (1x128 blocks) or 128 (128x128)
      .template Attr<int64_t>("b_block_rows")  // of b likewise
      .template Attr<int64_t>("algo");         // -1: the heuristic's choice; i: its i-th candidate
}

}  // namespace jf

// Every handler that both platform modules define: X(target, Name, bind, ...) for the FFI target
// `target` (the name the primitives lower to), the handlers jf::<Name><Platform> and the signature
// jf::bind(...); the trailing arguments pass through to X.
#define JF_FFI_HANDLERS(X, ...)                                    \
  X(jf_quantize, Quantize, bind_quantize, __VA_ARGS__)             \
  X(jf_quantize_grouped, QuantizeGrouped, bind_quantize_grouped, __VA_ARGS__) \
  X(jf_dequantize, Dequantize, bind_dequantize, __VA_ARGS__)       \
  X(jf_produce, Produce, bind_produce, __VA_ARGS__)                \
  X(jf_produce_quantize, ProduceQuantize, bind_produce_quantize, __VA_ARGS__) \
  X(jf_norm_grad, NormGrad, bind_norm_grad, __VA_ARGS__)           \
  X(jf_partial_amax, PartialAmax, bind_partial_amax, __VA_ARGS__) \
  X(jf_partial_cast, PartialCast, bind_partial_cast, __VA_ARGS__)

#define JF_FFI_DEFINE_ONE_(target, Name, bind, Platform, binding, traits) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jf##Name##Platform, jf::Name##Platform, jf::bind(binding), traits);
// At namespace scope of a platform module: the XLA handler symbol Jf<Name><Platform> of every listed
// handler, bound with `binding` (an expression: the platform's ffi::Ffi::Bind() and contexts) and
// declaring `traits` (an initializer list of ffi::Traits, {} for none).
#define JF_FFI_DEFINE_HANDLERS(Platform, binding, traits) \
  JF_FFI_HANDLERS(JF_FFI_DEFINE_ONE_, Platform, binding, traits)

#define JF_FFI_REGISTER_ONE_(target, Name, bind, Platform, dict) \
  dict[#target] = nanobind::capsule(reinterpret_cast<void*>(Jf##Name##Platform));
// Inside a module's registrations(): every listed handler's symbol into the nanobind dict `dict`, keyed
// by its FFI target name (what jax_fp8/_ffi.py registers with XLA).
#define JF_FFI_REGISTER_HANDLERS(Platform, dict) JF_FFI_HANDLERS(JF_FFI_REGISTER_ONE_, Platform, dict)
