// The CUDA dequantize kernel: FP8 data times its block scales, to fp32, bf16 or fp16.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

constexpr int kDeqThreads = 256;

// Stores of 8 outputs (one 16-byte store for 16-bit dtypes, two for fp32) with canonical NaNs.
struct StoreF32 {
  using T = float;
  __device__ static void store8(T* out, int64_t i, const float* y) {
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = __float_as_uint(canonical_f32(y[k]));
    *reinterpret_cast<uint4*>(out + i) = make_uint4(w[0], w[1], w[2], w[3]);
    *reinterpret_cast<uint4*>(out + i + 4) = make_uint4(w[4], w[5], w[6], w[7]);
  }
  __device__ static void store1(T* out, int64_t i, float y) { out[i] = canonical_f32(y); }
};
template <bool kHalf>
struct Store16 {
  using T = uint16_t;
  __device__ static void store8(T* out, int64_t i, const float* y) {
    uint32_t w[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) w[p] = pack2_from_floats<kHalf>(y[2 * p], y[2 * p + 1]);
    *reinterpret_cast<uint4*>(out + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ static void store1(T* out, int64_t i, float y) { out[i] = kHalf ? f16_from_float(y) : bf16_from_float(y); }
};

// Exact FP8 decode of two bytes through the hardware's fp8x2 -> half2 conversion.
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two, int fp8) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xFFFFu), fp8 == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <int VEC>
struct Fp8Vec;  // VEC FP8 bytes as one 8- or 16-byte load
template <>
struct Fp8Vec<8> {
  uint2 v;
  __device__ void load(const uint8_t* p) { v = __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ uint32_t word(int i) const { return i == 0 ? v.x : v.y; }
};
template <>
struct Fp8Vec<16> {
  uint4 v;
  __device__ void load(const uint8_t* p) { v = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ uint32_t word(int i) const { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
};
template <>
struct Fp8Vec<32> {
  Fp8Vec<16> a, b;
  __device__ void load(const uint8_t* p) { a.load(p), b.load(p + 16); }
  __device__ uint32_t word(int i) const { return i < 4 ? a.word(i) : b.word(i - 4); }
};

// grid.x walks VEC-element column vectors, grid.y (strided) the B*M rows; block sizes are powers of
// two, so block indices are shifts (no 64-bit division per element). A vector shares one scale unless
// blocks are narrower than it (columnwise scales: one per column). Rows whose vectors are not 16-byte
// aligned (K not a multiple of 16) go element by element.
template <class Rule, class St, int VEC, int UNROLL>
__global__ void __launch_bounds__(kDeqThreads)
    dequantize_kernel(const uint8_t* __restrict__ d, const typename Rule::ScaleT* __restrict__ s, int64_t B, int64_t M,
                      int64_t K, int bm_log2, int bk_log2, int fp8, bool aligned, typename St::T* __restrict__ out) {
  const int64_t col0 = (blockIdx.x * int64_t(kDeqThreads) + threadIdx.x) * VEC;
  if (col0 >= K) return;
  const int64_t sm = cdiv(M, int64_t(1) << bm_log2), sk = cdiv(K, int64_t(1) << bk_log2);
  const bool full = aligned && col0 + VEC <= K;
  const bool per_elem = (1 << bk_log2) < VEC;
#pragma unroll UNROLL
  for (int64_t rr = blockIdx.y; rr < B * M; rr += gridDim.y) {
    const int64_t b = B == 1 ? 0 : rr / M, r = rr - b * M;
    const typename Rule::ScaleT* srow = s + (b * sm + (r >> bm_log2)) * sk;
    const int64_t base = rr * K;
    if (full) {
      Fp8Vec<VEC> raw;
      raw.load(d + base + col0);
      const float one = Rule::dequant_scale(srow[col0 >> bk_log2]);
      float y[VEC];
#pragma unroll
      for (int p = 0; p < VEC / 2; ++p) {
        const float2 f = fp8x2_to_float2(raw.word(p / 2) >> (16 * (p % 2)), fp8);
        const int64_t c = col0 + 2 * p;
        y[2 * p] = f.x * (per_elem ? Rule::dequant_scale(srow[c >> bk_log2]) : one);
        y[2 * p + 1] = f.y * (per_elem ? Rule::dequant_scale(srow[(c + 1) >> bk_log2]) : one);
      }
#pragma unroll
      for (int q = 0; q < VEC / 8; ++q) St::store8(out, base + col0 + 8 * q, y + 8 * q);
    } else {
      for (int e = 0; e < VEC && col0 + e < K; ++e)
        St::store1(out, base + col0 + e,
                   fp8_to_float(d[base + col0 + e], fp8) * Rule::dequant_scale(srow[(col0 + e) >> bk_log2]));
    }
  }
}

// Enough CTAs to fill the chip several times over; each thread then walks many rows, UNROLL rows' loads
// in flight at once. Defaults measured fastest (bench/kernel_bench.cu, bench/RESULTS.md): 16-byte
// loads, 2 rows in flight, 32 CTAs' worth of rows per SM.
template <class Rule, class St, int VEC = 16, int UNROLL = 2>
void launch_dequantize(cudaStream_t st, const void* d, const void* s, void* out, int64_t B, int64_t M, int64_t K,
                       int bm, int bk, int fp8, int ctas_per_sm = 32) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t gx = cdiv(cdiv(K, VEC), kDeqThreads);
  const int64_t gy = std::min<int64_t>(B * M, std::max<int64_t>(1, int64_t(sms) * ctas_per_sm / gx));
  const bool aligned = K % VEC == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0;
  dequantize_kernel<Rule, St, VEC, UNROLL><<<dim3(unsigned(gx), unsigned(gy)), kDeqThreads, 0, st>>>(
      static_cast<const uint8_t*>(d), static_cast<const typename Rule::ScaleT*>(s), B, M, K, __builtin_ctz(bm),
      __builtin_ctz(bk), fp8, aligned, static_cast<typename St::T*>(out));
}

}  // namespace
}  // namespace jf
