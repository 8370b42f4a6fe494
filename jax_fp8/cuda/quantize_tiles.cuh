// The CUDA quantize kernel: every usage (rowwise, columnwise, 2-D tile) and every mode (quantize a
// dense tensor; partial amax or partial cast of a master-weight shard) from one tiled kernel.
//
// One CTA of 256 threads owns a TM x TK tile of one (M, K) matrix. Each thread loads 16-byte vectors
// of one fixed column chunk on rows g, g+G, ... and keeps them in registers, so the input is read
// from HBM exactly once and every usage is cast from the same registers: rowwise blocks reduce by
// warp shuffles, columnwise blocks by a small shared-memory reduction, 2-D tiles by a CTA reduction.
// Tiles inside the matrix (and the shard window) take a path without per-vector bounds checks: at
// these rates the kernel is bound by instruction issue as much as by HBM, and the checks cost more
// than the block math (bench/RESULTS.md, run 11). The per-block math is fp8_math.h, shared with the
// CPU kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

constexpr int kThreads = 256;

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

  // The amax without unpacking: max.xorsign.abs on f16x2/bf16x2 words gives max(|a|, |b|) per half
  // in one instruction, a NaN half yielding the other operand, as amax_step's fmaxf does (subnormals
  // kept: no .ftz). The result's sign bits are the XOR of the operands', so readers mask them. Per 8
  // elements: 4 instructions and 4 registers of column maxima instead of 8 unpacks, 8 fmaxf and 8
  // registers (partial amax at 5 CTAs/SM: 160.6 -> 150.1 us; bench/RESULTS.md, runs 19-20).
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

// Where a matrix's elements live. Dense: x[b*M*K + r*K + c]. Master-weight shard: a flat buffer
// holding elements [offset, offset + length) of the row-major weight, offset/length in device memory.
// Callers give M, K, L and the shard's offset/length (dense_span / shard_span); plan_tiles fills in
// the tile counts and the alignment.
struct Span {
  int64_t M, K, nTM, nTK;
  int64_t nTM_launch;            // tile rows walked: all (dense) or enough to cover a shard
  int64_t L;                     // dense: M*K; shard: the flat buffer's length
  const int32_t* dev_offset;     // null for dense
  const int32_t* dev_length;
  bool aligned_base;             // input pointer 16-byte aligned and K a multiple of VEC
};
inline Span dense_span(int64_t M, int64_t K) { return Span{M, K, 0, 0, 0, M * K, nullptr, nullptr, false}; }
inline Span shard_span(int64_t M, int64_t K, int64_t L, const void* dev_offset, const void* dev_length) {
  return Span{M, K, 0, 0, 0, L, static_cast<const int32_t*>(dev_offset), static_cast<const int32_t*>(dev_length),
              false};
}

enum Mode { kQuantize = 0, kAmax = 1, kCast = 2 };

template <class S>
struct Outs {
  uint8_t* data;
  S* scale;               // kQuantize: scales; kAmax: partial values; kCast: fp32 scale_inv (null for E8M0)
  const S* global;        // kCast: the reduced per-block values
};

// The shard window of a call (the whole matrix when dense), read once per CTA.
struct Window {
  int64_t offset, length;
  int64_t first_tm;       // a shard walks only the tile rows from the one holding its first element
  bool aligned;           // 16-byte vectors of the buffer line up with VEC-element column chunks
};

// The first tile row a shard's walk covers: the one holding its first element (offset >= 0). The tile
// CTAs and the fill CTAs (which write the rows outside the walk) must agree on it.
template <int TM>
__device__ __forceinline__ int64_t first_tile_row(int64_t offset, int64_t K) {
  return offset / K / TM;
}

// Which of the VEC elements of row r from column col0 are valid (bit e), and the buffer position of
// the first. Dense matrices skip the shard window checks.
template <int VEC, bool SHARD, bool INTERIOR>
__device__ __forceinline__ uint32_t vec_mask(int64_t r, int64_t col0, const Span& sp, const Window& w, int64_t& idx) {
  idx = r * sp.K + col0 - w.offset;
  if (INTERIOR) return (1u << VEC) - 1u;
  if (r >= sp.M) return 0;
  if (col0 + VEC <= sp.K && (!SHARD || (idx >= 0 && idx + VEC <= w.length))) return (1u << VEC) - 1u;
  uint32_t mask = 0;
#pragma unroll
  for (int e = 0; e < VEC; ++e)
    mask |= uint32_t(col0 + e < sp.K && (!SHARD || (idx + e >= 0 && idx + e < w.length))) << e;
  return mask;
}

