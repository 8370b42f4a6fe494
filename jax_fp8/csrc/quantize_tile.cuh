// The CUDA quantize tile: every usage (rowwise, columnwise, 2-D tile) and every mode (quantize a dense
// tensor; partial amax or partial cast of a master-weight shard) from one device function.
//
// One CTA of 256 threads owns a TM x TK tile of one (M, K) matrix. Each thread loads 16-byte vectors of one fixed
// column chunk on rows g, g+G, ... and keeps them in registers, so the input is read from HBM exactly once and
// every usage is cast from the same registers: rowwise blocks reduce by warp shuffles, columnwise blocks by a small
// shared-memory reduction, 2-D tiles by a CTA reduction. Tiles inside the matrix (and the shard window) take a path
// without per-vector bounds checks: at these rates the kernel is bound by instruction issue as much as by HBM, and
// the checks cost more than the block math (bench/RESULTS.md, "What changed, and what each step measured"). The
// per-block math is fp8_math.h, shared with the CPU kernels; loads, stores and positions are quantize_tile_io.cuh.
// The launches: quantize_dense.cuh (dense tensors), quantize_shards.cuh (master weights).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "quantize_tile_io.cuh"

namespace jf {
namespace {

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

// Rowwise 1 x RBK blocks: the LANES threads of a block hold NV vectors (rows) each, and lane gl applies
// the rule for row mi = gl % NV only (NV <= LANES), so each thread evaluates the rule once, not NV
// times; row_in: row mi's block lies inside the matrix; g_row: its reduced value (kCast).
template <class Th, bool INTERIOR>
__device__ __forceinline__ void quantize_rows(const TileVectors<Th, INTERIOR>& tv, int gl, int mi, bool row_in,
                                              typename Th::S g_row) {
  constexpr int VEC = Th::VEC, NV = Th::NV, LANES = Th::Cfg::RBK / VEC;
  const Th& th = tv.th;
  float my_amax = 0.0f;  // the block amax of row mi
  if constexpr (Th::MODE != kCast) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float amax = Th::Loader::amax_of(tv.raw[i]);
#pragma unroll
      for (int off = LANES / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
      my_amax = mi == i ? amax : my_amax;
    }
  }
  const float my_m =
      row_in ? block_multiplier<Th::MODE>(th.rule, my_amax, g_row, th.row, th.row_gi(mi), gl < NV) : 1.0f;
  th.write_pads(th.row, th.row_scale_at);  // threads 0-2 of tile column 0 (or row 0) write a stored row's padding
  if constexpr (Th::MODE != kAmax)
    cast_store(tv, th.row.data, [&](int i, float (&mult)[VEC]) {
      const float m = __shfl_sync(0xFFFFFFFFu, my_m, i, LANES);  // row i's multiplier, from lane i
#pragma unroll
      for (int e = 0; e < VEC; ++e) mult[e] = m;
    });
}

// Columnwise TM x 1 blocks: per-column partial amax over this thread's rows, reduced over the G row
// groups in shared memory (red: per row group and column; col_mult: the columns' multipliers); g_col:
// tile column tid's reduced value (kCast).
template <class Th, bool INTERIOR>
__device__ __forceinline__ void quantize_cols(const TileVectors<Th, INTERIOR>& tv, typename Th::S g_col,
                                              float (*red)[Th::TK], float* col_mult) {
  constexpr int TM = Th::TM, TK = Th::TK, VEC = Th::VEC, G = Th::G, NV = Th::NV;
  const Th& th = tv.th;
  const int tid = th.tid, c = th.c;
  if constexpr (Th::MODE != kCast) {
    uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < NV; ++i) Th::Loader::amax_acc(acc, tv.raw[i]);
    float part[VEC];
    Th::Loader::amax_unpack(acc, part);
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      reinterpret_cast<float4*>(&red[th.g][c * VEC])[q] =
          make_float4(part[4 * q], part[4 * q + 1], part[4 * q + 2], part[4 * q + 3]);
    __syncthreads();
  }
  // One thread per tile column finishes the reduction, applies the rule once and writes the column's
  // scale (coalesced); the multipliers go back through shared memory.
  static_assert(TK <= kThreads, "one thread per column");
  if (tid < TK) {
    float m = 1.0f;
    if (th.p.tk * TK + tid < th.sp.K && th.p.tm * TM < th.sp.M) {
      float a = 0.0f;
      if constexpr (Th::MODE != kCast) {
#pragma unroll
        for (int gg = 0; gg < G; ++gg) a = fmaxf(a, red[gg][tid]);
      }
      m = block_multiplier<Th::MODE>(th.rule, a, g_col, th.col, th.col_gi, true);
    }
    col_mult[tid] = m;
  }
  th.write_pads(th.col, th.col_scale_at);
  __syncthreads();
  if constexpr (Th::MODE != kAmax) {
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
    if constexpr (Th::Cfg::COL_T) cast_store_T(tv, th.col.data, col_mults);
    else cast_store(tv, th.col.data, col_mults);
  }
}

