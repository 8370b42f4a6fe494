// kernel_bench.cu's helpers: error checks, test data, device buffers, timing and the report line.
#pragma once

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

// The three rotating bf16 inputs of every timing, (M, K) each (so that L2 holds none of them).
struct Inputs {
  int64_t M, K, n;
  std::vector<Buf*> xs;
};

// One line of the table: time, bandwidth and its share of the device-to-device copy's.
struct Report {
  double copy_gbs;
  void operator()(const std::string& name, double us, double bytes, const char* exact) const {
    const double gbs = bytes / us / 1e3;
    std::printf("%-34s %9.1f %8.0f %7.1f  %s\n", name.c_str(), us, gbs, 100.0 * gbs / copy_gbs, exact);
  }
};