// Cast VEC elements (times their multipliers) and store the valid ones at out[idx ...].
template <int VEC>
__device__ __forceinline__ void store_fp8(uint8_t* __restrict__ out, int64_t idx, uint32_t mask, bool aligned,
                                          const float (&v)[VEC], const float (&mult)[VEC], int fp8) {
  uint16_t pair[VEC / 2];
#pragma unroll
  for (int p = 0; p < VEC / 2; ++p)
    pair[p] = fp8x2_from_float(v[2 * p] * mult[2 * p], v[2 * p + 1] * mult[2 * p + 1], fp8);
  if (aligned && mask == (1u << VEC) - 1u) {
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint2*>(out + idx) =
          make_uint2(pair[0] | (uint32_t(pair[1]) << 16), pair[2] | (uint32_t(pair[3]) << 16));
    } else {
      *reinterpret_cast<uint32_t*>(out + idx) = pair[0] | (uint32_t(pair[1]) << 16);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (mask & (1u << e)) out[idx + e] = uint8_t(pair[e / 2] >> (8 * (e % 2)));
  }
}

// A tile all of whose vectors are full and aligned (inside the matrix and the shard window): its
// loads and stores skip the per-vector checks.
template <int TM, int TK, bool SHARD>
__device__ __forceinline__ bool tile_interior(int64_t tm, int64_t tk, const Span& sp, const Window& w) {
  if (!w.aligned || (tm + 1) * TM > sp.M || (tk + 1) * TK > sp.K) return false;
  const int64_t first = tm * TM * sp.K + tk * TK - w.offset;                  // buffer positions increase
  const int64_t end = ((tm + 1) * TM - 1) * sp.K + (tk + 1) * TK - w.offset;  // with (row, col)
  return !SHARD || (first >= 0 && end <= w.length);
}

// Tile t: batch b, tile row tm (a shard's walk starts at the tile row of its first element), tile
// column tk. 32-bit division: the launch checks the tile count.
struct TilePos {
  int64_t b, tm, tk;
};
__device__ __forceinline__ TilePos tile_pos(int64_t t, const Span& sp, const Window& w) {
  const uint32_t u = uint32_t(t), nk = uint32_t(sp.nTK), nm = uint32_t(sp.nTM_launch);
  const uint32_t q = u / nk;
  return {int64_t(q / nm), w.first_tm + int64_t(q % nm), int64_t(u % nk)};
}

// One 16-byte vector of row r from column col0; vectors cut by the matrix edge or the shard window
// are gathered element by element, zeros where invalid.
template <class L, bool SHARD, bool INTERIOR>
__device__ __forceinline__ uint4 load_vector(const typename L::T* __restrict__ xb, int64_t r, int64_t col0,
                                             const Span& sp, const Window& w) {
  int64_t idx;
  const uint32_t mask = vec_mask<L::VEC, SHARD, INTERIOR>(r, col0, sp, w, idx);
  if (INTERIOR || (w.aligned && mask == (1u << L::VEC) - 1u)) return __ldg(reinterpret_cast<const uint4*>(xb + idx));
  uint4 raw = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int e = 0; e < L::VEC; ++e)
    if (mask & (1u << e)) L::set(raw, e, xb[idx + e]);
  return raw;
}

// Per block: from its amax (or, when casting a shard, from the reduced global value g) to the
// multiplier, writing what the mode stores for the block when `write` (kQuantize: the scale; kAmax:
// the rank's partial value; kCast: the fp32 scale_inv, every rank the same from the global amax).
template <int MODE, class Rule>
__device__ __forceinline__ float block_multiplier(const Rule& rule, float amax, typename Rule::ScaleT g,
                                                  const Outs<typename Rule::ScaleT>& o, int64_t gi, bool write) {
  typename Rule::ScaleT s;
  float mult = 1.0f;
  if constexpr (MODE == kQuantize) {
    rule(amax, s, mult);
  } else if constexpr (MODE == kAmax) {
    s = rule.partial(amax);
  } else {
    rule.from_global(g, s, mult);
  }
  if (write && (MODE != kCast || o.scale)) o.scale[gi] = s;
  return mult;
}

