// CUDA kernels behind the XLA FFI targets (built for sm_90 where nvcc exists).
//
// Quantize: one CTA of 256 threads owns a TM x TK tile of one (M, K) matrix. Each thread loads 16-byte
// vectors of one fixed column chunk on rows g, g+G, ... and keeps them in registers, so the input is
// read from HBM exactly once and every usage (rowwise blocks via warp shuffles, columnwise blocks via a
// small shared-memory reduction, 2-D tiles via a CTA reduction) is cast from the same registers.
// The per-block math is fp8_math.h, shared with the CPU kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <nanobind/nanobind.h>

#include "ffi_common.h"
#include "fp8_math.h"

namespace jf {
namespace {

constexpr int kThreads = 256;

// Word i of a 16-byte vector by name (an indexed pointer into a register vector can go to local memory).
__device__ __forceinline__ uint32_t& word(uint4& r, int i) { return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w; }

struct LoadF32 {
  using T = float;
  static constexpr int VEC = 4;
  __device__ static float get(T v) { return v; }
  __device__ static void unpack(uint4 r, float* o) {
    o[0] = __uint_as_float(r.x); o[1] = __uint_as_float(r.y);
    o[2] = __uint_as_float(r.z); o[3] = __uint_as_float(r.w);
  }
  __device__ static void set(uint4& r, int e, T v) { word(r, e) = __float_as_uint(v); }
};
template <bool kHalf>
struct Load16 {
  using T = uint16_t;
  static constexpr int VEC = 8;
  __device__ static float get(T v) {
    if constexpr (kHalf) return __half2float(__ushort_as_half(v));
    else return bf16_to_float(v);
  }
  __device__ static void unpack(uint4 r, float* o) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = get(uint16_t(w[i] & 0xFFFFu));
      o[2 * i + 1] = get(uint16_t(w[i] >> 16));
    }
  }
  __device__ static void set(uint4& r, int e, T v) { word(r, e / 2) |= uint32_t(v) << (16 * (e % 2)); }
};
using LoadBF16 = Load16<false>;
using LoadF16 = Load16<true>;

// Where a matrix's elements live. Dense: x[b*M*K + r*K + c]. Master-weight shard: a flat buffer
// holding elements [offset, offset + length) of the row-major weight, offset/length in device memory.
struct Span {
  int64_t M, K, nTM, nTK;
  int64_t nTM_launch;            // tile rows launched: all (dense) or enough to cover a shard
  int64_t L;                     // dense: M*K; shard: the flat buffer's length
  const int32_t* dev_offset;     // null for dense
  const int32_t* dev_length;
  bool aligned_base;             // input pointer 16-byte aligned and K a multiple of VEC
};

enum Mode { kQuantize = 0, kAmax = 1, kCast = 2 };

template <class S>
struct Outs {
  uint8_t* data;
  S* scale;               // kQuantize: scales; kAmax: partial values; kCast: unused (scale_inv_kernel)
  const S* global;        // kCast: the reduced per-block values
};

// One thread's VEC elements of row r from column col0, kept packed in the input dtype (zeros where
// invalid) to halve the registers of 16-bit inputs; `mask` has bit e set for valid elements and idx
// is the first element's position in the buffer. Dense matrices skip the shard window checks.
template <class L, bool SHARD>
__device__ __forceinline__ void load_vec(const typename L::T* __restrict__ x, int64_t r, int64_t col0,
                                         const Span& sp, int64_t offset, int64_t length, bool aligned,
                                         uint4& raw, uint32_t& mask, int64_t& idx) {
  idx = r * sp.K + col0 - offset;
  const bool rows_ok = r < sp.M;
  const bool full = rows_ok && col0 + L::VEC <= sp.K && (!SHARD || (idx >= 0 && idx + L::VEC <= length));
  if (full && aligned) {
    raw = __ldg(reinterpret_cast<const uint4*>(x + idx));
    mask = (1u << L::VEC) - 1u;
  } else {
    raw = make_uint4(0, 0, 0, 0);
    mask = 0;
#pragma unroll
    for (int e = 0; e < L::VEC; ++e) {
      const bool ok = rows_ok && col0 + e < sp.K && (!SHARD || (idx + e >= 0 && idx + e < length));
      if (ok) L::set(raw, e, x[idx + e]);
      mask |= uint32_t(ok) << e;
    }
  }
}

