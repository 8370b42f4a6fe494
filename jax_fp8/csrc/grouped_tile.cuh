// jf_quantize_grouped on CUDA: rows in groups (groups.h) quantized as GEMM-ready Float8 1x128 operands,
// rowwise and columnwise from one read of x, the columnwise blocks restarting at every group start.
//
// Work items of (block row, 128 columns, matrix), 256 threads each: a CTA each for few groups, else
// walked by one wave of resident CTAs (columns fastest: a wave reads whole rows). Block rows x < S are
// the slots; rows x >= S are chunks of 128 of the rows past the last group, which get data 0 and the
// padding scale, and of the columnwise columns past the groups', which get 0. Each CTA first reads the group sizes once (on the device: no
// host sync) into a table of the groups' rows, slots and columns in shared memory, from which every
// item's rows and columns follow by a binary search; items with nothing to write (tail chunks past the
// rows and columns the sizes leave) cost no sync. More than kTableGroups groups: each item scans the
// sizes itself (find_span). Each thread holds 16 consecutive rows x 4 columns in registers (vector
// loads): a row's 1x128 amax is a warp reduction, a column's 128x1 amax a shared-memory one; the
// hardware's FP8 cast, and the columnwise bytes go out transposed straight from registers, a column's
// 16 rows in one 16-byte store.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "groups.h"

namespace jf {
namespace {

constexpr int kGroupTile = 128;  // rows and columns of a CTA's tile: one 1x128 block per row, one 128x1 per column
constexpr int kGroupRowsPerWarp = kGroupTile / (kThreads / 32);

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

// A group of `rows` rows: its slots (128-row blocks) and its columnwise columns (rows rounded up to kColAlign).
__device__ __forceinline__ int64_t group_slots(int64_t rows) { return (rows + kGroupTile - 1) / kGroupTile; }
__device__ __forceinline__ int64_t group_width(int64_t rows) { return (rows + kColAlign - 1) / kColAlign * kColAlign; }

// One lane's group, as groups.h's group_blocks numbers them: its rows [beg, end) (the prefix sum of the
// clipped sizes, clipped to M), its slots (128-row blocks) and columns (its rows rounded up to kColAlign),
// each with the inclusive prefix sum over the groups before it.
struct GroupBounds {
  int64_t beg, end, slots, slot_end, width, col_end;
};

// The prefix sums over the groups, 32 at a time (a warp, every lane calling next with its group's clipped
// size): the rows, slots and columns of the groups scanned so far.
struct GroupScan {
  int64_t rows = 0, slots = 0, cols = 0;

