// _jax_fp8_cutlass: the XLA FFI handler jf_cutlass_gemm, the FP8 block-scaled GEMM on CUTLASS's Hopper
// blockwise-scaling mainloop (cutlass_gemm.cuh; kernels in cutlass_gemm_<pair>_<out>.cu), and its nanobind
// module. Built only on request (CMake: JAX_FP8_CUTLASS), for sm_90a.
//
// The handler: out (M, N) = a (M, K) · b (N, K)ᵀ [+ c], the contract of jax_fp8/gemm/contract.py, with
// a in 1x128 blocks and b in 128x128 (a_block_rows = 1, b_block_rows = 128) or 1x128 blocks (both 1);
// 128x128 blocks on a are not implemented. It is command-buffer compatible (a CUDA graph may capture
// it): it takes its workspace as a result buffer (the lowering allocates `workspace_bytes`), never
// allocates, never synchronises with the host; per call it builds the kernel's parameters on the host
// (microseconds) and launches one kernel on XLA's stream. The only other CUDA runtime calls:
// cudaDeviceGetAttribute (the SM count, once per device) and cudaFuncSetAttribute (shared memory size,
// in CUTLASS's initialize), both allowed during stream capture.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cutlass_gemm.cuh"
#include "cutlass_ragged.cuh"
#include "xla/ffi/api/ffi.h"

