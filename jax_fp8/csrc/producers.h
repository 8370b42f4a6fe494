// The producers that quantization fuses with (RMSNorm, SwiGLU and its derivative, the cast of fp32
// master weights), shared by the CPU and CUDA kernels. jax_fp8/producers.py defines the same numbers
// (its docstring gives the order of every operation); tests compare them bit for bit. Every fp32 op
// rounds on its own: the module is built without FMA contraction (-ffp-contract=off, nvcc -fmad=false),
// and sqrt / division are IEEE (-prec-sqrt, -prec-div).
#pragma once

#include <cmath>
#include <cstdint>

#include "fp8_math.h"

namespace jf {

// jax_fp8/producers.py's PRODUCERS, in order.
enum class Producer : int32_t { kCast = 0, kRmsNorm = 1, kSwiglu = 2, kSwigluGrad = 3 };

// The row sum of squares: kSumLanes partial sums, partial v over elements v, v + kSumLanes, ... in
// order, then the pairwise tree v + (v ^ half) for half = kSumLanes / 2 ... 1.
constexpr int kSumLanes = 256;

JF_HD float sqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
JF_HD float pow2_f(int k) { return u2f(uint32_t(k + 127) << 23); }  // k in [-126, 127]

// e**x: Cody-Waite reduction, a degree-6 polynomial by Horner's rule (kExpPoly, highest power first), 2**n
// in two exact halves. n = rint(x log2 e), clamped to [-151, 128], is computed as (y + 1.5 * 2**23) - 1.5 * 2**23,
// which rounds half to even for |y| < 2**22 and clamps to the same n beyond; its integer is the low bits of
// n + 1.5 * 2**23. No conversion instructions (a quarter of the FP32 rate on the GPU), no branches.
JF_HD float exp_f(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23
  float n = (x * 1.44269502f + kMagic) - kMagic;
  n = n < -151.0f ? -151.0f : (n > 128.0f ? 128.0f : n);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860677e-06f;
  constexpr uint32_t kExpPoly[7] = {0x3AB55C67u, 0x3C0936DFu, 0x3D2AAC4Fu, 0x3E2AAA05u,
                                    0x3EFFFFFDu, 0x3F800000u, 0x3F800000u};
  float p = u2f(kExpPoly[0]);
#pragma unroll
  for (int i = 1; i < 7; ++i) p = p * r + u2f(kExpPoly[i]);
  const int32_t k = int32_t(f2u(n + kMagic) - f2u(kMagic)), half = k >> 1;  // floor(k / 2)
  const float y = (p * pow2_f(half)) * pow2_f(k - half);
  return is_nan(x) ? x : x > 88.7228394f ? u2f(0x7F800000u) : x < -103.972084f ? 0.0f : y;
}
JF_HD float sigmoid_f(float g) { return 1.0f / (1.0f + exp_f(-g)); }

// SwiGLU: silu(gate) * up, before rounding.
JF_HD float swiglu_f(float g, float u) { return (g * sigmoid_f(g)) * u; }
// SwiGLU's gradient given da, before rounding: d_up (the up projection's column) where `up`, else d_gate
// (the gate's column; u unused for d_up).
JF_HD float swiglu_grad_half_f(float d, float g, float u, bool up) {
  const float s = sigmoid_f(g);
  return up ? d * (g * s) : (d * u) * (s * (1.0f + g * (1.0f - s)));
}

// RMSNorm's rstd from a row's sum of squares: 1 / sqrt(sum * fp32(1 / K) + eps), NaN canonical.
JF_HD float rms_rstd_f(float sum_squares, float inv_k, float eps) {
  return canonical_f32(1.0f / sqrt_f(sum_squares * inv_k + eps));  // one NaN, whatever the row's were
}
// The float32 nearest 1 / K, as jax_fp8/producers.py's np.float32(1.0 / K).
inline float inv_len(int64_t K) { return float(1.0 / double(K)); }

// The tree of the kSumLanes partials in place: the total ends in p[0].
JF_HD void sum_tree(float* p) {
  for (int half = kSumLanes / 2; half > 0; half /= 2)
    for (int v = 0; v < half; ++v) p[v] = p[v] + p[v + half];
}

}  // namespace jf