// Cast VEC elements (times their multipliers) and store the valid ones at out[idx ...].
template <int VEC>
__device__ __forceinline__ void store_fp8(uint8_t* __restrict__ out, int64_t idx, uint32_t mask, bool aligned,
                                          const float (&v)[VEC], const float (&mult)[VEC], int fp8) {
  uint16_t pair[VEC / 2];
#pragma unroll
  for (int p = 0; p < VEC / 2; ++p)
    pair[p] = fp8x2_from_float(v[2 * p] * mult[2 * p], v[2 * p + 1] * mult[2 * p + 1], fp8);
  if (aligned && mask == (1u << VEC) - 1u) {
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint2*>(out + idx) =
          make_uint2(pair[0] | (uint32_t(pair[1]) << 16), pair[2] | (uint32_t(pair[3]) << 16));
    } else {
      *reinterpret_cast<uint32_t*>(out + idx) = pair[0] | (uint32_t(pair[1]) << 16);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (mask & (1u << e)) out[idx + e] = uint8_t(pair[e / 2] >> (8 * (e % 2)));
  }
}

// Per block: from its amax (or, when casting a shard, from the reduced global value) to the multiplier,
// writing what the mode stores for the block when `write` (kQuantize: the scale; kAmax: the rank's
// partial value; kCast: nothing, scale_inv_kernel fills the fp32 grids).
template <int MODE, class Rule>
__device__ __forceinline__ float block_multiplier(const Rule& rule, float amax, const Outs<typename Rule::ScaleT>& o,
                                                  int64_t gi, bool write) {
  typename Rule::ScaleT s;
  float mult = 1.0f;
  if constexpr (MODE == kQuantize) {
    rule(amax, s, mult);
  } else if constexpr (MODE == kAmax) {
    s = rule.partial(amax);
  } else {
    rule.from_global(o.global[gi], s, mult);
  }
  if (write && MODE != kCast) o.scale[gi] = s;
  return mult;
}

