// The grouped (ragged) FP8 block-scaled GEMMs of fp8_ragged_dot on CUTLASS's Hopper ptr-array grouped
// mainloop with blockwise scaling (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, CUTLASS >= 4.2,
// sm_90a; CUTLASS's example 68). The group sizes stay on the device: a setup kernel turns them into the
// per-group problem shapes and pointers the grouped kernel reads (no host sync, CUDA-graph safe).
//
// Two kinds (jax_fp8/gemm/ragged_primitive.py states the contract, groups.py defines the groups), over the
// Gl groups [offset, offset + Gl) of the G that group_sizes describes (offset: a device scalar, as
// lax.ragged_dot's group_offset; an expert-parallel shard holds Gl experts):
// - M-grouped (forward, dgrad): out (M, N), rows of group offset + j = a[rows of it] (1x128 blocks) · b[j]ᵀ,
//   b (Gl, N, K) in 128x128 tiles; every other row 0. Scales as the dense GEMM takes them (GEMM-ready): a's
//   (ceil(K/128), roundup(M, 4)), b's (Gl, ceil(N/128), roundup(ceil(K/128), 4)).
// - K-grouped (wgrad): out (Gl, R, N), out[j] = a[:, cols of group offset + j] · b[:, same cols]ᵀ of a (R,
//   Mc) and b (N, Mc), the columnwise operands of jf_quantize_grouped: a group's columns start at
//   groups.col_starts (16-aligned: TMA's base address rule), in blocks of 128 that restart at the group start,
//   scales (S, R) and (S, N), one row per block slot. An empty group's out[j] is 0.
//
// The grouped mainloop reads each group's scales through CUTLASS's packed layouts (tile_atom_to_shape_SF*
// of the group's problem shape), not through per-group layouts: so the M-grouped kernel takes a's scales
// K-major (M, nk) and b's (G, ceil(N/128), nk) packed, which the fill kernel repacks from the GEMM-ready ones
// (small: nk floats per row); the K-grouped kernel takes the slots' scale rows as they are (MN-major, one
// row of R or N per slot), which needs R % 4 == 0 and N % 4 == 0 for the quantizer's rows to be unpadded.
//
// The interface part is always compiled (cutlass_module.cu includes it); the kernels only with
// JF_CUTLASS_KERNELS defined (the cutlass_ragged_<kind>_<out>.cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cutlass_gemm.cuh"
#include "groups.h"

