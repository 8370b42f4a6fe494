// The CUDA quantize tile: every usage (rowwise, columnwise, 2-D tile) and every mode (quantize a dense
// tensor; partial amax or partial cast of a master-weight shard) from one device function.
//
// One CTA of 256 threads owns a TM x TK tile of one (M, K) matrix. Each thread loads 16-byte vectors
// of one fixed column chunk on rows g, g+G, ... and keeps them in registers, so the input is read
// from HBM exactly once and every usage is cast from the same registers: rowwise blocks reduce by
// warp shuffles, columnwise blocks by a small shared-memory reduction, 2-D tiles by a CTA reduction.
// Tiles inside the matrix (and the shard window) take a path without per-vector bounds checks: at
// these rates the kernel is bound by instruction issue as much as by HBM, and the checks cost more
// than the block math (bench/RESULTS.md, run 11). The per-block math is fp8_math.h, shared with the
// CPU kernels. The launches: quantize_dense.cuh (dense tensors), quantize_shards.cuh (master weights).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"

namespace jf {
namespace {

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
  int64_t group;                 // the walk's tile order: groups of `group` tile rows, rows fastest inside
};
// A dense (M, K) matrix walked in groups of `group` tile rows (TileCfg::GROUP).
inline Span dense_span(int64_t M, int64_t K, int64_t group) {
  return Span{M, K, 0, 0, 0, M * K, nullptr, nullptr, false, group};
}
// A master-weight shard, walked tile row by tile row.
inline Span shard_span(int64_t M, int64_t K, int64_t L, const void* dev_offset, const void* dev_length) {
  return Span{M, K, 0, 0, 0, L, static_cast<const int32_t*>(dev_offset), static_cast<const int32_t*>(dev_length),
              false, 1};
}

enum Mode { kQuantize = 0, kAmax = 1, kCast = 2 };

// One output of a tile.
template <class S>
struct Outs {
  uint8_t* data;          // (B, M, K), or (B, K, M) when the tile's config stores columnwise data transposed
  S* scale;               // kQuantize: scales; kAmax: partial values; kCast: fp32 scale_inv (null for E8M0)
  const S* global;        // kCast: the reduced per-block values
};

// Where an output keeps the scale of block (i, j) of matrix b (OutLayout, ffi_common.h):
// scale[b * s_batch + i * s_row + j * s_col]. GEMM-ready scales pad each stored row from pad_from to
// ld; a stored row is a block column j when `transposed`, else a block row i.
struct ScaleAt {
  int64_t s_batch, s_row, s_col, pad_from, ld;
  bool transposed;
  __device__ __forceinline__ int64_t operator()(int64_t b, int64_t i, int64_t j) const {
    return b * s_batch + i * s_row + j * s_col;
  }
};
inline ScaleAt scale_at(const OutLayout& o) { return {o.s_batch, o.s_row, o.s_col, o.pad_from, o.ld, o.scales_transposed}; }
// The compact grid of bm x bk blocks of an (M, K) matrix, row-major (master-weight shards).
__host__ __device__ __forceinline__ ScaleAt compact_scale_at(int64_t M, int64_t K, int bm, int bk) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  return {sm * sk, sk, 1, 0, 0, false};
}

// Four words of four bytes (rows a, b, c, d) transposed: o[t] holds byte t of a, b, c, d, in that order.
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&o)[4]) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);
  const uint32_t cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
  o[0] = __byte_perm(ab01, cd01, 0x5410);
  o[1] = __byte_perm(ab01, cd01, 0x7632);
  o[2] = __byte_perm(ab23, cd23, 0x5410);
  o[3] = __byte_perm(ab23, cd23, 0x7632);
}

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
// column tk. The tiles of a matrix are walked in groups of sp.group tile rows, tile rows fastest inside
// a group (group 1: tile columns fastest). 32-bit division: the launch checks the tile count.
struct TilePos {
  int64_t b, tm, tk;
};
__device__ __forceinline__ TilePos tile_pos(int64_t t, const Span& sp, const Window& w) {
  const uint32_t u = uint32_t(t), nk = uint32_t(sp.nTK), nm = uint32_t(sp.nTM_launch), G = uint32_t(sp.group);
  const uint32_t r = u % (nk * nm), first = r / (G * nk) * G, rows = min(G, nm - first), in = r - first * nk;
  return {int64_t(u / (nk * nm)), w.first_tm + int64_t(first + in % rows), int64_t(in / rows)};
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
  if (write && (MODE != kCast || o.scale)) store_scale(o.scale + gi, s);
  return mult;
}

