// The slice of cuBLASLt's C API that the FP8 GEMM uses, declared here and loaded with dlopen when
// first asked for, so that the CUDA module builds without cuBLAS headers and imports without the
// library. Values are cuBLAS 12.9+/13.x's (cublasLt.h, cublas_api.h); where the real header is on the
// include path (a CUDA toolkit, or the nvidia-cublas wheel) the static_asserts below compare them.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t
#include <dlfcn.h>
#include <library_types.h>  // cudaDataType_t: CUDA_R_8F_E4M3, CUDA_R_16BF, ...

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace jf {
namespace lt {

using Status = int;        // cublasStatus_t
using Handle = void*;      // cublasLtHandle_t
using MatmulDesc = void*;  // cublasLtMatmulDesc_t
using Layout = void*;      // cublasLtMatrixLayout_t
using Preference = void*;  // cublasLtMatmulPreference_t
struct Algo {              // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct Heuristic {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

constexpr Status kSuccess = 0;         // CUBLAS_STATUS_SUCCESS
constexpr Status kNotSupported = 15;   // CUBLAS_STATUS_NOT_SUPPORTED (e.g. no heuristic for the problem)
constexpr int kCompute32F = 68;        // CUBLAS_COMPUTE_32F
constexpr int kOpN = 0, kOpT = 1;      // CUBLAS_OP_N, CUBLAS_OP_T
constexpr int kDescTransA = 3;         // CUBLASLT_MATMUL_DESC_TRANSA (int32)
constexpr int kDescTransB = 4;         // CUBLASLT_MATMUL_DESC_TRANSB (int32)
constexpr int kDescAScalePointer = 17;  // CUBLASLT_MATMUL_DESC_A_SCALE_POINTER (const void*)
constexpr int kDescBScalePointer = 18;  // CUBLASLT_MATMUL_DESC_B_SCALE_POINTER (const void*)
constexpr int kDescAScaleMode = 31;    // CUBLASLT_MATMUL_DESC_A_SCALE_MODE (int32)
constexpr int kDescBScaleMode = 32;    // CUBLASLT_MATMUL_DESC_B_SCALE_MODE (int32)
constexpr int kPrefMaxWorkspace = 1;   // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES (uint64)
constexpr int kPrefMinAlignA = 5;      // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES = 5..8 (uint32)
constexpr int kScaleVec128 = 4;        // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F: 1x128 blocks
constexpr int kScaleBlk128x128 = 5;    // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: 128x128 blocks
// The first cuBLASLt with Hopper block scaling (cublasLtGetVersion: major * 10000 + minor * 100 + patch).
constexpr size_t kMinVersion = 120900;

// The entry points, resolved from the loaded library.
struct Api {
  size_t (*GetVersion)();
  Status (*Create)(Handle*);
  Status (*MatmulDescCreate)(MatmulDesc*, int compute, cudaDataType_t scale_type);
  Status (*MatmulDescDestroy)(MatmulDesc);
  Status (*MatmulDescSetAttribute)(MatmulDesc, int attr, const void* buf, size_t size);
  Status (*MatrixLayoutCreate)(Layout*, cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld);
  Status (*MatrixLayoutDestroy)(Layout);
  Status (*MatmulPreferenceCreate)(Preference*);
  Status (*MatmulPreferenceDestroy)(Preference);
  Status (*MatmulPreferenceSetAttribute)(Preference, int attr, const void* buf, size_t size);
  Status (*MatmulAlgoGetHeuristic)(Handle, MatmulDesc, Layout a, Layout b, Layout c, Layout d, Preference,
                                   int requested, Heuristic* results, int* returned);
  Status (*Matmul)(Handle, MatmulDesc, const void* alpha, const void* A, Layout, const void* B, Layout,
                   const void* beta, const void* C, Layout, void* D, Layout, const Algo*, void* workspace,
                   size_t workspace_size, cudaStream_t);
  std::string path;  // where it was loaded from
  size_t version;
};

// Resolves every entry point of `lib`; false (and `why`) when one is missing.
inline bool resolve(void* lib, Api* api, std::string* why) {
  bool ok = true;
  const auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) {
      ok = false;
      *why += std::string(" missing ") + name + ";";
    }
  };
  sym(api->GetVersion, "cublasLtGetVersion");
  sym(api->Create, "cublasLtCreate");
  sym(api->MatmulDescCreate, "cublasLtMatmulDescCreate");
  sym(api->MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  sym(api->MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  sym(api->MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  sym(api->MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  sym(api->MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  sym(api->MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  sym(api->MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  sym(api->MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  sym(api->Matmul, "cublasLtMatmul");
  return ok;
}

struct Loaded {
  std::mutex mu;
  Api api{};
  bool ok = false;
  std::string error = "cuBLASLt not loaded yet (jax_fp8.gemm.backends.cublaslt.cublaslt() loads it)";
};
inline Loaded& loaded() {
  static Loaded l;
  return l;
}

// Loads cuBLASLt once: first the copy this process already has (XLA's, by soname), then each of
// `paths` in order (the nvidia wheels' files, then bare sonames for the system's search path).
// Returns the version (0 on failure); `message` says where from, or why not.
inline size_t load(const std::vector<std::string>& paths, std::string* message) {
  Loaded& l = loaded();
  std::lock_guard<std::mutex> lock(l.mu);
  if (!l.ok) {
    std::string why;
    std::vector<std::pair<std::string, int>> tries;
    for (const char* soname : {"libcublasLt.so.13", "libcublasLt.so.12"}) tries.push_back({soname, RTLD_NOLOAD});
    for (const auto& p : paths) tries.push_back({p, 0});
    for (const auto& [path, flag] : tries) {
      void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | flag);
      if (!lib) {
        if (!flag) why += " " + path + ": " + dlerror() + ";";
        continue;
      }
      Api api{};
      if (!resolve(lib, &api, &why)) continue;
      api.path = path;
      api.version = api.GetVersion();
      l.api = api;
      l.ok = true;
      break;
    }
    if (!l.ok) l.error = "cuBLASLt could not be loaded:" + why;
  }
  *message = l.ok ? l.api.path : l.error;
  return l.ok ? l.api.version : 0;
}

// The loaded API (loading the copy this process already has when nothing was loaded yet, e.g. for an
// executable deserialized without our lowering), or nullptr (then `error()` says why).
inline const Api* api() {
  Loaded& l = loaded();
  {
    std::lock_guard<std::mutex> lock(l.mu);
    if (l.ok) return &l.api;
  }
  std::string message;
  return load({}, &message) ? &l.api : nullptr;
}

// The names of the statuses a GEMM call can meet (cublas_api.h), for error messages.
inline std::string status_name(Status s) {
  switch (s) {
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case kNotSupported: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cublasStatus_t " + std::to_string(s);
  }
}
inline std::string error() {
  Loaded& l = loaded();
  std::lock_guard<std::mutex> lock(l.mu);
  return l.error;
}

}  // namespace lt
}  // namespace jf

// Where the real header is available (and new enough to have block scaling), check every value above
// against it.
#if defined(__has_include)
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#if CUBLAS_VERSION >= 120900
static_assert(jf::lt::kSuccess == CUBLAS_STATUS_SUCCESS);
static_assert(jf::lt::kNotSupported == CUBLAS_STATUS_NOT_SUPPORTED);
static_assert(jf::lt::kPrefMinAlignA == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
              jf::lt::kPrefMinAlignA + 3 == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(jf::lt::kCompute32F == CUBLAS_COMPUTE_32F);
static_assert(jf::lt::kOpN == CUBLAS_OP_N && jf::lt::kOpT == CUBLAS_OP_T);
static_assert(jf::lt::kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA);
static_assert(jf::lt::kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(jf::lt::kDescAScalePointer == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER);
static_assert(jf::lt::kDescBScalePointer == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER);
static_assert(jf::lt::kDescAScaleMode == CUBLASLT_MATMUL_DESC_A_SCALE_MODE);
static_assert(jf::lt::kDescBScaleMode == CUBLASLT_MATMUL_DESC_B_SCALE_MODE);
static_assert(jf::lt::kPrefMaxWorkspace == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(jf::lt::kScaleVec128 == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
static_assert(jf::lt::kScaleBlk128x128 == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
static_assert(sizeof(jf::lt::Algo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(jf::lt::Heuristic) == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(offsetof(jf::lt::Heuristic, workspace_size) == offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));
static_assert(offsetof(jf::lt::Heuristic, state) == offsetof(cublasLtMatmulHeuristicResult_t, state));
#define JF_CUBLASLT_HEADER_CHECKED 1
#endif
#endif
#endif
#ifndef JF_CUBLASLT_HEADER_CHECKED
#define JF_CUBLASLT_HEADER_CHECKED 0  // built without cublasLt.h: the values above stand unchecked
#endif
