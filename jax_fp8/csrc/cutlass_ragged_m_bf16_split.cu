// The grouped FP8 GEMM of one (kind, output type, configuration): M-grouped (forward, dgrad), bf16 out, the 256-row tile with
// the split promotion, cluster 1x2 (cutlass_ragged.cuh, cutlass_split.cuh). One translation unit each, so
// that a parallel build compiles them side by side.
#define JF_CUTLASS_KERNELS
#include "cutlass_gemm.cuh"
#include "cutlass_ragged.cuh"

JF_CUTLASS_DEFINE_RAGGED(run_ragged_m_bf16_split, kMGrouped, cutlass::bfloat16_t, 2, kTileSplit)