// One TM x TK block for the whole tile: a CTA-wide amax (warp_max: the warps' amaxes, in shared
// memory); g_row: the tile's reduced value (kCast). GEMM-ready tiles may have a rowwise output, a
// transposed columnwise one (COL_T), or both.
template <class Th, bool INTERIOR>
__device__ __forceinline__ void quantize_whole_tile(const TileVectors<Th, INTERIOR>& tv, typename Th::S g_row,
                                                    float* warp_max) {
  constexpr int VEC = Th::VEC, NV = Th::NV;
  constexpr bool COL_T = Th::Cfg::COL_T;
  const Th& th = tv.th;
  const int tid = th.tid;
  const TilePos& p = th.p;
  float amax = 0.0f;
  if constexpr (Th::MODE != kCast) {
    uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < NV; ++i) Th::Loader::amax_acc(acc, tv.raw[i]);
    amax = Th::Loader::amax_of(acc);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    if (tid % 32 == 0) warp_max[tid / 32] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kThreads / 32; ++k) amax = fmaxf(amax, warp_max[k]);
  }
  const bool rows_out = !COL_T || th.row.data;
  const float m = block_multiplier<Th::MODE>(th.rule, amax, g_row, th.row, th.row_scale_at(p.b, p.tm, p.tk),
                                             tid == 0 && rows_out);
  if (rows_out) th.write_pads(th.row, th.row_scale_at);
  const auto tile_mults = [&](int, float (&mult)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) mult[e] = m;
  };
  if constexpr (Th::MODE != kAmax)
    if (rows_out) cast_store(tv, th.row.data, tile_mults);
  if constexpr (COL_T)
    if (th.col.data) {
      block_multiplier<Th::MODE>(th.rule, amax, g_row, th.col, th.col_scale_at(p.b, p.tm, p.tk), tid == 0);
      th.write_pads(th.col, th.col_scale_at);
      cast_store_T(tv, th.col.data, tile_mults);
    }
}

