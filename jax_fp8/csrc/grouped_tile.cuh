// jf_quantize_grouped on CUDA: rows in groups (groups.h) quantized as GEMM-ready Float8 1x128 operands,
// rowwise and columnwise from one read of x, the columnwise blocks restarting at every group start.
//
// One CTA of 256 threads per (block row, 128 columns, matrix). Block rows x < S are the slots: warp 0
// finds its slot's rows and columns from the group sizes (a warp scan over the groups, on the device: no
// host sync); rows x >= S are chunks of 128 of the rows past the last group, which get data 0 and the
// padding scale, and of the columnwise columns past the groups', which get 0. Each thread holds 16
// consecutive rows x 4 columns in registers (vector loads): a row's 1x128 amax is a warp reduction, a
// column's 128x1 amax a shared-memory one; the hardware's FP8 cast, and the columnwise bytes go out
// transposed straight from registers, a column's 16 rows in one 16-byte store.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "groups.h"

namespace jf {
namespace {

constexpr int kGroupTile = 128;  // rows and columns of a CTA's tile: one 1x128 block per row, one 128x1 per column
constexpr int kGroupRowsPerWarp = kGroupTile / (kThreads / 32);

template <class L>
__device__ __forceinline__ float load_elem(const typename L::T* p) {
  if constexpr (std::is_same_v<typename L::T, float>) return *p;
  else return L::get(*p);
}

// Where the outputs of one matrix go (null data: the usage is not asked for).
struct GroupedOut {
  uint8_t* row_data;   // (M, K)
  float* row_scale;    // (ceil(K/128), row_ld): entry [kb][r]
  int64_t row_ld;
  uint8_t* col_data;   // (K, col_cols): group g's rows in the columns from groups.h's column starts
  float* col_scale;    // (S, col_ld): entry [slot][k]
  int64_t col_ld, col_cols;
};

// The sum of v over lanes 0..lane of the warp.
__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int64_t u = __shfl_up_sync(0xFFFFFFFFu, v, off);
    if (lane >= off) v += u;
  }
  return v;
}

// Warp 0: block row x's rows [span[0], span[1]) and the columns [span[2], span[3]) its columnwise bytes
// fill, from the group sizes as groups.h's group_blocks numbers the slots (a group's end: the prefix sum
// of the clipped sizes, clipped to M; its first column: the groups before it, each rounded up to
// kColAlign). A slot's columns are its rows' and the padding to kColAlign after a group's last block; a
// tail chunk x - S has 128 of the rows past the groups' (rowwise: data 0) and 128 of the columns past the
// groups' (columnwise: 0); an unused slot has none. Lanes take 32 groups at a time; prefix sums by shuffles.
__device__ __forceinline__ void find_span(const int32_t* sizes, int64_t G, int64_t M, int64_t Mc, int64_t S,
                                          int64_t x, int64_t* span) {
  const int lane = threadIdx.x % 32;
  int64_t rows_before = 0, slots_before = 0, cols_before = 0;
  bool found = false;
  for (int64_t g0 = 0; g0 < G; g0 += 32) {
    const int64_t g = g0 + lane;
    const int64_t size = g < G ? min(max(int64_t(sizes[g]), int64_t(0)), M) : 0;
    const int64_t incl = warp_inclusive_sum(size) + rows_before;
    const int64_t end = min(M, incl), beg = min(M, incl - size);
    const int64_t n = (end - beg + kGroupTile - 1) / kGroupTile;
    const int64_t nincl = warp_inclusive_sum(n) + slots_before;
    const int64_t width = (end - beg + kColAlign - 1) / kColAlign * kColAlign;
    const int64_t cincl = warp_inclusive_sum(width) + cols_before;
    if (x < S && x >= nincl - n && x < nincl) {  // one lane at most: the slot's group
      const int64_t off = (x - (nincl - n)) * kGroupTile;
      span[0] = beg + off;
      span[1] = min(end, span[0] + kGroupTile);
      span[2] = cincl - width + off;
      span[3] = min(cincl, span[2] + kGroupTile);
      found = true;
    }
    rows_before = __shfl_sync(0xFFFFFFFFu, incl, 31);
    slots_before = __shfl_sync(0xFFFFFFFFu, nincl, 31);
    cols_before = __shfl_sync(0xFFFFFFFFu, cincl, 31);
  }
  found = __any_sync(0xFFFFFFFFu, found);
  if (lane == 0 && !found) {
    if (x < S) {  // an unused slot
      span[0] = span[1] = M;
      span[2] = span[3] = Mc;
    } else {  // a chunk of the rows and of the columns past the groups'
      const int64_t off = (x - S) * kGroupTile;
      span[0] = min(M, min(M, rows_before) + off);
      span[1] = min(M, span[0] + kGroupTile);
      span[2] = min(Mc, cols_before + off);
      span[3] = min(Mc, span[2] + kGroupTile);
    }
  }
}

