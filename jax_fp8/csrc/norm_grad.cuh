// jf_norm_grad on CUDA: a norm's backward (producers.h), in the order jax_fp8/producers.py's norm_grad
// defines, in three kernels over the workspace NormGradArgs::work_needed describes:
// - norm_dx_kernel, one warp per row: the row sums c1 (LayerNorm) and c2 (warp_sum), then dx, stored in
//   its dtype;
// - norm_block_sums_kernel: per block of kGradRows rows of one batch entry and 8 columns per thread, the
//   column terms (dy * xhat; LayerNorm: dy) summed down the block's rows in order;
// - norm_sums_kernel: per column, the blocks' sums in order.
// Included by cuda_kernels.cu after produce_tile.cuh (load8, warp_sum, store_n, aligned16).
#pragma once

#include <cuda_runtime.h>

#include "produce_args.h"
#include "producers.h"

namespace jf {
namespace {

struct NormGradView {
  const void *x, *gamma, *dy;
  InType xt, gt, dyt;
  const float* stats;
  bool layer, vec;  // vec: every row of x and dy, and gamma, loads as 16-byte vectors
  int64_t B, M, K;
  __device__ float mean(int64_t r) const { return layer ? stats[2 * r] : 0.0f; }
  __device__ float rstd(int64_t r) const { return layer ? stats[2 * r + 1] : stats[r]; }
  // xhat and dy of row r's elements c .. c + 7 (n of them), and gamma there
  __device__ void load(int64_t r, int64_t c, int n, float (&xh)[kVec], float (&d)[kVec]) const {
    load8(x, xt, r * K + c, n, vec && n == kVec, xh);
    load8(dy, dyt, r * K + c, n, vec && n == kVec, d);
    const float m = mean(r), s = rstd(r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) xh[e] = norm_xhat_f(xh[e], m, s);
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads) norm_dx_kernel(NormGradView v, float inv_k, T* __restrict__ dx) {
  const int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (r >= v.B * v.M) return;
  // dxhat = dy * gamma of elements c .. c + 7, and their xhat
  const auto at = [&](int64_t c, int n, float (&xh)[kVec], float (&dxh)[kVec]) {
    float g[kVec];
    v.load(r, c, n, xh, dxh);
    load8(v.gamma, v.gt, c, n, v.vec && n == kVec, g);
#pragma unroll
    for (int e = 0; e < kVec; ++e) dxh[e] = dxh[e] * g[e];
  };
  const float c1 = !v.layer ? 0.0f : warp_sum(v.K, [&](int64_t c, int n, float (&t)[kVec]) {
    float xh[kVec];
    at(c, n, xh, t);
  }) * inv_k;
  const float c2 = warp_sum(v.K, [&](int64_t c, int n, float (&t)[kVec]) {
    float xh[kVec];
    at(c, n, xh, t);
#pragma unroll
    for (int e = 0; e < kVec; ++e) t[e] = t[e] * xh[e];
  }) * inv_k;
  const float s = v.rstd(r);
  for (int64_t c = 8 * (threadIdx.x % 32); c < v.K; c += kSumLanes) {
    const int n = v.K - c >= kVec ? kVec : int(v.K - c);
    float xh[kVec], dxh[kVec], out[kVec];
    at(c, n, xh, dxh);
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = norm_dx_f(dxh[e], xh[e], s, c1, c2);
    store_n(dx + r * v.K + c, out, n);
  }
}

constexpr int kSumThreads = 128;  // norm_block_sums_kernel: 8 columns per thread, 1024 per CTA

// Block blockIdx.x (of kGradRows rows of one batch entry), 8 columns per thread from column
// 8 (blockIdx.y * kSumThreads + threadIdx.x): part[(block * n + i) * K + k], i = 0 dgamma's, 1 dbeta's.
__global__ void __launch_bounds__(kSumThreads) norm_block_sums_kernel(NormGradView v, float* __restrict__ part) {
  const int64_t c = 8 * (int64_t(blockIdx.y) * kSumThreads + threadIdx.x);
  if (c >= v.K) return;
  const int n = v.K - c >= kVec ? kVec : int(v.K - c);
  const int64_t per_entry = cdiv(v.M, kGradRows), b = blockIdx.x / per_entry, m0 = (blockIdx.x % per_entry) * kGradRows;
  float pg[kVec] = {0, 0, 0, 0, 0, 0, 0, 0}, pb[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t r = b * v.M + m0, end = b * v.M + min(v.M, m0 + kGradRows); r < end; ++r) {
    float xh[kVec], d[kVec];
    v.load(r, c, n, xh, d);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      pg[e] = pg[e] + d[e] * xh[e];
      pb[e] = pb[e] + d[e];
    }
  }
  const int sums = v.layer ? 2 : 1;
  float* out = part + int64_t(blockIdx.x) * sums * v.K + c;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (e >= n) break;
    out[e] = pg[e];
    if (v.layer) out[v.K + e] = pb[e];
  }
}

// sums[j] (j < n * K) = the blocks' part[block * n * K + j], from +0 in block order, NaNs canonical.
__global__ void __launch_bounds__(kThreads) norm_sums_kernel(const float* __restrict__ part, int64_t blocks,
                                                             int64_t width, float* __restrict__ sums) {
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= width) return;
  float acc = 0.0f;
  for (int64_t i = 0; i < blocks; ++i) acc = acc + part[i * width + j];
  sums[j] = canonical_f32(acc);
}

inline ffi::Error norm_grad(cudaStream_t st, const NormGradArgs& a) {
  if (a.work_size < a.work_needed()) return bad("norm_grad: the workspace is too small");
  const int64_t rows = a.B * a.M, blocks = a.blocks(), width = a.n_sums() * a.K;
  const bool vec = a.K % kVec == 0 && aligned16(a.x) && aligned16(a.dy) && aligned16(a.gamma);
  const NormGradView v{a.x, a.gamma, a.dy, a.xt, a.gt, a.dyt, a.stats, a.layer, vec, a.B, a.M, a.K};
  float* part = a.work;
  if (rows > 0 && a.K > 0) {
    const int64_t grid = cdiv(rows, kThreads / 32), col_grid = cdiv(a.K, kVec * kSumThreads);
    if (grid > 0x7FFFFFFF || blocks > 0x7FFFFFFF || col_grid > 65535) return bad("tensor too large for one launch");
    switch (a.dxt) {
      case InType::kF32:
        norm_dx_kernel<<<unsigned(grid), kThreads, 0, st>>>(v, a.inv_k, static_cast<float*>(a.dx));
        break;
      case InType::kBF16:
        norm_dx_kernel<<<unsigned(grid), kThreads, 0, st>>>(v, a.inv_k, static_cast<__nv_bfloat16*>(a.dx));
        break;
      case InType::kF16:
        norm_dx_kernel<<<unsigned(grid), kThreads, 0, st>>>(v, a.inv_k, static_cast<__half*>(a.dx));
        break;
    }
    norm_block_sums_kernel<<<dim3(unsigned(blocks), unsigned(col_grid)), kSumThreads, 0, st>>>(v, part);
  }
  if (width > 0) {
    if (cdiv(width, kThreads) > 0x7FFFFFFF) return bad("tensor too large for one launch");
    norm_sums_kernel<<<unsigned(cdiv(width, kThreads)), kThreads, 0, st>>>(part, blocks, width, a.sums);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jf
