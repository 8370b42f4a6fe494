// Kernel-level benchmark of the CUDA quantize/dequantize kernels, without Python or XLA: CUDA-event
// timing of many back-to-back launches over three rotating inputs (so L2 holds none of them), median
// of several runs, against a device-to-device cudaMemcpy. Used to choose the kernels' launch
// configuration (registers per thread, dequantize unroll and grid); bench_kernels.py times the
// shipped configuration through JAX against the XLA-fused reference.
// Before timing, every configuration is checked bit for bit against a host loop over the shared
// per-block math (fp8_math.h) on an odd-shaped input.
//
//   bash bench/build_kernel_bench.sh && bench/.bin/kernel_bench [M K [FILTER]]   (default 32768 16384)
// FILTER runs only the quantize cases whose names contain it ("dequant": dequantize and the traffic
// ceilings), e.g. to profile one kernel: ncu -k regex:tile_kernel --launch-skip 2 --launch-count 1 ...
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dequantize.cuh"
#include "quantize_dense.cuh"
#include "quantize_shards.cuh"

using namespace jf;

#define CUDA_OK(x)                                                                \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// bf16 test data: random sign, mantissa and exponent in [2^-8, 2^8], so blocks get varied scales.
__global__ void fill_bf16(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed ^ uint32_t(i >> 32) * 0x85EBCA77u;
    h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; h *= 0x297A2D39u; h ^= h >> 15;
    x[i] = uint16_t(((h >> 31) << 15) | ((127 - 8 + (h >> 8) % 17) << 7) | (h & 0x7Fu));
  }
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  ~Buf() { cudaFree(p); }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

// Median over `reps` runs of the mean time of `iters` back-to-back launches (CUDA events), in us.
double time_us(const std::function<void(int)>& launch, int iters = 30, int reps = 7) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) launch(i);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) launch(i % 3);
    cudaEventRecord(b);
    CUDA_OK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(1000.0 * ms / iters);
  }
  CUDA_OK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Bandwidth ceilings for unbalanced traffic: 16 bytes read and 32 written per chunk (WIDEN, as
// dequantize to bf16 moves them), or 32 read and 16 written (as quantize from bf16), with no math.
// U chunks per thread (a CTA's U x 256 chunks contiguous); STREAM: stores that bypass L2 retention.
template <bool WIDEN, int U = 1, bool STREAM = false>
__global__ void traffic_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t i = (blockIdx.x * int64_t(U) + u) * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    if constexpr (WIDEN) {
      const uint4 v = __ldg(in + i), w = make_uint4(v.w, v.z, v.y, v.x);
      if constexpr (STREAM) __stcs(out + 2 * i, v), __stcs(out + 2 * i + 1, w);
      else out[2 * i] = v, out[2 * i + 1] = w;
    } else {
      const uint4 a = __ldg(in + 2 * i), b = __ldg(in + 2 * i + 1);
      out[i] = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
    }
  }
}

// Dequantize's traffic with every store instruction writing 512 contiguous bytes: a thread reads 8
// bytes and writes them widened to 16 at the same index (traffic_kernel<true>'s two 16-byte stores a
// thread half-fill each instruction's sectors).
__global__ void widen_coalesced_kernel(const uint2* __restrict__ in, uint4* __restrict__ out, int64_t chunks) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= chunks) return;
  const uint2 v = __ldg(in + i);
  out[i] = make_uint4(v.x, v.y, v.y, v.x);
}

// The traffic of quantizing to two usages (1x128 + 128x1: 2n bytes read, n + n written to two
// outputs), or a copy kernel's (TWO false: 2n read, 2n written to one output), with no math.
template <bool TWO>
__global__ void balanced_kernel(const uint4* __restrict__ in, uint4* __restrict__ o1, uint4* __restrict__ o2,
                                int64_t chunks) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= chunks) return;
  const uint4 a = __ldg(in + 2 * i), b = __ldg(in + 2 * i + 1);
  if constexpr (TWO) o1[i] = a, o2[i] = b;
  else o1[2 * i] = a, o1[2 * i + 1] = b;
}

// The memory access pattern of the GEMM-ready 1x128 + 128x1T kernel with none of its math: a CTA
// reads a 128x128 bf16 tile as that kernel does (thread (c, g): 16-byte vectors of rows 8g..8g+7),
// writes the elements' low bytes rowwise and, transposed through shared memory, columnwise (K, M).
// It reproduces the kernel's global-memory accesses, not its shared-memory swizzle (a plain XOR
// here). Dense, K and M multiples of 128. T false: the columnwise output stored as the rowwise one
// is (compact 1x128 + 128x1's pattern).
// The writes of tile (tm, tk) from thread (c, g)'s vectors v; st: the CTA's 16 KB transpose stage.
template <bool T>
__device__ __forceinline__ void tile_traffic_writes(const uint4 (&v)[8], uint8_t* __restrict__ o1,
                                                    uint8_t* __restrict__ o2, uint32_t* st, int64_t M, int64_t K,
                                                    int64_t tm, int64_t tk) {
  const int tid = threadIdx.x, c = tid % 16, g = tid / 16;
  uint32_t rows[8][2];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    rows[i][0] = __byte_perm(v[i].x, v[i].y, 0x6420), rows[i][1] = __byte_perm(v[i].z, v[i].w, 0x6420);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    *reinterpret_cast<uint2*>(o1 + (tm * 128 + g * 8 + i) * K + tk * 128 + c * 8) = make_uint2(rows[i][0], rows[i][1]);
  if constexpr (!T) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<uint2*>(o2 + (tm * 128 + g * 8 + i) * K + tk * 128 + c * 8) =
          make_uint2(rows[i][1], rows[i][0]);
    return;
  }
  // column col's word w (rows 4w..4w+3) at st[col*32 + (w ^ col%32)]
#pragma unroll
  for (int i = 0; i < 8; i += 4)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t o[4];
      jf::transpose4x4(rows[i][q], rows[i + 1][q], rows[i + 2][q], rows[i + 3][q], o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = c * 8 + 4 * q + e, w = (g * 8 + i) / 4;
        st[col * 32 + (w ^ (col & 31))] = o[e];
      }
    }
  __syncthreads();
