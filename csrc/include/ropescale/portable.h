// Portability macros for code shared by the CPU build, nvcc, and the host SIMT emulation that runs
// the CUDA kernels on the CPU in CI (tests/emulation). Headers under csrc/include/ropescale include
// this, never cuda_runtime.h.
//
//   ROPESCALE_HOST_DEVICE, ROPESCALE_INLINE
//       qualifiers for math shared by CPU code, CUDA kernels and emulated kernels.
//   ROPESCALE_DYNAMIC_SMEM(T, name);                      (kernels only: nvcc or emulation)
//       Declares `T* name` pointing at the block's dynamic shared memory (at least 16-byte
//       aligned). Replaces `extern __shared__ T name[];`, which cannot be emulated.
//   ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, args...);
//       kernel<<<grid, block, smem_bytes, stream>>>(args...). Wrap a template kernel whose name
//       contains commas in parentheses: ROPESCALE_LAUNCH_KERNEL((k<float, 4>), ...). Under
//       emulation the launch runs synchronously on the CPU and `stream` is ignored.
//   ROPESCALE_OPT_IN_DYNAMIC_SMEM(kernel, bytes) -> int
//       cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): 0 on
//       success, else the CUDA error code. Needed before a launch whose static + dynamic shared
//       memory exceeds 48 KiB; the emulation refuses such a launch without it.
//   ROPESCALE_LAST_LAUNCH_ERROR() -> int
//       cudaGetLastError() under nvcc (0 = none); 0 under the emulation, whose launches throw.
//   ROPESCALE_CURRENT_DEVICE() -> int
//       cudaGetDevice under nvcc (-1 on an error); the emulated target's index under the emulation.
//   device::SmemOptIn                 a kernel's opt-in, set once per device (see below)
//
// Tensor-core and asynchronous-copy primitives (sm_80+), namespace ropescale::device: inline PTX
// under nvcc, and under the emulation the warp-collective implementations of
// tests/emulation/include/ropescale_emu/warp_matrix.h (written from the PTX ISA's fragment
// layouts, with self-tests against plain matrix products in tests/emulation/test_emulation.cpp):
//   pack2<T>(lo, hi)                 two floats -> one .f16x2/.bf16x2 register (lo in the low half)
//   mma_m16n8k16<T>(acc, a, b)       acc += A B: mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32
//   ldmatrix<kNum, kTrans>(r, row)   ldmatrix.sync.aligned.m8n8.x{kNum}{.trans}.shared.b16
//   cp_async_16(dst, src, src_bytes) cp.async.cg.shared.global, 16 bytes, zero-filled past src_bytes
//   cp_async_commit(), cp_async_wait<N>()   cp.async.commit_group, cp.async.wait_group N
#pragma once

#if defined(ROPESCALE_EMULATION)

#include <ropescale_emu/cuda_emulation.h>

#define ROPESCALE_HOST_DEVICE __host__ __device__
#define ROPESCALE_INLINE inline
// A device function kept out of line on the GPU (register pressure); an ordinary inline function here.
#define ROPESCALE_NOINLINE inline

#define ROPESCALE_DYNAMIC_SMEM(T, name) \
  T* name = reinterpret_cast<T*>(::ropescale_emu::dynamic_shared_memory())

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  ((void)(stream),                                                            \
   ::ropescale_emu::launch((grid), (block), (smem_bytes), kernel __VA_OPT__(, ) __VA_ARGS__))
#define ROPESCALE_OPT_IN_DYNAMIC_SMEM(kernel, bytes) \
  ::ropescale_emu::set_max_dynamic_shared_memory(kernel, static_cast<int>(bytes))
#define ROPESCALE_LAST_LAUNCH_ERROR() 0
#define ROPESCALE_CURRENT_DEVICE() ::ropescale_emu::current_device()

#elif defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define ROPESCALE_HOST_DEVICE __host__ __device__
#define ROPESCALE_INLINE __forceinline__
#define ROPESCALE_NOINLINE __noinline__

// All `extern __shared__` arrays alias the same dynamic shared memory; one fixed element type and
// alignment keeps their declarations compatible.
#define ROPESCALE_DYNAMIC_SMEM(T, name)                              \
  extern __shared__ __align__(16) unsigned char name##_smem_bytes[]; \
  T* name = reinterpret_cast<T*>(name##_smem_bytes)

#define ROPESCALE_LAUNCH_KERNEL(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)
#define ROPESCALE_OPT_IN_DYNAMIC_SMEM(kernel, bytes)                                           \
  static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                        static_cast<int>(bytes)))