  __device__ __forceinline__ GroupBounds next(int64_t size, int64_t M) {
    GroupBounds b;
    const int64_t incl = warp_inclusive_sum(size) + rows;
    b.end = min(M, incl);
    b.beg = min(M, incl - size);
    b.slots = group_slots(b.end - b.beg);
    b.slot_end = warp_inclusive_sum(b.slots) + slots;
    b.width = group_width(b.end - b.beg);
    b.col_end = warp_inclusive_sum(b.width) + cols;
    rows = __shfl_sync(0xFFFFFFFFu, incl, 31);
    slots = __shfl_sync(0xFFFFFFFFu, b.slot_end, 31);
    cols = __shfl_sync(0xFFFFFFFFu, b.col_end, 31);
    return b;
  }
};

// Block row x's rows [span[0], span[1]) and the columns [span[2], span[3]) its columnwise bytes fill.
// A slot of the group with rows [beg, end), first slot `first_slot` and columns [col_beg, col_end): its
// rows, and its columns with the padding to kColAlign after the group's last block.
__device__ __forceinline__ void slot_span(int64_t x, int64_t beg, int64_t end, int64_t first_slot, int64_t col_beg,
                                          int64_t col_end, int64_t* span) {
  const int64_t off = (x - first_slot) * kGroupTile;
  span[0] = beg + off;
  span[1] = min(end, span[0] + kGroupTile);
  span[2] = col_beg + off;
  span[3] = min(col_end, span[2] + kGroupTile);
}

// Block row x in no group, the groups holding `rows` rows and `cols` columnwise columns in all: an unused
// slot (x < S) has none; a tail chunk x - S has 128 of the rows past the groups' (rowwise: data 0) and 128
// of the columns past the groups' (columnwise: 0).
__device__ __forceinline__ void span_past_groups(int64_t x, int64_t S, int64_t rows, int64_t cols, int64_t M,
                                                 int64_t Mc, int64_t* span) {
  if (x < S) {
    span[0] = span[1] = M;
    span[2] = span[3] = Mc;
  } else {
    const int64_t off = (x - S) * kGroupTile;
    span[0] = min(M, min(M, rows) + off);
    span[1] = min(M, span[0] + kGroupTile);
    span[2] = min(Mc, cols + off);
    span[3] = min(Mc, span[2] + kGroupTile);
  }
}

// Warp 0: block row x's span (slot_span, span_past_groups), from the group sizes (GroupScan).
__device__ __forceinline__ void find_span(const int32_t* sizes, int64_t G, int64_t M, int64_t Mc, int64_t S,
                                          int64_t x, int64_t* span) {
  const int lane = threadIdx.x % 32;
  GroupScan scan;
  bool found = false;
  for (int64_t g0 = 0; g0 < G; g0 += 32) {
    const int64_t g = g0 + lane;
    const GroupBounds b = scan.next(g < G ? min(max(int64_t(sizes[g]), int64_t(0)), M) : 0, M);
    if (x < S && x >= b.slot_end - b.slots && x < b.slot_end) {  // one lane at most: the slot's group
      slot_span(x, b.beg, b.end, b.slot_end - b.slots, b.col_end - b.width, b.col_end, span);
      found = true;
    }
  }
  found = __any_sync(0xFFFFFFFFu, found);
  if (lane == 0 && !found) span_past_groups(x, S, scan.rows, scan.cols, M, Mc, span);
}

// Groups whose bounds a CTA keeps in shared memory (16 KB); calls with more scan the sizes per item.
constexpr int kTableGroups = 512;

// The groups' bounds as find_span numbers them: group g's rows [beg, end), the slots and the columns of
// groups 0..g (inclusive prefix sums); the totals, for the tail chunks (rows: the clipped sizes' sum).
struct GroupTable {
  int64_t beg[kTableGroups], end[kTableGroups], slot_end[kTableGroups], col_end[kTableGroups];
  int64_t rows_total, slots_total, cols_total;
};

// The whole CTA: the table of G <= kTableGroups groups. Every thread loads sizes at once (one load's
// latency), then warp 0 forms the prefix sums by shuffles, 32 groups at a time.
__device__ __forceinline__ void build_table(const int32_t* sizes, int64_t G, int64_t M, GroupTable& t) {
  for (int64_t g = threadIdx.x; g < G; g += kThreads) t.end[g] = min(max(int64_t(sizes[g]), int64_t(0)), M);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    GroupScan scan;
    for (int64_t g0 = 0; g0 < G; g0 += 32) {
      const int64_t g = g0 + lane;
      const GroupBounds b = scan.next(g < G ? t.end[g] : 0, M);
      if (g < G) t.beg[g] = b.beg, t.end[g] = b.end, t.slot_end[g] = b.slot_end, t.col_end[g] = b.col_end;
    }
    if (lane == 0) t.rows_total = scan.rows, t.slots_total = scan.slots, t.cols_total = scan.cols;
  }
  __syncthreads();
}

// Every thread: block row x's span as find_span gives it, from the table (a slot's group: the first whose
// slots end past x, by binary search).
__device__ __forceinline__ void table_span(const GroupTable& t, int64_t G, int64_t M, int64_t Mc, int64_t S,
                                           int64_t x, int64_t (&span)[4]) {
  if (x >= S || x >= t.slots_total) {  // a tail chunk or an unused slot
    span_past_groups(x, S, t.rows_total, t.cols_total, M, Mc, span);
    return;
  }
  int64_t lo = 0, hi = G - 1;  // slot_end[hi] > x
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (t.slot_end[mid] > x) hi = mid; else lo = mid + 1;
  }
  const int64_t rows = t.end[lo] - t.beg[lo];
  slot_span(x, t.beg[lo], t.end[lo], t.slot_end[lo] - group_slots(rows), t.col_end[lo] - group_width(rows),
            t.col_end[lo], span);
}