#pragma unroll
  for (int k = tid; k < 128 * 8; k += 256) {
    const int col = k / 8, piece = k % 8;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = st[col * 32 + ((piece * 4 + j) ^ (col & 31))];
    *reinterpret_cast<uint4*>(o2 + (tk * 128 + col) * M + tm * 128 + piece * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Tile order: the shipped kernels' tile_pos, in groups of sp.group tile rows (a dense span planned by
// plan_tiles). SCALES: also the tile's 128 + 128 fp32 scales where the shipped kernels store them
// (into sc): the 1x128 scales at a stride of K/128 words in the compact grid (M, K/128), contiguous in
// the GEMM-ready (K/128, M); the 128x1 scales contiguous in both. SCALES 0: none; 1: as shipped, with
// plain stores (no L2 policy); 2, 4, 8: see below.
template <bool T = true, int SCALES = 0>
__global__ void __launch_bounds__(256) tiled_traffic_kernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ o1,
                                                            uint8_t* __restrict__ o2, Span sp, float* sc = nullptr) {
  __shared__ __align__(16) uint32_t st[128 * 32];
  const int64_t M = sp.M, K = sp.K;
  const TilePos p = tile_pos(blockIdx.x, sp, Window{});
  const int64_t tm = p.tm, tk = p.tk;
  const int tid = threadIdx.x, c = tid % 16, g = tid / 16;
  uint4 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    v[i] = __ldg(reinterpret_cast<const uint4*>(x + (tm * 128 + g * 8 + i) * K + tk * 128 + c * 8));
  tile_traffic_writes<T>(v, o1, o2, st, M, K, tm, tk);
  if constexpr (SCALES > 0) {
    const float one = __uint_as_float(v[0].x & 0x3F800000u);  // some value the compiler cannot drop
    if (tid >= 128) {
      sc[M * (K / 128) + tm * K + tk * 128 + tid - 128] = one;  // 128x1: contiguous in both layouts
    } else if constexpr (SCALES == 1) {
      sc[T ? tk * M + tm * 128 + tid : (tm * 128 + tid) * (K / 128) + tk] = one;
    } else if (tk % SCALES == 0) {  // compact 1x128 scales as if gathered: every SCALES-th tile writes
                                    // SCALES words a row (run 62: fewer, wider stores still cost)
      float* d = sc + (tm * 128 + tid) * (K / 128) + tk;
      if constexpr (SCALES == 2) {
        *reinterpret_cast<float2*>(d) = make_float2(one, one);
      } else {
#pragma unroll
        for (int q = 0; q < SCALES; q += 4) reinterpret_cast<float4*>(d)[q / 4] = make_float4(one, one, one, one);
      }
    }
  }
}

// The same writes, the tiles read by the copy engine instead: persistent CTAs, each fetching its
// tiles' 128 rows of 256 bytes with bulk asynchronous copies (cp.async.bulk, completing on an
// mbarrier) into S shared-memory stages, S - 1 tiles ahead of the one it writes, so the loads stay
// in flight without registers. Dynamic shared memory: S x 32 KB of stages, then the transpose stage.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

template <int S>
__global__ void __launch_bounds__(256) bulk_tiled_traffic_kernel(const uint16_t* __restrict__ x,
                                                                 uint8_t* __restrict__ o1, uint8_t* __restrict__ o2,
                                                                 int64_t M, int64_t K) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[S];
  uint32_t* st = reinterpret_cast<uint32_t*>(smem + S * 32768);
  const int64_t nk = K / 128, tiles = M / 128 * nk;
  const int tid = threadIdx.x, c = tid % 16, g = tid / 16;
  if (tid < S) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[tid])));
  if (tid == 0) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  // warp 0 fetches tile t into stage s: lane 0 sets the byte count, each lane copies 4 rows
  const auto fetch = [&](int64_t t, int s) {
    if (tid >= 32 || t >= tiles) return;
    const int64_t tm = t / nk, tk = t % nk;
    const uint32_t bar = smem_addr(&full[s]);
    if (tid == 0)
      asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], 32768; }" ::"r"(bar)
                   : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = tid + 32 * j;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];" ::"r"(
              smem_addr(smem + s * 32768 + r * 256)),
          "l"(x + (tm * 128 + r) * K + tk * 128), "r"(bar)
          : "memory");
    }
  };
  const int64_t step = gridDim.x;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) fetch(blockIdx.x + s * step, s);
  int i = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += step, ++i) {
    const int s = i % S;
    fetch(t + (S - 1) * step, (i + S - 1) % S);
    const uint32_t bar = smem_addr(&full[s]), parity = (i / S) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = *reinterpret_cast<const uint4*>(smem + s * 32768 + (g * 8 + k) * 256 + c * 16);
    tile_traffic_writes<true>(v, o1, o2, st, M, K, t / nk, t % nk);
    __syncthreads();  // the stage and the transpose stage are free again
  }
}

// Output pointers (data, scale) for up to two usages, and buffers that own them.
struct OutPtrs {
  uint8_t* d0;
  void* s0;
  uint8_t* d1;
  void* s1;
};
struct Outputs {
  Buf d0, s0, d1, s1;
  Outputs(int64_t n, int64_t s0n, int64_t s1n, size_t item) : d0(n), s0(s0n * item), d1(n), s1(s1n * item) {}
  OutPtrs ptrs() const { return {d0.as<uint8_t>(), s0.p, d1.as<uint8_t>(), s1.p}; }
};

using Launch = std::function<void(const QuantizeArgs&, const void*, const Span&, const OutPtrs&)>;

