// Dense tensors: one launch over every tile of a (B, M, K) input, one tile per CTA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quantize_tile.cuh"

namespace jf {
namespace {

// Src: where the tiles' vectors come from (FromMemory: x; a producer, produce_tile.cuh: x is null).
template <class L, class Cfg, int MINB, class Src>
__global__ void __launch_bounds__(kThreads, MINB)
    tile_kernel(const typename L::T* __restrict__ x, Span sp, typename Cfg::Rule rule, int fp8,
                Outs<typename Cfg::S> row, Outs<typename Cfg::S> col, ScaleAt row_at, ScaleAt col_at, Src src) {
  quantize_tile<L, Cfg, kQuantize, Src>(x, sp, rule, fp8, row, col, row_at, col_at, blockIdx.x, src);
}

// The register cap (CTAs per SM) of tile_kernel<L, Cfg, ...> as launched here.
template <class L, class Cfg>
constexpr int dense_min_blocks() {
  return min_blocks_for<L, typename Cfg::Rule, Cfg::COL, kQuantize, true, Cfg::COL_T>();
}

// One launch over every tile of x (B matrices, in the configuration's tile order); `row` / `col`: the
// rowwise (or tile) and columnwise outputs. A producer `src` computes the vectors instead (x null: the
// tiles' alignment is then K's alone, XLA's buffers being aligned). MINB: a register cap (CTAs per SM)
// other than the configuration's (0: dense_min_blocks).
template <class L, class Cfg, class Src = FromMemory, int MINB = 0>
ffi::Error launch_tiles(cudaStream_t stream, const QuantizeArgs& a, const void* x, const typename Cfg::Rule& rule,
                        Outs<typename Cfg::S> row, Outs<typename Cfg::S> col, ScaleAt row_at, ScaleAt col_at,
                        const Src& src = Src{}) {
  constexpr int kMinBlocks = MINB ? MINB : dense_min_blocks<L, Cfg>();
  Span sp = dense_span(a.M, a.K, Cfg::GROUP);
  const int64_t n_tiles = plan_tiles<L, Cfg::TM, Cfg::TK>(sp, a.B, x);
  if (n_tiles > 0x7FFFFFFF) return bad("tensor too large for one launch");
  if (n_tiles == 0) return ffi::Error::Success();
  tile_kernel<L, Cfg, kMinBlocks, Src><<<unsigned(n_tiles), kThreads, 0, stream>>>(
      static_cast<const typename L::T*>(x), sp, rule, a.fp8, row, col, row_at, col_at, src);
  return ffi::Error::Success();
}

// The kernel's `row` and `col` outputs and their scale positions for a call's outputs: `d`/`s` hold
// the data and scales of each output, in the call's result order (a.out).
template <class S>
void tile_outputs(const QuantizeArgs& a, uint8_t* const* d, void* const* s, Outs<S>& row, Outs<S>& col,
                  ScaleAt& row_at, ScaleAt& col_at) {
  row = col = Outs<S>{};
  row_at = col_at = ScaleAt{};
  for (int k = 0; k < a.n_out; ++k) {
    const bool c = a.out[k].colwise();
    (c ? col : row) = Outs<S>{d[k], static_cast<S*>(s[k]), nullptr};
    (c ? col_at : row_at) = scale_at(a.out[k]);
  }
}

// Quantizes the (B, M, K) tensor x into the outputs `d`/`s` (as tile_outputs reads them).
inline ffi::Error quantize_tiles(cudaStream_t st, const QuantizeArgs& a, const void* x, uint8_t* const* d,
                                 void* const* s) {
  return with_loader(a.in, [&](auto ld) {
    return with_cfg(a, [&](auto cfg, auto rule) {
      using C = decltype(cfg);
      Outs<typename C::S> row, col;
      ScaleAt row_at, col_at;
      tile_outputs(a, d, s, row, col, row_at, col_at);
      return launch_tiles<decltype(ld), C>(st, a, x, rule, row, col, row_at, col_at);
    });
  });
}

}  // namespace
}  // namespace jf