// TM x TK tile per CTA. RBK > 0: rowwise 1 x RBK blocks; COL: TM x 1 blocks; TILE: one TM x TK block.
// Every scale block belongs to exactly one CTA, so no atomics are needed in any mode.
template <class L, class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MODE>
__global__ void __launch_bounds__(kThreads)
    tile_kernel(const typename L::T* __restrict__ x, Span sp, Rule rule, int fp8, Outs<typename Rule::ScaleT> row,
                Outs<typename Rule::ScaleT> col) {
  constexpr int VEC = L::VEC;
  constexpr int CHUNKS = TK / VEC;      // 16-byte vectors per tile row
  constexpr int G = kThreads / CHUNKS;  // tile rows loaded per pass
  constexpr int NV = TM / G;            // vectors per thread
  static_assert(kThreads % CHUNKS == 0 && TM % G == 0, "tile shape");

  const int tid = threadIdx.x;
  const int c = tid % CHUNKS, g = tid / CHUNKS;
  int64_t t = blockIdx.x;
  const int64_t tk = t % sp.nTK;
  t /= sp.nTK;
  const int64_t offset = sp.dev_offset ? *sp.dev_offset : 0;
  // a shard launches only the tile rows from the one holding its first element
  const int64_t tm = (sp.dev_offset ? offset / sp.K / TM : 0) + t % sp.nTM_launch, b = t / sp.nTM_launch;
  if (tm >= sp.nTM) return;
  const int64_t col0 = tk * TK + int64_t(c) * VEC;
  const int64_t row0 = tm * TM + g;
  const int64_t length = sp.dev_length && *sp.dev_length < sp.L ? int64_t(*sp.dev_length) : sp.L;
  const bool aligned = sp.aligned_base && offset % VEC == 0;
  const int64_t base = b * sp.M * sp.K;  // dense batches; shards have b == 0
  const typename L::T* xb = x + base;

  constexpr bool SHARD = MODE != kQuantize;
  uint4 raw[NV];
  uint32_t mask[NV];
  int64_t idx[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i)
    load_vec<L, SHARD>(xb, row0 + int64_t(i) * G, col0, sp, offset, length, aligned, raw[i], mask[i], idx[i]);

  if constexpr (RBK > 0) {  // rowwise: the RBK / VEC lanes of a block reduce by shuffles
    constexpr int LANES = RBK / VEC;
    static_assert(LANES <= 32 && CHUNKS % LANES == 0, "row block must sit inside a warp");
    const int64_t n_scales = cdiv(sp.K, RBK);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float v[VEC];
      L::unpack(raw[i], v);
      float amax = 0.0f;
      if constexpr (MODE != kCast) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) amax = amax_step(amax, v[e]);
#pragma unroll
        for (int off = LANES / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
      }
      const int64_t r = row0 + int64_t(i) * G;
      const bool in = r < sp.M && col0 < sp.K;
      const int64_t gi = (b * sp.M + r) * n_scales + col0 / RBK;
      const float m = in ? block_multiplier<MODE>(rule, amax, row, gi, c % LANES == 0) : 1.0f;
      if constexpr (MODE != kAmax) {
        float mult[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) mult[e] = m;
        if (mask[i]) store_fp8<VEC>(row.data + base, idx[i], mask[i], aligned, v, mult, fp8);
      }
    }
  }

  if constexpr (COL) {  // columnwise: per-column partial amax over this thread's rows, reduced over G
    __shared__ __align__(16) float red[G][TK];  // partial amax per (row group, column)
    __shared__ __align__(16) float col_mult[TK];
    if constexpr (MODE != kCast) {
      float part[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) part[e] = 0.0f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC];
        L::unpack(raw[i], v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) part[e] = amax_step(part[e], v[e]);
      }
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q)
        reinterpret_cast<float4*>(&red[g][c * VEC])[q] = make_float4(part[4 * q], part[4 * q + 1], part[4 * q + 2], part[4 * q + 3]);
      __syncthreads();
    }
    // One thread per tile column finishes the reduction, applies the rule once and writes the column's
    // scale (coalesced); the multipliers go back through shared memory.
    static_assert(TK <= kThreads, "one thread per column");
    if (tid < TK) {
      const int64_t colj = tk * TK + tid;
      float m = 1.0f;
      if (colj < sp.K && tm * TM < sp.M) {
        float a = 0.0f;
        if constexpr (MODE != kCast) {
#pragma unroll
          for (int gg = 0; gg < G; ++gg) a = fmaxf(a, red[gg][tid]);
        }
        m = block_multiplier<MODE>(rule, a, col, (b * sp.nTM + tm) * sp.K + colj, true);
      }
      col_mult[tid] = m;
    }
    __syncthreads();
    if constexpr (MODE != kAmax) {
      float mult[VEC];
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        const float4 m4 = reinterpret_cast<const float4*>(&col_mult[c * VEC])[q];
        mult[4 * q] = m4.x, mult[4 * q + 1] = m4.y, mult[4 * q + 2] = m4.z, mult[4 * q + 3] = m4.w;
      }
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC];
        L::unpack(raw[i], v);
        if (mask[i]) store_fp8<VEC>(col.data + base, idx[i], mask[i], aligned, v, mult, fp8);
      }
    }
  }

  if constexpr (TILE) {  // one block for the whole tile: CTA-wide amax
    float amax = 0.0f;
    if constexpr (MODE != kCast) {
      __shared__ float warp_max[kThreads / 32];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC];
        L::unpack(raw[i], v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) amax = amax_step(amax, v[e]);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
      if (tid % 32 == 0) warp_max[tid / 32] = amax;
      __syncthreads();
      amax = 0.0f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    }
    const float m = block_multiplier<MODE>(rule, amax, row, (b * sp.nTM + tm) * sp.nTK + tk, tid == 0);
    if constexpr (MODE != kAmax) {
      float mult[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) mult[e] = m;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        float v[VEC];
        L::unpack(raw[i], v);
        if (mask[i]) store_fp8<VEC>(row.data + base, idx[i], mask[i], aligned, v, mult, fp8);
      }
    }
  }
}

