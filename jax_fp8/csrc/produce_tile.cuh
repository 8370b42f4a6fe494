// Producers fused with the quantize tile (quantize_tile.cuh): instead of loading a 16-byte vector of
// its input, the tile asks a source for VEC produced values of one row (RMSNorm, SwiGLU, GELU, their
// gradients, a cast; producers.h), rounded to the produced dtype and packed as that dtype's vector; the
// tile's amaxes, scales and stores are unchanged, so the produced tensor never reaches memory in high
// precision. A norm's statistics (RMSNorm's rstd, LayerNorm's mean and rstd) come from a pass of their own
// first (norm_stats_kernel), one warp per row.
//
// Inputs may be float32, bfloat16 or float16 (a run-time switch per load: the same for every thread); the
// fused kernels produce bfloat16 (LoadBF16, VEC 8). What they do not take (with_produce) runs as jf_produce
// (produce_values_kernel: the values alone, any produced dtype) then jf_quantize
// (jax_fp8/primitives/produce.py).
#pragma once

#include <cuda_runtime.h>

#include "produce_args.h"
#include "producers.h"
#include "quantize_dense.cuh"

namespace jf {
namespace {

constexpr int kVec = 8;  // produced values per vector (bf16 / fp16)

// The dtype of a source's inputs: IN, an InType fixed at compile time (the fused kernels: one code path),
// or kAnyIn: the call's, switched on at run time (jf_produce).
constexpr int kAnyIn = -1;

// n <= 8 consecutive elements of an input from element `at`, as fp32 (zeros past n); `vec`: the 8 are
// present and 16-byte aligned (one or two vector loads); t: the input's dtype, unless IN fixes it.
template <int IN = kAnyIn>
__device__ __forceinline__ void load8(const void* p, InType t, int64_t at, int n, bool vec, float (&o)[kVec]) {
  if constexpr (IN != kAnyIn) t = InType(IN);
  if (t == InType::kF32) {
    const float* q = static_cast<const float*>(p) + at;
    if (vec) {
      LoadF32::unpack(__ldg(reinterpret_cast<const uint4*>(q)), o);
      LoadF32::unpack(__ldg(reinterpret_cast<const uint4*>(q + 4)), o + 4);
      return;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = e < n ? q[e] : 0.0f;
    return;
  }
  const uint16_t* q = static_cast<const uint16_t*>(p) + at;
  const bool half = t == InType::kF16;
  if (vec) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(q));
    if (half) LoadF16::unpack(r, o);
    else LoadBF16::unpack(r, o);
    return;
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) o[e] = e < n ? (half ? LoadF16::get(q[e]) : LoadBF16::get(q[e])) : 0.0f;
}

// 8 values rounded to the produced dtype and packed as its 16-byte vector (NaN payloads are not
// canonicalised: the quantization maps every NaN to the one FP8 NaN byte).
template <class L>
__device__ __forceinline__ uint4 pack8(const float (&v)[kVec]) {
  constexpr bool kHalf = std::is_same_v<L, LoadF16>;
  return make_uint4(cvt_pack2<kHalf>(v[0], v[1]), cvt_pack2<kHalf>(v[2], v[3]), cvt_pack2<kHalf>(v[4], v[5]),
                    cvt_pack2<kHalf>(v[6], v[7]));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// How many of the 8 columns from col0 of row r exist (all of them inside an interior tile).
template <bool INTERIOR>
__device__ __forceinline__ int valid8(const Span& sp, int64_t r, int64_t col0) {
  if (INTERIOR) return kVec;
  if (r >= sp.M) return 0;
  const int64_t n = sp.K - col0;
  return n >= kVec ? kVec : (n > 0 ? int(n) : 0);
}

// The producers' sources: values<INTERIOR>(span, b, r, col0, v) writes the 8 values of row r of matrix b from
// column col0 before rounding, zeros past the matrix (valid8 says how many exist). `vec`: every input
// row is 16-byte aligned at multiples of 8 columns (the host checked the widths and pointers), so whole
// vectors load directly. IN: the dtype of the inputs (RMSNorm's x, not gamma), as load8's.
template <int IN = kAnyIn>
struct CastSrc {
  const void* x;
  InType xt;
  bool vec;
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    const int n = valid8<INTERIOR>(sp, r, col0);
    load8<IN>(x, xt, (b * sp.M + r) * sp.K + col0, n, vec && n == kVec, v);
  }
};

// A norm's values from its statistics (norm_stats_kernel): RMSNorm's (x * rstd) * gamma (LAYER false), or
// LayerNorm's ((x - mean) * rstd) * gamma + beta.
template <int IN, bool LAYER>
struct NormSrc {
  const void* x;
  const void* gamma;
  const void* beta;  // LayerNorm's
  InType xt, gt, bt;
  const float* stats;  // per row: RMSNorm's rstd; LayerNorm's (mean, rstd)
  bool vec;
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    const int n = valid8<INTERIOR>(sp, r, col0);
    if (n == 0) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = 0.0f;
      return;
    }
    float g[kVec], bb[kVec];
    const bool whole = vec && n == kVec;
    const int64_t row = b * sp.M + r;
    load8<IN>(x, xt, row * sp.K + col0, n, whole, v);
    load8(gamma, gt, col0, n, whole, g);
    if constexpr (LAYER) {
      load8(beta, bt, col0, n, whole, bb);
      const float2 ms = reinterpret_cast<const float2*>(stats)[row];
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = e < n ? layer_norm_f(v[e], ms.x, ms.y, g[e], bb[e]) : 0.0f;
    } else {
      const float s = stats[row];
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = e < n ? (v[e] * s) * g[e] : 0.0f;
    }
  }
};

