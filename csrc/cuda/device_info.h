// What the CUDA launches need to know about a device, asked of the driver once per device
// (cudaDeviceGetAttribute is a driver call; a launch should not pay for it every time).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <mutex>

namespace ropescale {

struct CudaDeviceInfo {
  int multiprocessors = 0;
  int max_threads_per_multiprocessor = 0;
  // cudaDevAttrMaxSharedMemoryPerBlockOptin: static + dynamic shared memory a block may opt in to
  // (163 KiB on sm_80/87, 227 KiB on sm_90/100, 99 KiB on sm_86/89/120).
  int shared_memory_per_block_optin = 0;
  int major = 0, minor = 0;  // compute capability
};

inline CudaDeviceInfo query_cuda_device_info(int device) {
  CudaDeviceInfo info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_threads_per_multiprocessor,
                                        cudaDevAttrMaxThreadsPerMultiProcessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.shared_memory_per_block_optin,
                                        cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
  return info;
}

// The device's facts, queried on first use and cached (one copy for the whole library: an inline
// function's statics are shared by every translation unit).
inline CudaDeviceInfo cuda_device_info(int device) {
  constexpr int kMaxDevices = 64;
  static CudaDeviceInfo infos[kMaxDevices];
  static std::once_flag queried[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return query_cuda_device_info(device);
  std::call_once(queried[device], [&] { infos[device] = query_cuda_device_info(device); });
  return infos[device];
}

}  // namespace ropescale
