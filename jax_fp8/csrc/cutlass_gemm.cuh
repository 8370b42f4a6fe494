// The FP8 block-scaled GEMM on CUTLASS's Hopper blockwise-scaling mainloop (CUTLASS >= 4.2, sm_90a):
// out (M, N) = a (M, K) · b (N, K)ᵀ [+ c], the contract of jax_fp8/gemm/contract.py, the same as the
// cuBLASLt backend's (cublaslt_gemm.h). Two parts:
//
// - the interface (always): the call's description (GemmCall), what came of it (GemmResult), the
//   configurations' names, and one entry point per (scale pair, output type), run_<pair>_<out>, each
//   defined in its own translation unit (cutlass_gemm_<pair>_<out>.cu) so that a parallel build compiles
//   them side by side. cutlass_module.cu (the FFI handler) includes this part only;
// - the kernels (with JF_CUTLASS_KERNELS defined before the include: the cutlass_gemm_*.cu files only):
//   the CUTLASS types of every configuration and the launcher.
//
// Mapping onto CUTLASS (GemmUniversal, D = A · B with A (M, K), B (K, N)): CUTLASS A = our a, RowMajor
// (K contiguous); CUTLASS B = our b, ColumnMajor (B (K, N) column-major is b (N, K) row-major); C and D
// RowMajor (M, N). The block scales (fp32 scale_inv, dequantized value = data * scale):
// - SFA, a's 1x128 blocks, GEMM-ready (ceil(K/128), roundup(M, 4)): M-major, scale[kb, m] at
//   kb * roundup(M, 4) + m: cute layout ((1, M), (128, nk)) with strides ((0, 1), (0, roundup(M, 4)));
// - SFB of 128x128 blocks ("1D2D"), (ceil(N/128), roundup(nk, 4)): K-major, ((128, ceil(N/128)), (128,
//   nk)) with strides ((0, roundup(nk, 4)), (0, 1));
// - SFB of 1x128 blocks ("1D1D"), (nk, roundup(N, 4)): N-major like SFA.
// The layouts are built here with the GEMM-ready strides (CUTLASS's tile_atom_to_shape_SF* assumes packed
// ones). Their shapes are the unpadded grids: the mainloop loads scales with predicates (cp.async) or TMA
// bounds checks against them, so padding entries are never read (1D2D loads SFA with TMA, which needs
// 16-byte strides, true of roundup(M, 4) floats, and M % 4 == 0, checked by can_implement; our sizes
// rule asks M % 4 then). Partial blocks: TMA zero-fills A and B past M, N and K, so the last K block's
// scale multiplies the product of the K it has, and rows past M / columns past N are never stored.
//
// The epilogue is CUTLASS's LinearCombination, D = alpha * acc + beta * C with alpha = 1 and beta = 0 or
// 1 chosen at run time (beta = 0: C is not read), computed in fp32, rounded to the output once. One
// kernel per output type (bfloat16, float32) then serves both accumulate modes.
//
// Tile scheduler: CUTLASS's persistent one (PersistentScheduler: a grid of at most one CTA per SM, each
// walking tiles), raster order and swizzle as run-time arguments. It needs no workspace (0 bytes); the
// handler still asks the kernel (get_workspace_size) and checks against the buffer it was given.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>