template <class L, class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MODE>
ffi::Error launch_tiles(cudaStream_t stream, const QuantizeArgs& a, const void* x, Span sp, Rule rule,
                        Outs<typename Rule::ScaleT> row, Outs<typename Rule::ScaleT> col) {
  sp.nTM = cdiv(a.M, TM);
  sp.nTK = cdiv(a.K, TK);
  // A shard of L elements spans at most ceil(L/K) + 1 rows, so that many rows' tiles (+1) cover it.
  sp.nTM_launch = sp.dev_offset ? std::min(sp.nTM, cdiv(cdiv(sp.L, a.K) + 1, TM) + 1) : sp.nTM;
  const int64_t blocks = a.B * sp.nTM_launch * sp.nTK;
  if (blocks > 0x7FFFFFFF) return bad("tensor too large for one launch");
  if (blocks == 0) return ffi::Error::Success();
  sp.aligned_base = a.K % L::VEC == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  tile_kernel<L, Rule, TM, TK, RBK, COL, TILE, MODE><<<unsigned(blocks), kThreads, 0, stream>>>(
      static_cast<const typename L::T*>(x), sp, rule, a.fp8, row, col);
  return ffi::Error::Success();
}

// Picks the tile configuration for the requested usages; `o` holds the usages in the order row, col
// (or the single tile usage).
template <class L, int MODE>
ffi::Error tiles_in(cudaStream_t st, const QuantizeArgs& a, const void* x, const Span& sp, uint8_t* const* d,
                    void* const* s, const void* const* global) {
  if (a.scale_kind == kScaleE8M0) {
    using O = Outs<uint8_t>;
    const MxRule rule{a.fp8};
    const O o0{d[0], static_cast<uint8_t*>(s[0]), static_cast<const uint8_t*>(global[0])};
    const O o1{d[1], static_cast<uint8_t*>(s[1]), static_cast<const uint8_t*>(global[1])};
    if (a.row_block && a.col_block)
      return launch_tiles<L, MxRule, 32, 256, 32, true, false, MODE>(st, a, x, sp, rule, o0, o1);
    if (a.row_block) return launch_tiles<L, MxRule, 32, 256, 32, false, false, MODE>(st, a, x, sp, rule, o0, O{});
    return launch_tiles<L, MxRule, 32, 256, 0, true, false, MODE>(st, a, x, sp, rule, O{}, o0);
  }
  using O = Outs<float>;
  const BlockRule rule{a.fp8, a.pow2, a.eps, a.inf_value};
  const O o0{d[0], static_cast<float*>(s[0]), static_cast<const float*>(global[0])};
  const O o1{d[1], static_cast<float*>(s[1]), static_cast<const float*>(global[1])};
  if (a.tile_block) return launch_tiles<L, BlockRule, 128, 128, 0, false, true, MODE>(st, a, x, sp, rule, o0, O{});
  if (a.row_block && a.col_block)
    return launch_tiles<L, BlockRule, 128, 128, 128, true, false, MODE>(st, a, x, sp, rule, o0, o1);
  if (a.row_block) return launch_tiles<L, BlockRule, 128, 128, 128, false, false, MODE>(st, a, x, sp, rule, o0, O{});
  return launch_tiles<L, BlockRule, 128, 128, 0, true, false, MODE>(st, a, x, sp, rule, O{}, o0);
}

template <int MODE>
ffi::Error run_tiles(cudaStream_t st, const QuantizeArgs& a, const void* x, const Span& sp, uint8_t* const* d,
                     void* const* s, const void* const* global) {
  switch (a.in) {
    case InType::kF32: return tiles_in<LoadF32, MODE>(st, a, x, sp, d, s, global);
    case InType::kBF16: return tiles_in<LoadBF16, MODE>(st, a, x, sp, d, s, global);
    case InType::kF16: return tiles_in<LoadF16, MODE>(st, a, x, sp, d, s, global);
  }
  return bad("unreachable");
}