namespace jf {
namespace cutlass_gemm {

enum RaggedKind : int { kMGrouped = 0, kKGrouped = 1 };

// The grouped kernels' configurations, in index order (the `config` attribute; cutlass.py's
// RAGGED_CONFIGS): CTA tile M x N x K, cluster shape M x N (1x2: two CTAs of one row of tiles share a's
// loads, TMA multicast), cooperative schedule; "_split": the 256-row tile's MMAs and promotion one 64-row
// atom at a time (cutlass_split.cuh); "_ordered": the two consumer warp groups issue each k tile's MMAs in
// turn (cutlass_ordered.cuh; the "_coop" kernels' bits). (A 64x128 ping-pong tile, one consumer warp
// group's epilogue under the other's MMAs, ran 1.07-1.69x slower than the best of these on an H100 at 512
// and 2048 rows per group, forward and wgrad: bench/RESULTS.md, "Issues 48-49, thirteenth session".) The tile scheduler's raster
// order (`raster`: 0 and 1 along M, 2 along N) is a run-time argument. Its swizzle is not: CUTLASS's
// grouped scheduler sizes the swizzle from the host's problem shapes, and with the shapes on the device
// only it always takes 1 (PersistentTileSchedulerSm90Group: its problem blocks are then (SMs, 1)).
constexpr int kNumRaggedConfigs = 4;
constexpr const char* kRaggedConfigNames[kNumRaggedConfigs] = {"128x128x128_c1x1_coop", "128x128x128_c1x2_coop",
                                                               "256x128x128_c1x2_coop_split",
                                                               "128x128x128_c1x2_coop_ordered"};
// The kernels' tile and mainloop: 128 rows on CUTLASS's mainloop or in turns, or 256 with the split promotion
enum RaggedTile : int { kTileCoop = 0, kTileSplit = 1, kTileOrdered = 2 };

struct RaggedCall {
  int kind = kMGrouped;
  int64_t M = 0;   // rows in groups: a's rows (M-grouped) or the rows the columns came from (K-grouped)
  int64_t N = 0;   // out's columns
  int64_t K = 0;   // M-grouped: the contraction; K-grouped: R, a's rows (out[g] is (R, N))
  int64_t G = 0;   // groups in group_sizes
  int64_t Gl = 0;  // groups of b (M-grouped) or out (K-grouped): [offset, offset + Gl)
  int64_t Mc = 0;  // K-grouped: the columns of a and b (>= M; groups.col_count)
  const int32_t* group_sizes = nullptr;   // (G,) on the device
  const int32_t* group_offset = nullptr;  // (1,) on the device: the first group of b / out
  const void* a = nullptr;
  const float* a_scale = nullptr;
  const void* b = nullptr;
  const float* b_scale = nullptr;
  void* out = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  int config = 0;                 // index into kRaggedConfigNames
  int raster = kRasterHeuristic;  // Raster (kRasterHeuristic: along M, as kRasterAlongM)
  cudaStream_t stream = nullptr;
  bool dry_run = false;  // size the workspace only: no CUDA call
};

// The entry points, one per (kind, output type, configuration), each in its own translation unit.
GemmResult run_ragged_m_bf16(const RaggedCall& call);
GemmResult run_ragged_m_f32(const RaggedCall& call);
GemmResult run_ragged_k_bf16(const RaggedCall& call);
GemmResult run_ragged_k_f32(const RaggedCall& call);
GemmResult run_ragged_m_bf16_c1x2(const RaggedCall& call);
GemmResult run_ragged_m_f32_c1x2(const RaggedCall& call);
GemmResult run_ragged_k_bf16_c1x2(const RaggedCall& call);
GemmResult run_ragged_k_f32_c1x2(const RaggedCall& call);
GemmResult run_ragged_m_bf16_split(const RaggedCall& call);
GemmResult run_ragged_m_f32_split(const RaggedCall& call);
GemmResult run_ragged_k_bf16_split(const RaggedCall& call);
GemmResult run_ragged_k_f32_split(const RaggedCall& call);
GemmResult run_ragged_m_bf16_ordered(const RaggedCall& call);
GemmResult run_ragged_m_f32_ordered(const RaggedCall& call);
GemmResult run_ragged_k_bf16_ordered(const RaggedCall& call);
GemmResult run_ragged_k_f32_ordered(const RaggedCall& call);

inline GemmResult run_ragged(int out_type, const RaggedCall& call) {
  if (call.config < 0 || call.config >= kNumRaggedConfigs || call.raster < kRasterHeuristic || call.raster > kRasterAlongN) {
    GemmResult r;
    r.status = kInvalid;
    r.message = "grouped GEMM options out of range: config " + std::to_string(call.config) + " (in [0, " +
                std::to_string(kNumRaggedConfigs) + ")), raster " + std::to_string(call.raster) + " (0, 1 or 2)";
    return r;
  }
  const bool bf16 = out_type == kOutBF16, m = call.kind == kMGrouped;
  switch (call.config) {
    case 1: return m ? (bf16 ? run_ragged_m_bf16_c1x2(call) : run_ragged_m_f32_c1x2(call))
                     : (bf16 ? run_ragged_k_bf16_c1x2(call) : run_ragged_k_f32_c1x2(call));
    case 2: return m ? (bf16 ? run_ragged_m_bf16_split(call) : run_ragged_m_f32_split(call))
                     : (bf16 ? run_ragged_k_bf16_split(call) : run_ragged_k_f32_split(call));
    case 3: return m ? (bf16 ? run_ragged_m_bf16_ordered(call) : run_ragged_m_f32_ordered(call))
                     : (bf16 ? run_ragged_k_bf16_ordered(call) : run_ragged_k_f32_ordered(call));
    default: return m ? (bf16 ? run_ragged_m_bf16(call) : run_ragged_m_f32(call))
                      : (bf16 ? run_ragged_k_bf16(call) : run_ragged_k_f32(call));
  }
}

}  // namespace cutlass_gemm
}  // namespace jf