namespace jf {
namespace cutlass_gemm {

// The scale-block pairs: a has 1x128 blocks in both; b 128x128 (fprop, dgrad) or 1x128 (wgrad).
enum Pair : int { k1D2D = 0, k1D1D = 1 };
enum Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };
enum OutType : int { kOutBF16 = 0, kOutF32 = 1 };
// Raster order of the persistent tile scheduler (CUTLASS's RasterOrderOptions): the `raster` attribute.
enum Raster : int { kRasterHeuristic = 0, kRasterAlongM = 1, kRasterAlongN = 2 };

// The configurations, in index order (the `config` attribute; cutlass.py's CONFIGS). "c<m>x<n>": the
// cluster shape along M and N; "coop": cooperative (two consumer warp groups split a tile along M),
// "pingpong": two consumer warp groups alternate between tiles; "_overlap": each k tile's scale promotion
// overlapped with the next tile's MMAs (cutlass_overlap.cuh); "_split": a 256-row tile whose MMAs and
// promotion run one 64-row atom at a time (cutlass_split.cuh); "_ordered": the two consumer warp groups
// issue each k tile's MMAs in turn, so that one's promotion runs under the other's MMAs
// (cutlass_ordered.cuh; the base's bits). Each, for calls without c, an epilogue with no C operand
// (Kernel's HasC).
// (256x128x128 cluster 1x2, example 67's, on CUTLASS 4.2's own mainloop spilled 546 bytes and ran at
// 0.2-0.5x cuBLASLt on the H200: bench/RESULTS.md, section "GEMM backends, the kernel table, CUDA graphs,
// where="auto""; the "_split" mainloop is that tile without the spills.)
constexpr int kNumConfigs = 7;
constexpr const char* kConfigNames[kNumConfigs] = {
    "128x128x128_c1x1_coop",          "128x128x128_c1x2_coop",          "64x128x128_c1x1_pingpong",
    "128x128x128_c1x1_coop_overlap",  "128x128x128_c1x2_coop_overlap",  "256x128x128_c1x2_coop_split",
    "128x128x128_c1x2_coop_ordered",
};

// Operand type pairs with kernels: E4M3 x E4M3 always; with JF_CUTLASS_E5M2 (CMake: JAX_FP8_CUTLASS_E5M2)
// also E5M2 x E4M3 and E4M3 x E5M2 (each triples the kernels, and the build time).
#ifndef JF_CUTLASS_E5M2
#define JF_CUTLASS_E5M2 0
#endif

// One GEMM. Every check of shapes against the contract is the caller's (cutlass_module.cu); the kernel's
// own rules (alignment: can_implement) are checked here.
struct GemmCall {
  int a_type = kE4M3, b_type = kE4M3;  // Fp8Type
  int config = 0;                      // index into kConfigNames
  int raster = kRasterHeuristic;       // Raster
  int swizzle = 1;                     // 1, 2, 4 or 8
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;        // (M, K) fp8, row-major
  const float* a_scale = nullptr;  // GEMM-ready 1x128 scales of a
  const void* b = nullptr;        // (N, K) fp8, row-major
  const float* b_scale = nullptr;  // GEMM-ready scales of b (128x128 for k1D2D, 1x128 for k1D1D)
  const void* c = nullptr;        // (M, N) of the output type, or null: out = a · bᵀ
  void* out = nullptr;            // (M, N) bfloat16 / float32, row-major
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;  // the device's SM count (the persistent grid's size); must be > 0 unless dry_run
  cudaStream_t stream = nullptr;
  // Check (can_implement) and size the workspace only: no launch, no CUDA call (runs without a GPU).
  bool dry_run = false;
};

enum Status : int { kOk = 0, kInvalid = 1, kUnimplemented = 2, kInternal = 3 };
struct GemmResult {
  int status = kOk;
  size_t workspace = 0;  // the kernel's workspace for the problem (dry runs and launches)
  std::string message;   // why not, when status != kOk
};

// The entry points, one per (pair, output type), each in its own translation unit.
GemmResult run_1d2d_bf16(const GemmCall& call);
GemmResult run_1d2d_f32(const GemmCall& call);
GemmResult run_1d1d_bf16(const GemmCall& call);
GemmResult run_1d1d_f32(const GemmCall& call);

inline GemmResult run(int pair, int out_type, const GemmCall& call) {
  if (pair == k1D2D) return out_type == kOutBF16 ? run_1d2d_bf16(call) : run_1d2d_f32(call);
  return out_type == kOutBF16 ? run_1d1d_bf16(call) : run_1d1d_f32(call);
}

}  // namespace cutlass_gemm
}  // namespace jf

// ---- the kernels ----------------------------------------------------------------------------------
#ifdef JF_CUTLASS_KERNELS

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/numeric_types.h"
#include "cutlass_ordered.cuh"
#include "cutlass_overlap.cuh"
#include "cutlass_split.cuh"

