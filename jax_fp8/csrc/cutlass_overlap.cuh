// CUTLASS's Hopper blockwise-scaling mainloop with each k tile's scale promotion overlapped with the
// next tile's MMAs (the "_overlap" configurations of cutlass_gemm.cuh). Included by cutlass_gemm.cuh's
// kernel part only.
//
// Why: the blockwise mainloop (CUTLASS 4.2, sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp)
// issues a k tile's WGMMAs into a temporary accumulator, waits for them (warpgroup_wait<0>), then promotes
// (accum += temp * scale) while the tensor cores have nothing to do. With 1x128 scales on both operands
// (wgrad, "1D1D") the promotion is a multiply and an FMA per accumulator, half as many issue slots as the
// tile's MMAs take on the tensor pipe: ncu saw the tensor pipe 58% busy (80% in 1D2D; bench/RESULTS.md,
// "Issues 30-31 on an H100").
//
// What changes: two temporary accumulators. Tile k's WGMMAs go into one while tile k-1's, in the other,
// are promoted, so the tensor pipe has a batch while the promotion runs.
// Registers per consumer thread at a 128x128 tile (cooperative: 64x128 per warp group): 64 accumulators
// + 2 x 64 temporaries. Everything else (loads, shared storage, pipeline, scale layouts, the epilogue
// hand-off, mma_tail's release of the last stage) is the base collective's: only mma() is replaced.
//
// Measured on an H100 (bench/RESULTS.md, "Issue 48, fourth session"): 0.6-6% off CUTLASS's wgrad times at
// most shapes, but the tensor pipe stayed 54% busy with half the issue slots free either way: this kernel
// waits on its loads and barriers, not on the promotion's instructions.
//
// Numbers: accum = fma(temp_k, s_k, accum) from accum = 0, s_k = scale_a * scale_b of tile k: the base's
// sum in the base's order, and its bits where the scales are powers of two (the recipe's default).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass_stage_views.cuh"

namespace jf {
namespace cutlass_gemm {

template <class Base>
struct OverlappedPromotionMma : Base {
  using typename Base::ElementBlockScale;
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
    Tensor sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA, MMA_M, MMA_N)
    Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
    Tensor part0 = make_fragment_like(accum), part1 = make_fragment_like(accum);
    // Zeroed and fenced one register at a time: from one shared zero, part1's copies would read a register
    // that ptxas gave part0's in-flight WGMMAs, and it would serialize them.
    clear(part0);
    clear(part1);
    warpgroup_fence_operand(part0);
    warpgroup_fence_operand(part1);

    // Tile `stage`'s WGMMAs into `part` (zeroed by the first), one committed batch.
    auto issue = [&](auto& part, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
    };
    // A finished batch times its stage's scales into the accumulators.
    auto promote = [&](auto& part, int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
      warpgroup_fence_operand(part);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) = fmaf(part(i), sfa(i) * sfb(i), accum(i));
    };
    auto wait_stage = [&](PipelineState s) { pipeline.consumer_wait(s, pipeline.consumer_try_wait(s)); };

    clear(accum);
    warpgroup_fence_operand(accum);
    // Two k tiles per trip, part0 then part1: each promotion runs while the other temporary's batch is in
    // flight, and every trip ends with no batch in flight and part1's tile not yet promoted; it is promoted
    // at the start of the next trip, under part0's batch. (ptxas must see part1 in the same state on every
    // way into the loop, done and WGMMA-written: with a batch in flight at the loop edge, or part1 fresh
    // on the first trip, it serializes the WGMMAs or waits for all of them before part1's promotion.)
    // A stage is released once promoted (its scales are read then); the last tile's stage is released by
    // mma_tail, as in the base.
    auto issue_next = [&](auto& part) {
      const PipelineState stage = smem_pipe_read;
      wait_stage(stage);
      issue(part, stage.index());
      ++smem_pipe_read;
      return stage;
    };
    if (k_tile_count == 1) {
      const PipelineState only = issue_next(part0);
      warpgroup_wait<0>();
      promote(part0, only.index());
    } else {
      PipelineState stage0 = issue_next(part0);
      PipelineState stage1 = issue_next(part1);
      warpgroup_wait<1>();
      promote(part0, stage0.index());
      pipeline.consumer_release(stage0);
      warpgroup_wait<0>();
      int k = 2;
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k + 2 <= k_tile_count; k += 2) {
        stage0 = issue_next(part0);
        promote(part1, stage1.index());
        pipeline.consumer_release(stage1);
        stage1 = issue_next(part1);
        warpgroup_wait<1>();
        promote(part0, stage0.index());
        pipeline.consumer_release(stage0);
        warpgroup_wait<0>();
      }
      if (k < k_tile_count) {  // an odd count: the last tile in part0
        stage0 = issue_next(part0);
        promote(part1, stage1.index());
        pipeline.consumer_release(stage1);
        warpgroup_wait<0>();
        promote(part0, stage0.index());
      } else {
        promote(part1, stage1.index());
      }
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace cutlass_gemm
}  // namespace jf
