// rerope_attention on CUDA: ATen glue around the kernels of ropescale/rerope_attention.cuh (checks,
// device guard, current stream, workspaces, dtype and head-dim dispatch, checked launches).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // (not ATen/cuda/CUDAContext.h: it needs the cuSPARSE/cuBLAS headers)

#include <limits>

#include "cuda_element.h"
#include "ops.h"
#include "rerope_attention.h"
#include "ropescale/rerope_attention.cuh"

namespace ropescale {
namespace {

using rerope_cuda::ReropeParams;


// Up to this many query tokens, the decode plan (keys split over the grid, rotation of the window
// tiles in shared memory) beats rotating every key of the cache first.
constexpr int64_t kDecodeMaxQueries = 16;

template <typename T, int kMaxDim>
void launch(const ReropeArgs& a, ReropeParams p, cudaStream_t stream) {
  const auto f32 = a.q.options().dtype(at::kFloat);
  if (a.q_len <= kDecodeMaxQueries) {
    int multiprocessors = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, a.q.get_device()));
    const int splits = rerope_cuda::rerope_decode_splits<kMaxDim>(p, multiprocessors);
    at::Tensor partial_out, partial_lse;
    if (splits > 1) {
      const int64_t rows = a.batch * a.q_heads * a.q_len;
      partial_out = at::empty({splits, rows, a.head_dim}, f32);
      partial_lse = at::empty({splits, rows}, f32);
      p.partial_out = partial_out.data_ptr<float>();
      p.partial_lse = partial_lse.data_ptr<float>();
    }
    rerope_cuda::launch_rerope_decode<T, kMaxDim>(p, splits, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const int64_t query_blocks = (a.q_len + rerope_cuda::TileShape<kMaxDim>::kRows - 1) /
                                 rerope_cuda::TileShape<kMaxDim>::kRows;
    TORCH_CHECK(query_blocks * (a.q_heads / a.kv_heads) <= 65535,
                "rerope_attention: too many queries per k/v head for one launch (", a.q_len, " x ",
                a.q_heads / a.kv_heads, " heads); split the queries into chunks");
    at::Tensor k_near = at::empty({a.batch, a.kv_heads, a.k_len, a.head_dim}, f32);
    at::Tensor k_far = a.leaky_inv != 0.0 ? at::empty_like(k_near) : at::Tensor();
    p.k_near = k_near.data_ptr<float>();
    p.k_far = k_far.defined() ? k_far.data_ptr<float>() : nullptr;
    rerope_cuda::launch_rerope_prefill<T, kMaxDim>(p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rerope_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                         int64_t window, double leaky_k, double scale,
                                                         int64_t logn_length, bool causal, bool interleaved) {
  const ReropeArgs a = check_rerope_attention_args(q, k, v, q_positions, k_positions, inv_freq, window, leaky_k,
                                                   scale, logn_length, causal, interleaved);
  TORCH_CHECK(a.q.is_cuda(), "rerope_attention: the CUDA kernel got tensors on ", a.q.device());
  const c10::cuda::CUDAGuard guard(a.q.device());
  at::Tensor out, lse;
  if (empty_rerope_outputs(a, out, lse)) return {out, lse};
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(a.q_len <= kIntMax && a.k_len <= kIntMax && a.batch * a.kv_heads <= 65535,
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
  p.window = a.window, p.logn_length = a.logn_length;
  p.leaky_inv = a.leaky_inv, p.inv_log_train = a.inv_log_train;
  p.scale = a.scale, p.causal = a.causal, p.interleaved = a.interleaved;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_SWITCH(a.q.scalar_type(), "rerope_attention_cuda",
                     AT_DISPATCH_CASE_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, [&] {
                       using T = typename CudaElement<scalar_t>::type;
                       if constexpr (!std::is_same_v<T, double>) {
                         if (a.head_dim <= 64)
                           launch<T, 64>(a, p, stream);
                         else if (a.head_dim <= 128)
                           launch<T, 128>(a, p, stream);
                         else
                           launch<T, 256>(a, p, stream);
                       }
                     }));
  return {out, lse};
}

}  // namespace ropescale
