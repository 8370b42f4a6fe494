// The CUTLASS FP8 GEMM kernels of one (scale pair, output type): 1D2D scale blocks, bf16 out, every
// configuration (cutlass_gemm.cuh). One translation unit each, so that a parallel build compiles the
// four side by side; cutlass_module.cu calls the entry point defined here.
#define JF_CUTLASS_KERNELS
#include "cutlass_gemm.cuh"

JF_CUTLASS_DEFINE_ENTRY(run_1d2d_bf16, k1D2D, cutlass::bfloat16_t)