template <int IN = kAnyIn>
struct SwigluSrc {  // h (B, M, 2K) = [gate | up]
  const void* h;
  InType ht;
  bool vec;
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    const int n = valid8<INTERIOR>(sp, r, col0);
    if (n == 0) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = 0.0f;
      return;
    }
    float u[kVec];
    const bool whole = vec && n == kVec;
    const int64_t at = (b * sp.M + r) * 2 * sp.K + col0;
    load8<IN>(h, ht, at, n, whole, v);
    load8<IN>(h, ht, at + sp.K, n, whole, u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = e < n ? swiglu_f(v[e], u[e]) : 0.0f;
  }
};

// SwiGLU's gradient at column col of row `row` ([d_gate | d_up], K = 2F), from scalar loads.
__device__ __noinline__ float swiglu_grad_at(const void* da, const void* h, InType dt, InType ht, int64_t row,
                                             int64_t F, int64_t col) {
  const int64_t c = col >= F ? col - F : col;
  float d[kVec], g[kVec], u[kVec];
  load8(da, dt, row * F + c, 1, false, d);
  load8(h, ht, row * 2 * F + c, 1, false, g);
  load8(h, ht, row * 2 * F + F + c, 1, false, u);
  return swiglu_grad_half_f(d[0], g[0], u[0], col >= F);
}

template <int IN = kAnyIn>
struct SwigluGradSrc {  // da (B, M, F), h (B, M, 2F); the produced row is [d_gate | d_up], K = 2F
  const void* da;
  const void* h;
  InType dt, ht;
  bool vec;  // also: F % 8 == 0, so a vector lies inside one half
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    const int n = valid8<INTERIOR>(sp, r, col0);
    if (n == 0) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = 0.0f;
      return;
    }
    const int64_t F = sp.K / 2, row = b * sp.M + r;
    if (vec && n == kVec) {  // the vector lies in one half: the gate's or the up projection's gradient
      const bool up = col0 >= F;
      const int64_t c = up ? col0 - F : col0;
      float d[kVec], g[kVec], u[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
      load8<IN>(da, dt, row * F + c, kVec, true, d);
      load8<IN>(h, ht, row * sp.K + c, kVec, true, g);
      if (!up) load8<IN>(h, ht, row * sp.K + F + c, kVec, true, u);
      // one code path for both halves (two inlined copies of the math overflowed the instruction cache)
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = swiglu_grad_half_f(d[e], g[e], u[e], up);
    } else {  // the matrix's edge, or unaligned rows: element by element, out of line (registers)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        v[e] = e < n ? swiglu_grad_at(da, h, IN == kAnyIn ? dt : InType(IN), IN == kAnyIn ? ht : InType(IN), row, F,
                                      col0 + e)
                     : 0.0f;
    }
  }
};