// The TM x TK tile geometry: thread tid holds VEC-element chunk c of NV rows: g, g+G, ..., or, when
// columnwise data is stored transposed (COL_T), the NV consecutive rows g*NV ... g*NV + NV-1, so that
// each group of 4 rows transposes in registers into whole words of its columns.
template <class L, int TM, int TK>
struct Geom {
  static constexpr int VEC = L::VEC;
  static constexpr int CHUNKS = TK / VEC;      // 16-byte vectors per tile row
  static constexpr int G = kThreads / CHUNKS;  // tile rows per pass
  static constexpr int NV = TM / G;            // vectors per thread
  static_assert(kThreads % CHUNKS == 0 && TM % G == 0, "tile shape");
};

// Quantizes tile t of a matrix or shard with the tile configuration Cfg (TileCfg below): rowwise
// 1 x RBK blocks (RBK > 0), TM x 1 columnwise blocks (COL), one TM x TK block (TILE); columnwise data
// stored transposed (COL_T: GEMM-ready). Every scale block belongs to exactly one tile, so no atomics
// are needed in any mode.
template <class L, class Cfg, int MODE>
__device__ __forceinline__ void quantize_tile(const typename L::T* __restrict__ x, const Span& sp,
                                              const typename Cfg::Rule& rule, int fp8,
                                              const Outs<typename Cfg::S>& row, const Outs<typename Cfg::S>& col,
                                              const ScaleAt& row_at, const ScaleAt& col_at, uint32_t t) {
  constexpr int TM = Cfg::TM, TK = Cfg::TK, RBK = Cfg::RBK;
  constexpr bool COL = Cfg::COL, TILE = Cfg::TILE, COL_T = Cfg::COL_T;
  using Gm = Geom<L, TM, TK>;
  using S = typename Cfg::S;
  constexpr int VEC = Gm::VEC, CHUNKS = Gm::CHUNKS, G = Gm::G, NV = Gm::NV;
  constexpr bool SHARD = MODE != kQuantize;
  static_assert(!(COL_T && SHARD), "master-weight shards are compact");
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
  const auto row_of = [&](int i) -> int64_t { return p.tm * TM + (COL_T ? g * NV + i : g + i * G); };
  const int64_t base = p.b * sp.M * sp.K;  // dense batches; shards have b == 0
  // The transposed tile of COL_T (cast_store_T), declared here once for both paths of `run` below.
  __shared__ __align__(16) uint32_t stage[COL_T ? TK * TM / 4 : 1];
  // Scale positions: GEMM-ready scales as the call's ScaleAt says; compact grids from the span, so
  // that the compact kernels keep their registers (the strides are compile-time there).
  const ScaleAt rat = Cfg::GEMM_SCALES ? row_at : compact_scale_at(sp.M, sp.K, Cfg::ROW_BM, Cfg::ROW_BK ? Cfg::ROW_BK : 1);
  const ScaleAt cat = Cfg::GEMM_SCALES ? col_at : compact_scale_at(sp.M, sp.K, TM, 1);
  const auto row_gi = [&](int i) { return rat(p.b, row_of(i), col0 / (RBK > 0 ? RBK : 1)); };  // row i's block
  const int64_t col_gi = cat(p.b, p.tm, p.tk * TK + tid);
  // GEMM-ready scales: the tiles of block row 0 (transposed scales) or of block column 0 pad the
  // stored rows of their blocks with the scale of an all-zero block.
  const auto write_pads = [&](const Outs<S>& o, const ScaleAt& at) {
    if (!Cfg::GEMM_SCALES || at.pad_from >= at.ld || (at.transposed ? p.tm : p.tk) != 0) return;
    const int64_t r = at.transposed ? p.tk : p.tm;
    if (tid < at.ld - at.pad_from) o.scale[p.b * at.s_batch + r * at.ld + at.pad_from + tid] = S(kGemmScalePad);
  };

  const auto run = [&](auto interior) {
    constexpr bool INTERIOR = decltype(interior)::value;
    const bool aligned = INTERIOR || w.aligned;
    uint4 raw[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) raw[i] = load_vector<L, SHARD, INTERIOR>(x + base, row_of(i), col0, sp, w);
    // Rowwise blocks: the LANES threads of a block hold NV vectors (rows) each, and lane gl applies
    // the rule for row gl % NV only (NV <= LANES), so each thread evaluates the rule once, not NV times.
    constexpr int LANES = RBK > 0 ? RBK / VEC : 1;
    static_assert(RBK == 0 || (LANES <= 32 && CHUNKS % LANES == 0 && NV <= LANES), "row block inside a warp");
    const int gl = c % LANES, mi = gl % NV;
    const bool row_in = INTERIOR || (row_of(mi) < sp.M && col0 - gl * VEC < sp.K);
    // A shard cast's reduced scales are loaded with the tile, not after it.
    S g_row = {}, g_col = {};
    if constexpr (MODE == kCast) {
      if constexpr (RBK > 0)
        if (row_in) g_row = row.global[row_gi(mi)];
      if constexpr (TILE) g_row = row.global[rat(p.b, p.tm, p.tk)];
      if constexpr (COL)
        if (tid < TK && p.tk * TK + tid < sp.K) g_col = col.global[col_gi];
    }
    // Casts every vector i, times the multipliers mult_of(i, mult) fills in, into `out`. Each vector's
    // mask and position are recomputed here from a row stride the compiler cannot see through, rather
    // than kept live from the loads across the reductions (which spilled at 3 CTAs/SM).
    const auto cast_store = [&](uint8_t* out, auto&& mult_of) {
      Span at = sp;
      asm("" : "+l"(at.K));
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC], mult[VEC];
        L::unpack(raw[i], v);
        mult_of(i, mult);
        int64_t idx;
        const uint32_t mask = vec_mask<VEC, SHARD, INTERIOR>(row_of(i), col0, at, w, idx);
        if (mask) store_fp8<VEC>(out + base, idx, mask, aligned, v, mult, fp8);
      }
    };
    // The same into the transposed (B, K, M) `out`. This thread's NV x VEC bytes, cast row by row, are
    // transposed in registers (4x4 byte blocks) and staged in shared memory as the tile's transpose
    // (TK columns of TM bytes); the CTA then writes whole 16-byte pieces of each column's run of TM
    // bytes, so every sector of the output is written whole (stores straight from the registers
    // wrote 4-8 bytes at a stride of M and ran at 65% of memcpy; bench/RESULTS.md run 24).
    const auto cast_store_T = [&](uint8_t* out, auto&& mult_of) {
      uint32_t rows[NV][VEC / 4];  // row i's bytes, four columns a word
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC], mult[VEC];
        L::unpack(raw[i], v);
        mult_of(i, mult);
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q)
          rows[i][q] = fp8x2_from_float(v[4 * q] * mult[4 * q], v[4 * q + 1] * mult[4 * q + 1], fp8) |
                       uint32_t(fp8x2_from_float(v[4 * q + 2] * mult[4 * q + 2], v[4 * q + 3] * mult[4 * q + 3], fp8))
                           << 16;
      }
      // the staged tile: column col's word w (rows 4w..4w+3) at stage[col * TM/4 + (w ^ swz(col))]; the
      // XOR spreads a warp's writes (one word of 16 columns, two row groups) and reads (16-byte
      // pieces of 4 adjacent columns) over the banks
      constexpr int WORDS = TM / 4;
      const auto at = [](int col, int w) {
        const int cc = col / VEC, e = col % VEC;
        return col * WORDS + ((w ^ ((((cc & 7) << 2) | ((cc >> 3) & 3)) ^ (e & 3))) & (WORDS - 1));
      };
