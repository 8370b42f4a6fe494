// Argument decoding of jf_produce_quantize (ffi_bindings.h), shared by the CPU and CUDA handlers: the
// producer's inputs checked against the (B, M, K) tensor it produces, which is quantized as jf_quantize
// quantizes an input of that shape and dtype.
#pragma once

#include <string>
#include <vector>

#include "ffi_common.h"
#include "producers.h"

namespace jf {

struct ProduceArgs {
  Producer producer;
  const void* in[2];  // cast: x; rmsnorm: x, gamma; swiglu: h; swiglu_grad: da, h
  InType in_type[2];
  InType out;         // the produced values' dtype (they are rounded to it)
  float eps, inv_k;   // rmsnorm
  float* rstd;        // rmsnorm's extra output (B, M); null otherwise
};

inline ffi::Error in_type(const ffi::AnyBuffer& x, InType* t) {
  float unused;
  return in_type_of(x.element_type(), t, &unused);
}

// args: the producer's inputs; res: the quantize outputs; extra: rmsnorm's rstd (B, M) float32, else
// empty; dtype: the produced dtype as InType (0 float32, 1 bfloat16, 2 float16).
inline ffi::Error make_produce_args(const ffi::RemainingArgs& args, const QuantizeResult* res,
                                    const ffi::AnyBuffer& extra, const Scheme& s, int32_t producer, int32_t dtype,
                                    float eps, QuantizeArgs* a, ProduceArgs* p) {
  if (producer < 0 || producer > int32_t(Producer::kSwigluGrad))
    return bad("produce_quantize: producer must be 0..3, got " + std::to_string(producer));
  if (dtype < 0 || dtype > 2) return bad("produce_quantize: dtype must be 0 (f32), 1 (bf16) or 2 (f16)");
  p->producer = Producer(producer);
  p->out = InType(dtype);
  const size_t n = p->producer == Producer::kRmsNorm || p->producer == Producer::kSwigluGrad ? 2 : 1;
  if (args.size() != n) return bad("produce_quantize: wrong number of inputs for the producer");
  std::vector<ffi::AnyBuffer> in;
  for (size_t i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return bad("produce_quantize: inputs must be buffers");
    in.push_back(*b);
    p->in[i] = in[i].untyped_data();
    if (auto e = in_type(in[i], &p->in_type[i]); e.failure()) return e;
  }
  int64_t B, M, K;
  if (auto e = dims3(in[0], &B, &M, &K); e.failure()) return e;
  const auto same3 = [&](const ffi::AnyBuffer& b, int64_t k) {
    auto d = b.dimensions();
    return d.size() == 3 && d[0] == B && d[1] == M && d[2] == k;
  };
  switch (p->producer) {
    case Producer::kCast: break;
    case Producer::kRmsNorm:
      if (in[1].dimensions().size() != 1 || in[1].dimensions()[0] != K)
        return bad("produce_quantize: rmsnorm's gamma must be (K,) for x (B, M, K)");
      break;
    case Producer::kSwiglu:
      if (K % 2) return bad("produce_quantize: swiglu's input must be (B, M, 2F)");
      K /= 2;
      break;
    case Producer::kSwigluGrad:
      if (!same3(in[1], 2 * K)) return bad("produce_quantize: swiglu_grad takes da (B, M, F) and h (B, M, 2F)");
      K *= 2;
      break;
  }
  static const ffi::DataType kTypes[3] = {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16};
  if (auto e = fill_quantize_args(kTypes[dtype], B, M, K, s, a); e.failure()) return e;
  if (auto e = check_quantize_outputs(res, a); e.failure()) return e;
  p->eps = eps;
  p->inv_k = K > 0 ? inv_len(K) : 0.0f;
  const bool rms = p->producer == Producer::kRmsNorm;
  if (rms && (extra.element_type() != ffi::DataType::F32 || !(extra.dimensions().size() == 2 &&
                                                              extra.dimensions()[0] == B && extra.dimensions()[1] == M)))
    return bad("produce_quantize: rmsnorm's rstd output must be float32 (B, M)");
  if (!rms && extra.element_count() != 0) return bad("produce_quantize: only rmsnorm has an extra output");
  p->rstd = rms ? static_cast<float*>(const_cast<void*>(extra.untyped_data())) : nullptr;
  return ffi::Error::Success();
}

}  // namespace jf
