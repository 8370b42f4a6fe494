// The CUDA dequantize kernel: FP8 data times its block scales, to fp32, bf16 or fp16.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

constexpr int kDeqThreads = 256;

// One 16-byte store (a weak st.global.v4, which a plain uint4 assignment did not always compile to).
__device__ __forceinline__ void store16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// N outputs in one 16-byte store (8 for 16-bit dtypes, 4 for fp32), NaNs canonical.
struct StoreF32 {
  using T = float;
  static constexpr int N = 4;
  __device__ static void store(T* out, const float* y) {
    store16(out, __float_as_uint(canonical_f32(y[0])), __float_as_uint(canonical_f32(y[1])),
            __float_as_uint(canonical_f32(y[2])), __float_as_uint(canonical_f32(y[3])));
  }
  __device__ static void store1(T* out, float y) { *out = canonical_f32(y); }
};
template <bool kHalf>
struct Store16 {
  using T = uint16_t;
  static constexpr int N = 8;
  __device__ static void store(T* out, const float* y) {
    uint32_t w[4], nans = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) w[p] = cvt_pack2<kHalf>(y[2 * p], y[2 * p + 1]), nans |= nan_halves<kHalf>(w[p]);
    if (nans) {
#pragma unroll
      for (int p = 0; p < 4; ++p) w[p] = with_canonical_nans<kHalf>(w[p]);
    }
    store16(out, w[0], w[1], w[2], w[3]);
  }
  __device__ static void store1(T* out, float y) { *out = kHalf ? f16_from_float(y) : bf16_from_float(y); }
};

// Exact FP8 decode of two bytes through the hardware's fp8x2 -> half2 conversion.
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two, int fp8) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xFFFFu), fp8 == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// N FP8 bytes (one store's worth) as one 4- or 8-byte load.
template <int N>
__device__ __forceinline__ uint2 load_fp8(const uint8_t* p) {
  if constexpr (N == 8) return __ldg(reinterpret_cast<const uint2*>(p));
  else return make_uint2(__ldg(reinterpret_cast<const uint32_t*>(p)), 0u);
}

// grid.x walks the columns, VEC per thread, grid.y (strided) the B*M rows. A thread's VEC columns are
// P = VEC / N pieces of N (one 16-byte store each), interleaved across its warp (piece q of lane l at
// column q * 32N + lN), so that every store instruction writes 512 contiguous bytes: a thread's VEC
// contiguous columns half-fill each store instruction's sectors, which cost about 10% of memcpy
// bandwidth (bench/RESULTS.md, "dequantize at 90% of memcpy"). Rows and columns are 32-bit
// (dequantize_fits), so that a row's addresses are one wide multiply each. Block sizes are powers of two, so block indices are
// shifts. A piece shares one scale unless blocks are narrower than it (PER_ELEM: columnwise scales, one
// per column). Pieces that are not aligned (K not a multiple of N) or cross the row's end go element
// by element.
template <class Rule, class St, int VEC, int UNROLL>
__global__ void __launch_bounds__(kDeqThreads)
    dequantize_kernel(const uint8_t* __restrict__ d, const typename Rule::ScaleT* __restrict__ s, int B, int M, int K,
                      int bm_log2, int bk_log2, int fp8, bool aligned, typename St::T* __restrict__ out) {
  using ScaleT = typename Rule::ScaleT;
  constexpr int N = St::N, P = VEC / N;
  const int lane = threadIdx.x % 32;
  const int warp_col = (blockIdx.x * kDeqThreads + threadIdx.x - lane) * VEC;
  if (warp_col >= K) return;
  const int rows = B * M, sm = (M + (1 << bm_log2) - 1) >> bm_log2, sk = (K + (1 << bk_log2) - 1) >> bk_log2;
  // a row's scale row: rr >> bm_log2 unless batches end inside a block (then per batch)
  const bool flat = B == 1 || (M & ((1 << bm_log2) - 1)) == 0;
  const auto scale_row = [&](int rr) { return flat ? rr >> bm_log2 : rr / M * sm + ((rr % M) >> bm_log2); };
  // the same columns in every row: piece q's first column, whether it is one vector, its scale's index
  int col[P], scol[P];
  bool vec[P];
#pragma unroll
  for (int q = 0; q < P; ++q) {
    col[q] = warp_col + (q * 32 + lane) * N;
    scol[q] = col[q] >> bk_log2;
    vec[q] = aligned && col[q] + N <= K;
  }
  // The row walk, compiled once per FP8 format and scale width, so the common case has no
  // per-element branches.
  const auto walk = [&](auto per_elem, auto format) {
    constexpr bool PER_ELEM = decltype(per_elem)::value;
    constexpr int FP8 = decltype(format)::value;
    // UNROLL rows at a time (gridDim.y apart): every row's data and scale loads issued before any is used
    for (int r0 = blockIdx.y; r0 < rows; r0 += gridDim.y * UNROLL) {
      uint2 raw[UNROLL][P];
      ScaleT sc[UNROLL][P];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int rr = r0 + u * gridDim.y;
        if (rr >= rows) break;
        const uint8_t* drow = d + int64_t(rr) * K;
        const ScaleT* srow = s + int64_t(scale_row(rr)) * sk;
#pragma unroll
        for (int q = 0; q < P; ++q)
          if (vec[q]) raw[u][q] = load_fp8<N>(drow + col[q]), sc[u][q] = srow[scol[q]];
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int rr = r0 + u * gridDim.y;
        if (rr >= rows) break;
        typename St::T* orow = out + int64_t(rr) * K;
        const ScaleT* srow = s + int64_t(scale_row(rr)) * sk;
#pragma unroll
        for (int q = 0; q < P; ++q) {
          if (vec[q]) {
            const float one = Rule::dequant_scale(sc[u][q]);
            float y[N];
#pragma unroll
            for (int p = 0; p < N / 2; ++p) {
              const float2 f = fp8x2_to_float2((p < 2 ? raw[u][q].x : raw[u][q].y) >> (16 * (p % 2)), FP8);
              const int c = col[q] + 2 * p;
              y[2 * p] = f.x * (PER_ELEM ? Rule::dequant_scale(srow[c >> bk_log2]) : one);
              y[2 * p + 1] = f.y * (PER_ELEM ? Rule::dequant_scale(srow[(c + 1) >> bk_log2]) : one);
            }
            St::store(orow + col[q], y);
          } else {
            for (int c = col[q]; c < col[q] + N && c < K; ++c)
              St::store1(orow + c,
                         fp8_to_float(d[int64_t(rr) * K + c], FP8) * Rule::dequant_scale(srow[c >> bk_log2]));
          }
        }
      }
    }
  };
  using E4M3 = std::integral_constant<int, kE4M3>;
  using E5M2 = std::integral_constant<int, kE5M2>;
  if ((1 << bk_log2) < N) fp8 == kE4M3 ? walk(std::true_type{}, E4M3{}) : walk(std::true_type{}, E5M2{});
  else fp8 == kE4M3 ? walk(std::false_type{}, E4M3{}) : walk(std::false_type{}, E5M2{});
}