template <int IN = kAnyIn>
struct GeluSrc : CastSrc<IN> {  // x (B, M, K): the cast's values, then GELU
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    CastSrc<IN>::template values<INTERIOR>(sp, b, r, col0, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = gelu_f(v[e]);  // gelu(0) = 0 past the matrix
  }
};

template <int IN = kAnyIn>
struct GeluGradSrc {  // da (B, M, K), x (B, M, K)
  const void* da;
  const void* x;
  InType dt, xt;
  bool vec;
  template <bool INTERIOR>
  __device__ __forceinline__ void values(const Span& sp, int64_t b, int64_t r, int64_t col0, float (&v)[kVec]) const {
    const int n = valid8<INTERIOR>(sp, r, col0);
    const int64_t at = (b * sp.M + r) * sp.K + col0;
    float d[kVec];
    load8<IN>(da, dt, at, n, vec && n == kVec, d);
    load8<IN>(x, xt, at, n, vec && n == kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = gelu_grad_f(d[e], v[e]);  // da = 0 past the matrix: 0
  }
};

// The register cap (CTAs per SM) of a source's fused tile kernel: 0, the tile configuration's (3), or fewer
// where the source's math needs the registers (GELU and its gradient spilled 150-230 bytes at 3, none at 2).
template <class S>
constexpr int kSourceMinBlocks = 0;
template <int IN>
constexpr int kSourceMinBlocks<GeluSrc<IN>> = 2;
template <int IN>
constexpr int kSourceMinBlocks<GeluGradSrc<IN>> = 2;

// A source's values rounded to the produced dtype (L) and packed as its vectors: the tile's source.
template <class L, class S>
struct Packed {
  S src;
  template <bool INTERIOR>
  __device__ __forceinline__ uint4 vector(const Span& sp, int64_t b, int64_t r, int64_t col0) const {
    float v[kVec];
    src.template values<INTERIOR>(sp, b, r, col0, v);
    return pack8<L>(v);
  }
};

// SwiGLU's gradient with one sigmoid per (gate, up) pair (swiglu_pair_tiles): the CTA quantizes the gate tile
// of columns [c, c + 128) (second false), keeping the up projection's values of the same positions, rounded and
// packed, in shared memory, then the up tile of columns [F + c, F + c + 128) from there (second true): each
// thread reads back the vectors it wrote. Takes F % 128 == 0 and whole aligned vectors.
template <class L>
struct SwigluGradPairSrc {
  static_assert(std::is_same_v<L, LoadBF16>, "bfloat16 inputs and values");
  const void* da;
  const void* h;
  uint4* up;    // shared: the up tile's vectors, [row in tile][vector in row]
  bool second;  // the up tile
  template <bool INTERIOR>
  __device__ __forceinline__ uint4 vector(const Span& sp, int64_t b, int64_t r, int64_t col0) const {
    const int slot = int(r % 128) * (128 / kVec) + int(col0 % 128) / kVec;
    if (second) return up[slot];
    uint4 d = make_uint4(0, 0, 0, 0), g = d, u = d;
    // the loads after the previous vector's store: hoisting more of the tile's (8 x 3 vectors) spilled
    asm volatile("" ::: "memory");
    if (INTERIOR || r < sp.M) {  // the gate tile's columns all exist (F % 128 == 0); rows past M: zeros
      const int64_t F = sp.K / 2, row = b * sp.M + r;
      d = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(da) + row * F + col0));
      g = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(h) + row * sp.K + col0));
      u = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(h) + row * sp.K + F + col0));
    }
    // word by word (2 elements): fewer values live at once than 8 unpacked inputs and outputs
    const uint32_t dw[4] = {d.x, d.y, d.z, d.w}, gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
    uint32_t gate[4], upw[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float dg[2], du[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int sh = 16 * e;
        swiglu_grad_pair_f(L::get(uint16_t(dw[w] >> sh)), L::get(uint16_t(gw[w] >> sh)), L::get(uint16_t(uw[w] >> sh)),
                           dg[e], du[e]);  // 0 from zeros
      }
      gate[w] = cvt_pack2<false>(dg[0], dg[1]);
      upw[w] = cvt_pack2<false>(du[0], du[1]);
    }
    up[slot] = make_uint4(upw[0], upw[1], upw[2], upw[3]);
    return make_uint4(gate[0], gate[1], gate[2], gate[3]);
  }
};

