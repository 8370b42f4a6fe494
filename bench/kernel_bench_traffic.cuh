// kernel_bench.cu's bandwidth ceilings: kernels that move the kernels' bytes with none of their math,
// and the two timings of them (flat traffic shapes; the tile pattern of the GEMM-ready kernels).
#pragma once

#include "kernel_bench_util.cuh"

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
                                    // SCALES words a row (fewer, wider stores, which measured still cost)
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

// The ceilings of dequantize's and quantize's traffic shapes: n bytes in and 2n out, 2n in and n out.
inline void bench_flat_ceilings(const Inputs& in, const Report& report) {
  const int64_t n = in.n;
  const std::vector<Buf*>& xs = in.xs;
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
}

// The same traffic in 1x128 + 128x1(T)'s tiles and access pattern: at the occupancy its ~40 registers
// allow, and held to 3 CTAs/SM (the shipped kernels') by a shared-memory reservation; in the shipped
// tile order and in groups of G tile rows; and the tiles fetched by bulk asynchronous copies.
inline void bench_tiled_ceilings(const Inputs& in, const Report& report) {
  const int64_t M = in.M, K = in.K, n = in.n;
  const std::vector<Buf*>& xs = in.xs;
  if (M % 128 != 0 || K % 128 != 0) return;
  Buf out(n * 2);
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