// Whether launch_dequantize takes these sizes: rows and columns as 32-bit indices, with room for a
// thread's last row step and column piece past the end.
inline bool dequantize_fits(int64_t B, int64_t M, int64_t K) {
  return B * M < (int64_t(1) << 30) && K < (int64_t(1) << 30);
}

// The launch configuration, measured fastest on the H200 (bench/kernel_bench.cu sweeps it; bench/RESULTS.md,
// "dequantize at 90% of memcpy"): 8 columns per thread (one piece), 4 rows in flight, 64 CTAs' worth of rows per
// SM.
constexpr int kDeqVec = 8, kDeqUnroll = 4, kDeqCtasPerSm = 64;

// The grid of a dequantize_kernel with `vec` columns per thread over B*M rows of K columns: enough CTAs
// to fill the chip ctas_per_sm times over; each thread then walks many rows, UNROLL rows' loads in
// flight at once.
inline dim3 dequantize_grid(int64_t B, int64_t M, int64_t K, int vec, int ctas_per_sm) {
  const int sms = current_sm_count();
  const int64_t gx = cdiv(cdiv(K, vec), kDeqThreads);
  const int64_t gy = std::min<int64_t>(B * M, std::max<int64_t>(1, int64_t(sms) * ctas_per_sm / gx));
  return dim3(unsigned(gx), unsigned(gy));
}

// Dequantizes (B, M, K) FP8 data `d` with the compact scale grid `s` of bm x bk blocks into `out`.
template <class Rule, class St>
void launch_dequantize(cudaStream_t st, const void* d, const void* s, void* out, int64_t B, int64_t M, int64_t K,
                       int bm, int bk, int fp8) {
  const dim3 grid = dequantize_grid(B, M, K, kDeqVec, kDeqCtasPerSm);
  const bool aligned = K % St::N == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0;
  dequantize_kernel<Rule, St, kDeqVec, kDeqUnroll><<<grid, kDeqThreads, 0, st>>>(
      static_cast<const uint8_t*>(d), static_cast<const typename Rule::ScaleT*>(s), int(B), int(M), int(K),
      __builtin_ctz(bm), __builtin_ctz(bk), fp8, aligned, static_cast<typename St::T*>(out));
}

}  // namespace
}  // namespace jf