// ---- the kernels ----------------------------------------------------------------------------------
#ifdef JF_CUTLASS_KERNELS

#include <cub/block/block_scan.cuh>

namespace jf {
namespace cutlass_gemm {

template <int Kind, class ElementOut, int ClusterN, int Tile>
struct RaggedKernel {
  static constexpr int kKind = Kind;
  using E4 = cutlass::float_e4m3_t;
  using TileShape = cute::Shape<cute::Int<Tile == kTileSplit ? 256 : 128>, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::Int<ClusterN>, cute::_1>;
  // M-grouped: a 1x128 (K-major scales), b 128x128 tiles (K-major); K-grouped: both 1x128 along the
  // contraction, scales MN-major (one row per block slot)
  static constexpr auto kMajor = Kind == kMGrouped ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, Kind == kMGrouped ? 128 : 1, 128, kMajor, kMajor>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignOut = 16 / int(sizeof(ElementOut));

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor*, kAlignOut,  // no C
      ElementOut, cutlass::layout::RowMajor*, kAlignOut,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, ElementOut, float>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      E4, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, 16,
      E4, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, 16,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Mainloop = typename PromotionOf<Tile == kTileSplit     ? kPromoteSplit
                                        : Tile == kTileOrdered ? kPromoteOrdered
                                                               : kPromoteBase>::template Mma<BuiltMainloop>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

// Where each per-group array lives in the workspace (byte offsets, each 256-aligned), and the bytes in all.
template <class K>
struct RaggedLayout {
  size_t shapes, ptr_a, ptr_b, ptr_sfa, ptr_sfb, ptr_d, stride_a, stride_b, stride_d, rows, sfa, sfb, cutlass, total;