// MINB: a register cap (CTAs per SM) other than the shipped one (0: min_blocks_for's).
template <class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MINB = 0>
Launch quantize_cfg() {
  return [](const QuantizeArgs& a, const void* x, const Span& sp, const OutPtrs& o) {
    using S = typename Rule::ScaleT;
    Rule rule;
    if constexpr (std::is_same_v<Rule, MxRule>) rule = MxRule{a.fp8};
    else rule = BlockRule{a.fp8, false, 0.0f, 3.38953139e38f};
    Outs<S> r{o.d0, static_cast<S*>(o.s0), nullptr};
    Outs<S> c{o.d1, static_cast<S*>(o.s1), nullptr};
    if (!RBK && !TILE) c = r;  // a single columnwise usage comes first
    using C = TileCfg<Rule, TM, TK, RBK, COL, TILE>;
    // (no rowwise usage: RBK 0; a 1-wide grid then, never a division by zero, which GCC turned into a
    // trap: the "Illegal instruction" of runs 24-25)
    const ScaleAt r_at = compact_scale_at(sp.M, sp.K, TILE ? TM : 1, TILE ? TK : (RBK ? RBK : 1));
    const ScaleAt c_at = compact_scale_at(sp.M, sp.K, TM, 1);
    if constexpr (MINB > 0) launch_tiles<LoadBF16, C, MINB>(nullptr, a, x, sp, rule, r, c, r_at, c_at);
    else launch_tiles<LoadBF16, C>(nullptr, a, x, sp, rule, r, c, r_at, c_at);
  };
}

struct Case {
  std::string name;
  bool mx;
  int row_bk, col_bm, tile;  // usages: 1 x row_bk, col_bm x 1, tile x tile (0: absent)
  Launch launch;
  bool gemm_ready = false;   // columnwise data transposed (a tile: both orientations); Float8 scales in GEMM order
  int group = 1;             // tile order: groups of this many tile rows (Span::group)
};

// GEMM-ready cases: the shipped dispatch (quantize_tiles) or, with MINB > 0, its tile configuration
// Cfg at another register cap.
template <class Cfg = void, int MINB = 0>
Launch gemm_ready_cfg() {
  return [](const QuantizeArgs& a, const void* x, const Span& sp, const OutPtrs& o) {
    uint8_t* d[2] = {o.d0, o.d1};
    void* s[2] = {o.s0, o.s1};
    if constexpr (MINB == 0) {
      quantize_tiles(nullptr, a, x, d, s);
    } else {
      using S = typename Cfg::S;
      using Rule = typename Cfg::Rule;
      Rule rule;
      if constexpr (std::is_same_v<Rule, MxRule>) rule = MxRule{a.fp8};
      else rule = BlockRule{a.fp8, false, 0.0f, 3.38953139e38f};
      Outs<S> row, col;
      ScaleAt row_at, col_at;
      tile_outputs(a, d, s, row, col, row_at, col_at);
      launch_tiles<LoadBF16, Cfg, MINB>(nullptr, a, x, sp, rule, row, col, row_at, col_at);
    }
  };
}

// Host reference of one usage: bm x bk blocks through the shared rule and the software cast.
template <class Rule>
void host_usage(const std::vector<uint16_t>& x, int64_t M, int64_t K, int bm, int bk, const Rule& rule, int fp8,
                std::vector<uint8_t>& data, std::vector<typename Rule::ScaleT>& scale) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  data.assign(M * K, 0);
  scale.assign(sm * sk, 0);
  for (int64_t bi = 0; bi < sm; ++bi)
    for (int64_t bj = 0; bj < sk; ++bj) {
      float amax = 0.0f;
      for (int64_t r = bi * bm; r < std::min(M, (bi + 1) * bm); ++r)
        for (int64_t c = bj * bk; c < std::min(K, (bj + 1) * bk); ++c)
          amax = amax_step(amax, bf16_to_float(x[r * K + c]));
      float mult;
      rule(amax, scale[bi * sk + bj], mult);
      for (int64_t r = bi * bm; r < std::min(M, (bi + 1) * bm); ++r)
        for (int64_t c = bj * bk; c < std::min(K, (bj + 1) * bk); ++c)
          data[r * K + c] = fp8_from_float_sw(bf16_to_float(x[r * K + c]) * mult, fp8);
    }
}