#pragma unroll
      for (int i = 0; i < NV; i += 4)
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          uint32_t o[4];
          transpose4x4(rows[i][q], rows[i + 1][q], rows[i + 2][q], rows[i + 3][q], o);
#pragma unroll
          for (int e = 0; e < 4; ++e) stage[at(c * VEC + 4 * q + e, (g * NV + i) / 4)] = o[e];
        }
      __syncthreads();
      constexpr int PIECES = TM / 16;  // 16-byte pieces of a column's TM bytes
      const int64_t r_tile = p.tm * TM, c_tile = p.tk * TK;
      const bool whole = INTERIOR && sp.M % 16 == 0;  // every piece present and 16-byte aligned
#pragma unroll
      for (int k = tid; k < TK * PIECES; k += kThreads) {
        const int col = k / PIECES, piece = k % PIECES;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = stage[at(col, piece * 4 + j)];
        const int64_t r = r_tile + piece * 16;
        uint8_t* dst = out + base + (c_tile + col) * sp.M + r;  // (K, M) per matrix
        if (whole) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        } else if (c_tile + col < sp.K) {
#pragma unroll
          for (int b = 0; b < 16; ++b)
            if (r + b < sp.M) dst[b] = uint8_t(w[b / 4] >> (8 * (b % 4)));
        }
      }
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
      write_pads(row, rat);  // threads 0-2 of tile column 0 (or row 0) write a stored row's padding
      if constexpr (MODE != kAmax)
        cast_store(row.data, [&](int i, float (&mult)[VEC]) {
          const float m = __shfl_sync(0xFFFFFFFFu, my_m, i, LANES);  // row i's multiplier, from lane i
#pragma unroll
          for (int e = 0; e < VEC; ++e) mult[e] = m;
        });
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
      write_pads(col, cat);
      __syncthreads();
      if constexpr (MODE != kAmax) {
        float cm[VEC];  // this thread's columns' multipliers, the same for all its rows
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          const float4 m4 = reinterpret_cast<const float4*>(&col_mult[c * VEC])[q];
          cm[4 * q] = m4.x, cm[4 * q + 1] = m4.y, cm[4 * q + 2] = m4.z, cm[4 * q + 3] = m4.w;
        }
        const auto col_mults = [&](int, float (&mult)[VEC]) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) mult[e] = cm[e];
        };
        if constexpr (COL_T) cast_store_T(col.data, col_mults);
        else cast_store(col.data, col_mults);
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
      // GEMM-ready tiles may have a rowwise output, a transposed columnwise one, or both
      const bool rows_out = !COL_T || row.data;
      const float m = block_multiplier<MODE>(rule, amax, g_row, row, rat(p.b, p.tm, p.tk), tid == 0 && rows_out);
      if (rows_out) write_pads(row, rat);
      const auto tile_mults = [&](int, float (&mult)[VEC]) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) mult[e] = m;
      };
      if constexpr (MODE != kAmax)
        if (rows_out) cast_store(row.data, tile_mults);
      if constexpr (COL_T)
        if (col.data) {
          block_multiplier<MODE>(rule, amax, g_row, col, cat(p.b, p.tm, p.tk), tid == 0);
          write_pads(col, cat);
          cast_store_T(col.data, tile_mults);
        }
    }
  };
  if (tile_interior<TM, TK, SHARD>(p.tm, p.tk, sp, w)) run(std::true_type{});
  else run(std::false_type{});
}

