// Per-element and per-block FP8 math shared by the C++ CPU kernels and the CUDA kernels.
//
// Every rule that decides a bit of output lives here once: the MXFP8 E8M0 scale rule, the
// Float8 blockwise fp32 scale rule, the saturating round-to-nearest-even cast to E4M3/E5M2,
// the FP8 decode and the conversions to and from bf16/fp16. The jax.numpy reference in
// jax_fp8/reference.py defines the same numbers; tests compare the two bit for bit.
// Build without fast math or flush-to-zero: subnormal amaxes and elements are part of the contract.
//
// GPU fast paths that compute the same bits with other instructions:
// - here, under __CUDA_ARCH__: the hardware satfinite cast of element pairs (fp8x2_from_float; the CPU
//   kernels cast with fp8_from_float_sw), the paired bf16/fp16 rounding (cvt_pack2:
//   cvt.rn.{bf16x2,f16x2}.f32) and f16_from_float's __float2half_rn;
// - outside this file: the packed amax of bf16/fp16 pairs (cuda_common.cuh, Load16::max_abs2:
//   max.xorsign.abs.{bf16x2,f16x2}) and the paired FP8 decode (dequantize.cuh, fp8x2_to_float2).
// On a GPU backend tests/test_mxfp8.py and tests/test_blockwise.py run them against the reference on
// every input dtype with zeros, subnormals, huge values, inf and NaN, bit for bit, and
// bench/kernel_bench.cu checks each launch configuration against a host loop over this file.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#else
#define JF_HD inline
#endif

namespace jf {

JF_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum Fp8Kind : int { kE4M3 = 0, kE5M2 = 1 };

JF_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
JF_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
JF_HD bool is_nan(float f) { return (f2u(f) & 0x7FFFFFFFu) > 0x7F800000u; }
JF_HD bool is_inf(float f) { return (f2u(f) & 0x7FFFFFFFu) == 0x7F800000u; }
JF_HD float abs_f(float f) { return u2f(f2u(f) & 0x7FFFFFFFu); }
// Block amax step as TE: fmaxf ignores NaN elements, inf counts.
JF_HD float amax_step(float acc, float v) {
#if defined(__CUDA_ARCH__)
  return fmaxf(acc, fabsf(v));  // one max with |v|; fmaxf returns the non-NaN operand (acc is never NaN)
#else
  const float a = abs_f(v);
  return (a > acc) ? a : acc;  // NaN compares false: ignored
#endif
}

// ---- FP8 element formats --------------------------------------------------------------------
JF_HD float fp8_max(int kind) { return kind == kE4M3 ? 448.0f : 57344.0f; }
// 1/fp8_max as an fp32 constant (TE's max_norm_rcp): 1/448 and 1/57344 rounded to fp32.
JF_HD float fp8_max_rcp(int kind) { return kind == kE4M3 ? (1.0f / 448.0f) : (1.0f / 57344.0f); }
constexpr uint8_t kFp8NaN = 0x7F;  // canonical NaN byte for both formats (what the GPU's cvt emits)

// Round a finite, non-negative fp32 to a small float format with `mant` mantissa bits and
// exponent bias `bias` (round to nearest even, subnormals included). Returns the magnitude bits;
// a result past the largest exponent carries into the exponent field (the caller saturates).
JF_HD uint32_t round_magnitude(float a, int mant, int bias) {
  // Both candidates are computed and one selected, so loops over elements stay branch-free.
  const float min_normal = u2f(uint32_t(127 + 1 - bias) << 23);
  // Subnormal: count units of 2^(1-bias-mant); adding 2^23 rounds the count to nearest even.
  const float units = a * u2f(uint32_t(127 + bias + mant - 1) << 23);
  const uint32_t sub = f2u(units + 8388608.0f) - 0x4B000000u;
  const int shift = 23 - mant;
  uint32_t u = f2u(a);
  u += ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
  const uint32_t normal = (u >> shift) - (uint32_t(127 - bias) << mant);
  return a < min_normal ? sub : normal;
}

// Saturating round-to-nearest-even cast (TE's satfinite): |v| >= max gives +-max, NaN gives 0x7F.
JF_HD uint8_t fp8_from_float_sw(float v, int kind) {
  const uint32_t sign = (f2u(v) >> 24) & 0x80u;
  const float a = abs_f(v);
  const bool e4m3 = kind == kE4M3;
  const uint32_t mag = e4m3 ? round_magnitude(a, 3, 7) : round_magnitude(a, 2, 15);
  const uint32_t sat = a >= fp8_max(kind) ? (e4m3 ? 0x7Eu : 0x7Bu) : mag;
  return uint8_t(is_nan(v) ? kFp8NaN : (sign | sat));
}

#if defined(__CUDACC__)
// Two elements at once through the hardware's satfinite conversion (sm_89+); equal to the
// software rule above bit for bit (the GPU tests check it against the reference).
__device__ __forceinline__ uint16_t fp8x2_from_float(float lo, float hi, int kind) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                  kind == kE4M3 ? __NV_E4M3 : __NV_E5M2);
}
#endif

