// The FP8 block-scaled GEMM on cuBLASLt (host code only): out (M, N) = a (M, K) · b (N, K)ᵀ [+ c],
// the FFI target jf_cublaslt_gemm. The contract: jax_fp8/gemm/contract.py; the jf_fp8_gemm primitive
// (jax_fp8/gemm/primitive.py) checks every shape before it lowers here.
//
// cuBLASLt is column-major and Hopper's FP8 GEMM is "TN" only, so: cuBLAS A = our b (transa = T,
// m = N), cuBLAS B = our a (transb = N, n = M), k = K, lda = ldb = K, and D column-major (N, M) with
// ld = N, which is our row-major (M, N). The scale pointer and mode of cuBLAS A are b's, of B a's.
// Per call: the descriptors (host objects, microseconds), the algorithm from a cache keyed by device,
// problem and `algo` (the heuristic query is the slow part), and one cublasLtMatmul on XLA's stream.
// The workspace is a result buffer of the call (kGemmWorkspaceBytes + 256, aligned here to 256), not
// XLA's scratch, which is freed when the handler returns and so could not be captured in a CUDA graph.
// `algo` picks the algorithm: -1 the heuristic's first choice, i >= 0 its i-th candidate (of at most
// kGemmCandidates; the first where the list is shorter), as an autotuner measured them
// (jax_fp8/gemm/table.py). No host synchronisation, no cudaMalloc.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cublaslt.h"
#include "ffi_common.h"

namespace jf {
namespace {

// The workspace cuBLASLt may ask for; the heuristic picks algorithms that fit (TE gives Hopper 32 MiB).
constexpr uint64_t kGemmWorkspaceBytes = 32ull << 20;
// How many of the heuristic's candidates the `algo` attribute may pick from.
constexpr int kGemmCandidates = 16;

inline std::string lt_failure(const char* what, lt::Status s) {
  return std::string("jax_fp8: cuBLASLt ") + what + " failed: " + lt::status_name(s);
}
#define JF_LT(call, what)                                                                 \
  do {                                                                                   \
    if (lt::Status s_ = (call); s_ != lt::kSuccess)                                      \
      return ffi::Error(ffi::ErrorCode::kInternal, lt_failure(what, s_));                \
  } while (0)

// The alignment cuBLASLt may assume for a buffer (its algorithms default to 256 bytes; XLA's buffers
// are aligned less strictly in general): the largest power of two up to 256 dividing the address.
inline uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align) align /= 2;
  return align;
}

// One cublasLtMatmulDesc_t and its four layouts, destroyed with the call.
struct GemmDescs {
  const lt::Api& api;
  lt::MatmulDesc op = nullptr;
  lt::Layout a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  ~GemmDescs() {
    for (lt::Layout l : {a, b, c, d})
      if (l) api.MatrixLayoutDestroy(l);
    if (op) api.MatmulDescDestroy(op);
  }
};

// Everything the algorithm choice depends on: device, M, N, K, the three types, the two scale modes,
// accumulation, and the alignment of A, B, C, D (an algorithm chosen for aligned buffers may need it).
using GemmKey = std::tuple<int32_t, int64_t, int64_t, int64_t, int, int, int, int, int, bool, uint32_t, uint32_t,
                           uint32_t, uint32_t, int64_t>;

struct GemmCache {
  std::mutex mu;
  std::map<int32_t, lt::Handle> handles;  // one cuBLASLt handle per device, never destroyed
  std::map<GemmKey, lt::Heuristic> algos;
};
inline GemmCache& gemm_cache() {
  static GemmCache c;
  return c;
}

// The device's cuBLASLt handle, made on first use (cublaslt_prepare makes them all at lowering, so that
// none is made while XLA captures the call into a CUDA graph).
inline lt::Status handle_for(const lt::Api& api, int32_t device, lt::Handle* handle) {
  GemmCache& cache = gemm_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  auto it = cache.handles.find(device);
  if (it == cache.handles.end()) {
    if (lt::Status s = api.Create(handle); s != lt::kSuccess) return s;
    it = cache.handles.emplace(device, *handle).first;
  }
  *handle = it->second;
  return lt::kSuccess;
}