ffi::Error check_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_fp8 CUDA: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error QuantizeCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> o0,
                            ffi::Result<ffi::AnyBuffer> o1, ffi::Result<ffi::AnyBuffer> o2,
                            ffi::Result<ffi::AnyBuffer> o3, int64_t fp8, int64_t scale_kind, int64_t row_block,
                            int64_t col_block, int64_t tile_block, bool pow2, float eps) {
  QuantizeArgs a;
  if (auto e = make_quantize_args(x, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps, &a); e.failure())
    return e;
  if (a.B * a.M * a.K == 0) return ffi::Error::Success();
  uint8_t* d[2] = {static_cast<uint8_t*>(o0->untyped_data()), static_cast<uint8_t*>(o2->untyped_data())};
  void* s[2] = {o1->untyped_data(), o3->untyped_data()};
  const void* none[2] = {nullptr, nullptr};
  const Span sp{a.M, a.K, 0, 0, 0, a.M * a.K, nullptr, nullptr, false};
  if (auto e = run_tiles<kQuantize>(stream, a, x.untyped_data(), sp, d, s, none); e.failure()) return e;
  return check_launch();
}


__global__ void scale_inv_kernel(const float* __restrict__ amax, float* __restrict__ scale_inv, int64_t n,
                                 BlockRule rule) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i < n) {
    float mult;
    rule(amax[i], scale_inv[i], mult);
  }
}

ffi::Error PartialAmaxCudaImpl(cudaStream_t stream, ffi::AnyBuffer shard, ffi::AnyBuffer offset, ffi::AnyBuffer length,
                               ffi::Result<ffi::AnyBuffer> o0, ffi::Result<ffi::AnyBuffer> o1, int64_t M, int64_t K,
                               int64_t fp8, int64_t scale_kind, int64_t row_block, int64_t col_block,
                               int64_t tile_block) {
  QuantizeArgs a;
  int64_t L_;
  if (auto e = make_shard_args(shard, offset, length, M, K, fp8, scale_kind, row_block, col_block, tile_block, false,
                               0.0f, &a, &L_);
      e.failure())
    return e;
  uint8_t* d[2] = {nullptr, nullptr};
  void* s[2] = {o0->untyped_data(), o1->untyped_data()};
  const void* none[2] = {nullptr, nullptr};
  // blocks outside the launched tiles hold none of the shard: partial value 0 (E8M0 0 / amax 0.0)
  const size_t item = a.scale_kind == kScaleE8M0 ? 1 : 4;
  Usage u[2];
  const int n_usages = usages_of(a, u);
  for (int i = 0; i < n_usages; ++i) cudaMemsetAsync(s[i], 0, u[i].blocks(a) * item, stream);
  if (a.M * a.K == 0) return check_launch();
  const Span sp{a.M, a.K, 0, 0, 0, L_, static_cast<const int32_t*>(offset.untyped_data()),
                static_cast<const int32_t*>(length.untyped_data()), false};
  if (auto e = run_tiles<kAmax>(stream, a, shard.untyped_data(), sp, d, s, none); e.failure()) return e;
  return check_launch();
}

ffi::Error PartialCastCudaImpl(cudaStream_t stream, ffi::AnyBuffer shard, ffi::AnyBuffer offset, ffi::AnyBuffer length,
                               ffi::AnyBuffer g0, ffi::AnyBuffer g1, ffi::Result<ffi::AnyBuffer> d0,
                               ffi::Result<ffi::AnyBuffer> d1, ffi::Result<ffi::AnyBuffer> s0,
                               ffi::Result<ffi::AnyBuffer> s1, int64_t M, int64_t K, int64_t fp8, int64_t scale_kind,
                               int64_t row_block, int64_t col_block, int64_t tile_block, bool pow2, float eps) {
  QuantizeArgs a;
  int64_t L_;
  if (auto e = make_shard_args(shard, offset, length, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2,
                               eps, &a, &L_);
      e.failure())
    return e;
  uint8_t* d[2] = {static_cast<uint8_t*>(d0->untyped_data()), static_cast<uint8_t*>(d1->untyped_data())};
  void* s[2] = {s0->untyped_data(), s1->untyped_data()};
  const void* global[2] = {g0.untyped_data(), g1.untyped_data()};
  Usage u[2];
  const int n_usages = usages_of(a, u);
  for (int i = 0; i < n_usages; ++i)  // padding past the shard's elements reads as zeros
    if (L_ > 0) cudaMemsetAsync(d[i], 0, L_, stream);
  if (a.scale_kind == kScaleFp32) {  // every rank derives the same scale_inv grids from the global amaxes
    const BlockRule rule{a.fp8, a.pow2, a.eps, a.inf_value};
    for (int i = 0; i < n_usages; ++i) {
      const int64_t n = u[i].blocks(a);
      if (n > 0)
        scale_inv_kernel<<<unsigned(cdiv(n, kThreads)), kThreads, 0, stream>>>(
            static_cast<const float*>(global[i]), static_cast<float*>(s[i]), n, rule);
    }
  }
  if (a.M * a.K == 0) return check_launch();
  const Span sp{a.M, a.K, 0, 0, 0, L_, static_cast<const int32_t*>(offset.untyped_data()),
                static_cast<const int32_t*>(length.untyped_data()), false};
  if (auto e = run_tiles<kCast>(stream, a, shard.untyped_data(), sp, d, s, global); e.failure()) return e;
  return check_launch();
}