  RaggedLayout(const RaggedCall& c, size_t cutlass_bytes) {
    size_t at = 0;
    auto take = [&at](size_t bytes) { const size_t here = at; at += (bytes + 255) / 256 * 256; return here; };
    const size_t G = size_t(c.G), nk = size_t((c.K + 127) / 128);
    shapes = take(G * sizeof(typename K::Shape3));
    ptr_a = take(G * sizeof(void*));
    ptr_b = take(G * sizeof(void*));
    ptr_sfa = take(G * sizeof(void*));
    ptr_sfb = take(G * sizeof(void*));
    ptr_d = take(G * sizeof(void*));
    stride_a = take(G * sizeof(typename K::StrideA));
    stride_b = take(G * sizeof(typename K::StrideB));
    stride_d = take(G * sizeof(typename K::StrideD));
    rows = take((G + 2) * sizeof(int64_t));  // each group's rows after clipping, then the local groups' first row and end
    // the M-grouped kernel's packed scales: a's (M, nk), b's (G, ceil(N/128), nk)
    sfa = take(c.kind == kMGrouped ? size_t(c.M) * nk * sizeof(float) : 0);
    sfb = take(c.kind == kMGrouped ? size_t(c.Gl) * size_t((c.N + 127) / 128) * nk * sizeof(float) : 0);
    cutlass = take(cutlass_bytes);
    total = at;
  }
};

constexpr int kSetupThreads = 256;

// One CTA: the groups' bounds (groups.py: sizes clipped to [0, M], ends at most M) by a block scan, and
// every group's problem shape, pointers and strides (groups outside [offset, offset + Gl): no tiles).
template <class K, class ElementOut>
__global__ void __launch_bounds__(kSetupThreads) ragged_setup_kernel(RaggedCall c, RaggedLayout<K> L) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  char* ws = static_cast<char*>(c.workspace);
  auto* shapes = reinterpret_cast<typename K::Shape3*>(ws + L.shapes);
  auto* ptr_a = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + L.ptr_a);
  auto* ptr_b = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + L.ptr_b);
  auto* ptr_sfa = reinterpret_cast<const float**>(ws + L.ptr_sfa);
  auto* ptr_sfb = reinterpret_cast<const float**>(ws + L.ptr_sfb);
  auto* ptr_d = reinterpret_cast<ElementOut**>(ws + L.ptr_d);
  auto* stride_a = reinterpret_cast<typename K::StrideA*>(ws + L.stride_a);
  auto* stride_b = reinterpret_cast<typename K::StrideB*>(ws + L.stride_b);
  auto* stride_d = reinterpret_cast<typename K::StrideD*>(ws + L.stride_d);
  auto* rows = reinterpret_cast<int64_t*>(ws + L.rows);
  const auto* a = static_cast<const cutlass::float_e4m3_t*>(c.a);
  const auto* b = static_cast<const cutlass::float_e4m3_t*>(c.b);
  auto* out = static_cast<ElementOut*>(c.out);
  const int64_t nk = (c.K + 127) / 128, nbn = (c.N + 127) / 128, offset = *c.group_offset;
  int64_t row0 = 0, slot0 = 0, col0 = 0;  // the carries: rows, block slots and columns before this chunk
  __shared__ int64_t local_rows[2];      // the local groups' first row and end
  if (threadIdx.x == 0) local_rows[0] = local_rows[1] = -1;
  for (int64_t base = 0; base < c.G; base += kSetupThreads) {
    const int64_t g = base + threadIdx.x, j = g - offset;
    const int64_t want = g < c.G ? min(max(int64_t(c.group_sizes[g]), int64_t(0)), c.M) : 0;
    int64_t before, chunk;
    Scan(scan_storage).ExclusiveSum(want, before, chunk);
    __syncthreads();
    const int64_t start = min(row0 + before, c.M), m = min(row0 + before + want, c.M) - start;
    const int64_t blocks = (m + 127) / 128, cols = (m + kColAlign - 1) / kColAlign * kColAlign;
    int64_t slot_before, slot_chunk, col_before, col_chunk;
    Scan(scan_storage).ExclusiveSum(blocks, slot_before, slot_chunk);
    __syncthreads();
    Scan(scan_storage).ExclusiveSum(cols, col_before, col_chunk);
    __syncthreads();
    if (g < c.G) {
      const bool local = j >= 0 && j < c.Gl;
      rows[g] = m;
      if (g == max(offset, int64_t(0))) local_rows[0] = start;
      if (g == min(offset + c.Gl, c.G) - 1) local_rows[1] = start + m;
      typename K::StrideA sa{};
      typename K::StrideB sb{};
      typename K::StrideD sd{};
      const int64_t jc = local ? j : 0;  // pointers of a group with no tiles are never read
      if constexpr (K::kKind == kMGrouped) {
        shapes[g] = typename K::Shape3(local ? int(m) : 0, int(c.N), int(c.K));
        ptr_a[g] = a + start * c.K;
        ptr_sfa[g] = reinterpret_cast<const float*>(ws + L.sfa) + start * nk;
        ptr_b[g] = b + jc * c.N * c.K;
        ptr_sfb[g] = reinterpret_cast<const float*>(ws + L.sfb) + jc * nbn * nk;
        ptr_d[g] = out + start * c.N;
        cute::get<0>(sa) = c.K;
        cute::get<0>(sb) = c.K;
      } else {
        const int64_t slot = slot0 + slot_before, col = col0 + col_before;
        // an empty group has no tiles (its out[j] is zeroed by the fill kernel)
        shapes[g] = typename K::Shape3(local && m > 0 ? int(c.K) : 0, int(c.N), int(m));
        ptr_a[g] = a + col;
        ptr_sfa[g] = c.a_scale + slot * c.K;
        ptr_b[g] = b + col;
        ptr_sfb[g] = c.b_scale + slot * c.N;
        ptr_d[g] = out + jc * c.K * c.N;
        cute::get<0>(sa) = c.Mc;
        cute::get<0>(sb) = c.Mc;
      }
      cute::get<0>(sd) = c.N;
      stride_a[g] = sa;
      stride_b[g] = sb;
      stride_d[g] = sd;
    }
    row0 += chunk;
    slot0 += slot_chunk;
    col0 += col_chunk;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // no local group (an offset past the groups): no local rows
    const bool none = local_rows[0] < 0 || local_rows[1] < 0;
    rows[c.G] = none ? c.M : local_rows[0];
    rows[c.G + 1] = none ? c.M : local_rows[1];
  }
}

