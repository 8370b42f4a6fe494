// Bench-only XLA FFI target: a device-to-device cudaMemcpyAsync, the bandwidth roofline that
// bench_kernels.py times through JAX exactly as it times our kernels. Not part of jax_fp8: built by
// bench/build_kernel_bench.sh into bench/.bin/libjf_device_copy.so and loaded with ctypes.
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error DeviceCopy(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfDeviceCopy, DeviceCopy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>());  // y, same shape and type