// The 4 elements of row r from column c of x (zeros outside the rows [r, r1) given as `valid` and past K):
// one 8-byte (16-bit input) or 16-byte (fp32) load when `vec` (K % 4 == 0: aligned, and c < K covers c + 3).
template <class L>
__device__ __forceinline__ void load4(const typename L::T* __restrict__ p, bool valid, bool vec, int64_t c,
                                      int64_t K, float (&v)[4]) {
  if (valid && vec) {
    if constexpr (std::is_same_v<typename L::T, float>) {
      const float4 q = *reinterpret_cast<const float4*>(p);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      v[0] = L::get(uint16_t(q.x & 0xFFFFu)), v[1] = L::get(uint16_t(q.x >> 16));
      v[2] = L::get(uint16_t(q.y & 0xFFFFu)), v[3] = L::get(uint16_t(q.y >> 16));
    }
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = valid && c + e < K ? load_elem<L>(p + e) : 0.0f;
  }
}

// Four FP8 bytes of v_k * m (the hardware's satfinite cast, equal to fp8_from_float_sw), byte k from v_k.
__device__ __forceinline__ uint32_t fp8x4(float v0, float v1, float v2, float v3, float m, int fp8) {
  return fp8x2_from_float(v0 * m, v1 * m, fp8) | (uint32_t(fp8x2_from_float(v2 * m, v3 * m, fp8)) << 16);
}

