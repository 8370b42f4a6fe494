// Master-weight shards: the grouped partial-amax and partial-cast launches (many weights per launch).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quantize_tile.cuh"

namespace jf {
namespace {

// A group launch takes up to kMaxJobs weights (a transformer has hundreds; one launch each costs about 3.4 us of
// GPU time over its HBM time on the H200, bench/RESULTS.md, "Many small tensors: the grouped master-weight
// launch"). Each job's CTAs are `n_fill` CTAs that write what the tiles do not, then its tiles. The fill covers the
// blocks of the tile rows outside the walk (partial value 0; when casting, the fp32 scale_inv from the global amax)
// and, when casting, zeros in the data past the shard's elements; it goes first so that its writes overlap the
// tiles' reads. The jobs live in the kernel's parameter space (under 4 KB).

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

// One CTA of a group launch: the job it belongs to, then its fill or tile work. ONE: a single job (a large weight
// launched alone): its fields sit at fixed parameter offsets, which the instructions read directly; a job picked at
// run time costs a register and a load per field (a half-weight 32768x16384 shard: amax tiles 173.9 us picked at
// run time, 165.7 us as ONE; bench/RESULTS.md, "Many small tensors: the grouped master-weight launch"). The fill
// CTAs come first, so that their writes overlap the tiles' reads.
template <class L, class Cfg, int MODE, bool ONE>
__device__ __forceinline__ void shard_cta(const ShardGroup<typename Cfg::S>& grp, const typename Cfg::Rule& rule,
                                          int fp8) {
  int j = 0;
  if (!ONE)
    while (j + 1 < grp.n && grp.job[j + 1].begin <= blockIdx.x) ++j;
  const ShardJob<typename Cfg::S>& jb = grp.job[ONE ? 0 : j];
  const uint32_t t = blockIdx.x - jb.begin;
  if (t < jb.n_fill)
    fill_outside_walk<Cfg, MODE>(jb, rule, int64_t(t) * kThreads + threadIdx.x, int64_t(jb.n_fill) * kThreads);
  else
    quantize_tile<L, Cfg, MODE>(static_cast<const typename L::T*>(jb.x), jb.sp, rule, fp8, jb.row, jb.col,
                                compact_scale_at(jb.sp.M, jb.sp.K, Cfg::ROW_BM, Cfg::ROW_BK),
                                compact_scale_at(jb.sp.M, jb.sp.K, Cfg::TM, 1), t - jb.n_fill);
}

template <class L, class Cfg, int MODE, bool ONE>
__global__ void __launch_bounds__(kThreads, (min_blocks_for<L, typename Cfg::Rule, Cfg::COL, MODE, ONE>()))
    shard_kernel(const __grid_constant__ ShardGroup<typename Cfg::S> grp, const typename Cfg::Rule rule, int fp8) {
  shard_cta<L, Cfg, MODE, ONE>(grp, rule, fp8);
}

// One weight of a group: its flat shard x of L elements holds elements [offset, offset + length) of
// the row-major (M, K) weight, (offset, length) = window[0..1] in device memory. Per output (the call's
// order, rowwise first): data (kCast), the partial values (kAmax) or fp32 scale_inv (kCast), the global
// values.
struct ShardIO {
  const void* x;
  int64_t L, M, K;
  const int32_t* window;
  uint8_t* data[2];
  void* scale[2];
  const void* global[2];
};

// A weight's job: its tiles and the fill CTAs that write what the tiles do not (begin is set when it
// joins a group).
template <class L, class Cfg, int MODE>
ffi::Error shard_job(const ShardIO& io, ShardJob<typename Cfg::S>* jb) {
  using S = typename Cfg::S;
  jb->x = io.x;
  jb->sp = shard_span(io.M, io.K, io.L, io.window, io.window + 1);
  const auto slot = [&](int k) -> Outs<S> {  // the call's output k (the kernel's row or col slot)
    if (k < 0) return {};
    return {io.data[k], static_cast<S*>(io.scale[k]), static_cast<const S*>(io.global[k])};
  };
  jb->row = slot(Cfg::ROW_SLOT);
  jb->col = slot(Cfg::COL_SLOT);
  const int64_t tiles = plan_tiles<L, Cfg::TM, Cfg::TK>(jb->sp, 1, jb->x);
  // fill work, at most: every block of the written grids, and the data padding; ~256 bytes a thread
  int64_t bytes = 0;
  if (MODE == kAmax || io.scale[0]) {
    if (Cfg::ROW_SLOT >= 0) bytes += n_blocks(io.M, io.K, Cfg::ROW_BM, Cfg::ROW_BK) * int64_t(sizeof(S));
    if (Cfg::COL_SLOT >= 0) bytes += n_blocks(io.M, io.K, Cfg::TM, 1) * int64_t(sizeof(S));
  }
  if (MODE == kCast) bytes += ((Cfg::ROW_SLOT >= 0) + (Cfg::COL_SLOT >= 0)) * io.L;
  const int64_t fill = std::min<int64_t>(cdiv(bytes, kThreads * 256), 1024);
  if (tiles + fill > 0x7FFFFFFF) return bad("master-weight shard too large for one launch");
  jb->n_tiles = uint32_t(tiles);
  jb->n_fill = uint32_t(fill);
  jb->begin = 0;
  return ffi::Error::Success();
}

// The partial amax (kAmax) or partial cast (kCast) of n weights: their jobs packed into launches of up
// to kMaxJobs; a weight of kAloneCtas CTAs or more gets its own (its launch overhead is small next to
// its run time).
template <int MODE>
ffi::Error launch_shards(cudaStream_t st, const QuantizeArgs& a, const ShardIO* io, int n) {
  static_assert(MODE != kQuantize, "shards are partial-amax or partial-cast calls");
  if (!a.saturate_inf) return bad("master-weight shards take TransformerEngine's rule (saturate_inf)");
  return with_loader(a.in, [&](auto ld) {
    return with_cfg<true>(a, [&](auto cfg, auto rule) -> ffi::Error {
      using L = decltype(ld);
      using C = decltype(cfg);
      if constexpr (C::COL_T || C::GEMM_SCALES) {
        return bad("master-weight shards are compact");  // no such kernels are built
      } else {
        ShardGroup<typename C::S> grp;
        grp.n = 0;
        int64_t ctas = 0;
        const auto flush = [&] {
          if (grp.n == 1) shard_kernel<L, C, MODE, true><<<unsigned(ctas), kThreads, 0, st>>>(grp, rule, a.fp8);
          if (grp.n > 1) shard_kernel<L, C, MODE, false><<<unsigned(ctas), kThreads, 0, st>>>(grp, rule, a.fp8);
          grp.n = 0;
          ctas = 0;
        };
        for (int i = 0; i < n; ++i) {
          ShardJob<typename C::S> jb;
          if (auto e = shard_job<L, C, MODE>(io[i], &jb); e.failure()) return e;
          const int64_t own = jb.n_tiles + jb.n_fill;
          if (own == 0) continue;
          const bool alone = own >= kAloneCtas;
          if (grp.n == kMaxJobs || ctas + own > 0x7FFFFFFF || alone) flush();
          jb.begin = uint32_t(ctas);
          grp.job[grp.n++] = jb;
          ctas += own;
          if (alone) flush();
        }
        flush();
        return ffi::Error::Success();
      }
    });
  });
}

}  // namespace
}  // namespace jf