// The fill kernel's share of the M-grouped kernel's packed a scales: 32 x 32 tiles of (nk, lda) -> (M, nk)
constexpr int kScaleTile = 32;

__host__ __device__ inline int64_t scale_tiles(const RaggedCall& c) {
  const int64_t nk = (c.K + 127) / 128;
  return c.kind == kMGrouped ? (c.M + kScaleTile - 1) / kScaleTile * ((nk + kScaleTile - 1) / kScaleTile) : 0;
}

// Many CTAs, after the setup: the M-grouped kernel's packed scales, and the zeros the grouped kernel does
// not write (rows outside the local groups; an empty or absent local group's out[j]). The first
// scale_tiles(c) CTAs each transpose one 32 x 32 tile of a's GEMM-ready scales through shared memory (reads
// and writes in 128-byte runs; a row per thread with its nk scales in turn ran ~10% of the forward, a chain
// of dependent loads); the other CTAs copy b's scales and write the zeros, an element per thread in turn.
template <class K, class ElementOut>
__global__ void __launch_bounds__(kSetupThreads) ragged_fill_kernel(RaggedCall c, RaggedLayout<K> L) {
  static_assert(kSetupThreads == kScaleTile * 8, "a tile's 32 columns by 8 rows of threads, 4 rows each");
  char* ws = static_cast<char*>(c.workspace);
  const int64_t* rows = reinterpret_cast<const int64_t*>(ws + L.rows);
  const int64_t tiles = scale_tiles(c);
  const int64_t tid = (int64_t(blockIdx.x) - tiles) * blockDim.x + threadIdx.x;
  const int64_t step = (int64_t(gridDim.x) - tiles) * blockDim.x;
  auto* out = static_cast<ElementOut*>(c.out);
  if constexpr (K::kKind == kMGrouped) {
    const int64_t nk = (c.K + 127) / 128, nbn = (c.N + 127) / 128;
    const int64_t lda = (c.M + 3) / 4 * 4, ldb = (nk + 3) / 4 * 4;
    if (int64_t(blockIdx.x) < tiles) {  // sfa[r, kb] = a_scale[kb, r] for a 32 x 32 tile
      __shared__ float tile[kScaleTile][kScaleTile + 1];  // + 1: the column reads hit 32 banks
      float* sfa = reinterpret_cast<float*>(ws + L.sfa);
      const int64_t tiles_r = (c.M + kScaleTile - 1) / kScaleTile;
      const int64_t r0 = int64_t(blockIdx.x) % tiles_r * kScaleTile, k0 = int64_t(blockIdx.x) / tiles_r * kScaleTile;
      const int tx = threadIdx.x % kScaleTile, ty = threadIdx.x / kScaleTile;
      for (int i = ty; i < kScaleTile; i += 8)
        if (k0 + i < nk && r0 + tx < c.M) tile[i][tx] = c.a_scale[(k0 + i) * lda + r0 + tx];
      __syncthreads();
      for (int i = ty; i < kScaleTile; i += 8)
        if (r0 + i < c.M && k0 + tx < nk) sfa[(r0 + i) * nk + k0 + tx] = tile[tx][i];
      return;
    }
    float* sfb = reinterpret_cast<float*>(ws + L.sfb);
    for (int64_t i = tid; i < c.Gl * nbn * nk; i += step) {  // sfb[t, kb] = b_scale[t, kb], ldb -> nk
      const int64_t t = i / nk;
      sfb[i] = c.b_scale[t * ldb + (i - t * nk)];
    }
    const int64_t lo = rows[c.G] * c.N, hi = rows[c.G + 1] * c.N;
    for (int64_t i = tid; i < lo; i += step) out[i] = ElementOut(0.0f);
    for (int64_t i = hi + tid; i < c.M * c.N; i += step) out[i] = ElementOut(0.0f);
  } else {
    const int64_t per = c.K * c.N, offset = *c.group_offset;
    for (int64_t j = 0; j < c.Gl; ++j) {
      const int64_t g = offset + j;
      if (g < 0 || g >= c.G || rows[g] == 0)
        for (int64_t i = tid; i < per; i += step) out[j * per + i] = ElementOut(0.0f);
    }
  }
}

