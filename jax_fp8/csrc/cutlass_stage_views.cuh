// What a replaced mma() of CUTLASS's Hopper blockwise-scaling mainloop (cutlass_overlap.cuh,
// cutlass_split.cuh) starts from: this thread's views of the pipeline's stages, as the base's mma() makes
// them (CUTLASS 4.2, sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace jf {
namespace cutlass_gemm {

// (tCrA, tCrB, tCsSFA, tCsSFB): the warp group's operand fragments (MMA, MMA_M, MMA_K, PIPE) and
// (MMA, MMA_N, MMA_K, PIPE), and the thread's views of the stages' scales broadcast over the tile
// (MMA, MMA_M, MMA_N, (MMA_K, PIPE)), for the mainloop `Base`.
template <class Base>
CUTLASS_DEVICE auto stage_views(typename Base::TiledMma const& tiled_mma, typename Base::TensorStorage& shared_tensors,
                                int thread_idx) {
  using namespace cute;
  using SmemLayoutSFA = typename Base::SmemLayoutSFA;
  using SmemLayoutSFB = typename Base::SmemLayoutSFB;
  using TileShape = typename Base::TileShape;
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
  // The stage's scales broadcast over the tile: (BLK_M, BLK_N, (BLK_K, PIPE)), as the base views them
  Tensor sSFA = make_tensor(
      make_smem_ptr(shared_tensors.smem_SFA.data()),
      make_layout(make_shape(get<0>(shape(SmemLayoutSFA{})), get<1>(TileShape{}),
                             make_shape(get<1>(shape(SmemLayoutSFA{})), get<2>(shape(SmemLayoutSFA{})))),
                  make_stride(get<0>(stride(SmemLayoutSFA{})), _0{},
                              make_stride(get<1>(stride(SmemLayoutSFA{})), get<2>(stride(SmemLayoutSFA{}))))));
  Tensor sSFB = make_tensor(
      make_smem_ptr(shared_tensors.smem_SFB.data()),
      make_layout(make_shape(get<0>(TileShape{}), get<0>(shape(SmemLayoutSFB{})),
                             make_shape(get<1>(shape(SmemLayoutSFB{})), get<2>(shape(SmemLayoutSFB{})))),
                  make_stride(_0{}, get<0>(stride(SmemLayoutSFB{})),
                              make_stride(get<1>(stride(SmemLayoutSFB{})), get<2>(stride(SmemLayoutSFB{}))))));

  using TiledMma = typename Base::TiledMma;
  constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const Layout warp_groups = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
  const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
  return make_tuple(thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                    thread_mma.make_fragment_B(thread_mma.partition_B(sB)),
                    tiled_mma.get_slice(thread_idx).partition_C(sSFA),
                    tiled_mma.get_slice(thread_idx).partition_C(sSFB));
}

}  // namespace cutlass_gemm
}  // namespace jf
