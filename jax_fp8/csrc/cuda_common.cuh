// What every CUDA kernel of the module shares: the CTA size, the launch check, and the loaders that
// read 16-byte vectors of the input (fp32, bf16, fp16) and take their amax without unpacking.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include <string>

#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

constexpr int kThreads = 256;

// The current device's SM count: the size of a grid that walks its work in waves over the chip.
inline int current_sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

// The error of the last launch, if any (launches are asynchronous: this catches configuration errors).
inline ffi::Error check_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_fp8 CUDA: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// A block's scale. fp32 scales go with the L2 policy evict_last: a tile writes 4 bytes of each scale-grid row it
// touches (a compact 1x128 grid: at a stride of a grid row), and, as we read the measurements (bench/RESULTS.md,
// "the compact grid's scale stores, kept in L2"), lines evicted before the neighbouring tiles fill them reach HBM
// as partial writes. Kept in L2, compact Float8 1x128 + 128x1 at 8192^2 went from 88.5 to 95.6% of memcpy. E8M0
// scales (MXFP8) keep a plain store: the policy's 64-bit register made the 4-CTA/SM GEMM-ready MXFP8 kernel spill,
// and MXFP8 has not been timed with it.
template <class S>
__device__ __forceinline__ void store_scale(S* p, S v) {
  if constexpr (std::is_same_v<S, float>) {
    uint64_t keep;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" ::"l"(p), "r"(__float_as_uint(v)), "l"(keep) : "memory");
  } else {
    *p = v;
  }
}

// Word i of a 16-byte vector by name (an indexed pointer into a register vector can go to local memory).
__device__ __forceinline__ uint32_t& word(uint4& r, int i) { return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w; }

struct LoadF32 {
  using T = float;
  static constexpr int VEC = 4;
  __device__ static void unpack(uint4 r, float* o) {
    o[0] = __uint_as_float(r.x); o[1] = __uint_as_float(r.y);
    o[2] = __uint_as_float(r.z); o[3] = __uint_as_float(r.w);
  }
  __device__ static void set(uint4& r, int e, T v) { word(r, e) = __float_as_uint(v); }
  // The amax interface (see Load16): lane-wise |x| maxima kept in a vector, amax_step per lane.
  __device__ static void amax_acc(uint4& acc, uint4 r) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      word(acc, i) = __float_as_uint(amax_step(__uint_as_float(word(acc, i)), __uint_as_float(word(r, i))));
  }
  __device__ static void amax_unpack(uint4 acc, float* o) { unpack(acc, o); }
  __device__ static float amax_of(uint4 r) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    amax_acc(acc, r);
    float o[4];
    unpack(acc, o);
    return fmaxf(fmaxf(o[0], o[1]), fmaxf(o[2], o[3]));
  }
};
template <bool kHalf>
struct Load16 {
  using T = uint16_t;
  static constexpr int VEC = 8;
  __device__ static float get(T v) {
    if constexpr (kHalf) return __half2float(__ushort_as_half(v));
    else return bf16_to_float(v);
  }
  __device__ static void unpack(uint4 r, float* o) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = get(uint16_t(w[i] & 0xFFFFu));
      o[2 * i + 1] = get(uint16_t(w[i] >> 16));
    }
  }
  __device__ static void set(uint4& r, int e, T v) { word(r, e / 2) |= uint32_t(v) << (16 * (e % 2)); }

  // The amax without unpacking: max.xorsign.abs on f16x2/bf16x2 words gives max(|a|, |b|) per half in one
  // instruction, a NaN half yielding the other operand, as amax_step's fmaxf does (subnormals kept: no .ftz). The
  // result's sign bits are the XOR of the operands', so readers mask them. Per 8 elements: 4 instructions and 4
  // registers of column maxima instead of 8 unpacks, 8 fmaxf and 8 registers (partial amax at 5 CTAs/SM: 160.6 ->
  // 150.1 us; bench/RESULTS.md, "Many small tensors: the grouped master-weight launch").
  __device__ static uint32_t max_abs2(uint32_t a, uint32_t b) {
    uint32_t d;
    if constexpr (kHalf) asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  // acc = lane-wise max(|acc|, |r|), packed like the input (sign bits junk).
  __device__ static void amax_acc(uint4& acc, uint4 r) {
    acc.x = max_abs2(acc.x, r.x), acc.y = max_abs2(acc.y, r.y);
    acc.z = max_abs2(acc.z, r.z), acc.w = max_abs2(acc.w, r.w);
  }
  static constexpr uint32_t kAbs = 0x7FFF7FFFu;
  __device__ static void amax_unpack(uint4 acc, float* o) {
    unpack(make_uint4(acc.x & kAbs, acc.y & kAbs, acc.z & kAbs, acc.w & kAbs), o);
  }
  // The amax of r's lanes: folded from +0, so lanes that are all NaN give 0, not NaN.
  __device__ static float amax_of(uint4 r) {
    const uint32_t m = max_abs2(max_abs2(max_abs2(max_abs2(0u, r.x), r.y), r.z), r.w) & kAbs;
    return fmaxf(get(uint16_t(m & 0xFFFFu)), get(uint16_t(m >> 16)));
  }
};
using LoadBF16 = Load16<false>;
using LoadF16 = Load16<true>;

// Calls f(loader) for the input type.
template <class F>
ffi::Error with_loader(InType in, F&& f) {
  switch (in) {
    case InType::kF32: return f(LoadF32{});
    case InType::kBF16: return f(LoadBF16{});
    case InType::kF16: return f(LoadF16{});
  }
  return bad("unreachable");
}

}  // namespace
}  // namespace jf