// The TM x TK tile geometry: thread tid holds VEC-element chunk c of rows g, g+G, ..., NV vectors.
template <class L, int TM, int TK>
struct Geom {
  static constexpr int VEC = L::VEC;
  static constexpr int CHUNKS = TK / VEC;      // 16-byte vectors per tile row
  static constexpr int G = kThreads / CHUNKS;  // tile rows per pass
  static constexpr int NV = TM / G;            // vectors per thread
  static_assert(kThreads % CHUNKS == 0 && TM % G == 0, "tile shape");
};

// Quantizes tile t of a matrix or shard. RBK > 0: rowwise 1 x RBK blocks; COL: TM x 1 blocks; TILE:
// one TM x TK block. Every scale block belongs to exactly one tile, so no atomics are needed in any mode.
template <class L, class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MODE>
__device__ __forceinline__ void quantize_tile(const typename L::T* __restrict__ x, const Span& sp, const Rule& rule,
                                              int fp8, const Outs<typename Rule::ScaleT>& row,
                                              const Outs<typename Rule::ScaleT>& col, uint32_t t) {
  using Gm = Geom<L, TM, TK>;
  using S = typename Rule::ScaleT;
  constexpr int VEC = Gm::VEC, CHUNKS = Gm::CHUNKS, G = Gm::G, NV = Gm::NV;
  constexpr bool SHARD = MODE != kQuantize;
  Window w;
  w.offset = sp.dev_offset ? *sp.dev_offset : 0;
  w.length = sp.dev_length && *sp.dev_length < sp.L ? int64_t(*sp.dev_length) : sp.L;
  w.first_tm = sp.dev_offset ? first_tile_row<TM>(w.offset, sp.K) : 0;
  w.aligned = sp.aligned_base && w.offset % VEC == 0;
  const TilePos p = tile_pos(t, sp, w);
  if (p.tm >= sp.nTM) return;
  const int tid = threadIdx.x;
  const int c = tid % CHUNKS, g = tid / CHUNKS;
  const int64_t col0 = p.tk * TK + int64_t(c) * VEC;
  const int64_t row0 = p.tm * TM + g;
  const int64_t base = p.b * sp.M * sp.K;  // dense batches; shards have b == 0
  const int64_t n_row_scales = RBK > 0 ? cdiv(sp.K, RBK) : 0;
  const auto row_gi = [&](int i) {  // scale index of row i's block
    return (p.b * sp.M + row0 + int64_t(i) * G) * n_row_scales + col0 / (RBK > 0 ? RBK : 1);
  };
  const int64_t col_gi = (p.b * sp.nTM + p.tm) * sp.K + p.tk * TK + tid;
  const int64_t tile_gi = (p.b * sp.nTM + p.tm) * sp.nTK + p.tk;

  const auto run = [&](auto interior) {
    constexpr bool INTERIOR = decltype(interior)::value;
    const bool aligned = INTERIOR || w.aligned;
    uint4 raw[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) raw[i] = load_vector<L, SHARD, INTERIOR>(x + base, row0 + int64_t(i) * G, col0, sp, w);
    // Rowwise blocks: the LANES threads of a block hold NV vectors (rows) each, and lane gl applies
    // the rule for row gl % NV only (NV <= LANES), so each thread evaluates the rule once, not NV times.
    constexpr int LANES = RBK > 0 ? RBK / VEC : 1;
    static_assert(RBK == 0 || (LANES <= 32 && CHUNKS % LANES == 0 && NV <= LANES), "row block inside a warp");
    const int gl = c % LANES, mi = gl % NV;
    const bool row_in = INTERIOR || (row0 + int64_t(mi) * G < sp.M && col0 - gl * VEC < sp.K);
    // A shard cast's reduced scales are loaded with the tile, not after it.
    S g_row = {}, g_col = {};
    if constexpr (MODE == kCast) {
      if constexpr (RBK > 0)
        if (row_in) g_row = row.global[row_gi(mi)];
      if constexpr (TILE) g_row = row.global[tile_gi];
      if constexpr (COL)
        if (tid < TK && p.tk * TK + tid < sp.K) g_col = col.global[col_gi];
    }
    // Casts vector i with multipliers `mult` into `out` (the vector's mask and position recomputed
    // here rather than kept live across the reductions).
    const auto store = [&](uint8_t* out, int i, const float (&v)[VEC], const float (&mult)[VEC]) {
      int64_t idx;
      const uint32_t mask = vec_mask<VEC, SHARD, INTERIOR>(row0 + int64_t(i) * G, col0, sp, w, idx);
      if (mask) store_fp8<VEC>(out + base, idx, mask, aligned, v, mult, fp8);
    };

    if constexpr (RBK > 0) {
      float my_amax = 0.0f;  // the block amax of row mi
      if constexpr (MODE != kCast) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          float amax = L::amax_of(raw[i]);
#pragma unroll
          for (int off = LANES / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
          my_amax = mi == i ? amax : my_amax;
        }
      }
      const float my_m = row_in ? block_multiplier<MODE>(rule, my_amax, g_row, row, row_gi(mi), gl < NV) : 1.0f;
      if constexpr (MODE != kAmax) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const float m = __shfl_sync(0xFFFFFFFFu, my_m, i, LANES);  // row i's multiplier, from lane i
          float v[VEC], mult[VEC];
          L::unpack(raw[i], v);
#pragma unroll
          for (int e = 0; e < VEC; ++e) mult[e] = m;
          store(row.data, i, v, mult);
        }
      }
    }

    if constexpr (COL) {  // columnwise: per-column partial amax over this thread's rows, reduced over G
      __shared__ __align__(16) float red[G][TK];  // partial amax per (row group, column)
      __shared__ __align__(16) float col_mult[TK];
      if constexpr (MODE != kCast) {
        uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < NV; ++i) L::amax_acc(acc, raw[i]);
        float part[VEC];
        L::amax_unpack(acc, part);
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q)
          reinterpret_cast<float4*>(&red[g][c * VEC])[q] =
              make_float4(part[4 * q], part[4 * q + 1], part[4 * q + 2], part[4 * q + 3]);
        __syncthreads();
      }
      // One thread per tile column finishes the reduction, applies the rule once and writes the
      // column's scale (coalesced); the multipliers go back through shared memory.
      static_assert(TK <= kThreads, "one thread per column");
      if (tid < TK) {
        float m = 1.0f;
        if (p.tk * TK + tid < sp.K && p.tm * TM < sp.M) {
          float a = 0.0f;
          if constexpr (MODE != kCast) {
#pragma unroll
            for (int gg = 0; gg < G; ++gg) a = fmaxf(a, red[gg][tid]);
          }
          m = block_multiplier<MODE>(rule, a, g_col, col, col_gi, true);
        }
        col_mult[tid] = m;
      }
      __syncthreads();
      if constexpr (MODE != kAmax) {
        float mult[VEC];
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          const float4 m4 = reinterpret_cast<const float4*>(&col_mult[c * VEC])[q];
          mult[4 * q] = m4.x, mult[4 * q + 1] = m4.y, mult[4 * q + 2] = m4.z, mult[4 * q + 3] = m4.w;
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          float v[VEC];
          L::unpack(raw[i], v);
          store(col.data, i, v, mult);
        }
      }
    }

    if constexpr (TILE) {  // one block for the whole tile: CTA-wide amax
      float amax = 0.0f;
      if constexpr (MODE != kCast) {
        __shared__ float warp_max[kThreads / 32];
        uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < NV; ++i) L::amax_acc(acc, raw[i]);
        amax = L::amax_of(acc);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
        if (tid % 32 == 0) warp_max[tid / 32] = amax;
        __syncthreads();
        amax = 0.0f;
#pragma unroll
        for (int k = 0; k < kThreads / 32; ++k) amax = fmaxf(amax, warp_max[k]);
      }
      const float m = block_multiplier<MODE>(rule, amax, g_row, row, tile_gi, tid == 0);
      if constexpr (MODE != kAmax) {
        float mult[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) mult[e] = m;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          float v[VEC];
          L::unpack(raw[i], v);
          store(row.data, i, v, mult);
        }
      }
    }
  };
  if (tile_interior<TM, TK, SHARD>(p.tm, p.tk, sp, w)) run(std::true_type{});
  else run(std::false_type{});
}

