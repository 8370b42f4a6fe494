// The producers that quantization fuses with (RMSNorm, LayerNorm, SwiGLU, GELU and their derivatives, the cast of fp32
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
enum class Producer : int32_t {
  kCast = 0,
  kRmsNorm = 1,
  kSwiglu = 2,
  kSwigluGrad = 3,
  kGelu = 4,
  kGeluGrad = 5,
  kLayerNorm = 6
};

// The row sums (RMSNorm's of x**2, LayerNorm's of x then of (x - mean)**2): kSumLanes partial sums, partial
// v over elements v, v + kSumLanes, ... in order, then the pairwise tree v + (v ^ half) for half =
// kSumLanes / 2 ... 1.
constexpr int kSumLanes = 256;

JF_HD float sqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
// e**x for x in [-17, 88], the domain sigmoid_f clamps to: Cody-Waite reduction, a degree-6 polynomial by
// Horner's rule (kExpPoly, highest power first), times 2**n. n = rint(x log2 e) is computed as
// (y + 1.5 * 2**23) - 1.5 * 2**23 (round half to even), and its integer is the low bits of y + 1.5 * 2**23:
// no conversion instructions (a quarter of the FP32 rate on the GPU), no branches, no selects; on this
// domain n is in [-25, 127], so 2**n is the exponent field alone and the result is normal.
JF_HD float exp_f(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23
  const float nm = x * 1.44269502f + kMagic;
  const float n = nm - kMagic;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860677e-06f;
  constexpr uint32_t kExpPoly[7] = {0x3AB55C67u, 0x3C0936DFu, 0x3D2AAC4Fu, 0x3E2AAA05u,
                                    0x3EFFFFFDu, 0x3F800000u, 0x3F800000u};
  float p = u2f(kExpPoly[0]);
#pragma unroll
  for (int i = 1; i < 7; ++i) p = p * r + u2f(kExpPoly[i]);
  return p * u2f((f2u(nm) - f2u(kMagic) + 127u) << 23);
}

// 1 / d, IEEE-rounded, for d in [1, 2**126). On the GPU: the fast path of div.rn / rcp.rn (MUFU.RCP and
// one Newton step, correctly rounded for normal d with its reciprocal normal) without the branch to the
// slow path, which d never needs here: a branch per element kept the compiler from interleaving elements.
JF_HD float recip_f(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, -__fmaf_rn(d, r, -1.0f), r);
#else
  return 1.0f / d;
#endif
}

// sigmoid(g) = 1 / (1 + e**-g), with e**-g from exp_f on -g clamped to [-17, 88] (NaN: -17), and 0 where
// 1 + e >= 2**126, i.e. where the quotient would be below float32's normal range (flushed, as FTZ would).
// The clamps change nothing else: below -17, 1 + e rounds to 1 either way; above 88, 1 + e >= 2**126.
// A NaN gate gives s = 1; SwiGLU's products carry the NaN (g * s).
JF_HD float sigmoid_f(float g) {
  const float d = 1.0f + exp_f(fminf(fmaxf(-g, -17.0f), 88.0f));
  return d >= 8.50705917e37f ? 0.0f : recip_f(d);  // 2**126
}

// SwiGLU: silu(gate) * up, before rounding.
JF_HD float swiglu_f(float g, float u) { return (g * sigmoid_f(g)) * u; }
// SwiGLU's gradient given da, before rounding, for the gate column (d_gate) and the up projection's (d_up)
// of one (g, u) pair: one sigmoid for both.
JF_HD void swiglu_grad_pair_f(float d, float g, float u, float& d_gate, float& d_up) {
  const float s = sigmoid_f(g);
  d_up = d * (g * s);
  d_gate = (d * u) * (s * (1.0f + g * (1.0f - s)));
}
// One of the pair: d_up where `up`, else d_gate.
JF_HD float swiglu_grad_half_f(float d, float g, float u, bool up) {
  float d_gate, d_up;
  swiglu_grad_pair_f(d, g, u, d_gate, d_up);
  return up ? d_up : d_gate;
}

// GELU, tanh form: x * sigmoid(x * (A + (B x) x)), A = 2 sqrt(2 / pi), B = 0.044715 A, before rounding.
constexpr float kGeluA = 1.5957691669464111f, kGeluB = 0.07135481387376785f, kGeluB3 = 0.21406444907188416f;
JF_HD float gelu_arg_f(float x) { return x * (kGeluA + (kGeluB * x) * x); }
JF_HD float gelu_f(float x) { return x * sigmoid_f(gelu_arg_f(x)); }
// GELU's gradient given da, before rounding: da * (s + (x * (s (1 - s))) * (A + (3B c) c)), c = x clamped
// to +-20 (beyond, s (1 - s) is 0; inside, (3B c) c cannot overflow to make inf * 0).
JF_HD float gelu_grad_f(float d, float x) {
  const float s = sigmoid_f(gelu_arg_f(x)), c = fminf(fmaxf(x, -20.0f), 20.0f);
  return d * (s + (x * (s * (1.0f - s))) * (kGeluA + (kGeluB3 * c) * c));
}

// A norm's rstd from a row's sum of squares (LayerNorm's: of x - mean): 1 / sqrt(sum * fp32(1 / K) + eps),
// NaN canonical.
JF_HD float rms_rstd_f(float sum_squares, float inv_k, float eps) {
  return canonical_f32(1.0f / sqrt_f(sum_squares * inv_k + eps));  // one NaN, whatever the row's were
}
// LayerNorm's value before rounding: ((x - mean) * rstd) * gamma + beta.
JF_HD float layer_norm_f(float x, float mean, float rstd, float gamma, float beta) {
  return ((x - mean) * rstd) * gamma + beta;
}

// The norms' backward (jax_fp8/producers.py's norm_grad), per element of a row: with xhat = (x - mean) *
// rstd and dxhat = dy * gamma (RMSNorm: mean = 0, c1 = 0, which change no bit), the row sums c1 = sum(dxhat)
// * fp32(1 / K) and c2 = sum(dxhat * xhat) * fp32(1 / K) in the row sums' order, and dx = rstd * ((dxhat - c1)
// - xhat * c2). The column sums (dgamma's terms dy * xhat; LayerNorm's dbeta's, dy) go by blocks of kGradRows
// rows of one batch entry, each from +0 in row order, then the blocks' sums from +0 in order.
constexpr int kGradRows = 64;
JF_HD float norm_xhat_f(float x, float mean, float rstd) { return (x - mean) * rstd; }
JF_HD float norm_dx_f(float dxhat, float xhat, float rstd, float c1, float c2) {
  return rstd * ((dxhat - c1) - xhat * c2);
}

// The float32 nearest 1 / K, as jax_fp8/producers.py's np.float32(1.0 / K).
inline float inv_len(int64_t K) { return float(1.0 / double(K)); }

// The tree of the kSumLanes partials in place: the total ends in p[0].
JF_HD void sum_tree(float* p) {
  for (int half = kSumLanes / 2; half > 0; half /= 2)
    for (int v = 0; v < half; ++v) p[v] = p[v] + p[v + half];
}

}  // namespace jf