template <int Kind, class ElementOut, int ClusterN, int Tile>
GemmResult run_ragged_kernel(const RaggedCall& call) {
  using K = RaggedKernel<Kind, ElementOut, ClusterN, Tile>;
  using Gemm = typename K::Gemm;
  GemmResult r;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = call.device;
  hw.sm_count = call.dry_run && call.sm_count <= 0 ? 132 : call.sm_count;

  // the per-group arrays' addresses are known once the workspace is: lay it out with the kernel's share last
  typename Gemm::Arguments args;
  auto fill_args = [&](char* ws, const RaggedLayout<K>& L) {
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {int(call.G), reinterpret_cast<typename K::Shape3*>(ws + L.shapes), nullptr};
    args.mainloop.ptr_A = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + L.ptr_a);
    args.mainloop.dA = reinterpret_cast<typename K::StrideA*>(ws + L.stride_a);
    args.mainloop.ptr_B = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + L.ptr_b);
    args.mainloop.dB = reinterpret_cast<typename K::StrideB*>(ws + L.stride_b);
    args.mainloop.ptr_SFA = reinterpret_cast<const float**>(ws + L.ptr_sfa);
    args.mainloop.layout_SFA = nullptr;  // the grouped mainloop derives each group's (packed) scale layout
    args.mainloop.ptr_SFB = reinterpret_cast<const float**>(ws + L.ptr_sfb);
    args.mainloop.layout_SFB = nullptr;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(ws + L.ptr_d);
    args.epilogue.dD = reinterpret_cast<typename K::StrideD*>(ws + L.stride_d);
    args.hw_info = hw;
    using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = call.raster == kRasterAlongN ? RasterOrderOptions::AlongN : RasterOrderOptions::AlongM;
  };
  fill_args(nullptr, RaggedLayout<K>(call, 0));
  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  const RaggedLayout<K> L(call, cutlass_bytes);
  r.workspace = L.total;
  if (call.dry_run || !launchable(call, &r)) return r;
  char* ws = static_cast<char*>(call.workspace);
  fill_args(ws, L);
  ragged_setup_kernel<K, ElementOut><<<1, kSetupThreads, 0, call.stream>>>(call, L);
  ragged_fill_kernel<K, ElementOut><<<unsigned(scale_tiles(call) + 2 * call.sm_count), kSetupThreads, 0, call.stream>>>(call, L);
  Gemm gemm;
  cutlass::Status s = gemm.initialize(args, ws + L.cutlass, call.stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(call.stream);
  const cudaError_t e = cudaGetLastError();
  if (s != cutlass::Status::kSuccess || e != cudaSuccess) {
    r.status = kInternal;
    r.message = "CUTLASS grouped GEMM launch failed: " + status_text(s) + " (" + cudaGetErrorString(e) + ")";
  }
  return r;
}

}  // namespace cutlass_gemm
}  // namespace jf

// One translation unit's entry point: JF_CUTLASS_DEFINE_RAGGED(run_ragged_m_bf16, kMGrouped, cutlass::bfloat16_t, 1,
// kTileCoop) (the last two: the cluster's CTAs along N; the tile, RaggedTile)
#define JF_CUTLASS_DEFINE_RAGGED(name, kind, out_type, cluster_n, tile)                                        \
  namespace jf {                                                                                               \
  namespace cutlass_gemm {                                                                                     \
  GemmResult name(const RaggedCall& call) { return run_ragged_kernel<kind, out_type, cluster_n, tile>(call); } \
  }                                                                                                            \
  }

#endif  // JF_CUTLASS_KERNELS