// CTAs per SM for the register allocation (the highest that compiles without spills and measured
// fastest, bench/kernel_bench.cu, RESULTS.md runs 12 and 19-21). fp32 tiles of 8-16 vectors per thread
// need the registers: the compiler's allocation. ONE: a shard kernel with its one job at fixed
// parameter offsets; a job picked at run time needs more registers (the partial amax spills above 4).
template <class L, class Rule, bool COL, int MODE, bool ONE = true>
constexpr int min_blocks_for() {
  if (L::VEC != 8) return 1;
  if (!std::is_same_v<Rule, MxRule>) return 2;
  if (MODE == kAmax) return ONE ? 6 : 4;
  return COL ? 3 : (MODE == kCast ? 3 : 4);
}

// The tile geometry and usages of one call: Rule, TM x TK tiles, rowwise 1 x RBK blocks (RBK > 0),
// TM x 1 columnwise blocks (COL), or one block per tile (TILE).
template <class Rule_, int TM_, int TK_, int RBK_, bool COL_, bool TILE_>
struct TileCfg {
  using Rule = Rule_;
  using S = typename Rule::ScaleT;
  static constexpr int TM = TM_, TK = TK_, RBK = RBK_;
  static constexpr bool COL = COL_, TILE = TILE_;
  // Which of the usage-ordered outputs (row, col, tile) goes to the kernel's `row` and `col` slots.
  static constexpr int ROW_SLOT = RBK || TILE ? 0 : -1, COL_SLOT = COL ? (RBK ? 1 : 0) : -1;
  // The row slot's blocks: 1 x RBK, or TM x TK for 2-D tiles.
  static constexpr int ROW_BM = TILE ? TM : 1, ROW_BK = TILE ? TK : RBK;
};

