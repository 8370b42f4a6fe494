// The memory side of the CUDA quantize tile (quantize_tile.cuh): where a matrix's elements and a
// tile's outputs live, the tile walk, the checked and unchecked 16-byte loads, and the FP8 stores of a
// thread's vectors, straight (cast_store) or transposed through shared memory (cast_store_T).
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

// Where a tile's vectors come from: the input in memory (x), or a producer (produce_tile.cuh) whose
// vector<INTERIOR>(span, b, r, col0) computes VEC values of row r of matrix b from column col0, packed as
// the loader's 16-byte vector, zeros where outside the matrix.
struct FromMemory {};

// One thread's place in tile p of a call with the loader Load and the tile configuration Config
// (TileCfg, quantize_tile.cuh) in mode kMode: thread tid holds chunk c of the rows of row group g
// (Geom). Its members refer to quantize_tile's locals (the span, the window, the tile and the outputs
// with their scale positions).
template <class Load, class Config, int kMode, class Src = FromMemory>
struct TileThread {
  using Loader = Load;
  using Source = Src;
  using Cfg = Config;
  using S = typename Cfg::S;
  using Gm = Geom<Loader, Cfg::TM, Cfg::TK>;
  static constexpr int MODE = kMode;
  static constexpr int TM = Cfg::TM, TK = Cfg::TK, VEC = Gm::VEC, CHUNKS = Gm::CHUNKS, G = Gm::G, NV = Gm::NV;
  static constexpr bool SHARD = MODE != kQuantize;
  const typename Loader::T* x;
  const Span& sp;
  const typename Cfg::Rule& rule;
  int fp8;
  const Outs<S>& row;
  const Outs<S>& col;
  const Window& w;
  const TilePos& p;
  int tid, c, g;
  int64_t col0;               // the first column of this thread's chunk
  int64_t base;               // the matrix's first element: dense batches; shards have b == 0
  uint32_t* stage;            // the transposed tile of COL_T (cast_store_T)
  const ScaleAt& row_scale_at;  // the row slot's scale positions (quantize_tile)
  const ScaleAt& col_scale_at;  // the col slot's
  int64_t col_gi;             // the scale position of tile column tid's columnwise block
  const Src& src;             // the vectors' source (FromMemory: x)

  // The row of vector i.
  __device__ __forceinline__ int64_t row_of(int i) const { return p.tm * TM + (Cfg::COL_T ? g * NV + i : g + i * G); }
  // The scale position of row i's rowwise block.
  __device__ __forceinline__ int64_t row_gi(int i) const {
    return row_scale_at(p.b, row_of(i), col0 / (Cfg::RBK > 0 ? Cfg::RBK : 1));
  }
  // GEMM-ready scales: the tiles of block row 0 (transposed scales) or of block column 0 pad the
  // stored rows of their blocks with the scale of an all-zero block.
  __device__ __forceinline__ void write_pads(const Outs<S>& o, const ScaleAt& at) const {
    if (!Cfg::GEMM_SCALES || at.pad_from >= at.ld || (at.transposed ? p.tm : p.tk) != 0) return;
    const int64_t r = at.transposed ? p.tk : p.tm;
    if (tid < at.ld - at.pad_from) o.scale[p.b * at.s_batch + r * at.ld + at.pad_from + tid] = S(kGemmScalePad);
  }
};

static_assert(kMaxScalePad <= kThreads, "write_pads: one padding entry per thread");

// A thread's vectors of its tile, as loaded: raw[i] holds row th.row_of(i). INTERIOR: the tile's
// vectors are all full and aligned (tile_interior); `aligned`: the buffer's vectors are.
template <class Th, bool INTERIOR>
struct TileVectors {
  const Th& th;
  const uint4 (&raw)[Th::NV];
  bool aligned;
};

