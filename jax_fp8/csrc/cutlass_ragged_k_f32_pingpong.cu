// The grouped FP8 GEMM of one (kind, output type, configuration): K-grouped (wgrad), f32 out, the 64-row tile with
// the ping-pong schedule (cutlass_ragged.cuh). One translation unit each, so that a parallel build compiles
// them side by side.
#define JF_CUTLASS_KERNELS
#include "cutlass_gemm.cuh"
#include "cutlass_ragged.cuh"

JF_CUTLASS_DEFINE_RAGGED(run_ragged_k_f32_pingpong, kKGrouped, float, 1, kTilePingpong)