// Calls f(cfg, rule) with the tile configuration and scale rule for the usages of `a`.
template <class F>
ffi::Error with_cfg(const QuantizeArgs& a, F&& f) {
  if (a.scale_kind == kScaleE8M0) {
    const MxRule r{a.fp8};
    if (a.row_block && a.col_block) return f(TileCfg<MxRule, 32, 256, 32, true, false>{}, r);
    if (a.row_block) return f(TileCfg<MxRule, 32, 256, 32, false, false>{}, r);
    return f(TileCfg<MxRule, 32, 256, 0, true, false>{}, r);
  }
  const BlockRule r{a.fp8, a.pow2, a.eps, a.inf_value};
  if (a.tile_block) return f(TileCfg<BlockRule, 128, 128, 0, false, true>{}, r);
  if (a.row_block && a.col_block) return f(TileCfg<BlockRule, 128, 128, 128, true, false>{}, r);
  if (a.row_block) return f(TileCfg<BlockRule, 128, 128, 128, false, false>{}, r);
  return f(TileCfg<BlockRule, 128, 128, 0, true, false>{}, r);
}

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

// The kernel's output slot for usage-ordered pointers (data, scale, global per usage).
template <class Cfg>
Outs<typename Cfg::S> slot(int which, uint8_t* const* d, void* const* s, const void* const* g) {
  using S = typename Cfg::S;
  if (which < 0) return {};
  return {d[which], static_cast<S*>(s[which]), static_cast<const S*>(g[which])};
}

// Fills in the tile counts and the alignment of a span; returns the number of tiles to launch.
template <class L, int TM, int TK>
int64_t plan_tiles(Span& sp, int64_t B, const void* x) {
  if (sp.M * sp.K == 0) return 0;
  sp.nTM = cdiv(sp.M, TM);
  sp.nTK = cdiv(sp.K, TK);
  // A shard of L elements spans at most ceil(L/K) + 1 rows, so that many rows' tiles (+1) cover it.
  sp.nTM_launch = sp.dev_offset ? std::min(sp.nTM, cdiv(cdiv(sp.L, sp.K) + 1, TM) + 1) : sp.nTM;
  sp.aligned_base = sp.K % L::VEC == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  return B * sp.nTM_launch * sp.nTK;
}

