// Argument decoding of jf_produce and jf_produce_quantize (ffi_bindings.h), shared by the CPU and CUDA
// handlers: the producer's inputs checked against the (B, M, K) tensor it produces (cast: x (B, M, K);
// rmsnorm: x (B, M, K), gamma (K,); swiglu: h (B, M, 2K); swiglu_grad: da (B, M, F), h (B, M, 2F), K = 2F;
// gelu: x (B, M, K); gelu_grad: da (B, M, K), x (B, M, K); layernorm: x (B, M, K), gamma (K,), beta (K,)),
// which jf_produce returns and jf_produce_quantize quantizes as jf_quantize quantizes an input of that
// shape and dtype.
#pragma once

#include <string>
#include <vector>

#include "ffi_common.h"
#include "producers.h"

namespace jf {

struct ProduceArgs {
  Producer producer;
  // cast, gelu: x; rmsnorm: x, gamma; swiglu: h; swiglu_grad: da, h; gelu_grad: da, x; layernorm: x, gamma, beta
  const void* in[3];
  InType in_type[3];
  InType out;        // the produced values' dtype (they are rounded to it)
  float eps, inv_k;  // the norms'
  // the norms' extra output, each row's statistics for the backward: rmsnorm rstd (B, M); layernorm (mean,
  // rstd) (B, M, 2); null otherwise
  float* stats;
};

inline bool is_norm(Producer p) { return p == Producer::kRmsNorm || p == Producer::kLayerNorm; }

inline ffi::Error in_type(const ffi::AnyBuffer& x, InType* t) {
  float unused;
  return in_type_of(x.element_type(), t, &unused);
}

// The producer of a call: its inputs checked against each other (shapes in produce_args.h's header
// comment), the produced tensor's (B, M, K), the extra output (the norms' statistics, ProduceArgs::stats,
// float32; else empty) and `dtype`, the produced dtype as InType (0 float32, 1 bfloat16, 2 float16).
inline ffi::Error make_producer(const ffi::RemainingArgs& args, const ffi::AnyBuffer& extra, int32_t producer,
                                int32_t dtype, float eps, int64_t* B, int64_t* M, int64_t* K, ProduceArgs* p) {
  if (producer < 0 || producer > int32_t(Producer::kLayerNorm))
    return bad("produce: producer must be 0..6, got " + std::to_string(producer));
  if (dtype < 0 || dtype > 2) return bad("produce: dtype must be 0 (f32), 1 (bf16) or 2 (f16)");
  p->producer = Producer(producer);
  p->out = InType(dtype);
  const size_t n = p->producer == Producer::kLayerNorm                                                     ? 3
                   : p->producer == Producer::kRmsNorm || p->producer == Producer::kSwigluGrad ||
                           p->producer == Producer::kGeluGrad
                       ? 2
                       : 1;
  if (args.size() != n) return bad("produce: wrong number of inputs for the producer");
  std::vector<ffi::AnyBuffer> in;
  for (size_t i = 0; i < n; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return bad("produce: inputs must be buffers");
    in.push_back(*b);
    p->in[i] = in[i].untyped_data();
    if (auto e = in_type(in[i], &p->in_type[i]); e.failure()) return e;
  }
  if (auto e = dims3(in[0], B, M, K); e.failure()) return e;
  const auto same3 = [&](const ffi::AnyBuffer& b, int64_t k) {
    auto d = b.dimensions();
    return d.size() == 3 && d[0] == *B && d[1] == *M && d[2] == k;
  };
  switch (p->producer) {
    case Producer::kCast:
    case Producer::kGelu: break;
    case Producer::kGeluGrad:
      if (!same3(in[1], *K)) return bad("produce: gelu_grad takes da and x of one shape (B, M, K)");
      break;
    case Producer::kRmsNorm:
    case Producer::kLayerNorm:
      for (size_t i = 1; i < n; ++i)
        if (in[i].dimensions().size() != 1 || in[i].dimensions()[0] != *K)
          return bad("produce: a norm's gamma and beta must be (K,) for x (B, M, K)");
      break;
    case Producer::kSwiglu:
      if (*K % 2) return bad("produce: swiglu's input must be (B, M, 2F)");
      *K /= 2;
      break;
    case Producer::kSwigluGrad:
      if (!same3(in[1], 2 * *K)) return bad("produce: swiglu_grad takes da (B, M, F) and h (B, M, 2F)");
      *K *= 2;
      break;
  }
  p->eps = eps;
  p->inv_k = *K > 0 ? inv_len(*K) : 0.0f;
  const bool norm = is_norm(p->producer), ln = p->producer == Producer::kLayerNorm;
  const auto d = extra.dimensions();
  if (norm && (extra.element_type() != ffi::DataType::F32 || d.size() != size_t(ln ? 3 : 2) || d[0] != *B ||
               d[1] != *M || (ln && d[2] != 2)))
    return bad("produce: the statistics output must be float32 (B, M) for rmsnorm, (B, M, 2) for layernorm");
  if (!norm && extra.element_count() != 0) return bad("produce: only the norms have an extra output");
  p->stats = norm ? static_cast<float*>(const_cast<void*>(extra.untyped_data())) : nullptr;
  return ffi::Error::Success();
}

inline const ffi::DataType kProducedTypes[3] = {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16};

// A jf_produce_quantize call: the producer, then its tensor's quantize outputs (res) as jf_quantize's.
inline ffi::Error make_produce_args(const ffi::RemainingArgs& args, const QuantizeResult* res,
                                    const ffi::AnyBuffer& extra, const Scheme& s, int32_t producer, int32_t dtype,
                                    float eps, QuantizeArgs* a, ProduceArgs* p) {
  int64_t B, M, K;
  if (auto e = make_producer(args, extra, producer, dtype, eps, &B, &M, &K, p); e.failure()) return e;
  if (auto e = fill_quantize_args(kProducedTypes[dtype], B, M, K, s, a); e.failure()) return e;
  return check_quantize_outputs(res, a);
}

// A jf_produce call: the producer, and its tensor's output y (B, M, K), whose dtype is the produced one.
inline ffi::Error make_produce_only(const ffi::RemainingArgs& args, const ffi::AnyBuffer& y,
                                    const ffi::AnyBuffer& extra, int32_t producer, float eps, int64_t* B, int64_t* M,
                                    int64_t* K, ProduceArgs* p) {
  InType t;
  if (auto e = in_type(y, &t); e.failure()) return bad("produce: the output must be float32, bfloat16 or float16");
  if (auto e = make_producer(args, extra, producer, int32_t(t), eps, B, M, K, p); e.failure()) return e;
  auto d = y.dimensions();
  if (d.size() != 3 || d[0] != *B || d[1] != *M || d[2] != *K) return bad("produce: the output must be (B, M, K)");
  return ffi::Error::Success();
}

// A jf_norm_grad call (producers.h's norm backward): x (B, M, K), gamma (K,), the forward's statistics
// (rmsnorm: rstd (B, M); layernorm: (mean, rstd) (B, M, 2)), dy (B, M, K); dx (B, M, K), the column sums
// (n, K) float32 (dgamma; layernorm: then dbeta) and a float32 workspace (the CUDA kernels': each block's
// column sums; the CPU kernel takes any size).
struct NormGradArgs {
  bool layer;
  int64_t B, M, K;
  const void *x, *gamma, *dy;
  InType xt, gt, dyt, dxt;
  const float* stats;
  void* dx;
  float *sums, *work;
  int64_t work_size;  // floats
  float inv_k;
  int64_t blocks() const { return B * cdiv(M, kGradRows); }  // of kGradRows rows (partial at each entry's end)
  int n_sums() const { return layer ? 2 : 1; }
  // the CUDA kernels' workspace: every block's n_sums() x K column sums
  int64_t work_needed() const { return blocks() * n_sums() * K; }
};

inline ffi::Error make_norm_grad(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& stats,
                                 const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx, const ffi::AnyBuffer& sums,
                                 const ffi::AnyBuffer& work, int32_t producer, NormGradArgs* a) {
  if (producer != int32_t(Producer::kRmsNorm) && producer != int32_t(Producer::kLayerNorm))
    return bad("norm_grad: producer must be 1 (rmsnorm) or 6 (layernorm), got " + std::to_string(producer));
  a->layer = producer == int32_t(Producer::kLayerNorm);
  if (auto e = dims3(x, &a->B, &a->M, &a->K); e.failure()) return e;
  const auto same3 = [&](const ffi::AnyBuffer& b) {
    auto d = b.dimensions();
    return d.size() == 3 && d[0] == a->B && d[1] == a->M && d[2] == a->K;
  };
  if (!same3(dy) || !same3(dx)) return bad("norm_grad: x, dy and dx must have one shape (B, M, K)");
  if (gamma.dimensions().size() != 1 || gamma.dimensions()[0] != a->K) return bad("norm_grad: gamma must be (K,)");
  const auto sd = stats.dimensions();
  if (stats.element_type() != ffi::DataType::F32 || sd.size() != size_t(a->layer ? 3 : 2) || sd[0] != a->B ||
      sd[1] != a->M || (a->layer && sd[2] != 2))
    return bad("norm_grad: the statistics must be float32 (B, M) for rmsnorm, (B, M, 2) for layernorm");
  const auto nd = sums.dimensions();
  if (sums.element_type() != ffi::DataType::F32 || nd.size() != 2 || nd[0] != a->n_sums() || nd[1] != a->K)
    return bad("norm_grad: the column sums must be float32 (1, K) for rmsnorm, (2, K) for layernorm");
  if (work.element_type() != ffi::DataType::F32) return bad("norm_grad: the workspace must be float32");
  for (auto [b, t] : {std::pair{&x, &a->xt}, {&gamma, &a->gt}, {&dy, &a->dyt}, {&dx, &a->dxt}})
    if (auto e = in_type(*b, t); e.failure()) return e;
  a->x = x.untyped_data();
  a->gamma = gamma.untyped_data();
  a->dy = dy.untyped_data();
  a->stats = static_cast<const float*>(stats.untyped_data());
  a->dx = const_cast<void*>(dx.untyped_data());
  a->sums = static_cast<float*>(const_cast<void*>(sums.untyped_data()));
  a->work = static_cast<float*>(const_cast<void*>(work.untyped_data()));
  a->work_size = int64_t(work.element_count());
  a->inv_k = a->K > 0 ? inv_len(a->K) : 0.0f;
  return ffi::Error::Success();
}

}  // namespace jf