// ---- dequantize: 8 elements per thread, one scale per vector unless blocks are 1 column wide ----
struct StoreF32 {
  using T = float;
  __device__ static void store(T* out, int64_t i, const float (&y)[8], bool full) {
    if (full) {
      float4* o = reinterpret_cast<float4*>(out + i);
      o[0] = make_float4(canonical_f32(y[0]), canonical_f32(y[1]), canonical_f32(y[2]), canonical_f32(y[3]));
      o[1] = make_float4(canonical_f32(y[4]), canonical_f32(y[5]), canonical_f32(y[6]), canonical_f32(y[7]));
    }
  }
  __device__ static void store1(T* out, int64_t i, float y) { out[i] = canonical_f32(y); }
};
template <bool kHalf>
struct Store16 {
  using T = uint16_t;
  __device__ static uint16_t conv(float y) { return kHalf ? f16_from_float(y) : bf16_from_float(y); }
  __device__ static void store(T* out, int64_t i, const float (&y)[8], bool full) {
    if (full) {
      uint32_t w[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) w[p] = conv(y[2 * p]) | (uint32_t(conv(y[2 * p + 1])) << 16);
      *reinterpret_cast<uint4*>(out + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __device__ static void store1(T* out, int64_t i, float y) { out[i] = conv(y); }
};

// Exact FP8 decode of two bytes through the hardware's fp8x2 -> half2 conversion.
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t two, int fp8) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, fp8 == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// grid.x walks 8-element column vectors, grid.y (strided) the B*M rows; block sizes are powers of two,
// so block indices are shifts (no 64-bit division per element).
template <class Rule, class St>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ d, const typename Rule::ScaleT* __restrict__ s, int64_t B, int64_t M,
                      int64_t K, int bm_log2, int bk_log2, int fp8, bool aligned, typename St::T* __restrict__ out) {
  const int64_t col0 = (blockIdx.x * int64_t(kThreads) + threadIdx.x) * 8;
  if (col0 >= K) return;
  const int64_t sm = cdiv(M, int64_t(1) << bm_log2), sk = cdiv(K, int64_t(1) << bk_log2);
  const bool full = aligned && col0 + 8 <= K;
#pragma unroll 4
  for (int64_t rr = blockIdx.y; rr < B * M; rr += gridDim.y) {
    const int64_t b = B == 1 ? 0 : rr / M, r = rr - b * M;
    const typename Rule::ScaleT* srow = s + (b * sm + (r >> bm_log2)) * sk;
    const int64_t base = rr * K;
    if (full) {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(d + base + col0));
      float y[8];
      const float one = Rule::dequant_scale(srow[col0 >> bk_log2]);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 f = fp8x2_to_float2(uint16_t(((p < 2 ? raw.x : raw.y) >> (16 * (p % 2))) & 0xFFFFu), fp8);
        y[2 * p] = f.x * (bk_log2 == 0 ? Rule::dequant_scale(srow[col0 + 2 * p]) : one);
        y[2 * p + 1] = f.y * (bk_log2 == 0 ? Rule::dequant_scale(srow[col0 + 2 * p + 1]) : one);
      }
      St::store(out, base + col0, y, true);
    } else {
      for (int e = 0; e < 8 && col0 + e < K; ++e)
        St::store1(out, base + col0 + e,
                   fp8_to_float(d[base + col0 + e], fp8) * Rule::dequant_scale(srow[(col0 + e) >> bk_log2]));
    }
  }
}