namespace jf {
namespace cutlass_gemm {
namespace {
namespace ffi = xla::ffi;

constexpr int64_t kMaxDim = (int64_t(1) << 31) - 1;  // CUTLASS's problem shape is int
// The workspace the lowering allocates: at least this, and at least what any kernel asks for a large
// problem (computed at import, workspace_bytes()). The persistent tile scheduler and the TMA epilogue
// need none today; the handler checks every call anyway.
constexpr size_t kMinWorkspaceBytes = 256;

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fp8: jf_cutlass_gemm: " + msg);
}

std::string shape_str(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
int64_t cdiv(int64_t n, int64_t m) { return (n + m - 1) / m; }

bool fp8_type(ffi::DataType t, int* out) {
  if (t == ffi::DataType::F8E4M3FN) *out = kE4M3;
  else if (t == ffi::DataType::F8E5M2) *out = kE5M2;
  else return false;
  return true;
}

// The SM count of a device, queried once (cudaDeviceGetAttribute: no stream work, capture-safe).
ffi::Error sm_count(int32_t device, int* out) {
  static std::mutex mu;
  static std::map<int32_t, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = counts.find(device);
  if (it == counts.end()) {
    int n = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess || n <= 0)
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_fp8: jf_cutlass_gemm: no SM count for device ") +
                                                       std::to_string(device) + ": " + cudaGetErrorString(e));
    it = counts.emplace(device, n).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

ffi::Error check_aligned(const char* name, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return invalid(std::string(name) + " is not 16-byte aligned (TMA)");
  return ffi::Error::Success();
}

// The buffers and stream of a call (GemmCall, RaggedCall), checked 16-byte aligned (TMA reads them).
template <class Call>
ffi::Error set_buffers(Call* call, const ffi::AnyBuffer& a, const ffi::AnyBuffer& a_scale, const ffi::AnyBuffer& b,
                       const ffi::AnyBuffer& b_scale, ffi::AnyBuffer& out, ffi::AnyBuffer& workspace, int32_t device,
                       cudaStream_t stream) {
  call->a = a.untyped_data();
  call->b = b.untyped_data();
  call->a_scale = static_cast<const float*>(a_scale.untyped_data());
  call->b_scale = static_cast<const float*>(b_scale.untyped_data());
  call->out = out.untyped_data();
  call->workspace = workspace.untyped_data();
  call->workspace_bytes = workspace.element_count();
  call->device = device;
  call->stream = stream;
  const std::pair<const char*, const void*> pointers[] = {
      {"a", call->a}, {"b", call->b}, {"a_scale", call->a_scale}, {"b_scale", call->b_scale}, {"out", call->out}};
  for (const auto& [name, p] : pointers)
    if (auto e = check_aligned(name, p); e.failure()) return e;
  return ffi::Error::Success();
}

ffi::Error status_error(const GemmResult& r) {
  const auto code = r.status == kInvalid         ? ffi::ErrorCode::kInvalidArgument
                    : r.status == kUnimplemented ? ffi::ErrorCode::kUnimplemented
                                                 : ffi::ErrorCode::kInternal;
  return ffi::Error(code, "jax_fp8: jf_cutlass_gemm: " + r.message);
}

// The kernel's alignment rules (sizes() in jax_fp8/gemm/backends/cutlass.py pads to them): K % 16 (16-byte
// rows of FP8 a and b), N % 8 for bfloat16 out / N % 4 for float32 (16-byte output rows), M % 4 with
// 128x128 b blocks (a's scales are loaded by TMA then). Empty: fine.
std::string alignment_problem(int pair, int out_type, int64_t M, int64_t N, int64_t K) {
  if (K % 16) return "K = " + std::to_string(K) + " is not a multiple of 16";
  const int n_align = out_type == kOutBF16 ? 8 : 4;
  if (N % n_align)
    return "N = " + std::to_string(N) + " is not a multiple of " + std::to_string(n_align) + " (" +
           (out_type == kOutBF16 ? "bfloat16" : "float32") + " out)";
  if (pair == k1D2D && M % 4) return "M = " + std::to_string(M) + " is not a multiple of 4 (128x128 b blocks)";
  return "";
}

// a: (M, K) fp8; a_scale: its GEMM-ready 1x128 scales (ceil(K/128), roundup(M, 4)) fp32; b: (N, K) fp8;
// b_scale: its GEMM-ready scales, (ceil(N/128), roundup(ceil(K/128), 4)) for 128x128 blocks or
// (ceil(K/128), roundup(N, 4)) for 1x128 blocks; c: none, or (M, N) of the output's type; out (M, N)
// bfloat16 / float32; workspace: uint8 (>= the kernel's workspace). Attributes: a_block_rows (1),
// b_block_rows (128 or 1), config (index into configs), raster (0 heuristic, 1 along M, 2 along N),
// swizzle (1, 2, 4, 8).
ffi::Error GemmCutlass(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                       ffi::AnyBuffer b_scale, ffi::RemainingArgs c, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t a_block_rows, int64_t b_block_rows,
                       int64_t config, int64_t raster, int64_t swizzle) {
  if (a_block_rows != 1)
    return invalid("a_block_rows must be 1 (1x128 blocks on a; 128x128 blocks on a are not implemented), got " +
                   std::to_string(a_block_rows));
  if (b_block_rows != 1 && b_block_rows != 128)
    return invalid("b_block_rows must be 1 or 128, got " + std::to_string(b_block_rows));
  if (config < 0 || config >= kNumConfigs)
    return invalid("config must be in [0, " + std::to_string(kNumConfigs) + "), got " + std::to_string(config));
  if (raster < 0 || raster > 2)
    return invalid("raster must be 0 (heuristic), 1 (along M) or 2 (along N), got " + std::to_string(raster));
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8)
    return invalid("swizzle must be 1, 2, 4 or 8, got " + std::to_string(swizzle));
  const int pair = b_block_rows == 128 ? k1D2D : k1D1D;

  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1])
    return invalid("a (M, K) and b (N, K) must be 2-D with one K, got a " + shape_str(ad) + ", b " + shape_str(bd));
  const int64_t M = ad[0], N = bd[0], K = ad[1];
  if (std::max({M, N, K}) > kMaxDim) return invalid("a GEMM dim over 2**31 - 1");
  GemmCall call;
  if (!fp8_type(a.element_type(), &call.a_type) || !fp8_type(b.element_type(), &call.b_type))
    return invalid("a and b must be float8_e4m3fn or float8_e5m2");
  if (call.a_type == kE5M2 && call.b_type == kE5M2) return invalid("a and b must not both be float8_e5m2");