// The tile of thread `th` (INTERIOR: without per-vector checks): its vectors loaded once, then every
// usage of the configuration quantized from them.
template <bool INTERIOR, class Th>
__device__ __forceinline__ void quantize_tile_vectors(const Th& th) {
  using Cfg = typename Th::Cfg;
  constexpr int TK = Th::TK, RBK = Cfg::RBK, VEC = Th::VEC, CHUNKS = Th::CHUNKS, NV = Th::NV;
  const bool aligned = INTERIOR || th.w.aligned;
  uint4 raw[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if constexpr (std::is_same_v<typename Th::Source, FromMemory>)
      raw[i] =
          load_vector<typename Th::Loader, Th::SHARD, INTERIOR>(th.x + th.base, th.row_of(i), th.col0, th.sp, th.w);
    else
      raw[i] = th.src.template vector<INTERIOR>(th.sp, th.p.b, th.row_of(i), th.col0);
  }
  // rowwise blocks: lane gl of the LANES threads of a block applies the rule for its row mi
  constexpr int LANES = RBK > 0 ? RBK / VEC : 1;
  static_assert(RBK == 0 || (LANES <= 32 && CHUNKS % LANES == 0 && NV <= LANES), "row block inside a warp");
  const int gl = th.c % LANES, mi = gl % NV;
  const bool row_in = INTERIOR || (th.row_of(mi) < th.sp.M && th.col0 - gl * VEC < th.sp.K);
  // A shard cast's reduced scales are loaded with the tile, not after it.
  typename Th::S g_row = {}, g_col = {};
  if constexpr (Th::MODE == kCast) {
    if constexpr (RBK > 0)
      if (row_in) g_row = th.row.global[th.row_gi(mi)];
    if constexpr (Cfg::TILE) g_row = th.row.global[th.row_scale_at(th.p.b, th.p.tm, th.p.tk)];
    if constexpr (Cfg::COL)
      if (th.tid < TK && th.p.tk * TK + th.tid < th.sp.K) g_col = th.col.global[th.col_gi];
  }
  const TileVectors<Th, INTERIOR> tv{th, raw, aligned};
  if constexpr (RBK > 0) quantize_rows(tv, gl, mi, row_in, g_row);
  // The usages' shared memory, one set per path. Declared here, not in quantize_cols or
  // quantize_whole_tile: declared there, it came before quantize_tile's `stage` in the CTA's shared
  // layout, and ptxas then spilled in the 4-CTA/SM GEMM-ready MXFP8 kernel.
  if constexpr (Cfg::COL) {
    __shared__ __align__(16) float red[Th::G][TK];
    __shared__ __align__(16) float col_mult[TK];
    quantize_cols(tv, g_col, red, col_mult);
  }
  if constexpr (Cfg::TILE) {
    __shared__ float warp_max[kThreads / 32];
    quantize_whole_tile(tv, g_row, warp_max);
  }
}

// Quantizes tile t of a matrix or shard with the tile configuration Cfg (TileCfg below): rowwise
// 1 x RBK blocks (RBK > 0), TM x 1 columnwise blocks (COL), one TM x TK block (TILE); columnwise data
// stored transposed (COL_T: GEMM-ready). Every scale block belongs to exactly one tile, so no atomics
// are needed in any mode.
// Src: where the tile's vectors come from (FromMemory: x; a producer: produce_tile.cuh).
// quantize_tile_at: tile p of the span in the window w (kernels that pick their tiles); quantize_tile: tile t
// of the call's walk.
template <class L, class Cfg, int MODE, class Src = FromMemory>
__device__ __forceinline__ void quantize_tile_at(const typename L::T* __restrict__ x, const Span& sp,
                                                 const typename Cfg::Rule& rule, int fp8,
                                                 const Outs<typename Cfg::S>& row, const Outs<typename Cfg::S>& col,
                                                 const ScaleAt& row_at, const ScaleAt& col_at, const Window& w,
                                                 const TilePos& p, const Src& src) {
  using Th = TileThread<L, Cfg, MODE, Src>;
  constexpr int TM = Cfg::TM, TK = Cfg::TK;
  static_assert(!(Cfg::COL_T && Th::SHARD), "master-weight shards are compact");
  const int tid = threadIdx.x;
  const int c = tid % Th::CHUNKS, g = tid / Th::CHUNKS;
  const int64_t col0 = p.tk * TK + int64_t(c) * Th::VEC;
  const int64_t base = p.b * sp.M * sp.K;  // dense batches; shards have b == 0
  // The transposed tile of COL_T (cast_store_T), declared here once for both paths below.
  __shared__ __align__(16) uint32_t stage[Cfg::COL_T ? TK * TM / 4 : 1];
  // Scale positions: GEMM-ready scales as the call's ScaleAt says; compact grids from the span, so
  // that the compact kernels keep their registers (the strides are compile-time there).
  const ScaleAt row_scale_at =
      Cfg::GEMM_SCALES ? row_at : compact_scale_at(sp.M, sp.K, Cfg::ROW_BM, Cfg::ROW_BK ? Cfg::ROW_BK : 1);
  const ScaleAt col_scale_at = Cfg::GEMM_SCALES ? col_at : compact_scale_at(sp.M, sp.K, TM, 1);
  const int64_t col_gi = col_scale_at(p.b, p.tm, p.tk * TK + tid);
  const Th th{x, sp, rule, fp8, row, col, w, p, tid, c, g, col0, base, stage, row_scale_at, col_scale_at, col_gi, src};
  if (tile_interior<TM, TK, Th::SHARD>(p.tm, p.tk, sp, w)) quantize_tile_vectors<true>(th);
  else quantize_tile_vectors<false>(th);
}