// The pair kernel: CTA i quantizes gate tile i of the walk over the gate half (`half`: the span with nTK / 2
// tile columns), then its up tile, nTK / 2 tile columns on.
template <class L, class Cfg, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    swiglu_pair_kernel(Span sp, Span half, typename Cfg::Rule rule, int fp8, Outs<typename Cfg::S> row,
                       Outs<typename Cfg::S> col, ScaleAt row_at, ScaleAt col_at, const void* da, const void* h) {
  extern __shared__ __align__(16) uint4 up_tile[];
  const Window w{0, sp.L, 0, sp.aligned_base};
  const TilePos p = tile_pos(blockIdx.x, half, w);
#pragma unroll 1
  for (int k = 0; k < 2; ++k) {  // one copy of the tile code (and of its shared memory)
    quantize_tile_at<L, Cfg, kQuantize>(nullptr, sp, rule, fp8, row, col, row_at, col_at, w,
                                        TilePos{p.b, p.tm, p.tk + k * half.nTK},
                                        SwigluGradPairSrc<L>{da, h, up_tile, k == 1});
    __syncthreads();  // the tile's shared staging is reused
  }
}

// The sum over a warp's row of K elements in producers.h's order, terms(c, n, t) giving the terms t of the
// elements c .. c + 7 (n <= 8 of them in the row): lane l's 8 partial sums are the partials 8l .. 8l+7
// (elements 256j + 8l + e), and the XOR shuffles 16 .. 1 then the lane's own pairs (4, 2, 1) are the tree;
// every lane returns the total.
template <class Terms>
__device__ __forceinline__ float warp_sum(int64_t K, Terms terms) {
  const int lane = threadIdx.x % 32;
  float part[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 8 * lane; c < K; c += kSumLanes) {
    const int n = K - c >= kVec ? kVec : int(K - c);
    float t[kVec];
    terms(c, n, t);
#pragma unroll
    for (int e = 0; e < kVec; ++e) part[e] = part[e] + (e < n ? t[e] : 0.0f);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
#pragma unroll
    for (int e = 0; e < kVec; ++e) part[e] = part[e] + __shfl_xor_sync(0xFFFFFFFFu, part[e], off);
#pragma unroll
  for (int half = kVec / 2; half > 0; half /= 2)
#pragma unroll
    for (int e = 0; e < half; ++e) part[e] = part[e] + part[e + half];
  return part[0];
}

// The sum of term(x) over row `row` of x (K wide): warp_sum's.
template <class Term>
__device__ __forceinline__ float warp_row_sum(const void* x, InType xt, int64_t row, int64_t K, bool vec, Term term) {
  return warp_sum(K, [&](int64_t c, int n, float (&t)[kVec]) {
    load8(x, xt, row * K + c, n, vec && n == kVec, t);
#pragma unroll
    for (int e = 0; e < kVec; ++e) t[e] = term(t[e]);
  });
}

// A norm's statistics of every row (B * M rows of K), one warp per row: RMSNorm's rstd (stats[row]);
// LayerNorm's mean and its rstd from the sum of (x - mean)**2, a second pass over the row (stats[2 row],
// stats[2 row + 1]).
__global__ void __launch_bounds__(kThreads) norm_stats_kernel(const void* x, InType xt, int64_t rows, int64_t K,
                                                              float inv_k, float eps, bool vec, bool layer,
                                                              float* stats) {
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  if (!layer) {
    const float ss = warp_row_sum(x, xt, row, K, vec, [](float v) { return v * v; });
    if (threadIdx.x % 32 == 0) stats[row] = rms_rstd_f(ss, inv_k, eps);
    return;
  }
  const float mean = canonical_f32(warp_row_sum(x, xt, row, K, vec, [](float v) { return v; }) * inv_k);
  const float ss = warp_row_sum(x, xt, row, K, vec, [mean](float v) {
    const float d = v - mean;
    return d * d;
  });
  if (threadIdx.x % 32 == 0) {
    stats[2 * row] = mean;
    stats[2 * row + 1] = rms_rstd_f(ss, inv_k, eps);
  }
}

// Calls f(src) with the source of the call's producer (its tensor K wide). FUSED: the fused kernels' sources,
// their inputs' dtypes fixed (a cast's x float32, the others' bfloat16: fused_inputs_ok), else the call's.
template <bool FUSED = false, class F>
ffi::Error with_source(const ProduceArgs& p, int64_t K, F&& f) {
  const bool k8 = K % kVec == 0;
  constexpr int kF32 = FUSED ? int(InType::kF32) : kAnyIn, kBF16 = FUSED ? int(InType::kBF16) : kAnyIn;
  switch (p.producer) {
    case Producer::kCast: return f(CastSrc<kF32>{p.in[0], p.in_type[0], k8 && aligned16(p.in[0])});
    case Producer::kRmsNorm:
      return f(NormSrc<kBF16, false>{p.in[0], p.in[1], nullptr, p.in_type[0], p.in_type[1], InType::kF32, p.stats,
                                     k8 && aligned16(p.in[0]) && aligned16(p.in[1])});
    case Producer::kLayerNorm:
      return f(NormSrc<kBF16, true>{p.in[0], p.in[1], p.in[2], p.in_type[0], p.in_type[1], p.in_type[2], p.stats,
                                    k8 && aligned16(p.in[0]) && aligned16(p.in[1]) && aligned16(p.in[2])});
    case Producer::kSwiglu: return f(SwigluSrc<kBF16>{p.in[0], p.in_type[0], k8 && aligned16(p.in[0])});
    case Producer::kSwigluGrad:
      return f(SwigluGradSrc<kBF16>{p.in[0], p.in[1], p.in_type[0], p.in_type[1],
                                    (K / 2) % kVec == 0 && aligned16(p.in[0]) && aligned16(p.in[1])});
    case Producer::kGelu: return f(GeluSrc<kBF16>{{p.in[0], p.in_type[0], k8 && aligned16(p.in[0])}});
    case Producer::kGeluGrad:
      return f(GeluGradSrc<kBF16>{p.in[0], p.in[1], p.in_type[0], p.in_type[1],
                                  k8 && aligned16(p.in[0]) && aligned16(p.in[1])});
  }
  return bad("unreachable");
}

// Whether the inputs have the dtypes of the fused kernels' sources: a cast's float32 (a master weight), the
// other producers' bfloat16 (a norm's gamma and beta: any).
inline bool fused_inputs_ok(const ProduceArgs& p) {
  if (p.producer == Producer::kCast) return p.in_type[0] == InType::kF32;
  const bool two = p.producer == Producer::kSwigluGrad || p.producer == Producer::kGeluGrad;  // not gamma
  return p.in_type[0] == InType::kBF16 && (!two || p.in_type[1] == InType::kBF16);
}

// Calls f(cfg, rule, src) with the tile configuration, scale rule and source of the call. The kernels are
// built for what the fused layers ask (the recipes' schemes): inputs as fused_inputs_ok says (one load path
// each), bfloat16 values, Float8 blockwise with an infinite amax kept infinite (saturate_inf false),
// GEMM-ready with both usages, a cast (a master weight) into 128x128 tiles, the other producers (activations
// and gradients) into 1x128 and transposed 128x1 blocks. The primitive's lowering runs jf_produce then
// jf_quantize for anything else (jax_fp8/primitives/produce.py, fused_kernel_takes): one fused kernel per
// producer, where every combination would be dozens.
template <class F>
ffi::Error with_produce(const QuantizeArgs& a, const ProduceArgs& p, F&& f) {
  const bool cast = p.producer == Producer::kCast, tiles = a.out[0].bm == a.out[0].bk;
  if (!fused_inputs_ok(p) || p.out != InType::kBF16 || a.format != Format::kBlockwise || a.saturate_inf ||
      !a.gemm_scales || a.n_out != 2 || tiles != cast)
    return bad("produce_quantize on CUDA takes float32 inputs to a cast, bfloat16 inputs to the other producers, "
               "and makes bfloat16 values in GEMM-ready Float8 blockwise schemes with both usages and saturate_inf "
               "false: 128x128 tiles for a cast, 1x128 blocks for the other producers");
  using R = BlockRuleT<true>;
  const R rule{a.fp8, a.pow2, a.eps, a.inf_value};
  return with_source<true>(p, a.K, [&](auto src) {
    using S = decltype(src);
    if constexpr (std::is_same_v<S, CastSrc<int(InType::kF32)>>)
      return f(TileCfg<R, 128, 128, 0, false, true, true, true>{}, rule, src);
    else return f(TileCfg<R, 128, 128, 128, true, false, true, true>{}, rule, src);
  });
}

// n <= 8 values into out[0 .. n) as T (float, or bf16 / fp16 bits), NaNs canonical.
template <class T>
__device__ __forceinline__ void store_n(T* out, const float (&v)[kVec], int n) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (e >= n) break;
    if constexpr (std::is_same_v<T, float>) out[e] = canonical_f32(v[e]);
    else if constexpr (std::is_same_v<T, __half>) out[e] = __ushort_as_half(f16_from_float(v[e]));
    else out[e] = __ushort_as_bfloat16(bf16_from_float(v[e]));
  }
}