  const int64_t nk = cdiv(K, 128);
  const std::vector<int64_t> want_sa = {nk, round_up(M, 4)};
  const std::vector<int64_t> want_sb =
      pair == k1D2D ? std::vector<int64_t>{cdiv(N, 128), round_up(nk, 4)} : std::vector<int64_t>{nk, round_up(N, 4)};
  for (auto [name, s, want] : {std::tuple{"a_scale", &a_scale, &want_sa}, std::tuple{"b_scale", &b_scale, &want_sb}}) {
    const auto d = s->dimensions();
    if (s->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != (*want)[0] || d[1] != (*want)[1])
      return invalid(std::string(name) + " must be float32 (" + std::to_string((*want)[0]) + ", " +
                     std::to_string((*want)[1]) + ") (GEMM-ready scales), got shape " + shape_str(d));
  }

  int out_type;
  if (out->element_type() == ffi::DataType::BF16) out_type = kOutBF16;
  else if (out->element_type() == ffi::DataType::F32) out_type = kOutF32;
  else return invalid("out must be bfloat16 or float32");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != M || od[1] != N) return invalid("out must be (M, N), got " + shape_str(od));
  if (c.size() > 1) return invalid("at most one accumulator c, got " + std::to_string(c.size()));
  if (c.size() == 1) {
    auto cb = c.get<ffi::AnyBuffer>(0);
    if (cb.has_error()) return cb.error();
    const auto cd = cb->dimensions();
    if (cb->element_type() != out->element_type() || cd.size() != 2 || cd[0] != M || cd[1] != N)
      return invalid("c must have the output's type and shape (M, N), got " + shape_str(cd));
    call.c = cb->untyped_data();
    if (auto e = check_aligned("c", call.c); e.failure()) return e;
  }
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1)
    return invalid("the workspace result must be a 1-D uint8 buffer");
  if (M * N * K == 0) return ffi::Error::Success();  // the contract has no empty GEMMs; nothing to do
  if (std::string why = alignment_problem(pair, out_type, M, N, K); !why.empty())
    return invalid(why + ": pad the operands with zeros (jax_fp8.gemm.backends.cutlass.sizes)");

  call.config = int(config);
  call.raster = int(raster);
  call.swizzle = int(swizzle);
  call.M = M;
  call.N = N;
  call.K = K;
  if (auto e = set_buffers(&call, a, a_scale, b, b_scale, *out, *workspace, device, stream); e.failure()) return e;
  if (auto e = sm_count(device, &call.sm_count); e.failure()) return e;
  const GemmResult r = run(pair, out_type, call);
  if (r.status != kOk) return status_error(r);
  return ffi::Error::Success();
}

ffi::Error check_buffer(const char* name, const ffi::AnyBuffer& buf, ffi::DataType type, const char* type_name,
                        const std::vector<int64_t>& want) {
  const auto d = buf.dimensions();
  if (buf.element_type() != type || std::vector<int64_t>(d.begin(), d.end()) != want)
    return invalid(std::string(name) + " must be " + type_name + " " + shape_str(want) + ", got shape " + shape_str(d));
  return ffi::Error::Success();
}