template <class L, class Cfg, int MODE, class Src = FromMemory>
__device__ __forceinline__ void quantize_tile(const typename L::T* __restrict__ x, const Span& sp,
                                              const typename Cfg::Rule& rule, int fp8,
                                              const Outs<typename Cfg::S>& row, const Outs<typename Cfg::S>& col,
                                              const ScaleAt& row_at, const ScaleAt& col_at, uint32_t t,
                                              const Src& src = Src{}) {
  Window w;
  w.offset = sp.dev_offset ? *sp.dev_offset : 0;
  w.length = sp.dev_length && *sp.dev_length < sp.L ? int64_t(*sp.dev_length) : sp.L;
  w.first_tm = sp.dev_offset ? first_tile_row<Cfg::TM>(w.offset, sp.K) : 0;
  w.aligned = sp.aligned_base && w.offset % TileThread<L, Cfg, MODE, Src>::VEC == 0;
  const TilePos p = tile_pos(t, sp, w);
  if (p.tm >= sp.nTM) return;
  quantize_tile_at<L, Cfg, MODE, Src>(x, sp, rule, fp8, row, col, row_at, col_at, w, p, src);
}

// CTAs per SM for the register allocation, measured fastest on the H200 (bench/kernel_bench.cu sweeps them;
// bench/RESULTS.md, "What changed, and what each step measured"). fp32 tiles of 8-16 vectors per thread need the
// registers: the compiler's allocation. ONE: a shard kernel with its one job at fixed parameter offsets; a job
// picked at run time needs more registers (the partial amax spills above 4). COL_T: columnwise data transposed
// through shared memory, where one more CTA per SM hides the staging (+5 to +7 points of memcpy). Dense Float8 at
// 3: no spills there since cast_store recomputes its positions, and faster than 2 (at 8192^2: 1x128 + 128x1 89.3
// against 87.1%, 128x1 98.4 against 92.2%); Float8 shard kernels with a columnwise usage stay at 2.
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
  // Dense walks in groups of GROUP tile rows (Span::group), measured on the H200 (bench/RESULTS.md, "the tile
  // order, the bulk-copy ceiling, and the spills removed"). Float8 with transposed columnwise data: 2 rather than 1
  // gains 0.6-0.8 points of memcpy at 32768x16384 and 0-0.8 at 8192^2; compact kernels lose with larger groups,
  // MXFP8 gains nothing.
  static constexpr int GROUP = COL_T && TM == 128 ? 2 : 1;
  // Which of the call's outputs (rowwise first) goes to the kernel's `row` and `col` slots.
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
      return col_t ? f(TileCfg<R, 32, 256, 0, true, false, true>{}, rule)
                   : f(TileCfg<R, 32, 256, 0, true, false>{}, rule);
    } else {  // GEMM-ready Float8: the scales in GEMM order, the columnwise data transposed
      const bool gemm = a.gemm_scales;
      if (first.bm == first.bk) {  // 128x128 tiles
        if (!gemm) return f(TileCfg<R, 128, 128, 0, false, true>{}, rule);
        return has_col ? f(TileCfg<R, 128, 128, 0, false, true, true, true>{}, rule)
                       : f(TileCfg<R, 128, 128, 0, false, true, false, true>{}, rule);
      }
      if (has_row && has_col)
        return gemm ? f(TileCfg<R, 128, 128, 128, true, false, true, true>{}, rule)
                    : f(TileCfg<R, 128, 128, 128, true, false>{}, rule);
      if (has_row)
        return gemm ? f(TileCfg<R, 128, 128, 128, false, false, false, true>{}, rule)
                    : f(TileCfg<R, 128, 128, 128, false, false>{}, rule);
      return gemm ? f(TileCfg<R, 128, 128, 0, true, false, true, true>{}, rule)
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