// CTAs per SM for the register allocation (measured fastest, bench/kernel_bench.cu, RESULTS.md runs
// 12, 19-22 and 28). fp32 tiles of 8-16 vectors per thread need the registers: the compiler's
// allocation. ONE: a shard kernel with its one job at fixed parameter offsets; a job picked at run time
// needs more registers (the partial amax spills above 4). COL_T: columnwise data transposed through
// shared memory, where one more CTA per SM hides the staging (+5 to +7 points of memcpy, run 28).
// Dense Float8 at 3: no spills there since cast_store recomputes its positions, and faster than 2
// (run 49 at 8192^2: 1x128 + 128x1 89.3 against 87.1%, 128x1 98.4 against 92.2%); Float8 shard
// kernels with a columnwise usage stay at 2.
template <class L, class Rule, bool COL, int MODE, bool ONE = true, bool COL_T = false>
constexpr int min_blocks_for() {
  if (L::VEC != 8) return 1;
  if (!std::is_same_v<Rule, MxRule>) return COL && MODE != kQuantize ? 2 : 3;
  if (MODE == kAmax) return ONE ? 6 : 4;
  if (COL_T) return 4;
  return COL ? 3 : (MODE == kCast ? 3 : 4);
}

// The tile geometry and usages of one call: Rule, TM x TK tiles, rowwise 1 x RBK blocks (RBK > 0),
// TM x 1 columnwise blocks (COL), or one block per tile (TILE); COL_T: the columnwise data (of COL or
// of GEMM-ready tiles) stored transposed; GEMM_SCALES: Float8 scales in GEMM-ready order.
template <class Rule_, int TM_, int TK_, int RBK_, bool COL_, bool TILE_, bool COL_T_ = false, bool GEMM_SCALES_ = false>
struct TileCfg {
  using Rule = Rule_;
  using S = typename Rule::ScaleT;
  static constexpr int TM = TM_, TK = TK_, RBK = RBK_;
  static constexpr bool COL = COL_, TILE = TILE_, COL_T = COL_T_;
  static constexpr bool GEMM_SCALES = GEMM_SCALES_;  // scales in GEMM-ready order (the call's ScaleAt)
  // Dense walks in groups of GROUP tile rows (Span::group). Float8 with transposed columnwise data:
  // 2 rather than 1 gains 0.6-0.8 points of memcpy at 32768x16384 and 0-0.8 at 8192^2 (RESULTS.md
  // runs 47-48); compact kernels lose with larger groups, MXFP8 gains nothing.
  static constexpr int GROUP = COL_T && TM == 128 ? 2 : 1;
  // Which of the usage-ordered outputs (row, col, tile) goes to the kernel's `row` and `col` slots.
  static constexpr int ROW_SLOT = RBK || TILE ? 0 : -1, COL_SLOT = COL ? (RBK ? 1 : 0) : -1;
  // The row slot's blocks: 1 x RBK, or TM x TK for 2-D tiles.
  static constexpr int ROW_BM = TILE ? TM : 1, ROW_BK = TILE ? TK : RBK;
};