template <class T>
bool same(const Buf& dev, const std::vector<T>& host) {
  std::vector<T> got(host.size());
  CUDA_OK(cudaMemcpy(got.data(), dev.p, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return std::memcmp(got.data(), host.data(), host.size() * sizeof(T)) == 0;
}

// E4M3, bf16 input of (1, M, K); E8M0 scales when mx, else fp32 (pow2 off, eps 0); usages as given.
QuantizeArgs bf16_args(bool mx, int row_bk, int col_bm, int tile, int64_t M, int64_t K) {
  QuantizeArgs a;
  static_cast<Scheme&>(a) = Scheme{kE4M3, mx, row_bk, col_bm, tile, false, 0.0f};
  a.in = InType::kBF16;
  a.B = 1;
  a.M = M;
  a.K = K;
  a.inf_value = 3.38953139e38f;
  return a;
}
QuantizeArgs args_of(const Case& c, int64_t M, int64_t K) {
  QuantizeArgs a = bf16_args(c.mx, c.row_bk, c.col_bm, c.tile, M, K);
  a.gemm_ready = c.gemm_ready;
  a.tile_rows = a.tile_cols = c.gemm_ready && c.tile;  // GEMM-ready tiles: both orientations
  return a;
}

// ---- bench-only variants of the master-weight shard launch --------------------------------------
// The shipped launch (quantize_shards.cuh) runs fill CTAs first at min_blocks_for's register cap. These
// time one MXFP8 row+col job with another cap (MINB), the fill CTAs last (FILL_LAST), or only part of
// its CTAs (to time the fill and the tiles apart).
using MxRowCol = TileCfg<MxRule, 32, 256, 32, true, false>;
enum class Part { kAll, kTiles, kFill };

template <int MODE, int MINB, bool FILL_LAST>
__global__ void __launch_bounds__(kThreads, MINB)
    bench_shard_kernel(const __grid_constant__ ShardGroup<uint8_t> grp, const MxRule rule, int fp8) {
  const ShardJob<uint8_t>& jb = grp.job[0];
  const uint32_t t = blockIdx.x;
  const uint32_t f = FILL_LAST ? t - jb.n_tiles : t;  // fill CTA index (wraps when not a fill CTA)
  if (f < jb.n_fill)
    fill_outside_walk<MxRowCol, MODE>(jb, rule, int64_t(f) * kThreads + threadIdx.x, int64_t(jb.n_fill) * kThreads);
  else
    quantize_tile<LoadBF16, MxRowCol, MODE>(static_cast<const uint16_t*>(jb.x), jb.sp, rule, fp8, jb.row, jb.col,
                                            compact_scale_at(jb.sp.M, jb.sp.K, 1, 32),
                                            compact_scale_at(jb.sp.M, jb.sp.K, 32, 1), FILL_LAST ? t : t - jb.n_fill);
}

// One bf16 MXFP8 row+col shard job, all or part of its CTAs; MINB 0: the shipped launch_shards.
template <int MODE, int MINB = 0, bool FILL_LAST = false>
void launch_one_shard(const QuantizeArgs& a, const ShardIO& io, Part part = Part::kAll) {
  if (MINB == 0 && !FILL_LAST && part == Part::kAll) {
    launch_shards<MODE>(nullptr, a, &io, 1);
    return;
  }
  ShardGroup<uint8_t> grp;
  grp.n = 1;
  shard_job<LoadBF16, MxRowCol, MODE>(io, &grp.job[0]);
  if (part == Part::kFill) grp.job[0].n_tiles = 0;
  if (part == Part::kTiles) grp.job[0].n_fill = 0;
  const unsigned ctas = grp.job[0].n_tiles + grp.job[0].n_fill;
  constexpr int B = MINB ? MINB : min_blocks_for<LoadBF16, MxRule, true, MODE, true>();
  if (ctas) bench_shard_kernel<MODE, B, FILL_LAST><<<ctas, kThreads>>>(grp, MxRule{a.fp8}, a.fp8);
}

// Each output of the case against the host reference on an odd-shaped input: the data (transposed
// for a transposed output), every block's scale where the output's layout keeps it, and the padding.
bool check(const Case& c) {
  const int64_t M = 1000, K = 1064;
  std::vector<uint16_t> hx(M * K);
  Buf x(M * K * 2);
  fill_bf16<<<64, 256>>>(x.as<uint16_t>(), M * K, 7);
  CUDA_OK(cudaMemcpy(hx.data(), x.p, M * K * 2, cudaMemcpyDeviceToHost));
  const size_t item = c.mx ? 1 : 4;
  Outputs o(M * K, 2 * M * K, 2 * M * K, item);  // room for padded GEMM-ready grids
  const QuantizeArgs a = args_of(c, M, K);
  c.launch(a, x.p, dense_span(M, K, c.group), o.ptrs());
  CUDA_OK(cudaDeviceSynchronize());
  OutLayout lay[2];
  const int n = outputs_of(a, lay);
  bool ok = true;
  for (int k = 0; k < n; ++k) {
    const OutLayout& l = lay[k];
    const Buf& d = k == 0 ? o.d0 : o.d1;
    const Buf& s = k == 0 ? o.s0 : o.s1;
    std::vector<uint8_t> data, want(M * K);
    const int64_t sm = cdiv(M, l.bm), sk = cdiv(K, l.bk);
    std::vector<float> scale;  // the host scales as float (E8M0 bytes widened)
    if (c.mx) {
      std::vector<uint8_t> sc;
      host_usage(hx, M, K, l.bm, l.bk, MxRule{kE4M3}, kE4M3, data, sc);
      scale.assign(sc.begin(), sc.end());
    } else {
      host_usage(hx, M, K, l.bm, l.bk, BlockRule{kE4M3, false, 0.0f, 3.38953139e38f}, kE4M3, data, scale);
    }
    for (int64_t r = 0; r < M; ++r)
      for (int64_t q = 0; q < K; ++q) want[l.transposed ? q * M + r : r * K + q] = data[r * K + q];
    ok = ok && same(d, want);
    const int64_t n_stored = std::max(sm * sk, l.pad_rows * l.ld);
    std::vector<uint8_t> raw(n_stored * item);
    CUDA_OK(cudaMemcpy(raw.data(), s.p, raw.size(), cudaMemcpyDeviceToHost));
    const auto at = [&](int64_t idx) {
      if (c.mx) return float(raw[idx]);
      float f;
      std::memcpy(&f, &raw[idx * 4], 4);
      return f;
    };
    for (int64_t i = 0; i < sm; ++i)
      for (int64_t j = 0; j < sk; ++j) ok = ok && at(i * l.s_row + j * l.s_col) == scale[i * sk + j];
    for (int64_t r = 0; r < l.pad_rows; ++r)
      for (int64_t q = l.pad_from; q < l.ld; ++q) ok = ok && at(r * l.ld + q) == kGemmScalePad;
  }
  return ok;
}

int main(int argc, char** argv) {
  const int64_t M = argc > 2 ? std::atoll(argv[1]) : 32768, K = argc > 2 ? std::atoll(argv[2]) : 16384;
  // a third argument: run only the cases whose names contain it (for profiling one kernel)
  const std::string only = argc > 3 ? argv[3] : "";
  const int64_t n = M * K;
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; bf16 %lldx%lld\n", prop.name, prop.multiProcessorCount, (long long)M, (long long)K);
  std::vector<Buf*> xs;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(new Buf(n * 2));
    fill_bf16<<<1024, 256>>>(xs[i]->as<uint16_t>(), n, 1234u + i);
  }
  Buf copy_out(n * 2);
  const double t_copy = time_us([&](int i) {
    cudaMemcpyAsync(copy_out.p, xs[i]->p, n * 2, cudaMemcpyDeviceToDevice);
  });
  const double copy_gbs = 2.0 * n * 2 / t_copy / 1e3;
  std::printf("%-34s %9s %8s %7s\n", "kernel", "us", "GB/s", "%copy");
  std::printf("%-34s %9.1f %8.0f %7.1f\n", "cudaMemcpy d2d", t_copy, copy_gbs, 100.0);
  const auto report = [&](const std::string& name, double us, double bytes, const char* exact) {
    const double gbs = bytes / us / 1e3;
    std::printf("%-34s %9.1f %8.0f %7.1f  %s\n", name.c_str(), us, gbs, 100.0 * gbs / copy_gbs, exact);
  };

#define CFG(name, mx, rb, cb, tile, Rule, TM, TK, ...) \
  Case{name, mx, rb, cb, tile, quantize_cfg<Rule, TM, TK, rb, cb != 0, tile != 0, ##__VA_ARGS__>()}
#define GR(name, mx, rb, cb, tile, ...) Case{name, mx, rb, cb, tile, gemm_ready_cfg<__VA_ARGS__>(), true}
  std::vector<Case> cases = {
      CFG("mx row", true, 32, 0, 0, MxRule, 32, 256),
      CFG("mx row+col", true, 32, 32, 0, MxRule, 32, 256),
      CFG("mx col", true, 0, 32, 0, MxRule, 32, 256),
      CFG("f8 1x128", false, 128, 0, 0, BlockRule, 128, 128),
      CFG("f8 1x128+128x1", false, 128, 128, 0, BlockRule, 128, 128),
      CFG("f8 128x128", false, 0, 0, 128, BlockRule, 128, 128),
      // other register caps than the shipped ones (the packed amax needs fewer registers)
      CFG("mx row 5 CTAs/SM", true, 32, 0, 0, MxRule, 32, 256, 5),
      CFG("mx row+col 4 CTAs/SM", true, 32, 32, 0, MxRule, 32, 256, 4),
      CFG("mx col 4 CTAs/SM", true, 0, 32, 0, MxRule, 32, 256, 4),
      CFG("f8 1x128 2 CTAs/SM", false, 128, 0, 0, BlockRule, 128, 128, 2),
      CFG("f8 1x128+128x1 2 CTAs/SM", false, 128, 128, 0, BlockRule, 128, 128, 2),
      CFG("f8 1x128+128x1 4 CTAs/SM", false, 128, 128, 0, BlockRule, 128, 128, 4),
      CFG("f8 128x1", false, 0, 128, 0, BlockRule, 128, 128),
      CFG("f8 128x1 2 CTAs/SM", false, 0, 128, 0, BlockRule, 128, 128, 2),
      CFG("f8 128x128 2 CTAs/SM", false, 0, 0, 128, BlockRule, 128, 128, 2),
      // GEMM-ready (columnwise data transposed in the same pass): shipped, and other register caps
      GR("f8 1x128+128x1T", false, 128, 128, 0),
      GR("f8 128x128 both orientations", false, 0, 0, 128),
      GR("mx row+colT", true, 32, 32, 0),
      GR("f8 1x128+128x1T 2 CTAs/SM", false, 128, 128, 0, TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 2),
      GR("f8 128x128 both 2 CTAs/SM", false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>, 2),
      GR("mx row+colT 3 CTAs/SM", true, 32, 32, 0, TileCfg<MxRule, 32, 256, 32, true, false, true>, 3),
      GR("f8 1x128+128x1T 4 CTAs/SM", false, 128, 128, 0, TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 4),
      GR("f8 128x128 both 4 CTAs/SM", false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>, 4),
  };
  // two-usage kernels (shipped register caps) in tile orders of groups of G tile rows
  for (const int G : {1, 2, 4, 8}) {
    const std::string tail = " order G" + std::to_string(G);
    cases.push_back(CFG("f8 1x128+128x1" + tail, false, 128, 128, 0, BlockRule, 128, 128));
    cases.push_back(GR("f8 1x128+128x1T" + tail, false, 128, 128, 0,
                       TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 3));
    cases.push_back(GR("f8 128x128 both" + tail, false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>,
                       3));
    cases.push_back(GR("mx row+colT" + tail, true, 32, 32, 0, TileCfg<MxRule, 32, 256, 32, true, false, true>, 4));
    for (int k = 1; k <= 4; ++k) cases.end()[-k].group = G;
  }
  for (const Case& c : cases) {
    if (c.name.find(only) == std::string::npos) continue;
    const int64_t b = c.mx ? 32 : 128;
    const int64_t item = c.mx ? 1 : 4;
    // outputs: one per usage; GEMM-ready tiles write both orientations
    const int usages = (c.row_bk > 0) + (c.col_bm > 0) + (c.tile > 0) * (c.gemm_ready ? 2 : 1);
    const int64_t n_scales = c.tile ? n / (b * b) : n / b;
    // one set of outputs per input buffer, so that no launch finds the previous one's outputs (its
    // scales above all, stored with an L2 policy that keeps them) still in L2
    std::unique_ptr<Outputs> o[3];
    for (auto& oi : o) oi = std::make_unique<Outputs>(n, 2 * n_scales + 4096, 2 * n_scales + 4096, item);  // room for padded GEMM-ready grids
    const bool ok = check(c);
    const QuantizeArgs a = args_of(c, M, K);
    const double us = time_us([&](int i) { c.launch(a, xs[i]->p, dense_span(M, K, c.group), o[i]->ptrs()); });
    report(c.name, us,
           double(n) * 2 + usages * double(n + n_scales * item), ok ? "exact" : "MISMATCH");
  }

  // The rest runs without a filter; the filter "dequant" runs dequantize and the traffic ceilings only.
  const bool all = only.empty();
  if (!all && only != "dequant") return 0;

  // Many small weights (launch overhead on the GPU side, no host dispatch): 64 launches on separate
  // 1024x1024 tensors back to back against one launch on the same bytes stacked as (64*1024) x 1024,
  // whose outputs are identical (column blocks of 32 rows never cross a 1024-row boundary).
  if (n >= 64 * 1024 * 1024 && all) {
    const int64_t T = 64, m = 1024, k = 1024;
    const Case& c = cases[1];  // mx row+col
    Outputs o(T * m * k, T * m * k / 32, T * m * k / 32, 1);
    const QuantizeArgs one = args_of(c, m, k), all = args_of(c, T * m, k);
    const OutPtrs op = o.ptrs();
    const double t_many = time_us([&](int i) {
      for (int64_t j = 0; j < T; ++j) {
        const OutPtrs v{op.d0 + j * m * k, static_cast<uint8_t*>(op.s0) + j * m * k / 32, op.d1 + j * m * k,
                        static_cast<uint8_t*>(op.s1) + j * m * k / 32};
        c.launch(one, xs[i]->as<uint16_t>() + j * m * k, dense_span(m, k), v);
      }
    });
    const double t_one = time_us([&](int i) { c.launch(all, xs[i]->p, dense_span(T * m, k), op); });
    std::printf("%lld launches of mx row+col on 1024x1024: %.1f us (%.2f us per tensor); one launch on the "
                "%lldx1024 stack: %.1f us (%.2f us per tensor)\n",
                (long long)T, t_many, t_many / T, (long long)(T * m), t_one, t_one / T);
  }

  // Partial amax / cast of a master-weight shard: half the weight, from element n/4. The amax as
  // shipped (fill and tile CTAs in one launch) against the fill and the tiles as two launches, and
  // against the previous scheme (memsets of both grids, then the tiles); the first and last must agree.
  if (all) {
    const int64_t L = n / 2;
    Buf win(8);
    const int32_t hv[2] = {int32_t(n / 4), int32_t(L)};
    CUDA_OK(cudaMemcpy(win.p, hv, 8, cudaMemcpyHostToDevice));
    const QuantizeArgs a = bf16_args(true, 32, 32, 0, M, K);
    Outputs o(L, n / 32, n / 32, 1);
    const auto io = [&](int i, bool cast) {
      return ShardIO{xs[i]->p, L, M, K, win.as<int32_t>(),
                     {cast ? o.d0.as<uint8_t>() : nullptr, cast ? o.d1.as<uint8_t>() : nullptr},
                     {cast ? nullptr : o.s0.p, cast ? nullptr : o.s1.p},
                     {cast ? o.s0.p : nullptr, cast ? o.s1.p : nullptr}};
    };
    const auto amax = [&](int i, Part part) { launch_one_shard<kAmax>(a, io(i, false), part); };
    const auto memset_tiles = [&](int i) {
      cudaMemsetAsync(o.s0.p, 0, n / 32);
      cudaMemsetAsync(o.s1.p, 0, n / 32);
      amax(i, Part::kTiles);
    };
    const auto grids = [&] {
      std::vector<uint8_t> h(2 * (n / 32));
      CUDA_OK(cudaMemcpy(h.data(), o.s0.p, n / 32, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(h.data() + n / 32, o.s1.p, n / 32, cudaMemcpyDeviceToHost));
      return h;
    };
    memset_tiles(0);
    const std::vector<uint8_t> want = grids();
    CUDA_OK(cudaMemset(o.s0.p, 0xAB, n / 32));
    CUDA_OK(cudaMemset(o.s1.p, 0xAB, n / 32));
    amax(0, Part::kAll);
    const char* same_amax = grids() == want ? "same" : "MISMATCH";
    const double amax_bytes = double(L) * 2 + 2.0 * (n / 32);
    report("partial amax mx r+c (one launch)", time_us([&](int i) { amax(i, Part::kAll); }), amax_bytes, same_amax);
    report("partial amax: fill, tiles (two)", time_us([&](int i) {
             amax(i, Part::kFill);
             amax(i, Part::kTiles);
           }), amax_bytes, "-");
    report("partial amax: memsets + tiles", time_us(memset_tiles), amax_bytes, "-");
    report("partial amax: tiles alone", time_us([&](int i) { amax(i, Part::kTiles); }), amax_bytes, "-");
    // the shipped one-launch amax against other register caps (CTAs per SM) and the fill CTAs last
    const auto variant = [&](auto minb, auto fill_last) {
      constexpr int B = decltype(minb)::value;
      constexpr bool LAST = decltype(fill_last)::value;
      const auto go = [&](int i) { launch_one_shard<kAmax, B, LAST>(a, io(i, false)); };
      CUDA_OK(cudaMemset(o.s0.p, 0xAB, n / 32));
      CUDA_OK(cudaMemset(o.s1.p, 0xAB, n / 32));
      go(0);
      const char* same = grids() == want ? "same" : "MISMATCH";
      report("partial amax " + std::to_string(B) + " CTAs/SM, fill " + (LAST ? "last" : "first"), time_us(go),
             amax_bytes, same);
    };
    using std::integral_constant;
    variant(integral_constant<int, 4>{}, std::false_type{});
    variant(integral_constant<int, 5>{}, std::false_type{});
    variant(integral_constant<int, 6>{}, std::true_type{});
    const auto cast = [&](int i, Part part) { launch_one_shard<kCast>(a, io(i, true), part); };
    const double cast_bytes = double(L) * 2 + 2.0 * L + 2.0 * (n / 32);
    report("partial cast mx r+c (one launch)", time_us([&](int i) { cast(i, Part::kAll); }), cast_bytes, "-");
    report("partial cast: tiles alone", time_us([&](int i) { cast(i, Part::kTiles); }), cast_bytes, "-");
    report("partial cast 4 CTAs/SM", time_us([&](int i) { launch_one_shard<kCast, 4>(a, io(i, true)); }), cast_bytes,
           "-");
  }

  // Many small master weights: 64 weights of 1024x1024, a rank's 1/8 shard of each; one group launch
  // per 24 weights against one launch per weight (the same kernel, group of one).
  if (n >= 64 * 1024 * 1024 && all) {
    const int64_t T = 64, mk = 1024 * 1024, L = mk / 8;
    Buf win(8);
    const int32_t hv[2] = {int32_t(3 * L), int32_t(L)};
    CUDA_OK(cudaMemcpy(win.p, hv, 8, cudaMemcpyHostToDevice));
    const QuantizeArgs a = bf16_args(true, 32, 32, 0, 0, 0);
    Outputs o(T * L, T * mk / 32, T * mk / 32, 1);
    const auto ios = [&](int i, bool cast) {
      std::vector<ShardIO> v;
      for (int64_t j = 0; j < T; ++j) {
        uint8_t* s0 = o.s0.as<uint8_t>() + j * mk / 32;
        uint8_t* s1 = o.s1.as<uint8_t>() + j * mk / 32;
        v.push_back(ShardIO{xs[i]->as<uint16_t>() + j * L, L, 1024, 1024, win.as<int32_t>(),
                            {cast ? o.d0.as<uint8_t>() + j * L : nullptr, cast ? o.d1.as<uint8_t>() + j * L : nullptr},
                            {cast ? nullptr : s0, cast ? nullptr : s1},
                            {cast ? s0 : nullptr, cast ? s1 : nullptr}});
      }
      return v;
    };
    for (const bool is_cast : {false, true}) {
      const std::vector<ShardIO> v[3] = {ios(0, is_cast), ios(1, is_cast), ios(2, is_cast)};
      const auto run = [&](const ShardIO* w, int k) {
        if (is_cast) launch_shards<kCast>(nullptr, a, w, k);
        else launch_shards<kAmax>(nullptr, a, w, k);
      };
      const double t_group = time_us([&](int i) { run(v[i].data(), int(T)); });
      const double t_each = time_us([&](int i) {
        for (int64_t j = 0; j < T; ++j) run(&v[i][j], 1);
      });
      std::printf("partial %s, %lld weights 1024x1024 (1/8 shards): grouped %.2f us per weight, one launch each "
                  "%.2f us per weight (%.2fx)\n",
                  is_cast ? "cast" : "amax", (long long)T, t_group / T, t_each / T, t_each / t_group);
    }
  }

  // Dequantize MXFP8 rowwise -> bf16: rows in flight per thread and grid size.
  {
    Buf out(n * 2);
    const QuantizeArgs a = bf16_args(true, 32, 0, 0, M, K);
    Outputs q(n, n / 32, 0, 1);
    launch_tiles<LoadBF16, TileCfg<MxRule, 32, 256, 32, false, false>>(
        nullptr, a, xs[0]->p, dense_span(M, K), MxRule{kE4M3},
        Outs<uint8_t>{q.d0.as<uint8_t>(), q.s0.as<uint8_t>(), nullptr}, Outs<uint8_t>{},
        compact_scale_at(M, K, 1, 32), ScaleAt{});
    // host reference on the first 64 rows
    const int64_t R = std::min<int64_t>(64, M);
    std::vector<uint8_t> hd(R * K), hs(R * cdiv(K, 32));
    CUDA_OK(cudaMemcpy(hd.data(), q.d0.p, hd.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hs.data(), q.s0.p, hs.size(), cudaMemcpyDeviceToHost));
    std::vector<uint16_t> want(R * K);
    for (int64_t i = 0; i < R * K; ++i)
      want[i] = bf16_from_float(fp8_to_float(hd[i], kE4M3) * e8m0_to_float(hs[(i / K) * cdiv(K, 32) + (i % K) / 32]));
    const double bytes = double(n) + n / 32 + 2.0 * n;
    // B > 1: the same rows as B matrices of M / B rows (the same scales and output)
    const auto run = [&](auto unroll, auto vec, int per_sm, int64_t B = 1) {
      constexpr int U = decltype(unroll)::value, V = decltype(vec)::value;
      const auto go = [&](int) {
        launch_dequantize<MxRule, Store16<false>, V, U>(nullptr, q.d0.p, q.s0.p, out.p, B, M / B, K, 1, 32, kE4M3,
                                                        per_sm);
      };
      go(0);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> got(R * K);
      CUDA_OK(cudaMemcpy(got.data(), out.p, got.size() * 2, cudaMemcpyDeviceToHost));
      const bool ok = std::memcmp(got.data(), want.data(), got.size() * 2) == 0;
      report("dequant mx->bf16 vec " + std::to_string(V) + " unroll " + std::to_string(U) + " ctas/sm " +
                 std::to_string(per_sm) + (B > 1 ? " B=" + std::to_string(B) : ""),
             time_us(go), bytes, ok ? "exact" : "MISMATCH");
    };
    using U1 = std::integral_constant<int, 1>;
    using U2 = std::integral_constant<int, 2>;
    using U4 = std::integral_constant<int, 4>;
    using U6 = std::integral_constant<int, 6>;
    using U8 = std::integral_constant<int, 8>;
    using V8 = std::integral_constant<int, 8>;
    using V16 = std::integral_constant<int, 16>;
    using V32 = std::integral_constant<int, 32>;
    run(U4{}, V8{}, 64);  // shipped
    run(U4{}, V8{}, 32);
    run(U8{}, V8{}, 32);
    run(U8{}, V8{}, 16);
    run(U8{}, V8{}, 64);
    run(U6{}, V8{}, 32);
    run(U2{}, V8{}, 32);
    run(U2{}, V16{}, 32);
    run(U4{}, V16{}, 32);
    run(U2{}, V32{}, 32);
    if (M % 4 == 0) run(U4{}, V8{}, 64, 4);
    // shaped like the traffic ceiling below: one row per CTA (ctas/sm so large that gy = B*M)
    run(U1{}, V8{}, 1024);
  }
  // The ceilings of dequantize's and quantize's traffic shapes: n bytes in and 2n out, 2n in and n out.
  {
    Buf out(n * 2);
    const int64_t chunks = n / 16;
    const unsigned grid = unsigned(cdiv(chunks, int64_t(256)));
    report("ceiling: read n, write 2n bytes", time_us([&](int i) {
             traffic_kernel<true><<<grid, 256>>>(xs[i]->as<uint4>(), out.as<uint4>(), chunks);
           }), 3.0 * n, "-");
    report("ceiling: read n, write 2n, coalesced", time_us([&](int i) {
             widen_coalesced_kernel<<<unsigned(cdiv(n / 8, int64_t(256))), 256>>>(xs[i]->as<uint2>(), out.as<uint4>(),
                                                                                n / 8);
           }), 3.0 * n, "-");
    report("ceiling: read n, write 2n, 4 per thread", time_us([&](int i) {
             traffic_kernel<true, 4><<<unsigned(cdiv(chunks, int64_t(1024))), 256>>>(xs[i]->as<uint4>(),
                                                                                  out.as<uint4>(), chunks);
           }), 3.0 * n, "-");
    report("ceiling: read n, write 2n, streaming", time_us([&](int i) {
             traffic_kernel<true, 1, true><<<grid, 256>>>(xs[i]->as<uint4>(), out.as<uint4>(), chunks);
           }), 3.0 * n, "-");
    report("ceiling: read 2n, write n bytes", time_us([&](int i) {
             traffic_kernel<false><<<grid, 256>>>(xs[i]->as<uint4>(), out.as<uint4>(), chunks);
           }), 3.0 * n, "-");
    const unsigned grid2 = unsigned(cdiv(n / 16, int64_t(256)));  // chunks of 32 bytes read
    report("ceiling: read 2n, write n + n", time_us([&](int i) {
             balanced_kernel<true><<<grid2, 256>>>(xs[i]->as<uint4>(), out.as<uint4>(), out.as<uint4>() + n / 16,
                                                   n / 16);
           }), 4.0 * n, "-");
    report("ceiling: read 2n, write 2n (copy)", time_us([&](int i) {
             balanced_kernel<false><<<grid2, 256>>>(xs[i]->as<uint4>(), out.as<uint4>(), nullptr, n / 16);
           }), 4.0 * n, "-");
    if (M % 128 == 0 && K % 128 == 0) {
      // the same traffic in 1x128 + 128x1(T)'s tiles and access pattern: at the occupancy its ~40
      // registers allow, and held to 3 CTAs/SM (the shipped kernels') by a shared-memory reservation;
      // in the shipped tile order and in groups of G tile rows
      const unsigned tiles = unsigned(M / 128 * (K / 128));
      const size_t pad3 = 56 * 1024;
      Buf sc(4 * (n / 128 + n / 128));  // the scales of the SCALES variant
      const auto tiled = [&](auto t, size_t pad, int G, auto scales) {
        Span sp = dense_span(M, K, G);
        plan_tiles<LoadBF16, 128, 128>(sp, 1, xs[0]->p);
        constexpr auto kern = tiled_traffic_kernel<decltype(t)::value, decltype(scales)::value>;
        CUDA_OK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pad3)));
        return [&, pad, sp, kern](int i) {
          kern<<<tiles, 256, pad>>>(xs[i]->as<uint16_t>(), out.as<uint8_t>(), out.as<uint8_t>() + n, sp, sc.as<float>());
        };
      };
      using Tr = std::integral_constant<bool, true>;
      using Co = std::integral_constant<bool, false>;
      CUDA_OK(cudaFuncSetAttribute(tiled_traffic_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pad3)));
      CUDA_OK(cudaFuncSetAttribute(tiled_traffic_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pad3)));
      int per_sm = 0, per_sm3 = 0;
      CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tiled_traffic_kernel<true>, 256, 0));
      CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm3, tiled_traffic_kernel<true>, 256, pad3));
      const int nm = int(M / 128);
      for (int G : {1, 2, 4, 8, 16, nm})
        for (const auto& [pad, occ] : {std::pair{size_t(0), per_sm}, std::pair{pad3, per_sm3}}) {
          const std::string tail = std::to_string(occ) + " CTAs/SM, groups of " + std::to_string(G) + " tile rows";
          report("ceiling: 1x128+128x1T tiles, " + tail, time_us(tiled(Tr{}, pad, G, std::false_type{})), 4.0 * n, "-");
          report("ceiling: 1x128+128x1 tiles, " + tail, time_us(tiled(Co{}, pad, G, std::false_type{})), 4.0 * n, "-");
        }
      // the tiles fetched by bulk asynchronous copies, 1-3 tiles ahead
      const auto bulk = [&](auto stages) {
        constexpr int S = decltype(stages)::value;
        const int bytes = S * 32768 + 16384;  // S stages of 32 KB and the transpose stage
        const auto kern = bulk_tiled_traffic_kernel<S>;
        CUDA_OK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        int occ = 0, sms = 0;
        CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 256, bytes));
        CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const unsigned grid = unsigned(std::min<int64_t>(tiles, int64_t(occ) * sms));
        const auto go = [&](int i) {
          kern<<<grid, 256, bytes>>>(xs[i]->as<uint16_t>(), out.as<uint8_t>(), out.as<uint8_t>() + n, M, K);
        };
        // the same bytes as the register-loading ceiling writes
        std::vector<uint8_t> want(2 * n), got(2 * n);
        tiled(Tr{}, 0, 1, std::false_type{})(0);
        CUDA_OK(cudaMemcpy(want.data(), out.p, 2 * n, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemset(out.p, 0, 2 * n));
        go(0);
        CUDA_OK(cudaMemcpy(got.data(), out.p, 2 * n, cudaMemcpyDeviceToHost));
        report("ceiling: 1x128+128x1T tiles, bulk copies, " + std::to_string(S) + " stages, " + std::to_string(occ) +
                   " CTAs/SM",
               time_us(go), 4.0 * n, want == got ? "same" : "DIFFERENT");
      };
      // with the scale stores, at the shipped kernels' 3 CTAs/SM
      const std::string with = std::to_string(per_sm3) + " CTAs/SM, with scales";
      report("ceiling: 1x128+128x1T tiles, " + with, time_us(tiled(Tr{}, pad3, 1, std::true_type{})), 4.0 * n + n / 16,
             "-");
      report("ceiling: 1x128+128x1 tiles, " + with, time_us(tiled(Co{}, pad3, 1, std::true_type{})), 4.0 * n + n / 16,
             "-");
      // compact, the row scales of none, or of 2, 4 or 8 tiles a store (the bytes counted as with scales)
      const auto rows_by = [&](const char* name, auto sc) {
        report(std::string("ceiling: 1x128+128x1 tiles, row scales ") + name, time_us(tiled(Co{}, pad3, 1, sc)),
               4.0 * n + n / 16, "-");
      };
      rows_by("none", std::integral_constant<int, 0>{});
      rows_by("x2", std::integral_constant<int, 2>{});
      rows_by("x4", std::integral_constant<int, 4>{});
      rows_by("x8", std::integral_constant<int, 8>{});
      bulk(std::integral_constant<int, 2>{});
      bulk(std::integral_constant<int, 3>{});
      bulk(std::integral_constant<int, 4>{});
    }
  }
  for (Buf* b : xs) delete b;
  return 0;
}