template <class L, class Rule>
__global__ void __launch_bounds__(kThreads) grouped_tile_kernel(const typename L::T* __restrict__ x,
                                                                const int32_t* __restrict__ sizes, int64_t M,
                                                                int64_t K, int64_t G, int64_t S, Rule rule, int fp8,
                                                                GroupedOut o) {
  __shared__ int64_t span[4];
  __shared__ __align__(16) float red[kThreads / 32][kGroupTile];
  __shared__ __align__(16) float col_mult[kGroupTile];
  const int64_t b = blockIdx.z, bx = blockIdx.x, kb = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x += b * M * K;
  sizes += b * G;
  const bool slot = bx < S, vec = K % 4 == 0;
  if (warp == 0) find_span(sizes, G, M, o.col_cols, S, bx, span);
  __syncthreads();
  const int64_t r0 = span[0], r1 = span[1], gc0 = span[2], gc1 = span[3], c = kb * kGroupTile + 4 * lane;
  const bool in_groups = slot && r1 > r0;
  uint8_t* row_data = o.row_data ? o.row_data + b * M * K : nullptr;
  float* row_scale = o.row_data ? o.row_scale + b * cdiv(K, kGroupTile) * o.row_ld : nullptr;
  uint8_t* col_data = o.col_data ? o.col_data + b * K * o.col_cols : nullptr;
  float* col_scale = o.col_data ? o.col_scale + b * S * o.col_ld : nullptr;

  // Padding: a slot's scale row past K (tile column 0), the rowwise scales past M (the first tail chunk)
  if (col_scale && slot && kb == 0)
    for (int64_t k = K + threadIdx.x; k < o.col_ld; k += kThreads) col_scale[bx * o.col_ld + k] = kGemmScalePad;
  if (row_scale && bx == S)
    for (int64_t r = M + threadIdx.x; r < o.row_ld; r += kThreads) row_scale[kb * o.row_ld + r] = kGemmScalePad;

  // This thread's 16 consecutive rows r0 + 16 warp + i and 4 columns c .. c + 3: a row's 128 columns are one
  // warp's (its amax: shuffles), and a column's 16 rows one thread's (its bytes: one 16-byte store)
  const int64_t rw = r0 + kGroupRowsPerWarp * warp;
  float v[kGroupRowsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kGroupRowsPerWarp; ++i)
    load4<L>(x + (rw + i) * K + c, in_groups && rw + i < r1 && c < K, vec, c, K, v[i]);

  // Rowwise: each row's 1x128 block (rows in no group: data 0, the padding scale)
  if (row_data) {
#pragma unroll
    for (int i = 0; i < kGroupRowsPerWarp; ++i) {
      const int64_t r = rw + i;
      float amax = 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) amax = amax_step(amax, v[i][e]);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
      if (r >= r1) continue;  // warp-uniform
      float s = kGemmScalePad, m = 0.0f;
      if (in_groups) rule(amax, s, m);
      if (lane == 0) row_scale[kb * o.row_ld + r] = s;
      if (c >= K) continue;
      const uint32_t q = fp8x4(v[i][0], v[i][1], v[i][2], v[i][3], m, fp8);
      if (vec) {
        *reinterpret_cast<uint32_t*>(row_data + r * K + c) = q;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c + e < K) row_data[r * K + c + e] = uint8_t(q >> (8 * e));
      }
    }
  }
  if (!col_data) return;

  // Columnwise: each column's 128x1 block of the slot's rows
  float amax4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kGroupRowsPerWarp; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) amax4[e] = amax_step(amax4[e], v[i][e]);
  *reinterpret_cast<float4*>(&red[warp][4 * lane]) = make_float4(amax4[0], amax4[1], amax4[2], amax4[3]);
  __syncthreads();
  if (threadIdx.x < kGroupTile) {
    const int64_t k = kb * kGroupTile + threadIdx.x;
    float amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, red[w][threadIdx.x]);
    float s = kGemmScalePad, m = 0.0f;
    if (in_groups) rule(amax, s, m);
    if (slot && k < K) col_scale[bx * o.col_ld + k] = s;  // an unused slot: the padding scale
    col_mult[threadIdx.x] = m;
  }
  __syncthreads();
  // Column k's bytes of this thread's 16 rows go to columns gc0 + 16 warp ... of its row of col_data: the
  // slot's rows, then 0 to its columns' end (rows past r1 hold v = 0, cast to 0). gc0 and gc1 - gc0 are
  // multiples of kColAlign = 16, col_cols too: the store is aligned and never straddles the columns' end.
  static_assert(kGroupRowsPerWarp == kColAlign, "a thread's rows are one aligned 16-byte column piece");
  const int64_t gc = gc0 + kGroupRowsPerWarp * warp;
  if (gc >= gc1) return;  // an unused slot, or past the columns here
  const float4 m4 = *reinterpret_cast<const float4*>(&col_mult[4 * lane]);
  const float m[4] = {m4.x, m4.y, m4.z, m4.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (c + e >= K) break;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = fp8x4(v[4 * j][e], v[4 * j + 1][e], v[4 * j + 2][e], v[4 * j + 3][e], m[e], fp8);
    *reinterpret_cast<uint4*>(col_data + (c + e) * o.col_cols + gc) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The grouped quantize of a call (a: make_grouped_quantize_args'; d / s: each output's data and scales).
inline ffi::Error quantize_grouped(cudaStream_t stream, const QuantizeArgs& a, int64_t G, const void* x,
                                   const int32_t* sizes, uint8_t* const* d, void* const* s) {
  const int64_t S = block_slots(a.M, G, kGroupTile);
  GroupedOut o{};
  for (int k = 0; k < a.n_out; ++k) {
    if (a.out[k].colwise())
      o.col_data = d[k], o.col_scale = static_cast<float*>(s[k]), o.col_ld = a.out[k].ld, o.col_cols = col_count(a.M, G);
    else o.row_data = d[k], o.row_scale = static_cast<float*>(s[k]), o.row_ld = a.out[k].ld;
  }
  // the slots, then tail chunks over the rows past the groups' and the columns past theirs (col_count >= M)
  const int64_t bx = S + cdiv(col_count(a.M, G), kGroupTile), by = cdiv(a.K, kGroupTile);
  if (a.B == 0 || bx == 0 || by == 0) return ffi::Error::Success();
  if (bx > 0x7FFFFFFF || by > 65535 || a.B > 65535) return bad("quantize_grouped: tensor too large for one launch");
  const dim3 grid(unsigned(bx), unsigned(by), unsigned(a.B));
  return with_loader(a.in, [&](auto ld) {
    using L = decltype(ld);
    return with_block_rule(a, [&](auto rule) {
      grouped_tile_kernel<L><<<grid, kThreads, 0, stream>>>(static_cast<const typename L::T*>(x), sizes, a.M, a.K, G,
                                                            S, rule, a.fp8, o);
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jf