// Exact decode of an FP8 byte.
JF_HD float fp8_to_float(uint8_t b, int kind) {
  const int mant_bits = kind == kE4M3 ? 3 : 2;
  const int bias = kind == kE4M3 ? 7 : 15;
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t exp = (b & 0x7Fu) >> mant_bits;
  const uint32_t mant = b & ((1u << mant_bits) - 1u);
  const uint32_t exp_max = (1u << (7 - mant_bits)) - 1u;
  if (kind == kE4M3 && exp == exp_max && mant == 7u) return u2f(0x7FC00000u);
  if (kind == kE5M2 && exp == exp_max) return u2f(mant ? 0x7FC00000u : (sign | 0x7F800000u));
  if (exp == 0) {  // subnormal: mant * 2^(1-bias-mant_bits), exact in fp32
    const float v = float(mant) * u2f(uint32_t(127 + 1 - bias - mant_bits) << 23);
    return u2f(f2u(v) | sign);
  }
  return u2f(sign | ((exp - bias + 127) << 23) | (mant << (23 - mant_bits)));
}

// ---- MXFP8: E8M0 scales (TE's pre-Blackwell software path) ------------------------------------
// e = float_to_e8m0(amax * (1/fp8_max)): the exponent of v, rounded up when v is not a power of
// two, except at 0xFE (saturate) and for subnormal v <= 2^-127 (stays 0). NaN -> 0xFF, inf -> 0xFE.
JF_HD uint8_t e8m0_from_amax(float amax, int kind) {
  const float v = amax * fp8_max_rcp(kind);
  if (is_nan(v)) return 0xFF;
  if (is_inf(v)) return 0xFE;
  if (v == 0.0f) return 0;
  const uint32_t bits = f2u(v);
  uint32_t exp = (bits >> 23) & 0xFFu;
  const uint32_t mant = bits & 0x7FFFFFu;
  if (mant > 0 && exp != 0xFEu && !(exp == 0 && mant <= 0x400000u)) ++exp;
  return uint8_t(exp);
}
// Multiplier applied before the cast: 2^(127-e), 1.0 for e == 0 (bits (254-e) << 23, as TE).
JF_HD float e8m0_reciprocal(uint8_t e) {
  return e == 0 ? 1.0f : u2f(uint32_t(254 - int(e)) << 23);
}
// Dequantization scale 2^(e-127): 2^-127 (subnormal) for e == 0, NaN for 0xFF.
JF_HD float e8m0_to_float(uint8_t e) {
  if (e == 0xFF) return u2f(0x7FC00000u);
  return e == 0 ? u2f(0x00400000u) : u2f(uint32_t(e) << 23);
}

// ---- Float8 blockwise: fp32 scales (TE's compute_scale_from_amax) ------------------------------
JF_HD float block_scale_from_amax(float amax, int kind, bool pow2, float eps, float inf_value) {
  if (amax < eps) amax = eps;
  if (is_inf(amax) || amax == 0.0f || is_nan(amax)) return 1.0f;
  float scale = fp8_max(kind) / amax;  // IEEE division, round to nearest
  if (is_inf(scale)) scale = inf_value;  // largest finite value of the input dtype
  if (pow2) scale = u2f(f2u(scale) & 0xFF800000u);
  return scale;
}