#define ROPESCALE_LAST_LAUNCH_ERROR() static_cast<int>(cudaGetLastError())
#define ROPESCALE_CURRENT_DEVICE() ::ropescale::device::cuda_current_device()

namespace ropescale::device {
inline int cuda_current_device() {
  int device = -1;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}
}  // namespace ropescale::device

#else  // a plain host compiler: the shared math only, no kernels

#define ROPESCALE_HOST_DEVICE
#define ROPESCALE_INLINE inline

#endif

#if defined(ROPESCALE_EMULATION) || defined(__CUDACC__)

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ropescale::device {

// A kernel's dynamic shared-memory opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize), set once
// per device: a launcher keeps one per kernel (a function-local static), so the driver call runs on
// the first launch on each device only (it applies to the current device's context). ensure()
// returns 0 or the CUDA error of the opt-in.
class SmemOptIn {
 public:
  template <class Kernel>
  int ensure(Kernel kernel, std::size_t bytes) {
    const int device = ROPESCALE_CURRENT_DEVICE();
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached && bytes > 0 && opted_in_[device].load(std::memory_order_acquire) >= bytes) return 0;
    const int status = ROPESCALE_OPT_IN_DYNAMIC_SMEM(kernel, bytes);
    if (status == 0 && cached) opted_in_[device].store(bytes, std::memory_order_release);
    return status;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<std::size_t> opted_in_[kMaxDevices] = {};  // bytes opted in per device; 0: not yet
};

// Two floats rounded to nearest into one .f16x2 / .bf16x2 register, `lo` in the lower 16 bits
// (the element with the lower index, as the mma and ldmatrix fragments hold them).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "f16 or bf16");
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 pair = __floats2half2_rn(lo, hi);
    std::memcpy(&bits, &pair, sizeof bits);
  } else {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    std::memcpy(&bits, &pair, sizeof bits);
  }
  return bits;
}

// dst[0], dst[1] = lo, hi rounded to nearest, as one 32-bit store (dst 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
  const uint32_t bits = pack2<T>(lo, hi);
#if defined(ROPESCALE_EMULATION)
  std::memcpy(static_cast<void*>(dst), &bits, sizeof bits);  // (no type-punned store in host C++)
#else
  *reinterpret_cast<uint32_t*>(dst) = bits;
#endif
}

// acc = A B + acc for the warp: A 16x16 (a: 4 registers per lane), B 16x8 (b: 2), acc 16x8 f32
// (4 per lane), in the fragment layouts of PTX ISA section 9.7.14.5.8. Every lane of the warp must
// call it (warp-uniform control flow).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "f16 or bf16");
#if defined(ROPESCALE_EMULATION)
  ::ropescale_emu::mma_m16n8k16<T>(acc, a, b, acc);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // tensor-core kernels are compiled for sm_80 and newer only
#endif
}

// kNum (1, 2 or 4) 8x8 matrices of 16-bit elements from shared memory: lane 8m + j passes the
// address of row j of matrix m (16 bytes, 16-byte aligned); lane l gets in r[m] the elements
// (row l/4, columns 2(l%4), 2(l%4)+1) of matrix m, or with kTrans (rows 2(l%4), 2(l%4)+1, column
// l/4). Warp-collective like mma_m16n8k16.
template <int kNum, bool kTrans = false>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[kNum], const void* row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(ROPESCALE_EMULATION)
  ::ropescale_emu::ldmatrix_m8n8_b16<kNum, kTrans>(r, row);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kNum == 1 && !kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
  else if constexpr (kNum == 1)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
  else if constexpr (kNum == 2 && !kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
  else if constexpr (kNum == 2)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
  else if constexpr (!kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#else
  (void)row;
  __trap();
#endif
}

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), asynchronously, through L2 only
// (.cg); bytes past src_bytes (0 or 16 here) are zero-filled. `dst` is undefined until this
// thread's cp_async_wait covering it, and other threads may read it only after a barrier that
// follows that wait.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
#if defined(ROPESCALE_EMULATION)
  ::ropescale_emu::cp_async<16>("cp.async.cg.shared.global", dst, src, src_bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src), "r"(src_bytes));
#else
  (void)dst, (void)src, (void)src_bytes;
  __trap();
#endif
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(ROPESCALE_EMULATION)
  ::ropescale_emu::cp_async_commit_group();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#else
  __trap();
#endif
}

// Waits until at most the kPending most recent groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(ROPESCALE_EMULATION)
  ::ropescale_emu::cp_async_wait_group(kPending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#else
  __trap();
#endif
}

}  // namespace ropescale::device

#endif  // ROPESCALE_EMULATION || __CUDACC__
