// CUTLASS's Hopper blockwise-scaling mainloop with the two consumer warp groups issuing their k tiles'
// WGMMAs in turn (the "_ordered" configurations of cutlass_gemm.cuh and cutlass_ragged.cuh). Included by
// their kernel parts only.
//
// Why: in the cooperative kernel both consumer warp groups wait for the same stage, issue its WGMMAs
// together, wait for them together and then promote (accum += temp * scale) together, so the tensor
// pipe idles through every promotion. Nsight Compute at 16384 x 2048 x 7168, 1D2D on an H100
// (bench/RESULTS.md, "seventeenth session"): CUTLASS's kernel had the tensor pipe 64-66% busy, its
// consumers' most-sampled stall the wait for their own WGMMAs; cuBLASLt's kernel with the same tile,
// stage layout and promotion (nvjet ..._128x128_128x6_1x2_..._coopA) had it 78% busy, and in its
// consumer loop a named barrier of both warp groups (BAR.SYNC 0x2, 0x100) that one group reaches before
// issuing a k tile's WGMMAs and the other after: the groups take turns, and one's promotion runs under
// the other's MMAs.
//
// What changes: the same, here. Per k tile a warp group waits for the stage, reads its scales, then warp
// group 0 meets warp group 1 at the turn barrier before issuing, warp group 1 after issuing; each then
// waits for its WGMMAs and promotes. A group's WGMMAs are issued only once the other's of the same tile
// were, so the two batches reach the tensor pipe one after the other rather than interleaved, and the
// first group's promotion runs while the second's batch does. Both groups take the same number of turns
// (every tile of a CTA has the same k tiles for both), so the barrier pairs up.
// Everything else (loads, shared storage, pipeline, scale layouts, the epilogue hand-off, mma_tail's
// release of the last stage) is the base collective's: only mma() is replaced.
//
// Numbers: the base's operations in the base's order, so its bits: the same WGMMAs into a temporary per
// k tile, a stage's scale product formed as the base forms it (scale_a * scale_b once per tile where b
// has one scale per tile, 1D2D; (temp * scale_a) * scale_b per element otherwise, 1D1D), and
// accum += temp * scale from accum = 0 in k order.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass_stage_views.cuh"

namespace jf {
namespace cutlass_gemm {

// The turn barrier's id among the named barriers CUTLASS leaves to users (NamedBarrier adds its reserved
// count): none of the kernels here uses another.
constexpr uint32_t kTurnBarrier = 0;

template <class Base>
struct OrderedPromotionMma : Base {
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
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    static_assert(kWarpGroups == 2, "turns are taken by the cooperative kernel's two consumer warp groups");
    // b's scales: one per tile and k tile (1D2D: 128x128 blocks), or one per column (1D1D); a's always one
    // per row (1x128), and one scale block per k tile: the base's two promotions this one reproduces
    constexpr bool kOneScaleB = Base::ScaleNsPerTile == 1;
    static_assert(Base::ScaleMsPerTile > 1, "a in 1x128 blocks only (1D2D, 1D1D)");
    static_assert(Base::ScalePromotionInterval == 4, "one 128-wide scale block per k tile");

    TiledMma tiled_mma;
    auto views = stage_views<Base>(tiled_mma, shared_tensors, thread_idx);
    Tensor tCrA = get<0>(views);    // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = get<1>(views);    // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tCsSFA = get<2>(views);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
    Tensor tCsSFB = get<3>(views);
    // a stage's scales in registers, broadcast over the tile as in shared memory (few distinct registers)
    Tensor sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA, MMA_M, MMA_N)
    Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
    Tensor part = make_fragment_like(accum);
    const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto take_turn = [] {
      cutlass::arch::NamedBarrier::arrive_and_wait(kWarpGroups * cutlass::NumThreadsPerWarpGroup, kTurnBarrier);
    };

    clear(accum);
    warpgroup_fence_operand(accum);
    // Every stage but the last is released after the next tile's WGMMAs are done, as in the base; the last
    // by mma_tail.
    PipelineState smem_pipe_release = smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < k_tile_count; ++k) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);

      if (warp_group == 0) take_turn();  // after warp group 1 issued this tile
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
      if (warp_group == 1) take_turn();

      if constexpr (kOneScaleB) {  // under the WGMMAs: the tile's scale products
        const ElementBlockScale scale_b = sfb(0);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfa)); ++i) filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * scale_b;
      }
      warpgroup_wait<0>();
      if (k > 0) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      ++smem_pipe_read;
      warpgroup_fence_operand(part);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        if constexpr (kOneScaleB) {
          accum(i) = fmaf(part(i), sfa(i), accum(i));
        } else {
          accum(i) = fmaf(part(i) * sfa(i), sfb(i), accum(i));
        }
      }
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace cutlass_gemm
}  // namespace jf
