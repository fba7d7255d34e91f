// rerope_attention on CUDA: ATen glue around the kernels of ropescale/rerope_attention.cuh (SIMT:
// fp32, decode, other head dims) and ropescale/rerope_attention_tc.cuh (tensor cores: fp16/bf16
// prefill, head dims 64/80/96/128): checks, device guard, current stream, workspaces, dtype and
// head-dim dispatch, a check after every launch. What a device allows (compute capability, shared
// memory per block) is asked once per device (device_info.h) and picks the kernel and its tiles:
// tensor cores from compute capability 8.0 on, the SIMT tile shape that fits the device's
// sharedMemPerBlockOptin (compact tiles for head dims above 128 on sm_86/89/120).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // (not ATen/cuda/CUDAContext.h: it needs the cuSPARSE/cuBLAS headers)

#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda_element.h"
#include "device_info.h"
#include "ops.h"
#include "rerope_attention.h"
#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_attention_tc.cuh"

namespace ropescale {
namespace {

using rerope_cuda::ReropeParams;

// Up to this many query tokens, the decode plan (keys split over the grid, rotation of the window
// tiles in shared memory) beats rotating every key of the cache first. Decode stays on the SIMT
// kernel at every dtype: it is bound by memory bandwidth (see rerope_attention.cuh).
constexpr int64_t kDecodeMaxQueries = 16;

// The launchers' check after every launch: throws, so no kernel reads the output of a failed one.
struct ThrowOnLaunchError {
  void operator()(int status, const char* what) const {
    TORCH_CHECK(status == 0, "rerope_attention: ", what, " failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(status)));
  }
};

template <typename T, class Shape>
void launch_simt(const ReropeArgs& a, ReropeParams p, cudaStream_t stream, int multiprocessors) {
  const auto f32 = a.q.options().dtype(at::kFloat);
  if (a.q_len <= kDecodeMaxQueries) {
    TORCH_CHECK(rerope_cuda::rerope_decode_grid_y<Shape>(p) <= 65535,
                "rerope_attention: too many query rows per k/v head for one decode launch (", a.q_len, " x ",
                a.q_heads / a.kv_heads, " heads)");
    const int splits = rerope_cuda::rerope_decode_splits<Shape>(p, multiprocessors);
    at::Tensor partial_out, partial_lse;
    if (splits > 1) {
      const int64_t rows = a.batch * a.q_heads * a.q_len;
      partial_out = at::empty({splits, rows, a.head_dim}, f32);
      partial_lse = at::empty({splits, rows}, f32);
      p.partial_out = partial_out.data_ptr<float>();
      p.partial_lse = partial_lse.data_ptr<float>();
    }
    rerope_cuda::launch_rerope_decode<T, Shape>(p, splits, stream, ThrowOnLaunchError{});
  } else {
    TORCH_CHECK(rerope_cuda::rerope_prefill_grid_y<Shape>(p) <= 65535,
                "rerope_attention: too many queries per k/v head for one launch (", a.q_len, " x ",
                a.q_heads / a.kv_heads, " heads); split the queries into chunks");
    at::Tensor k_near = at::empty({a.batch, a.kv_heads, a.k_len, a.head_dim}, f32);
    at::Tensor k_far = a.rule.far_key_rotated() ? at::empty_like(k_near) : at::Tensor();
    p.k_near = k_near.data_ptr<float>();
    p.k_far = k_far.defined() ? k_far.data_ptr<float>() : nullptr;
    rerope_cuda::launch_rerope_prefill<T, Shape>(p, stream, ThrowOnLaunchError{});
  }
}

// cp.async moves 16-byte rows: base and every stride (in 2-byte elements) must be 16-byte aligned.
bool rows_16_byte_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
         t.stride(2) % 8 == 0;
}
at::Tensor aligned_rows(const at::Tensor& t) {
  return rows_16_byte_aligned(t) ? t : at::empty(t.sizes(), t.options()).copy_(t);
}

// fp16 / bf16 prefill on tensor cores (rerope_attention_tc.cuh): keys rotated to T, key-tile bounds,
// then the FlashAttention-2-style kernel.
template <typename T, int kHeadDim>
void launch_tensor_core(const ReropeArgs& a, ReropeParams p, cudaStream_t stream) {
  TORCH_CHECK(a.q_heads <= 65535 && a.batch <= 65535, "rerope_attention: batch and q heads must be <= 65535, got ",
              a.batch, " and ", a.q_heads);
  const at::Tensor k = aligned_rows(a.k), v = aligned_rows(a.v);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_stride_b = k.stride(0), p.k_stride_h = k.stride(1), p.k_stride_l = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_h = v.stride(1), p.v_stride_l = v.stride(2);
  at::Tensor k_near = at::empty({a.batch, a.kv_heads, a.k_len, a.head_dim}, a.q.options());
  at::Tensor k_far = a.rule.far_key_rotated() ? at::empty_like(k_near) : at::Tensor();
  p.k_near = k_near.data_ptr();
  p.k_far = k_far.defined() ? k_far.data_ptr() : nullptr;
  at::Tensor q_rotation = at::empty({rerope_cuda::rerope_tc_query_rotation_floats(p)}, a.q.options().dtype(at::kFloat));
  p.q_rotation = q_rotation.data_ptr<float>();
  const int64_t tiles = a.batch * rerope_cuda::rerope_tc_key_tiles(static_cast<int>(a.k_len));
  at::Tensor tile_bounds =
      at::empty({tiles * static_cast<int64_t>(sizeof(rerope_cuda::KeyTile))}, a.q.options().dtype(at::kByte));
  rerope_cuda::launch_rerope_prefill_tc<T, kHeadDim>(
      p, reinterpret_cast<rerope_cuda::KeyTile*>(tile_bounds.data_ptr()), stream, ThrowOnLaunchError{});
}

template <typename T>
void launch(const ReropeArgs& a, const ReropeParams& p, cudaStream_t stream) {
  const CudaDeviceInfo device = cuda_device_info(a.q.get_device());
  const auto smem_optin = static_cast<std::size_t>(device.shared_memory_per_block_optin);
  if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    // mma.sync.m16n8k16, ldmatrix and cp.async exist from compute capability 8.0 on: below it (a build
    // that adds such an arch) the SIMT kernels serve, never a kernel compiled to __trap().
    const int head_dim = static_cast<int>(a.head_dim);
    if (a.q_len > kDecodeMaxQueries && rerope_cuda::rerope_tc_head_dim(head_dim) && device.major >= 8 &&
        rerope_cuda::rerope_tc_smem_bytes(head_dim) <= smem_optin) {
      switch (a.head_dim) {
        case 64: return launch_tensor_core<T, 64>(a, p, stream);
        case 80: return launch_tensor_core<T, 80>(a, p, stream);
        case 96: return launch_tensor_core<T, 96>(a, p, stream);
        default: return launch_tensor_core<T, 128>(a, p, stream);
      }
    }
  }
  // fp32, decode, and the head dims the tensor-core kernel does not take (256 among them), in the
  // tile shape the device's shared memory allows.
  const std::size_t missing = rerope_cuda::with_simt_shape(static_cast<int>(a.head_dim), smem_optin, [&]<class Shape>() {
    launch_simt<T, Shape>(a, p, stream, device.multiprocessors);
  });
  TORCH_CHECK(missing == 0, "rerope_attention: head dim ", a.head_dim, " needs ", missing,
              " bytes of shared memory per block on CUDA, and this GPU (compute capability ", device.major, ".",
              device.minor, ") allows ", smem_optin);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rerope_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                         int64_t window, double leaky_k, double scale,
                                                         int64_t logn_length, bool causal, bool interleaved,
                                                         int64_t group, int64_t chunk_size, int64_t far_start) {
  const ReropeArgs a = check_rerope_attention_args(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k,
                                                   scale, logn_length, causal, interleaved, group, chunk_size, far_start);
  TORCH_CHECK(a.q.is_cuda(), "rerope_attention: the CUDA kernel got tensors on ", a.q.device());
  const c10::cuda::CUDAGuard guard(a.q.device());
  at::Tensor out, lse;
  if (empty_rerope_outputs(a, out, lse)) return {out, lse};
  // int index sums (a key split's end, a tile's first key) stay below INT_MAX.
  constexpr int64_t kMaxLength = std::numeric_limits<int>::max() - 4096;
  TORCH_CHECK(a.q_len <= kMaxLength && a.k_len <= kMaxLength, "rerope_attention: sequence lengths must be <= ",
              kMaxLength, " on CUDA, got ", a.q_len, " queries and ", a.k_len, " keys");
  TORCH_CHECK(a.batch * a.kv_heads <= 65535,
              "rerope_attention: sizes too large for one launch (batch x k/v heads must be <= 65535)");

  ReropeParams p;
  p.q = a.q.data_ptr();
  p.k = a.k.data_ptr();
  p.v = a.v.data_ptr();
  p.q_stride_b = a.q.stride(0), p.q_stride_h = a.q.stride(1), p.q_stride_l = a.q.stride(2);
  p.k_stride_b = a.k.stride(0), p.k_stride_h = a.k.stride(1), p.k_stride_l = a.k.stride(2);
  p.v_stride_b = a.v.stride(0), p.v_stride_h = a.v.stride(1), p.v_stride_l = a.v.stride(2);
  p.q_positions = a.q_positions.data_ptr<int64_t>();
  p.k_positions = a.k_positions.data_ptr<int64_t>();
  p.inv_freq = a.inv_freq.data_ptr<float>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.batch = static_cast<int>(a.batch), p.q_heads = static_cast<int>(a.q_heads);
  p.kv_heads = static_cast<int>(a.kv_heads), p.q_len = static_cast<int>(a.q_len);
  p.k_len = static_cast<int>(a.k_len), p.head_dim = static_cast<int>(a.head_dim);
  p.rotary_pairs = static_cast<int>(a.rotary_pairs);
  p.rule = a.rule, p.logn_length = a.logn_length;
  p.inv_log_train = a.inv_log_train;
  p.scale = a.scale, p.causal = a.causal, p.interleaved = a.interleaved;
  // The keys' turn rates (turn_angles.h), written by each launch's first kernel: no FP64 per key.
  at::Tensor key_rates = at::empty({a.rotary_pairs * static_cast<int64_t>(sizeof(KeyRate) / sizeof(int64_t))},
                                   a.q.options().dtype(at::kLong));
  p.key_rates = reinterpret_cast<KeyRate*>(key_rates.data_ptr<int64_t>());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_SWITCH(a.q.scalar_type(), "rerope_attention_cuda",
                     AT_DISPATCH_CASE_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, [&] {
                       using T = typename CudaElement<scalar_t>::type;
                       if constexpr (!std::is_same_v<T, double>) launch<T>(a, p, stream);
                     }));
  return {out, lse};
}

}  // namespace ropescale
