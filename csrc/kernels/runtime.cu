// Small runtime queries of the CUDA kernel library (ABI version, error strings, device count).
// They need no device: the CI machine calls them to check that the library loads and that a call
// without a GPU yields a clear status instead of a crash.
#include "api.h"
#include "common.cuh"

// Bump when a signature in api.h changes; swiftspec/ops/cuda.py refuses a library of another ABI.
#define SS_ABI_VERSION 3

extern "C" SS_API int ss_abi_version(void) { return SS_ABI_VERSION; }

extern "C" SS_API const char* ss_error_name(int status) {
  return cudaGetErrorName(static_cast<cudaError_t>(status));
}

extern "C" SS_API const char* ss_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

extern "C" SS_API int ss_device_count(int* count) {
  if (count == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

extern "C" SS_API int ss_sm_count(int* count) {
  if (count == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(swiftspec::cuda::current_sm_count(count));
}