// The grouped GEMMs of fp8_ragged_dot (cutlass_ragged.cuh), E4M3 operands, over the Gl groups from
// group_offset (a device scalar) of the G in group_sizes (G,) int32. kind 0 (M-grouped): a (M, K), a_scale
// (ceil(K/128), roundup(M, 4)), b (Gl, N, K), b_scale (Gl, ceil(N/128), roundup(ceil(K/128), 4)), out (M, N).
// kind 1 (K-grouped): a (R, Mc), a_scale (S, R), b (N, Mc), b_scale (S, N), out (Gl, R, N), with `rows` the
// M the groups are clipped to and S = block_slots(rows, G, 128). config, raster: the kernel
// configuration and its scheduler's raster order (cutlass_ragged.cuh).
ffi::Error RaggedCutlass(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                         ffi::AnyBuffer b, ffi::AnyBuffer b_scale, ffi::AnyBuffer group_sizes,
                         ffi::AnyBuffer group_offset, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> workspace, int64_t kind, int64_t rows, int64_t config,
                         int64_t raster) {
  if (kind != kMGrouped && kind != kKGrouped) return invalid("kind must be 0 (M-grouped) or 1 (K-grouped)");
  const auto ad = a.dimensions(), bd = b.dimensions(), gd = group_sizes.dimensions();
  if (group_sizes.element_type() != ffi::DataType::S32 || gd.size() != 1)
    return invalid("group_sizes must be int32 (G,), got shape " + shape_str(gd));
  if (group_offset.element_type() != ffi::DataType::S32 || group_offset.element_count() != 1)
    return invalid("group_offset must be one int32");
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("the grouped GEMM takes float8_e4m3fn operands");
  int out_type;
  if (out->element_type() == ffi::DataType::BF16) out_type = kOutBF16;
  else if (out->element_type() == ffi::DataType::F32) out_type = kOutF32;
  else return invalid("out must be bfloat16 or float32");
  RaggedCall call;
  call.kind = int(kind);
  call.config = int(config);  // checked by run_ragged
  call.raster = int(raster);
  call.G = gd[0];
  if (ad.size() != 2) return invalid("a must be 2-D, got " + shape_str(ad));
  if (kind == kMGrouped) {
    call.M = ad[0];
    call.K = ad[1];
    if (bd.size() != 3 || bd[2] != call.K) return invalid("b must be (Gl, N, K) with a's K, got " + shape_str(bd));
    call.Gl = bd[0];
    call.N = bd[1];
    const int64_t nk = cdiv(call.K, 128);
    if (auto e = check_buffer("a_scale", a_scale, ffi::DataType::F32, "float32", {nk, round_up(call.M, 4)}); e.failure())
      return e;
    if (auto e = check_buffer("b_scale", b_scale, ffi::DataType::F32, "float32",
                              {call.Gl, cdiv(call.N, 128), round_up(nk, 4)}); e.failure())
      return e;
    if (auto e = check_buffer("out", *out, out->element_type(), "of the output type", {call.M, call.N}); e.failure())
      return e;
    if (call.K % 16) return invalid("K = " + std::to_string(call.K) + " is not a multiple of 16");
  } else {
    call.K = ad[0];  // R
    call.Mc = ad[1];
    call.M = rows;
    if (bd.size() != 2 || bd[1] != call.Mc) return invalid("b must be (N, Mc) with a's Mc, got " + shape_str(bd));
    call.N = bd[0];
    if (rows < 0 || rows > call.Mc) return invalid("rows must be in [0, Mc], got " + std::to_string(rows));
    const int64_t S = block_slots(rows, call.G, 128);
    if (auto e = check_buffer("a_scale", a_scale, ffi::DataType::F32, "float32", {S, call.K}); e.failure()) return e;
    if (auto e = check_buffer("b_scale", b_scale, ffi::DataType::F32, "float32", {S, call.N}); e.failure()) return e;
    const auto od = out->dimensions();
    if (od.size() != 3) return invalid("out must be (Gl, R, N), got " + shape_str(od));
    call.Gl = od[0];
    if (auto e = check_buffer("out", *out, out->element_type(), "of the output type", {call.Gl, call.K, call.N});
        e.failure())
      return e;
    if (call.Mc % kColAlign) return invalid("Mc = " + std::to_string(call.Mc) + " is not a multiple of 16");
  }
  if (std::max({call.M, call.N, call.K, call.Mc}) > kMaxDim) return invalid("a GEMM dim over 2**31 - 1");
  const int n_align = out_type == kOutBF16 ? 8 : 4;
  if (call.N % n_align) return invalid("N = " + std::to_string(call.N) + " is not a multiple of " + std::to_string(n_align));
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1)
    return invalid("the workspace result must be a 1-D uint8 buffer");
  if (out->element_count() == 0) return ffi::Error::Success();
  call.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  call.group_offset = static_cast<const int32_t*>(group_offset.untyped_data());
  if (auto e = set_buffers(&call, a, a_scale, b, b_scale, *out, *workspace, device, stream); e.failure()) return e;
  if (auto e = sm_count(device, &call.sm_count); e.failure()) return e;
  const GemmResult r = run_ragged(out_type, call);
  if (r.status != kOk) return status_error(r);
  return ffi::Error::Success();
}

