// Dense tensors: one launch over every tile of a (B, M, K) input, one tile per CTA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quantize_tile.cuh"

namespace jf {
namespace {

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

}  // namespace
}  // namespace jf