// jf_produce: one thread per 8 values of the (B, M, K) tensor, rounded to T (float, or bf16 / fp16 bits) with
// canonical NaNs and stored.
template <class T, class S>
__global__ void __launch_bounds__(kThreads) produce_values_kernel(Span sp, int64_t B, S src, T* __restrict__ y) {
  const int64_t per_row = cdiv(sp.K, kVec), i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= B * sp.M * per_row) return;
  const int64_t rr = i / per_row, col0 = (i % per_row) * kVec;
  float v[kVec];
  src.template values<false>(sp, rr / sp.M, rr % sp.M, col0, v);
  const int n = valid8<false>(sp, rr % sp.M, col0);
  store_n(y + rr * sp.K + col0, v, n);
}

// A norm's statistics into p.stats (nothing for the other producers).
inline ffi::Error norm_stats(cudaStream_t st, const ProduceArgs& p, int64_t rows, int64_t K) {
  const int64_t per_cta = kThreads / 32;
  if (!is_norm(p.producer) || rows == 0) return ffi::Error::Success();
  if (cdiv(rows, per_cta) > 0x7FFFFFFF) return bad("tensor too large for one launch");
  norm_stats_kernel<<<unsigned(cdiv(rows, per_cta)), kThreads, 0, st>>>(
      p.in[0], p.in_type[0], rows, K, p.inv_k, p.eps, K % kVec == 0 && aligned16(p.in[0]),
      p.producer == Producer::kLayerNorm, p.stats);
  return ffi::Error::Success();
}