// ---- dense tensors: one launch, one tile per CTA ----------------------------------------------

template <class L, class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    tile_kernel(const typename L::T* __restrict__ x, Span sp, Rule rule, int fp8, Outs<typename Rule::ScaleT> row,
                Outs<typename Rule::ScaleT> col) {
  quantize_tile<L, Rule, TM, TK, RBK, COL, TILE, kQuantize>(x, sp, rule, fp8, row, col, blockIdx.x);
}

template <class L, class Rule, int TM, int TK, int RBK, bool COL, bool TILE,
          int MINB = min_blocks_for<L, Rule, COL, kQuantize>()>
ffi::Error launch_tiles(cudaStream_t stream, const QuantizeArgs& a, const void* x, Span sp, Rule rule,
                        Outs<typename Rule::ScaleT> row, Outs<typename Rule::ScaleT> col) {
  const int64_t n_tiles = plan_tiles<L, TM, TK>(sp, a.B, x);
  if (n_tiles > 0x7FFFFFFF) return bad("tensor too large for one launch");
  if (n_tiles == 0) return ffi::Error::Success();
  tile_kernel<L, Rule, TM, TK, RBK, COL, TILE, MINB><<<unsigned(n_tiles), kThreads, 0, stream>>>(
      static_cast<const typename L::T*>(x), sp, rule, a.fp8, row, col);
  return ffi::Error::Success();
}

// Quantizes the (B, M, K) tensor x; `d`/`s` hold the outputs per usage in the order row, col, tile.
inline ffi::Error quantize_tiles(cudaStream_t st, const QuantizeArgs& a, const void* x, uint8_t* const* d,
                                 void* const* s) {
  const void* none[2] = {nullptr, nullptr};
  return with_loader(a.in, [&](auto ld) {
    return with_cfg(a, [&](auto cfg, auto rule) {
      using C = decltype(cfg);
      return launch_tiles<decltype(ld), typename C::Rule, C::TM, C::TK, C::RBK, C::COL, C::TILE>(
          st, a, x, dense_span(a.M, a.K), rule, slot<C>(C::ROW_SLOT, d, s, none), slot<C>(C::COL_SLOT, d, s, none));
    });
  });
}

// ---- master-weight shards: many weights per launch ----------------------------------------------
// A group launch takes up to kMaxJobs weights (a transformer has hundreds; one launch each costs
// about 3.4 us of GPU time over its HBM time, RESULTS.md run 15). Each job's CTAs are `n_fill` CTAs
// that write what the tiles do not, then its tiles. The fill covers the blocks of the tile rows outside
// the walk (partial value 0; when casting, the fp32 scale_inv from the global amax) and, when casting,
// zeros in the data past the shard's elements; it goes first so that its writes overlap the tiles'
// reads. The jobs live in the kernel's parameter space (under 4 KB).

template <class S>
struct ShardJob {
  const void* x;
  Span sp;
  Outs<S> row, col;
  uint32_t begin, n_tiles, n_fill;  // CTAs [begin, begin + n_fill) fill, the next n_tiles are tiles
};
constexpr int kMaxJobs = 24;
constexpr int64_t kAloneCtas = 8192;  // a weight of this many CTAs (~16 waves) gets its own launch
template <class S>
struct ShardGroup {
  ShardJob<S> job[kMaxJobs];
  int n;
};
static_assert(sizeof(ShardGroup<float>) + 64 <= 4096, "kernel parameters");

// Zeros bytes [b, e): 16-byte stores in the aligned middle, thread i of n.
__device__ __forceinline__ void zero_bytes(uint8_t* b, uint8_t* e, int64_t i, int64_t n) {
  uint8_t* v0 = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(b) + 15) & ~uintptr_t(15));
  uint8_t* v1 = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(e) & ~uintptr_t(15));
  if (v0 >= v1) v0 = v1 = e;  // no whole vector: every byte the scalar way
  for (int64_t k = i; k < v0 - b; k += n) b[k] = 0;
  for (int64_t k = i; k < (v1 - v0) / 16; k += n) reinterpret_cast<uint4*>(v0)[k] = make_uint4(0, 0, 0, 0);
  for (int64_t k = i; k < e - v1; k += n) v1[k] = 0;
}