// The largest workspace any kernel asks for, over a few problem sizes (dry runs: no GPU needed).
size_t workspace_bytes() {
  size_t ws = kMinWorkspaceBytes;
  for (int pair : {k1D2D, k1D1D})
    for (int out_type : {kOutBF16, kOutF32})
      for (int config = 0; config < kNumConfigs; ++config)
        for (int64_t n : {128, 4096, 65536}) {
          GemmCall call;
          call.config = config;
          call.M = call.N = call.K = n;
          call.dry_run = true;
          const GemmResult r = run(pair, out_type, call);
          if (r.status == kOk) ws = std::max(ws, r.workspace);
        }
  return ws;
}

int out_type_of(const std::string& name) {
  if (name == "bfloat16") return kOutBF16;
  if (name == "float32") return kOutF32;
  throw nanobind::value_error(("out_dtype must be 'bfloat16' or 'float32', got " + name).c_str());
}
int fp8_type_of(const std::string& name) {
  if (name == "float8_e4m3fn") return kE4M3;
  if (name == "float8_e5m2") return kE5M2;
  throw nanobind::value_error(("an FP8 dtype is 'float8_e4m3fn' or 'float8_e5m2', got " + name).c_str());
}

}  // namespace
}  // namespace cutlass_gemm
}  // namespace jf

namespace ffi = xla::ffi;

static auto gemm_cutlass_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()   // keys the SM count cache
      .Arg<ffi::AnyBuffer>()       // a (M, K) fp8
      .Arg<ffi::AnyBuffer>()       // a_scale, GEMM-ready fp32 (1x128 blocks)
      .Arg<ffi::AnyBuffer>()       // b (N, K) fp8
      .Arg<ffi::AnyBuffer>()       // b_scale, GEMM-ready fp32 (128x128 or 1x128 blocks)
      .RemainingArgs()             // c (M, N), only when accumulating
      .Ret<ffi::AnyBuffer>()       // out (M, N) bfloat16 / float32
      .Ret<ffi::AnyBuffer>()       // workspace, uint8 (workspace_bytes)
      .Attr<int64_t>("a_block_rows")
      .Attr<int64_t>("b_block_rows")
      .Attr<int64_t>("config")
      .Attr<int64_t>("raster")
      .Attr<int64_t>("swizzle");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfFp8GemmCutlass, jf::cutlass_gemm::GemmCutlass, gemm_cutlass_binding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