// A thread's 16 rows x 4 columns of x, element (i, e) row i's column c + e. load(i, ...) reads row i's 4
// elements at p (zeros where not `valid`, outside the slot's rows, and past K): one 8-byte (16-bit input)
// or 16-byte (fp32) load when `vec` (K % 4 == 0: aligned, and c < K covers c + 3). 16-bit inputs stay as
// loaded, two 32-bit words a row, converted where used: as floats they took 64 of the kernel's 125
// registers, which held it to 2 CTAs per SM (ncu: latency-bound, 25% occupancy).
template <class L, bool Packed = std::is_same_v<typename L::T, uint16_t>>
struct RowsBy4 {
  uint2 w[kGroupRowsPerWarp];
  __device__ __forceinline__ void load(int i, const uint16_t* __restrict__ p, bool valid, bool vec, int64_t c,
                                       int64_t K) {
    if (valid && vec) {
      w[i] = *reinterpret_cast<const uint2*>(p);
    } else {
      uint32_t h[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) h[e] = valid && c + e < K ? p[e] : 0u;  // 0: +0.0
      w[i] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    }
  }
  __device__ __forceinline__ float operator()(int i, int e) const {
    const uint32_t word = e < 2 ? w[i].x : w[i].y;
    return L::get(uint16_t(e % 2 ? word >> 16 : word & 0xFFFFu));
  }
  // Row i's 1x128 amax over the warp, and each of the 4 columns' amax over the thread's rows: packed
  // (L::max_abs2, folded from +0 as amax_step's fmaxf from 0), unpacked once at the end.
  __device__ __forceinline__ float row_amax(int i) const {
    uint32_t p = L::max_abs2(L::max_abs2(0u, w[i].x), w[i].y);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) p = L::max_abs2(p, __shfl_xor_sync(0xFFFFFFFFu, p, off));
    p &= L::kAbs;
    return fmaxf(L::get(uint16_t(p & 0xFFFFu)), L::get(uint16_t(p >> 16)));
  }
  __device__ __forceinline__ void col_amax(float (&a)[4]) const {
    uint32_t lo = 0u, hi = 0u;  // columns 0, 1 and 2, 3
#pragma unroll
    for (int i = 0; i < kGroupRowsPerWarp; ++i) lo = L::max_abs2(lo, w[i].x), hi = L::max_abs2(hi, w[i].y);
    lo &= L::kAbs, hi &= L::kAbs;
    a[0] = L::get(uint16_t(lo & 0xFFFFu)), a[1] = L::get(uint16_t(lo >> 16));
    a[2] = L::get(uint16_t(hi & 0xFFFFu)), a[3] = L::get(uint16_t(hi >> 16));
  }
};

template <class L>
struct RowsBy4<L, false> {
  float v[kGroupRowsPerWarp][4];
  __device__ __forceinline__ void load(int i, const float* __restrict__ p, bool valid, bool vec, int64_t c,
                                       int64_t K) {
    if (valid && vec) {
      const float4 q = *reinterpret_cast<const float4*>(p);
      v[i][0] = q.x, v[i][1] = q.y, v[i][2] = q.z, v[i][3] = q.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[i][e] = valid && c + e < K ? p[e] : 0.0f;
    }
  }
  __device__ __forceinline__ float operator()(int i, int e) const { return v[i][e]; }
  __device__ __forceinline__ float row_amax(int i) const {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) amax = amax_step(amax, v[i][e]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    return amax;
  }
  __device__ __forceinline__ void col_amax(float (&a)[4]) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = 0.0f;
#pragma unroll
    for (int i = 0; i < kGroupRowsPerWarp; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = amax_step(a[e], v[i][e]);
  }
};

// Four FP8 bytes of v_k * m (the hardware's satfinite cast, equal to fp8_from_float_sw), byte k from v_k.
__device__ __forceinline__ uint32_t fp8x4(float v0, float v1, float v2, float v3, float m, int fp8) {
  return fp8x2_from_float(v0 * m, v1 * m, fp8) | (uint32_t(fp8x2_from_float(v2 * m, v3 * m, fp8)) << 16);
}

// One work item: block row bx's rows [span[0], span[1]) (an unused slot or a tail chunk: none) and columns
// [span[2], span[3]) of the columnwise output, input columns kb * 128 ... of matrix b. `red`, `col_mult`:
// the CTA's shared memory; every thread calls it (it syncs the CTA when columnwise data is asked for).
template <class L, class Rule>
__device__ __forceinline__ void grouped_tile(const typename L::T* __restrict__ x, int64_t M, int64_t K, int64_t S,
                                             const Rule& rule, int fp8, const GroupedOut& o, int64_t b,
                                             int64_t bx, int64_t kb, const int64_t (&span)[4],
                                             float (&red)[kThreads / 32][kGroupTile], float (&col_mult)[kGroupTile]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool slot = bx < S, vec = K % 4 == 0;
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
  RowsBy4<L> v;
#pragma unroll
  for (int i = 0; i < kGroupRowsPerWarp; ++i) v.load(i, x + (rw + i) * K + c, in_groups && rw + i < r1 && c < K, vec, c, K);

  // Rowwise: each row's 1x128 block (rows in no group: data 0, the padding scale). Lane i < 16 takes row
  // i's scale rule (one rule a thread, not 16) and stores its scale: the warp's 16 in one store.
  if (row_data) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kGroupRowsPerWarp; ++i) {
      const float a = v.row_amax(i);
      if (lane == i) amax = a;
    }
    float s = kGemmScalePad, m = 0.0f;
    if (in_groups) rule(amax, s, m);
    if (lane < kGroupRowsPerWarp && rw + lane < r1) row_scale[kb * o.row_ld + rw + lane] = s;