template <class Rule, class St>
void launch_dequantize(cudaStream_t st, const void* d, const void* s, void* out, int64_t B, int64_t M, int64_t K,
                       int bm, int bk, int fp8) {
  // Enough CTAs to fill the chip a few times over; each thread then walks many rows, unrolled so that
  // several rows' loads are in flight at once.
  const int64_t gx = cdiv(cdiv(K, 8), kThreads);
  const dim3 grid(unsigned(gx), unsigned(std::min<int64_t>(B * M, std::max<int64_t>(1, 132 * 16 / gx))));
  const bool aligned = K % 8 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0;
  dequantize_kernel<Rule, St><<<grid, kThreads, 0, st>>>(
      static_cast<const uint8_t*>(d), static_cast<const typename Rule::ScaleT*>(s), B, M, K, __builtin_ctz(bm),
      __builtin_ctz(bk), fp8, aligned, static_cast<typename St::T*>(out));
}

template <class Rule>
ffi::Error dequantize_rule(cudaStream_t st, const void* d, const void* s, ffi::Result<ffi::AnyBuffer>& out, int64_t B,
                           int64_t M, int64_t K, int bm, int bk, int fp8) {
  void* o = out->untyped_data();
  switch (out->element_type()) {
    case ffi::DataType::F32: launch_dequantize<Rule, StoreF32>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    case ffi::DataType::BF16: launch_dequantize<Rule, Store16<false>>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    case ffi::DataType::F16: launch_dequantize<Rule, Store16<true>>(st, d, s, o, B, M, K, bm, bk, fp8); break;
    default: return bad("dequantize output must be float32, bfloat16 or float16");
  }
  return check_launch();
}

ffi::Error DequantizeCudaImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                              ffi::Result<ffi::AnyBuffer> out, int64_t fp8, int64_t block_m, int64_t block_k) {
  int64_t B, M, K;
  if (auto e = dims3(data, &B, &M, &K); e.failure()) return e;
  const auto pow2 = [](int64_t v) { return v >= 1 && (v & (v - 1)) == 0; };
  if (!pow2(block_m) || !pow2(block_k) || (block_k != 1 && block_k % 8 != 0)) return bad("unsupported block size");
  if (B * M * K == 0) return ffi::Error::Success();
  if (scale.element_type() == ffi::DataType::U8)
    return dequantize_rule<MxRule>(stream, data.untyped_data(), scale.untyped_data(), out, B, M, K, int(block_m),
                                   int(block_k), int(fp8));
  if (scale.element_type() == ffi::DataType::F32)
    return dequantize_rule<BlockRule>(stream, data.untyped_data(), scale.untyped_data(), out, B, M, K, int(block_m),
                                      int(block_k), int(fp8));
  return bad("scales must be uint8 (E8M0) or float32");
}

}  // namespace
}  // namespace jf

namespace ffi = xla::ffi;
#define JF_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQuantizeCuda, jf::QuantizeCudaImpl, JF_BIND_QUANTIZE(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfDequantizeCuda, jf::DequantizeCudaImpl, JF_BIND_DEQUANTIZE(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfPartialAmaxCuda, jf::PartialAmaxCudaImpl, JF_BIND_PARTIAL_AMAX(JF_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfPartialCastCuda, jf::PartialCastCudaImpl, JF_BIND_PARTIAL_CAST(JF_CUDA_BIND));

// Device-to-device copy (cudaMemcpyAsync): the benchmark's bandwidth roofline, not part of the API.
ffi::Error CopyCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  return jf::check_launch();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfCopyCuda, CopyCudaImpl,
                              JF_CUDA_BIND JF_ARG JF_RET);

NB_MODULE(_jax_fp8_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["jf_quantize"] = nanobind::capsule(reinterpret_cast<void*>(JfQuantizeCuda));
    d["jf_dequantize"] = nanobind::capsule(reinterpret_cast<void*>(JfDequantizeCuda));
    d["jf_partial_amax"] = nanobind::capsule(reinterpret_cast<void*>(JfPartialAmaxCuda));
    d["jf_partial_cast"] = nanobind::capsule(reinterpret_cast<void*>(JfPartialCastCuda));
    d["jf_device_copy"] = nanobind::capsule(reinterpret_cast<void*>(JfCopyCuda));
    return d;
  });
}