// Compiled for any other device architecture (sm_90 without the "a" included) CUTLASS's sm90 kernels
// would build as empty bodies that fail at run time: refuse at compile time instead.
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
#error "jax_fp8: the CUTLASS FP8 GEMM kernels need sm_90a (nvcc -gencode=arch=compute_90a,code=sm_90a)"
#endif

namespace jf {
namespace cutlass_gemm {

// A configuration: CTA tile (M, N; K is always 128, one scale block per k tile), cluster shape, kernel
// schedule, and the mainloop's promotion: CUTLASS's, overlapped with the MMAs (OverlappedPromotionMma),
// split along M (SplitPromotionMma) or in the two consumer warp groups' turns (OrderedPromotionMma).
enum Promotion : int { kPromoteBase = 0, kPromoteOverlap = 1, kPromoteSplit = 2, kPromoteOrdered = 3 };
template <int TileM, int TileN, int ClusterM, int ClusterN, bool Cooperative, int Promote = kPromoteBase>
struct Config {
  static constexpr int kPromotion = Promote;
  // our mainloops' configurations also have a kernel without C, for calls without c
  static constexpr bool kCLess = Promote != kPromoteBase;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using MainloopSchedule = std::conditional_t<Cooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                                              cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<Cooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
};
// Each Promotion's mainloop around the one CUTLASS's builder makes (the grouped kernels use it too).
template <int Promote>
struct PromotionOf {
  template <class Built>
  using Mma = Built;
};
template <>
struct PromotionOf<kPromoteOverlap> {
  template <class Built>
  using Mma = OverlappedPromotionMma<Built>;
};
template <>
struct PromotionOf<kPromoteSplit> {
  template <class Built>
  using Mma = SplitPromotionMma<Built>;
};
template <>
struct PromotionOf<kPromoteOrdered> {
  template <class Built>
  using Mma = OrderedPromotionMma<Built>;
};
// kConfigNames, in the same order
using Configs = std::tuple<Config<128, 128, 1, 1, true>, Config<128, 128, 1, 2, true>, Config<64, 128, 1, 1, false>,
                           Config<128, 128, 1, 1, true, kPromoteOverlap>, Config<128, 128, 1, 2, true, kPromoteOverlap>,
                           Config<256, 128, 1, 2, true, kPromoteSplit>, Config<128, 128, 1, 2, true, kPromoteOrdered>>;
static_assert(std::tuple_size_v<Configs> == kNumConfigs);
// Which configurations are compiled: all, or only the I-th with -DJF_CUTLASS_ONLY_CONFIG=I (the quick
// compile check of bench/check_cutlass_kernel.sh, CI's); the others then fail at run time, saying so.
#ifndef JF_CUTLASS_ONLY_CONFIG
#define JF_CUTLASS_ONLY_CONFIG -1
#endif
static_assert(JF_CUTLASS_ONLY_CONFIG < kNumConfigs, "JF_CUTLASS_ONLY_CONFIG: no such configuration");

template <int P>
struct ScaleLayouts {
  static constexpr int kGranN = P == k1D2D ? 128 : 1;
  // SFA M-major (a's 1x128 blocks); SFB K-major for 128x128 tiles, N-major for 1x128 blocks
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kGranN, 128, cute::GMMA::Major::MN,
                                                                P == k1D2D ? cute::GMMA::Major::K : cute::GMMA::Major::MN>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  static LayoutSFA sfa(int32_t M, int32_t nk) {
    using namespace cute;
    const int32_t ld = (M + 3) / 4 * 4;
    return LayoutSFA(make_shape(make_shape(_1{}, M), make_shape(_128{}, nk), int32_t(1)),
                     make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * nk));
  }
  static LayoutSFB sfb(int32_t N, int32_t nk) {
    using namespace cute;
    if constexpr (P == k1D2D) {
      const int32_t nb = (N + 127) / 128, ld = (nk + 3) / 4 * 4;
      return LayoutSFB(make_shape(make_shape(_128{}, nb), make_shape(_128{}, nk), int32_t(1)),
                       make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * nb));
    } else {
      const int32_t ld = (N + 3) / 4 * 4;
      return LayoutSFB(make_shape(make_shape(_1{}, N), make_shape(_128{}, nk), int32_t(1)),
                       make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * nk));
    }
  }
};