// Casts every vector i, times the multipliers mult_of(i, mult) fills in, into `out`. Each vector's
// mask and position are recomputed here from a row stride the compiler cannot see through, rather
// than kept live from the loads across the reductions (which spilled at 3 CTAs/SM).
template <class Th, bool INTERIOR, class MultOf>
__device__ __forceinline__ void cast_store(const TileVectors<Th, INTERIOR>& tv, uint8_t* out, MultOf&& mult_of) {
  constexpr int VEC = Th::VEC, NV = Th::NV;
  const Th& th = tv.th;
  Span at = th.sp;
  asm("" : "+l"(at.K));
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float v[VEC], mult[VEC];
    Th::Loader::unpack(tv.raw[i], v);
    mult_of(i, mult);
    int64_t idx;
    const uint32_t mask = vec_mask<VEC, Th::SHARD, INTERIOR>(th.row_of(i), th.col0, at, th.w, idx);
    if (mask) store_fp8<VEC>(out + th.base, idx, mask, tv.aligned, v, mult, th.fp8);
  }
}

// The same into the transposed (B, K, M) `out`. This thread's NV x VEC bytes, cast row by row, are
// transposed in registers (4x4 byte blocks) and staged in shared memory as the tile's transpose (TK
// columns of TM bytes); the CTA then writes whole 16-byte pieces of each column's run of TM bytes, so
// every sector of the output is written whole (stores straight from the registers wrote 4-8 bytes at
// a stride of M and ran at 65% of memcpy; bench/RESULTS.md, "the Scheme refactor and the first GEMM-ready
// kernels").
template <class Th, bool INTERIOR, class MultOf>
__device__ __forceinline__ void cast_store_T(const TileVectors<Th, INTERIOR>& tv, uint8_t* out, MultOf&& mult_of) {
  constexpr int TM = Th::TM, TK = Th::TK, VEC = Th::VEC, NV = Th::NV;
  const Th& th = tv.th;
  const int fp8 = th.fp8;
  uint32_t rows[NV][VEC / 4];  // row i's bytes, four columns a word
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float v[VEC], mult[VEC];
    Th::Loader::unpack(tv.raw[i], v);
    mult_of(i, mult);
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      rows[i][q] = fp8x2_from_float(v[4 * q] * mult[4 * q], v[4 * q + 1] * mult[4 * q + 1], fp8) |
                   uint32_t(fp8x2_from_float(v[4 * q + 2] * mult[4 * q + 2], v[4 * q + 3] * mult[4 * q + 3], fp8))
                       << 16;
  }
  // the staged tile: column col's word w (rows 4w..4w+3) at stage[col * TM/4 + (w ^ swz(col))]; the
  // XOR spreads a warp's writes (one word of 16 columns, two row groups) and reads (16-byte pieces of
  // 4 adjacent columns) over the banks
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
      for (int e = 0; e < 4; ++e) th.stage[at(th.c * VEC + 4 * q + e, (th.g * NV + i) / 4)] = o[e];
    }
  __syncthreads();
  constexpr int PIECES = TM / 16;  // 16-byte pieces of a column's TM bytes
  const int64_t r_tile = th.p.tm * TM, c_tile = th.p.tk * TK;
  const bool whole = INTERIOR && th.sp.M % 16 == 0;  // every piece present and 16-byte aligned
#pragma unroll
  for (int k = th.tid; k < TK * PIECES; k += kThreads) {
    const int col = k / PIECES, piece = k % PIECES;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = th.stage[at(col, piece * 4 + j)];
    const int64_t r = r_tile + piece * 16;
    uint8_t* dst = out + th.base + (c_tile + col) * th.sp.M + r;  // (K, M) per matrix
    if (whole) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if (c_tile + col < th.sp.K) {
#pragma unroll
      for (int b = 0; b < 16; ++b)
        if (r + b < th.sp.M) dst[b] = uint8_t(w[b / 4] >> (8 * (b % 4)));
    }
  }
}

}  // namespace
}  // namespace jf