static auto ragged_cutlass_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // a: (M, K) rows (M-grouped) or (R, Mc) columns (K-grouped), float8_e4m3fn
      .Arg<ffi::AnyBuffer>()  // a_scale
      .Arg<ffi::AnyBuffer>()  // b: (G, N, K) (M-grouped) or (N, Mc) (K-grouped)
      .Arg<ffi::AnyBuffer>()  // b_scale
      .Arg<ffi::AnyBuffer>()  // group_sizes (G,) int32
      .Arg<ffi::AnyBuffer>()  // group_offset, one int32: the first of the Gl groups of b (M) or out (K)
      .Ret<ffi::AnyBuffer>()  // out: (M, N) or (Gl, R, N)
      .Ret<ffi::AnyBuffer>()  // workspace, uint8 (ragged_workspace_bytes)
      .Attr<int64_t>("kind")
      .Attr<int64_t>("rows")
      .Attr<int64_t>("config")  // kRaggedConfigNames' index and the scheduler's raster order
      .Attr<int64_t>("raster");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfRaggedCutlass, jf::cutlass_gemm::RaggedCutlass, ragged_cutlass_binding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_jax_fp8_cutlass, m) {
  namespace cg = jf::cutlass_gemm;
  m.def("registrations", []() {
    nanobind::dict d;
    d["jf_cutlass_gemm"] = nanobind::capsule(reinterpret_cast<void*>(JfFp8GemmCutlass));
    d["jf_cutlass_ragged_gemm"] = nanobind::capsule(reinterpret_cast<void*>(JfRaggedCutlass));
    return d;
  });
  std::vector<std::string> configs(cg::kConfigNames, cg::kConfigNames + cg::kNumConfigs);
  m.attr("configs") = configs;
  std::vector<std::string> ragged_configs(cg::kRaggedConfigNames, cg::kRaggedConfigNames + cg::kNumRaggedConfigs);
  m.attr("ragged_configs") = ragged_configs;
  // bytes of the uint8 workspace result the lowering allocates (>= every kernel's need; checked per call)
  m.attr("workspace_bytes") = cg::workspace_bytes();
  std::vector<std::tuple<std::string, std::string>> pairs = {{"float8_e4m3fn", "float8_e4m3fn"}};
  if (JF_CUTLASS_E5M2) {
    pairs.emplace_back("float8_e5m2", "float8_e4m3fn");
    pairs.emplace_back("float8_e4m3fn", "float8_e5m2");
  }
  m.attr("dtype_pairs") = pairs;  // (a dtype, b dtype) pairs with kernels
  // The handler's verdict on a problem, on the host (its alignment rules, then CUTLASS's can_implement;
  // no GPU needed): the workspace the kernel needs, or ValueError saying why it cannot run it.
  m.def(
      "check",
      [](int64_t M, int64_t N, int64_t K, int64_t b_block_rows, const std::string& out_dtype, const std::string& a_dtype,
         const std::string& b_dtype, int config) {
        if (b_block_rows != 1 && b_block_rows != 128) throw nanobind::value_error("b_block_rows must be 1 or 128");
        if (std::max({M, N, K}) > cg::kMaxDim || std::min({M, N, K}) < 1)
          throw nanobind::value_error("GEMM dims must be in [1, 2**31 - 1]");
        cg::GemmCall call;
        call.a_type = cg::fp8_type_of(a_dtype);
        call.b_type = cg::fp8_type_of(b_dtype);
        call.config = config;
        call.M = M;
        call.N = N;
        call.K = K;
        call.dry_run = true;
        const int pair = b_block_rows == 128 ? cg::k1D2D : cg::k1D1D, out_type = cg::out_type_of(out_dtype);
        if (std::string why = cg::alignment_problem(pair, out_type, M, N, K); !why.empty())
          throw nanobind::value_error(why.c_str());
        const cg::GemmResult r = cg::run(pair, out_type, call);
        if (r.status != cg::kOk) throw nanobind::value_error(r.message.c_str());
        return r.workspace;
      },
      nanobind::arg("M"), nanobind::arg("N"), nanobind::arg("K"), nanobind::arg("b_block_rows"),
      nanobind::arg("out_dtype"), nanobind::arg("a_dtype") = "float8_e4m3fn",
      nanobind::arg("b_dtype") = "float8_e4m3fn", nanobind::arg("config") = 0);
  // The workspace bytes of a grouped GEMM (the lowering allocates them; the handler checks): kind 0
  // (M-grouped: M, N, K as a (M, K), b (Gl, N, K)) or 1 (K-grouped: M the rows, N, K = R, Mc the columns),
  // G groups in group_sizes, Gl of them local; config: the kernel configuration (kRaggedConfigNames).
  m.def(
      "ragged_workspace_bytes",
      [](int64_t kind, int64_t M, int64_t N, int64_t K, int64_t G, int64_t Gl, int64_t Mc,
         const std::string& out_dtype, int config) {
        if (kind != cg::kMGrouped && kind != cg::kKGrouped) throw nanobind::value_error("kind must be 0 or 1");
        cg::RaggedCall call;
        call.kind = int(kind);
        call.config = config;
        call.M = M;
        call.N = N;
        call.K = K;
        call.G = G;
        call.Gl = Gl;
        call.Mc = Mc;
        call.dry_run = true;
        // the largest SM count a Hopper part has: the tensormaps' share grows with it
        call.sm_count = 144;
        const cg::GemmResult r = cg::run_ragged(cg::out_type_of(out_dtype), call);
        if (r.status != cg::kOk) throw nanobind::value_error(r.message.c_str());
        return r.workspace;
      },
      nanobind::arg("kind"), nanobind::arg("M"), nanobind::arg("N"), nanobind::arg("K"), nanobind::arg("G"),
      nanobind::arg("Gl"), nanobind::arg("Mc"), nanobind::arg("out_dtype"), nanobind::arg("config") = 0);
}