// The fill CTAs of a job: thread i of n writes its share of what the tile walk leaves out.
template <class Cfg, int MODE>
__device__ void fill_outside_walk(const ShardJob<typename Cfg::S>& jb, const typename Cfg::Rule& rule, int64_t i,
                                  int64_t n) {
  using S = typename Cfg::S;
  const Span& sp = jb.sp;
  const int64_t off = *sp.dev_offset, len = *sp.dev_length, MK = sp.M * sp.K;
  if (MK > 0) {
    const int64_t first_tm = first_tile_row<Cfg::TM>(off, sp.K);
    // Blocks of grid rows [0, lo) and [hi, rows) of a usage with bm-row blocks lie outside the walk.
    const auto outside = [&](const Outs<S>& o, int bm, int bk) {
      const int64_t rows = cdiv(sp.M, bm), cols = cdiv(sp.K, bk), per_tile = Cfg::TM / bm;
      const int64_t lo = min(rows, first_tm * per_tile) * cols;
      const int64_t hi = min(rows, (first_tm + sp.nTM_launch) * per_tile) * cols;
      if constexpr (MODE == kAmax) {
        zero_bytes(reinterpret_cast<uint8_t*>(o.scale), reinterpret_cast<uint8_t*>(o.scale + lo), i, n);
        zero_bytes(reinterpret_cast<uint8_t*>(o.scale + hi), reinterpret_cast<uint8_t*>(o.scale + rows * cols), i, n);
      } else if (o.scale) {
        const auto from_global = [&](int64_t k) {
          float mult;
          rule.from_global(o.global[k], o.scale[k], mult);
        };
        for (int64_t k = i; k < lo; k += n) from_global(k);
        for (int64_t k = hi + i; k < rows * cols; k += n) from_global(k);
      }
    };
    if constexpr (Cfg::ROW_SLOT >= 0) outside(jb.row, Cfg::ROW_BM, Cfg::ROW_BK);
    if constexpr (Cfg::COL_SLOT >= 0) outside(jb.col, Cfg::TM, 1);
  }
  if constexpr (MODE == kCast) {  // the data past the shard's elements inside the weight
    const int64_t end = max(int64_t(0), min(min(len, MK - off), sp.L));
    if (jb.row.data) zero_bytes(jb.row.data + end, jb.row.data + sp.L, i, n);
    if (jb.col.data) zero_bytes(jb.col.data + end, jb.col.data + sp.L, i, n);
  }
}

// ONE: a single job (a large weight launched alone): its fields sit at fixed parameter offsets, which
// the instructions read directly; a job picked at run time costs a register and a load per field
// (a half-weight 32768x16384 shard: amax tiles 173.9 us picked at run time, 165.7 us as ONE; runs 17-18).
// FILL_LAST: the fill CTAs after the tiles instead (kernel_bench compares).
template <class L, class Cfg, int MODE, int MINB, bool ONE, bool FILL_LAST>
__global__ void __launch_bounds__(kThreads, MINB)
    shard_kernel(const __grid_constant__ ShardGroup<typename Cfg::S> grp, const typename Cfg::Rule rule, int fp8) {
  int j = 0;
  if (!ONE)
    while (j + 1 < grp.n && grp.job[j + 1].begin <= blockIdx.x) ++j;
  const ShardJob<typename Cfg::S>& jb = grp.job[ONE ? 0 : j];
  const uint32_t t = blockIdx.x - jb.begin;
  const uint32_t f = FILL_LAST ? t - jb.n_tiles : t;  // fill CTA index (wraps when not a fill CTA)
  if (f < jb.n_fill)
    fill_outside_walk<Cfg, MODE>(jb, rule, int64_t(f) * kThreads + threadIdx.x, int64_t(jb.n_fill) * kThreads);
  else
    quantize_tile<L, typename Cfg::Rule, Cfg::TM, Cfg::TK, Cfg::RBK, Cfg::COL, Cfg::TILE, MODE>(
        static_cast<const typename L::T*>(jb.x), jb.sp, rule, fp8, jb.row, jb.col, FILL_LAST ? t : t - jb.n_fill);
}

