// The grouped FP8 GEMM of one (kind, output type, configuration): K-grouped (wgrad), f32 out, the 128-row tile
// with the two consumer warp groups' MMAs in turns, cluster 1x2 (cutlass_ragged.cuh, cutlass_ordered.cuh).
// One translation unit each, so that a parallel build compiles them side by side.
#define JF_CUTLASS_KERNELS
#include "cutlass_gemm.cuh"
#include "cutlass_ragged.cuh"

JF_CUTLASS_DEFINE_RAGGED(run_ragged_k_f32_ordered, kKGrouped, float, 2, kTileOrdered)
