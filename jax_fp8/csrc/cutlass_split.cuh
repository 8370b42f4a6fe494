// CUTLASS's Hopper blockwise-scaling mainloop at a 256-row tile, its MMAs and scale promotion split along M
// (the "_split" configurations of cutlass_gemm.cuh). Included by cutlass_gemm.cuh's kernel part only.
//
// Why: a 256x128 tile reads 16 KB of operands from L2 per 128^3 MACs where 128x128 reads 24-32 KB, and it
// is the tile of CUTLASS's example 67, which ran 4-7% above our best 128x128 configuration on the H200
// (bench/RESULTS.md; DESIGN section 6). With the CUTLASS 4.2 headers (the newest nvidia-cutlass wheel) its
// mainloop keeps a temporary accumulator as large as the tile's (128 + 128 registers per consumer thread
// at 256x128) and spilled; newer CUTLASS splits it along M.
//
// What changes: each consumer warp group's 128 rows are two 64-row MMA atoms (MMA_M = 2). A k tile's
// WGMMAs for one atom go into one 64-row temporary, which is promoted into that atom's accumulators
// (accum += temp * scale) before the next atom's WGMMAs reuse it: 128 accumulators + 64 temporaries per
// thread. The two consumer warp groups run the same sequence independently, so one's promotion runs under
// the other's MMAs. Everything else (loads, shared storage, pipeline, scale layouts, the epilogue hand-off,
// mma_tail's release of the last stage) is the base collective's: only mma() is replaced.
//
// Numbers: accum = fma(temp_k, s_k, accum) from accum = 0, s_k = scale_a * scale_b of tile k, the base's
// sum in the base's order (each element's k tiles in turn).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass_stage_views.cuh"

namespace jf {
namespace cutlass_gemm {

template <class Base>
struct SplitPromotionMma : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulators live in registers");

    TiledMma tiled_mma;
    auto views = stage_views<Base>(tiled_mma, shared_tensors, thread_idx);
    Tensor tCrA = get<0>(views);    // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = get<1>(views);    // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tCsSFA = get<2>(views);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
    Tensor tCsSFB = get<3>(views);
    constexpr int kAtomsM = decltype(size<1>(accum))::value;
    constexpr int kAtomsN = decltype(size<2>(accum))::value;
    static_assert(kAtomsM > 1, "a split promotion needs two MMA atoms or more along M per warp group");
    // One atom row's temporaries and scales: (MMA, MMA_N)
    Tensor part = make_fragment_like(accum(_, _0{}, _));

    clear(accum);
    warpgroup_fence_operand(accum);
    // Tile `stage`, atom row m: its WGMMAs into part (zeroed by the first), waited for, then promoted.
    auto issue_and_promote = [&](int stage, int m) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < kAtomsN; ++n)  // (V) x (V) => (V): one atom
          cute::gemm(tiled_mma, tCrA(_, m, kb, stage), tCrB(_, n, kb, stage), part(_, n));
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(part);
      // the scales straight from shared memory (one load per distinct address): held in registers across
      // the wait, 1x128 b scales (32 per thread) pushed the wgrad kernel past its registers
      Tensor acc = accum(_, m, _);
      Tensor sfa = tCsSFA(_, m, _, make_coord(_0{}, stage));
      Tensor sfb = tCsSFB(_, m, _, make_coord(_0{}, stage));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(part); ++i) acc(i) = fmaf(part(i), sfa(i) * sfb(i), acc(i));
    };

    // Every stage but the last is released once its last atom row is promoted (its data and scales read
    // then); the last by mma_tail, as in the base.
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < k_tile_count; ++k) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kAtomsM; ++m) issue_and_promote(stage, m);
      if (k + 1 < k_tile_count) pipeline.consumer_release(smem_pipe_read);
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace cutlass_gemm
}  // namespace jf