// One weight of a group: its flat shard x of L elements holds elements [offset, offset + length) of
// the row-major (M, K) weight, (offset, length) = window[0..1] in device memory. Per usage (row, col,
// tile order): data (kCast), the partial values (kAmax) or fp32 scale_inv (kCast), the global values.
struct ShardIO {
  const void* x;
  int64_t L, M, K;
  const int32_t* window;
  uint8_t* data[2];
  void* scale[2];
  const void* global[2];
};

// Which CTAs of a group launch run: all, or (to time them apart) only the tiles or only the fill.
enum class Part { kAll, kTiles, kFill };

// MINB_ (a register cap other than min_blocks_for's) and FILL_LAST: for kernel_bench's comparisons.
template <int MODE, int MINB_ = 0, bool FILL_LAST = false>
ffi::Error launch_shards(cudaStream_t st, const QuantizeArgs& a, const ShardIO* io, int n, Part part = Part::kAll) {
  static_assert(MODE != kQuantize, "shards are partial-amax or partial-cast calls");
  return with_loader(a.in, [&](auto ld) {
    return with_cfg(a, [&](auto cfg, auto rule) -> ffi::Error {
      using L = decltype(ld);
      using C = decltype(cfg);
      using S = typename C::S;
      constexpr int MINB_ONE = MINB_ ? MINB_ : min_blocks_for<L, typename C::Rule, C::COL, MODE, true>();
      constexpr int MINB_MANY = MINB_ ? MINB_ : min_blocks_for<L, typename C::Rule, C::COL, MODE, false>();
      ShardGroup<S> grp;
      grp.n = 0;
      int64_t ctas = 0;
      const auto flush = [&] {
        if (grp.n == 1)
          shard_kernel<L, C, MODE, MINB_ONE, true, FILL_LAST><<<unsigned(ctas), kThreads, 0, st>>>(grp, rule, a.fp8);
        if (grp.n > 1)
          shard_kernel<L, C, MODE, MINB_MANY, false, FILL_LAST><<<unsigned(ctas), kThreads, 0, st>>>(grp, rule, a.fp8);
        grp.n = 0;
        ctas = 0;
      };
      for (int i = 0; i < n; ++i) {
        ShardJob<S> jb;
        jb.x = io[i].x;
        jb.sp = shard_span(io[i].M, io[i].K, io[i].L, io[i].window, io[i].window + 1);
        jb.row = slot<C>(C::ROW_SLOT, io[i].data, io[i].scale, io[i].global);
        jb.col = slot<C>(C::COL_SLOT, io[i].data, io[i].scale, io[i].global);
        const int64_t tiles = plan_tiles<L, C::TM, C::TK>(jb.sp, 1, jb.x);
        // fill work, at most: every block of the written grids, and the data padding; ~256 bytes a thread
        int64_t bytes = 0;
        if (MODE == kAmax || io[i].scale[0]) {
          if (C::ROW_SLOT >= 0) bytes += Usage{C::ROW_BM, C::ROW_BK}.blocks(io[i].M, io[i].K) * int64_t(sizeof(S));
          if (C::COL_SLOT >= 0) bytes += Usage{C::TM, 1}.blocks(io[i].M, io[i].K) * int64_t(sizeof(S));
        }
        if (MODE == kCast) bytes += ((C::ROW_SLOT >= 0) + (C::COL_SLOT >= 0)) * io[i].L;
        const int64_t fill = std::min<int64_t>(cdiv(bytes, kThreads * 256), 1024);
        if (tiles + fill > 0x7FFFFFFF) return bad("master-weight shard too large for one launch");
        jb.n_tiles = uint32_t(part == Part::kFill ? 0 : tiles);
        jb.n_fill = uint32_t(part == Part::kTiles ? 0 : fill);
        const int64_t own = jb.n_tiles + jb.n_fill;
        if (own == 0) continue;
        const bool alone = own >= kAloneCtas;  // launch overhead is small next to its run time
        if (grp.n == kMaxJobs || ctas + own > 0x7FFFFFFF || alone) flush();
        jb.begin = uint32_t(ctas);
        grp.job[grp.n++] = jb;
        ctas += own;
        if (alone) flush();
      }
      flush();
      return ffi::Error::Success();
    });
  });
}

inline ffi::Error check_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_fp8 CUDA: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jf
