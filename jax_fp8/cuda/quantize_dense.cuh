// Dense tensors: one launch over every tile of a (B, M, K) input, one tile per CTA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quantize_tile.cuh"

namespace jf {
namespace {

template <class L, class Cfg, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    tile_kernel(const typename L::T* __restrict__ x, Span sp, typename Cfg::Rule rule, int fp8,
                Outs<typename Cfg::S> row, Outs<typename Cfg::S> col, ScaleAt row_at, ScaleAt col_at) {
  quantize_tile<L, Cfg, kQuantize>(x, sp, rule, fp8, row, col, row_at, col_at, blockIdx.x);
}

// One launch over every tile of x; `row` / `col`: the rowwise (or tile) and columnwise outputs.
template <class L, class Cfg, int MINB = min_blocks_for<L, typename Cfg::Rule, Cfg::COL, kQuantize, true, Cfg::COL_T>()>
ffi::Error launch_tiles(cudaStream_t stream, const QuantizeArgs& a, const void* x, Span sp,
                        const typename Cfg::Rule& rule, Outs<typename Cfg::S> row, Outs<typename Cfg::S> col,
                        ScaleAt row_at, ScaleAt col_at) {
  const int64_t n_tiles = plan_tiles<L, Cfg::TM, Cfg::TK>(sp, a.B, x);
  if (n_tiles > 0x7FFFFFFF) return bad("tensor too large for one launch");
  if (n_tiles == 0) return ffi::Error::Success();
  tile_kernel<L, Cfg, MINB><<<unsigned(n_tiles), kThreads, 0, stream>>>(static_cast<const typename L::T*>(x), sp, rule,
                                                                       a.fp8, row, col, row_at, col_at);
  return ffi::Error::Success();
}

// The kernel's `row` and `col` outputs and their scale positions for a call's outputs: `d`/`s` hold
// the data and scales of each output, in the call's result order (outputs_of).
template <class S>
void tile_outputs(const QuantizeArgs& a, uint8_t* const* d, void* const* s, Outs<S>& row, Outs<S>& col,
                  ScaleAt& row_at, ScaleAt& col_at) {
  OutLayout o[2];
  const int n = outputs_of(a, o);
  row = col = Outs<S>{};
  row_at = col_at = ScaleAt{};
  for (int k = 0; k < n; ++k) {
    (o[k].col ? col : row) = Outs<S>{d[k], static_cast<S*>(s[k]), nullptr};
    (o[k].col ? col_at : row_at) = scale_at(o[k]);
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
      return launch_tiles<decltype(ld), C>(st, a, x, dense_span(a.M, a.K, C::GROUP), rule, row, col, row_at, col_at);
    });
  });
}

}  // namespace
}  // namespace jf