#pragma unroll
    for (int i = 0; i < kGroupRowsPerWarp; ++i) {
      const int64_t r = rw + i;
      if (r >= r1) break;  // warp-uniform
      const float mi = __shfl_sync(0xFFFFFFFFu, m, i);
      if (c >= K) continue;
      const uint32_t q = fp8x4(v(i, 0), v(i, 1), v(i, 2), v(i, 3), mi, fp8);
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
  float amax4[4];
  v.col_amax(amax4);
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
      w[j] = fp8x4(v(4 * j, e), v(4 * j + 1, e), v(4 * j + 2, e), v(4 * j + 3, e), m[e], fp8);
    *reinterpret_cast<uint4*>(col_data + (c + e) * o.col_cols + gc) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The work items (bx, kb) of matrix blockIdx.z, bx < n_x (the slots and tail chunks), columns fastest,
// walked by the grid's CTAs in turn (a CTA per item, or one wave: kItemPerCtaGroups); 3 CTAs per SM
// for 16-bit inputs (at most 85 registers: RowsBy4 keeps them as loaded), 2 for fp32 (64 floats a thread).
template <class L, class Rule>
__global__ void __launch_bounds__(kThreads, std::is_same_v<typename L::T, uint16_t> ? 3 : 2)
    grouped_tile_kernel(const typename L::T* __restrict__ x, const int32_t* __restrict__ sizes, int64_t M, int64_t K,
                        int64_t G, int64_t S, int64_t n_x, Rule rule, int fp8, GroupedOut o) {
  __shared__ GroupTable table;
  __shared__ int64_t scanned[4];  // find_span's, past kTableGroups groups
  __shared__ __align__(16) float red[kThreads / 32][kGroupTile];
  __shared__ __align__(16) float col_mult[kGroupTile];
  const int64_t b = blockIdx.z, nkb = cdiv(K, kGroupTile), items = n_x * nkb;
  x += b * M * K;
  sizes += b * G;
  const bool tabled = G <= kTableGroups;
  if (tabled) build_table(sizes, G, M, table);
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t bx = w / nkb, kb = w - bx * nkb;
    int64_t span[4];
    if (tabled) {
      table_span(table, G, M, o.col_cols, S, bx, span);
      // a tail chunk past every row and column has nothing to write (but the first pads the row scales)
      if (bx > S && span[1] <= span[0] && span[3] <= span[2]) continue;
    } else {
      if (threadIdx.x < 32) find_span(sizes, G, M, o.col_cols, S, bx, scanned);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 4; ++i) span[i] = scanned[i];
    }
    grouped_tile<L>(x, M, K, S, rule, fp8, o, b, bx, kb, span, red, col_mult);
    if (!tabled) __syncthreads();  // every thread has read `scanned` before warp 0 writes the next item's
  }
}

// Up to this many groups a CTA per work item (its table costs little to build), past it one wave of
// resident CTAs walking the items. H100, 16384 (32768) x 7168 bf16, a CTA per item against one wave:
// 330 against 370 us at 8 groups, 344 against 337 at 32, 1103 against 799 at 256; 2 or 4 waves were
// within 5% of one (bench/RESULTS.md, fourteenth session).
constexpr int64_t kItemPerCtaGroups = 16;

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
  const int64_t n_x = S + cdiv(col_count(a.M, G), kGroupTile), items = n_x * cdiv(a.K, kGroupTile);
  if (a.B == 0 || items == 0) return ffi::Error::Success();
  if (a.B > 65535) return bad("quantize_grouped: more than 65535 matrices in one launch");
  return with_loader(a.in, [&](auto ld) {
    using L = decltype(ld);
    return with_block_rule(a, [&](auto rule) {
      const auto kernel = grouped_tile_kernel<L, decltype(rule)>;
      int64_t ctas = std::min<int64_t>(items, 0x7FFFFFFF);  // a CTA per item (the kernel walks any rest)
      if (G > kItemPerCtaGroups) {
        int per_sm = 0;  // CTAs resident per SM (registers, shared memory): one wave of them walks every item
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
        ctas = std::min(ctas, int64_t(std::max(current_sm_count(), 1)) * std::max(per_sm, 1));
      }
      const dim3 grid(unsigned(ctas), 1, unsigned(a.B));
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const typename L::T*>(x), sizes, a.M, a.K, G, S, n_x, rule,
                                            a.fp8, o);
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jf