// ---- Scale rules: amax -> (stored scale, multiplier) ----------------------------------------
struct MxRule {
  using ScaleT = uint8_t;
  int kind;
  JF_HD void operator()(float amax, ScaleT& stored, float& mult) const {
    stored = e8m0_from_amax(amax, kind);
    mult = e8m0_reciprocal(stored);
  }
  JF_HD static float dequant_scale(ScaleT s) { return e8m0_to_float(s); }
  // Master-weight shards: what a rank contributes to the all-reduce (its local E8M0 byte, whose max
  // over ranks is the byte of the global amax) and how the reduced value gives (stored, mult).
  JF_HD ScaleT partial(float amax) const { return e8m0_from_amax(amax, kind); }
  JF_HD void from_global(ScaleT g, ScaleT& stored, float& mult) const {
    stored = g;
    mult = e8m0_reciprocal(g);
  }
};
// INF_SCALE_INV (scheme.py's saturate_inf=False): a block whose amax is inf stores scale_inv inf, so it
// dequantizes to non-finite values. A type of its own: a runtime flag costs the tightest kernel a spill.
template <bool INF_SCALE_INV>
struct BlockRuleT {
  using ScaleT = float;
  int kind;
  bool pow2;
  float eps;
  float inf_value;
  JF_HD void operator()(float amax, ScaleT& stored, float& mult) const {
    mult = block_scale_from_amax(amax, kind, pow2, eps, inf_value);
    stored = (INF_SCALE_INV && is_inf(amax)) ? u2f(0x7F800000u) : 1.0f / mult;  // scale_inv, round to nearest
  }
  JF_HD static float dequant_scale(ScaleT s) { return s; }
  // fp32 scales are not monotonic bytes: ranks all-reduce the amax itself.
  JF_HD ScaleT partial(float amax) const { return amax; }
  JF_HD void from_global(float g, ScaleT& stored, float& mult) const { (*this)(g, stored, mult); }
};
using BlockRule = BlockRuleT<false>;  // TransformerEngine's rule

// ---- bf16 / fp16 <-> fp32 -------------------------------------------------------------------
JF_HD float bf16_to_float(uint16_t h) { return u2f(uint32_t(h) << 16); }
JF_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1Fu) return u2f(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) return u2f(f2u(float(mant) * u2f(uint32_t(127 - 24) << 23)) | sign);
  return u2f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}
// Outputs use one canonical quiet NaN per dtype so that every implementation agrees by bits.
JF_HD uint16_t bf16_from_float(float v) {
  if (is_nan(v)) return 0x7FC0;
  uint32_t u = f2u(v);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
JF_HD uint16_t f16_from_float(float v) {
  if (is_nan(v)) return 0x7E00;
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(v));  // the same IEEE rounding in one instruction
#endif
  const uint16_t sign = uint16_t((f2u(v) >> 16) & 0x8000u);
  const float a = abs_f(v);
  if (a >= 65520.0f) return sign | 0x7C00;  // rounds past the largest finite fp16: inf
  return sign | uint16_t(round_magnitude(a, 10, 15));
}
JF_HD float canonical_f32(float v) { return is_nan(v) ? u2f(0x7FC00000u) : v; }

// Two values rounded as above and packed, a in the low half, on the GPU: one cvt.rn.{bf16x2,f16x2}.f32
// rounds both (the same RNE, subnormals kept, overflow to inf); only its NaN differs from ours, so
// callers pass the word through with_canonical_nans (or test nan_halves first: NaNs are rare).
#if defined(__CUDACC__)
template <bool kHalf>
__device__ __forceinline__ uint32_t cvt_pack2(float a, float b) {
  uint32_t w;
  if constexpr (kHalf) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));  // first source: high half
  else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));
  return w;
}
#endif
// Bit 15 of each half of a packed bf16x2 / f16x2 word set where that half is a NaN: a NaN's magnitude
// exceeds inf's (0x7F80 / 0x7C00), so adding 0x7FFF - inf carries into bit 15 for NaNs only.
template <bool kHalf>
JF_HD uint32_t nan_halves(uint32_t w) {
  return ((w & 0x7FFF7FFFu) + (kHalf ? 0x03FF03FFu : 0x007F007Fu)) & 0x80008000u;
}
template <bool kHalf>
JF_HD uint32_t with_canonical_nans(uint32_t w) {
  const uint32_t m = (nan_halves<kHalf>(w) >> 15) * 0xFFFFu;
  return (w & ~m) | ((kHalf ? 0x7E007E00u : 0x7FC07FC0u) & m);
}

}  // namespace jf