// The producer's (B, M, K) tensor into y (its dtype: p.out).
inline ffi::Error produce_values(cudaStream_t st, const ProduceArgs& p, int64_t B, int64_t M, int64_t K, void* y) {
  if (auto e = norm_stats(st, p, B * M, K); e.failure()) return e;
  const int64_t n = B * M * cdiv(K, kVec);
  if (n == 0) return ffi::Error::Success();
  if (cdiv(n, kThreads) > 0x7FFFFFFF) return bad("tensor too large for one launch");
  const Span sp = dense_span(M, K, 1);
  return with_source(p, K, [&](auto src) -> ffi::Error {
    const unsigned grid = unsigned(cdiv(n, kThreads));
    switch (p.out) {
      case InType::kF32: produce_values_kernel<<<grid, kThreads, 0, st>>>(sp, B, src, static_cast<float*>(y)); break;
      case InType::kBF16:
        produce_values_kernel<<<grid, kThreads, 0, st>>>(sp, B, src, static_cast<__nv_bfloat16*>(y));
        break;
      case InType::kF16: produce_values_kernel<<<grid, kThreads, 0, st>>>(sp, B, src, static_cast<__half*>(y)); break;
    }
    return ffi::Error::Success();
  });
}

// SwiGLU's gradient quantized by pairs of tiles (SwigluGradPairSrc; F = K / 2 a multiple of 128, whole vectors).
template <class L, class Cfg, int IN>
ffi::Error swiglu_pair_tiles(cudaStream_t st, const QuantizeArgs& a, const typename Cfg::Rule& rule,
                             const Outs<typename Cfg::S>& row, const Outs<typename Cfg::S>& col, const ScaleAt& row_at,
                             const ScaleAt& col_at, const SwigluGradSrc<IN>& s) {
  static_assert(Cfg::TM == 128 && Cfg::TK == 128, "the pair source's slots");
  Span sp = dense_span(a.M, a.K, Cfg::GROUP);
  const int64_t n_tiles = plan_tiles<L, Cfg::TM, Cfg::TK>(sp, a.B, nullptr);
  if (n_tiles / 2 > 0x7FFFFFFF) return bad("tensor too large for one launch");
  if (n_tiles == 0) return ffi::Error::Success();
  Span half = sp;
  half.nTK = sp.nTK / 2;
  constexpr int kUpBytes = Cfg::TM * Cfg::TK * int(sizeof(typename L::T));  // above the 48 KB of static memory
  // 2 CTAs per SM: the registers of two tiles' values (at 3: 80 registers, 216 bytes spilled; at 2: 128, 36)
  const auto kernel = swiglu_pair_kernel<L, Cfg, 2>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kUpBytes) != cudaSuccess)
    return bad("produce_quantize: the SwiGLU gradient's pair kernel cannot have its shared memory");
  kernel<<<unsigned(n_tiles / 2), kThreads, kUpBytes, st>>>(sp, half, rule, a.fp8, row, col, row_at, col_at, s.da,
                                                            s.h);
  return ffi::Error::Success();
}

// The producer's tensor quantized into the outputs d / s (tile_outputs' order); a norm's statistics first.
inline ffi::Error produce_tiles(cudaStream_t st, const QuantizeArgs& a, const ProduceArgs& p, uint8_t* const* d,
                                void* const* s) {
  using L = LoadBF16;
  return with_produce(a, p, [&](auto cfg, auto rule, auto src) -> ffi::Error {
    using C = decltype(cfg);
    if (auto e = norm_stats(st, p, a.B * a.M, a.K); e.failure()) return e;
    Outs<typename C::S> row, col;
    ScaleAt row_at, col_at;
    tile_outputs(a, d, s, row, col, row_at, col_at);
    using S = decltype(src);
    if constexpr (std::is_same_v<S, SwigluGradSrc<int(InType::kBF16)>>)
      if (src.vec && a.K % 256 == 0) return swiglu_pair_tiles<L, C>(st, a, rule, row, col, row_at, col_at, src);
    return launch_tiles<L, C, Packed<L, S>, kSourceMinBlocks<S>>(st, a, nullptr, rule, row, col, row_at, col_at,
                                                                 Packed<L, S>{src});
  });
}

}  // namespace
}  // namespace jf
