// The grouped FP8 GEMM of one (kind, output type, configuration): K-grouped (wgrad), bf16 out, cluster 1x2 (cutlass_ragged.cuh). One
// translation unit each, so that a parallel build compiles them side by side.
#define JF_CUTLASS_KERNELS
#include "cutlass_gemm.cuh"
#include "cutlass_ragged.cuh"

JF_CUTLASS_DEFINE_RAGGED(run_ragged_k_bf16_c1x2, kKGrouped, cutlass::bfloat16_t, 2, kTileCoop)