// Calls f(cfg, rule) with the tile configuration and scale rule for the outputs of `a` (SATURATE_ONLY:
// as with_rule's).
template <bool SATURATE_ONLY = false, class F>
ffi::Error with_cfg(const QuantizeArgs& a, F&& f) {
  return with_rule<SATURATE_ONLY>(a, [&](auto rule) -> ffi::Error {
    using R = decltype(rule);
    const Output& first = a.out[0];
    const bool has_row = !first.colwise(), has_col = a.n_out == 2 || first.colwise();
    if constexpr (std::is_same_v<R, MxRule>) {
      const bool col_t = a.out[a.n_out - 1].data_transposed;  // GEMM-ready: columnwise data transposed
      if (has_row && has_col)
        return col_t ? f(TileCfg<R, 32, 256, 32, true, false, true>{}, rule)
                     : f(TileCfg<R, 32, 256, 32, true, false>{}, rule);
      if (has_row) return f(TileCfg<R, 32, 256, 32, false, false>{}, rule);
      return col_t ? f(TileCfg<R, 32, 256, 0, true, false, true>{}, rule) : f(TileCfg<R, 32, 256, 0, true, false>{}, rule);
    } else {  // GEMM-ready Float8: the scales in GEMM order, the columnwise data transposed
      const bool T = a.gemm_scales;
      if (first.bm == first.bk) {  // 128x128 tiles
        if (!T) return f(TileCfg<R, 128, 128, 0, false, true>{}, rule);
        return has_col ? f(TileCfg<R, 128, 128, 0, false, true, true, true>{}, rule)
                       : f(TileCfg<R, 128, 128, 0, false, true, false, true>{}, rule);
      }
      if (has_row && has_col)
        return T ? f(TileCfg<R, 128, 128, 128, true, false, true, true>{}, rule)
                 : f(TileCfg<R, 128, 128, 128, true, false>{}, rule);
      if (has_row)
        return T ? f(TileCfg<R, 128, 128, 128, false, false, false, true>{}, rule)
                 : f(TileCfg<R, 128, 128, 128, false, false>{}, rule);
      return T ? f(TileCfg<R, 128, 128, 0, true, false, true, true>{}, rule)
               : f(TileCfg<R, 128, 128, 0, true, false>{}, rule);
    }
  });
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

}  // namespace
}  // namespace jf