// HasC false: the epilogue has no C operand at all (ElementC void: no shared memory for C, which the
// mainloop's stages get instead; CUTLASS's example 67 runs so), for calls without c.
template <class Cfg, int P, class ElementA, class ElementB, class ElementOut, bool HasC>
struct Kernel {
  using Scales = ScaleLayouts<P>;
  using LayoutSFA = typename Scales::LayoutSFA;
  using LayoutSFB = typename Scales::LayoutSFB;
  // 16 bytes per access (TMA): 16 FP8 elements, 8 bfloat16, 4 float
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignOut = 16 / int(sizeof(ElementOut));

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,  // accumulator, compute
      std::conditional_t<HasC, ElementOut, void>, cutlass::layout::RowMajor, kAlignOut,  // C
      ElementOut, cutlass::layout::RowMajor, kAlignOut,               // D
      typename Cfg::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, ElementOut, float>>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, kAlignAB,
      ElementB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, kAlignAB,
      float, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::MainloopSchedule>::CollectiveOp;
  using Mainloop = typename PromotionOf<Cfg::kPromotion>::template Mma<BuiltMainloop>;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                          cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

inline std::string status_text(cutlass::Status s) { return cutlassGetStatusString(s); }

// Whether a call (GemmCall, RaggedCall) can launch a kernel that needs r->workspace bytes: an SM count for
// the persistent scheduler and a workspace result that large; else r says why.
template <class Call>
bool launchable(const Call& call, GemmResult* r) {
  if (call.sm_count <= 0) {
    r->status = kInternal;
    r->message = "no SM count given for the persistent tile scheduler";
  } else if (r->workspace > call.workspace_bytes) {
    r->status = kInvalid;
    r->message = "the workspace result holds " + std::to_string(call.workspace_bytes) + " bytes, the kernel needs " +
                 std::to_string(r->workspace);
  }
  return r->status == kOk;
}

template <class Cfg, int P, class ElementA, class ElementB, class ElementOut, bool HasC>
GemmResult run_kernel(const GemmCall& call) {
  using K = Kernel<Cfg, P, ElementA, ElementB, ElementOut, HasC>;
  using Gemm = typename K::Gemm;
  using GemmKernel = typename K::GemmKernel;
  using namespace cute;
  GemmResult r;
  const int M = int(call.M), N = int(call.N), Kd = int(call.K), nk = (Kd + 127) / 128;

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(M, N, Kd, 1);
  args.mainloop.ptr_A = static_cast<const ElementA*>(call.a);
  args.mainloop.dA = typename GemmKernel::StrideA(int64_t(Kd), _1{}, int64_t(M) * Kd);
  args.mainloop.ptr_B = static_cast<const ElementB*>(call.b);
  args.mainloop.dB = typename GemmKernel::StrideB(int64_t(Kd), _1{}, int64_t(N) * Kd);
  args.mainloop.ptr_SFA = call.a_scale;
  args.mainloop.layout_SFA = K::Scales::sfa(M, nk);
  args.mainloop.ptr_SFB = call.b_scale;
  args.mainloop.layout_SFB = K::Scales::sfb(N, nk);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = call.c ? 1.0f : 0.0f;
  args.epilogue.thread.alpha_ptr = nullptr;
  args.epilogue.thread.beta_ptr = nullptr;
  if constexpr (HasC) {
    // beta = 0: C is never loaded; its descriptor still wants a valid address, the output's
    args.epilogue.ptr_C = static_cast<const ElementOut*>(call.c ? call.c : call.out);
  } else {
    args.epilogue.ptr_C = nullptr;
  }
  args.epilogue.dC = typename GemmKernel::StrideC(int64_t(N), _1{}, int64_t(M) * N);
  args.epilogue.ptr_D = static_cast<ElementOut*>(call.out);
  args.epilogue.dD = typename GemmKernel::StrideD(int64_t(N), _1{}, int64_t(M) * N);
  args.hw_info.device_id = call.device;
  // a dry run has no device: any positive count sizes the same (persistent scheduler) workspace
  args.hw_info.sm_count = call.dry_run && call.sm_count <= 0 ? 132 : call.sm_count;
  using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = call.raster == kRasterAlongM   ? RasterOrderOptions::AlongM
                                : call.raster == kRasterAlongN ? RasterOrderOptions::AlongN
                                                               : RasterOrderOptions::Heuristic;
  args.scheduler.max_swizzle_size = call.swizzle;

  if (cutlass::Status s = Gemm::can_implement(args); s != cutlass::Status::kSuccess) {
    r.status = kInvalid;
    r.message = "CUTLASS cannot take " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(Kd) +
                " with configuration " + kConfigNames[call.config < 0 ? 0 : call.config] + " (" + status_text(s) +
                "): its alignment rules are K % 16 == 0, N % 8 == 0 (bfloat16 out) / N % 4 == 0 (float32 out), "
                "M % 4 == 0 with 128x128 b blocks";
    return r;
  }
  r.workspace = Gemm::get_workspace_size(args);
  if (call.dry_run || !launchable(call, &r)) return r;
  Gemm gemm;
  cutlass::Status s = gemm.initialize(args, call.workspace, call.stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(call.stream);
  if (s != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    r.status = kInternal;
    r.message = "CUTLASS GEMM launch failed: " + status_text(s) + " (" + cudaGetErrorString(e) + ")";
  }
  return r;
}

template <int I, int P, class ElementA, class ElementB, class ElementOut>
GemmResult run_config(const GemmCall& call) {
  if constexpr (I < kNumConfigs) {
    using Cfg = std::tuple_element_t<I, Configs>;
    if constexpr (JF_CUTLASS_ONLY_CONFIG < 0 || JF_CUTLASS_ONLY_CONFIG == I) {
      if (call.config == I) {
        if constexpr (Cfg::kCLess)
          if (!call.c) return run_kernel<Cfg, P, ElementA, ElementB, ElementOut, false>(call);
        return run_kernel<Cfg, P, ElementA, ElementB, ElementOut, true>(call);
      }
    }
    return run_config<I + 1, P, ElementA, ElementB, ElementOut>(call);
  } else {
    GemmResult r;
    r.status = kInvalid;
    r.message = "config " + std::to_string(call.config) + " is not in [0, " + std::to_string(kNumConfigs) + ")" +
                (JF_CUTLASS_ONLY_CONFIG >= 0 ? " or not compiled into this build" : "");
    return r;
  }
}

// The entry point of one (pair, output type): dispatch on the operand types, then the configuration.
template <int P, class ElementOut>
GemmResult run_pair(const GemmCall& call) {
  using E4 = cutlass::float_e4m3_t;
  if (call.a_type == kE4M3 && call.b_type == kE4M3) return run_config<0, P, E4, E4, ElementOut>(call);
#if JF_CUTLASS_E5M2
  using E5 = cutlass::float_e5m2_t;
  if (call.a_type == kE5M2 && call.b_type == kE4M3) return run_config<0, P, E5, E4, ElementOut>(call);
  if (call.a_type == kE4M3 && call.b_type == kE5M2) return run_config<0, P, E4, E5, ElementOut>(call);
#endif
  GemmResult r;
  r.status = kUnimplemented;
  r.message = JF_CUTLASS_E5M2 ? "FP8 operands must not both be E5M2"
                              : "this build of the CUTLASS module has E4M3 x E4M3 kernels only (rebuild with "
                                "JAX_FP8_CUTLASS_E5M2=1 for E5M2 operands)";
  return r;
}

}  // namespace cutlass_gemm
}  // namespace jf

// One translation unit's entry point: JF_CUTLASS_DEFINE_ENTRY(run_1d2d_bf16, k1D2D, cutlass::bfloat16_t)
#define JF_CUTLASS_DEFINE_ENTRY(name, pair, out_type)                    \
  namespace jf {                                                        \
  namespace cutlass_gemm {                                              \
  GemmResult name(const GemmCall& call) { return run_pair<pair, out_type>(call); } \
  }                                                                     \
  }

#endif  // JF_CUTLASS_KERNELS