// Makes the handles of `devices` (ordinals) outside any capture, each with its device current: "" or
// what failed.
inline std::string prepare_handles(const std::vector<int32_t>& devices) {
  const lt::Api* api = lt::api();
  if (!api) return lt::error();
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return "cudaGetDevice failed";
  std::string failed;
  for (int32_t d : devices) {
    lt::Handle h;
    if (cudaSetDevice(d) != cudaSuccess) failed = "cudaSetDevice(" + std::to_string(d) + ") failed";
    else if (lt::Status s = handle_for(*api, d, &h); s != lt::kSuccess) failed = lt_failure("cublasLtCreate", s);
  }
  cudaSetDevice(previous);
  return failed;
}

inline ffi::Error cuda_type_of(ffi::DataType t, cudaDataType_t* out) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: *out = CUDA_R_8F_E4M3; break;
    case ffi::DataType::F8E5M2: *out = CUDA_R_8F_E5M2; break;
    case ffi::DataType::BF16: *out = CUDA_R_16BF; break;
    case ffi::DataType::F32: *out = CUDA_R_32F; break;
    default: return bad("fp8 gemm: operands must be float8_e4m3fn / float8_e5m2, out bfloat16 / float32");
  }
  return ffi::Error::Success();
}

// a: (M, K), b: (N, K) FP8; a_scale, b_scale: their GEMM-ready fp32 scales; c: none, or (M, N) of the
// output's type (out = a·bᵀ + c). a_block_rows, b_block_rows: rows per scale block of a and b, 1 (1x128
// blocks) or 128 (128x128 blocks); workspace: uint8, at least kGemmWorkspaceBytes + 256 bytes; algo: -1
// or a candidate's index (see above).
ffi::Error CublasltGemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                       ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::RemainingArgs c, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t a_block_rows, int64_t b_block_rows,
                       int64_t algo) {
  const lt::Api* api = lt::api();
  if (!api) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jax_fp8: " + lt::error());
  if (api->version < lt::kMinVersion)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_fp8: cuBLASLt " + std::to_string(api->version) + " at " + api->path +
                          " predates FP8 block scaling (needs >= " + std::to_string(lt::kMinVersion) + ")");
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) return bad("fp8 gemm: a (M, K) and b (N, K)");
  const int64_t M = ad[0], N = bd[0], K = ad[1];
  if ((a_block_rows != 1 && a_block_rows != 128) || (b_block_rows != 1 && b_block_rows != 128) ||
      (a_block_rows == 128 && b_block_rows == 128))
    return bad("fp8 gemm: a_block_rows, b_block_rows must be 1 or 128, not both 128; got " +
               std::to_string(a_block_rows) + ", " + std::to_string(b_block_rows));
  if (algo < -1 || algo >= kGemmCandidates)
    return bad("fp8 gemm: algo must be -1 (the heuristic's choice) or a candidate index below " +
               std::to_string(kGemmCandidates) + ", got " + std::to_string(algo));
  if (workspace->size_bytes() < kGemmWorkspaceBytes + 256)
    return bad("fp8 gemm: the workspace result must hold " + std::to_string(kGemmWorkspaceBytes + 256) + " bytes");
  if (a_scale.element_type() != ffi::DataType::F32 || b_scale.element_type() != ffi::DataType::F32)
    return bad("fp8 gemm: a_scale and b_scale must be float32");
  const void* c_ptr = nullptr;
  if (c.size() > 1) return bad("fp8 gemm: at most one accumulator");
  if (c.size() == 1) {
    auto cb = c.get<ffi::AnyBuffer>(0);
    if (cb.has_error()) return cb.error();
    if (cb->element_type() != out->element_type() || cb->element_count() != M * N)
      return bad("fp8 gemm: c must have the output's type and shape");
    c_ptr = cb->untyped_data();
  }
  cudaDataType_t ta, tb, tout;
  for (auto [t, o] : {std::pair{a.element_type(), &ta}, {b.element_type(), &tb}, {out->element_type(), &tout}})
    if (auto e = cuda_type_of(t, o); e.failure()) return e;

  GemmCache& cache = gemm_cache();
  lt::Handle handle;
  JF_LT(handle_for(*api, device, &handle), "cublasLtCreate");

  GemmDescs g{*api};
  const int32_t op_t = lt::kOpT, op_n = lt::kOpN;
  const int32_t mode_a = b_block_rows == 1 ? lt::kScaleVec128 : lt::kScaleBlk128x128;  // cuBLAS A = our b
  const int32_t mode_b = a_block_rows == 1 ? lt::kScaleVec128 : lt::kScaleBlk128x128;  // cuBLAS B = our a
  const void* scale_a = b_scale.untyped_data();
  const void* scale_b = a_scale.untyped_data();
  JF_LT(api->MatmulDescCreate(&g.op, lt::kCompute32F, CUDA_R_32F), "MatmulDescCreate");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescTransA, &op_t, sizeof(op_t)), "set TRANSA");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescTransB, &op_n, sizeof(op_n)), "set TRANSB");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescAScaleMode, &mode_a, sizeof(mode_a)), "set A_SCALE_MODE");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescBScaleMode, &mode_b, sizeof(mode_b)), "set B_SCALE_MODE");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescAScalePointer, &scale_a, sizeof(scale_a)), "set A_SCALE_POINTER");
  JF_LT(api->MatmulDescSetAttribute(g.op, lt::kDescBScalePointer, &scale_b, sizeof(scale_b)), "set B_SCALE_POINTER");
  JF_LT(api->MatrixLayoutCreate(&g.a, tb, K, N, K), "layout A");  // our b, (N, K) row-major
  JF_LT(api->MatrixLayoutCreate(&g.b, ta, K, M, K), "layout B");  // our a, (M, K) row-major
  JF_LT(api->MatrixLayoutCreate(&g.c, tout, N, M, N), "layout C");
  JF_LT(api->MatrixLayoutCreate(&g.d, tout, N, M, N), "layout D");

  // cuBLAS A, B, C, D = our b, a, c (out itself when not accumulating: beta is 0 then), out
  const void* c_buf = c_ptr ? c_ptr : out->untyped_data();
  const uint32_t align[4] = {alignment_of(b.untyped_data()), alignment_of(a.untyped_data()), alignment_of(c_buf),
                             alignment_of(out->untyped_data())};
  const GemmKey key{device, M,     N,     K,      int(ta), int(tb), int(tout), mode_a, mode_b, c_ptr != nullptr,
                    align[0], align[1], align[2], align[3], algo};
  lt::Heuristic chosen;
  bool cached;
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.algos.find(key);
    cached = it != cache.algos.end();
    if (cached) chosen = it->second;
  }
  if (!cached) {
    lt::Preference pref = nullptr;
    JF_LT(api->MatmulPreferenceCreate(&pref), "MatmulPreferenceCreate");
    int found = 0;
    const int want = algo < 0 ? 1 : int(algo) + 1;
    lt::Heuristic found_algos[kGemmCandidates];
    lt::Status s = api->MatmulPreferenceSetAttribute(pref, lt::kPrefMaxWorkspace, &kGemmWorkspaceBytes,
                                                     sizeof(kGemmWorkspaceBytes));
    for (int i = 0; i < 4 && s == lt::kSuccess; ++i)
      s = api->MatmulPreferenceSetAttribute(pref, lt::kPrefMinAlignA + i, &align[i], sizeof(align[i]));
    if (s == lt::kSuccess)
      s = api->MatmulAlgoGetHeuristic(handle, g.op, g.a, g.b, g.c, g.d, pref, want, found_algos, &found);
    api->MatmulPreferenceDestroy(pref);
    if (s != lt::kNotSupported) JF_LT(s, "MatmulAlgoGetHeuristic");
    const std::string mnk = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
    if (s == lt::kNotSupported || found == 0 || found_algos[0].state != lt::kSuccess)
      return ffi::Error(ffi::ErrorCode::kUnimplemented, "jax_fp8: cuBLASLt has no block-scaled FP8 algorithm for " +
                                                            mnk + " on this GPU (needs sm_90, cuBLAS >= 12.9)");
    // an index this problem's list does not reach: the heuristic's choice (the table measured another
    // problem, or other dtypes or alignments, whose list was longer)
    chosen = found >= want && found_algos[want - 1].state == lt::kSuccess ? found_algos[want - 1] : found_algos[0];
    std::lock_guard<std::mutex> lock(cache.mu);
    cache.algos.emplace(key, chosen);
  }

  // cuBLASLt wants a 256-byte aligned workspace; the buffer has 256 bytes to spare for it
  const uintptr_t w = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  void* ws = reinterpret_cast<void*>((w + 255) / 256 * 256);
  const float alpha = 1.0f, beta = c_ptr ? 1.0f : 0.0f;
  JF_LT(api->Matmul(handle, g.op, &alpha, b.untyped_data(), g.a, a.untyped_data(), g.b, &beta, c_buf, g.c,
                    out->untyped_data(), g.d, &chosen.algo, ws, chosen.workspace_size, stream),
        "cublasLtMatmul");
  return ffi::Error::Success();
}
#undef JF_LT

}  // namespace
}  // namespace jf
