// rerope_attention_paged and rerope_cache_write_ on CUDA: ATen glue around the paged kernels of
// ropescale/rerope_attention.cuh (the schedule kernel, the paged SIMT body it shares with dense
// decode, the split combine; the cache-write kernel) and ropescale/rerope_attention_tc.cuh (the
// tensor-core prefill it shares with the dense op, and its paged pre-passes): the shared checks
// (rerope_paged.h), device guard, current stream, workspaces, dtype and head-dim dispatch, a check
// after every launch.
//
// No host sync: the metadata (query_start_loc, seq_lens, block_table) stays on the device and the
// grid is an upper bound of the work computed from the sizes alone. The value checks the CPU kernel
// makes with an error are the caller's contract here; the schedule kernel still guards every read:
// a request whose pages fall outside [0, num_blocks), whose seq_len is past its block-table row, or
// whose q_len is past its seq_len gets NaN rows, and nothing outside the cache is read.
//
// What runs where: fp16/bf16 at head dims 64/80/96/128 on sm_80+ (caches whose rows are 16-byte
// aligned), in a launch whose sizes allow a request of more than 4 rows (T >= R + 4,
// rerope_paged_tc_possible): the rows of requests with more than 4 queries (prefill, chunked prefill)
// run on the tensor cores at any length, over keys (both sides) a pre-pass rotates through the block
// table into the workspace while they fit its budget, and past it rotating their key tiles from the
// pages inside the kernel; every other row (decode rows, fp32, other head dims) runs the SIMT body with
// keys rotated in shared memory tile by tile, its key splits sized on the device from each request's
// length. One schedule kernel decides both, on the device. Nothing is allocated for the tensor cores
// when no tensor-core row can exist (a decode step); the workspace is the caller's when it passes one
// (`workspace`, rerope_paged_workspace_bytes: an engine reserves it once, inside what it profiles),
// else the op's own (rerope_paged_tc_key_budget keys).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda_element.h"
#include "device_info.h"
#include "ops.h"
#include "rerope_paged.h"
#include "ropescale/rerope_attention.cuh"
#include "ropescale/rerope_attention_tc.cuh"
#include "ropescale/rerope_paged_plan.h"

namespace ropescale {
namespace {

using rerope_cuda::ReropeParams;

template <const char* kOp>
struct ThrowOnLaunchError {
  void operator()(int status, const char* what) const {
    TORCH_CHECK(status == 0, kOp, ": ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(status)));
  }
};
constexpr char kPagedOp[] = "rerope_attention_paged";
constexpr char kWriteOp[] = "rerope_cache_write_";

template <typename T, class Shape>
void launch_paged(const ReropePagedArgs& a, ReropeParams p, cudaStream_t stream, int multiprocessors) {
  const auto options = a.q.options();
  const int group = static_cast<int>(a.q_heads / a.kv_heads);
  const int64_t tasks = rerope_cuda::rerope_paged_max_tasks(a.tokens, a.requests, group, Shape::kRows);
  TORCH_CHECK(tasks <= std::numeric_limits<int>::max(), kPagedOp, ": too many query rows for one launch (", a.tokens,
              " tokens x ", group, " q heads per k/v head)");
  p.num_paged_tasks = static_cast<int>(tasks);
  // Workspaces: the validated requests, the task offsets and the task list (4 ints each).
  constexpr int64_t kRequestInts = sizeof(rerope_cuda::PagedRequest) / sizeof(int);
  at::Tensor requests = at::empty({a.requests * kRequestInts}, options.dtype(at::kInt));
  at::Tensor offsets = at::empty({a.requests + 1}, options.dtype(at::kInt));
  at::Tensor task_list = at::empty({tasks * 4}, options.dtype(at::kInt));
  p.paged_requests = reinterpret_cast<rerope_cuda::PagedRequest*>(requests.data_ptr<int>());
  p.paged_task_offsets = offsets.data_ptr<int>();
  p.paged_tasks = reinterpret_cast<rerope_cuda::PagedTask*>(task_list.data_ptr<int>());
  // The block table's page checks, one flag per chunk of a request's row (rerope_paged_prepare_kernel,
  // one block per flag and up to 1024 more for the turn rates: the grid's x).
  const int64_t page_chunks = a.requests * rerope_cuda::rerope_paged_page_chunks(p.max_blocks);
  TORCH_CHECK(page_chunks + 1024 <= std::numeric_limits<int>::max(), kPagedOp, ": block table too large for one launch (",
              a.requests, " x ", a.max_blocks, " pages)");
  at::Tensor page_flags = at::empty({page_chunks}, options.dtype(at::kInt));
  p.paged_page_flags = page_flags.data_ptr<int>();
  // Splits from the SM count and the task bound; each request sizes its own on the device.
  const int splits = rerope_cuda::rerope_paged_splits<Shape>(p, multiprocessors);
  at::Tensor partial_out, partial_lse;
  if (splits > 1) {
    partial_out = at::empty({splits, a.tokens * a.q_heads, a.head_dim}, options.dtype(at::kFloat));
    partial_lse = at::empty({splits, a.tokens * a.q_heads}, options.dtype(at::kFloat));
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  // The SIMT rows and then the tensor-core rows (p.paged_tc), from these params: the tensor-core kernels
  // read the workspaces set above.
  rerope_cuda::launch_rerope_paged_with_tensor_cores<T, Shape>(p, splits, stream, ThrowOnLaunchError<kPagedOp>{});
}

// `base` rounded up to the workspace's alignment (rerope_paged_workspace_layout counts the slack).
unsigned char* aligned_base(void* base) {
  const auto address = reinterpret_cast<uintptr_t>(base);
  const auto align = static_cast<uintptr_t>(rerope_cuda::kPagedWorkspaceAlign);
  return reinterpret_cast<unsigned char*>((address + align - 1) / align * align);
}

template <typename T>
void launch(const ReropePagedArgs& a, ReropeParams p, cudaStream_t stream) {
  const CudaDeviceInfo device = cuda_device_info(a.q.get_device());
  const auto smem_optin = static_cast<std::size_t>(device.shared_memory_per_block_optin);
  const auto options = a.q.options();
  // The keys' turn rates (one row per request with per-request tables): written by the launch's first
  // kernel, read by every kernel that rotates keys.
  at::Tensor key_rates = at::empty({(a.per_request_inv_freq ? a.requests : 1) * a.rotary_pairs *
                                    static_cast<int64_t>(sizeof(KeyRate) / sizeof(int64_t))},
                                   options.dtype(at::kLong));
  p.key_rates = reinterpret_cast<KeyRate*>(key_rates.data_ptr<int64_t>());
  // The tensor-core prefill: fp16/bf16, its head dims, sm_80+ (mma.sync, ldmatrix, cp.async), its shared
  // memory, caches whose rows cp.async can read (values, and keys rotated in the kernel, are read in
  // place), and sizes that allow a tensor-core row at all (nothing is allocated for a decode step).
  // Its workspaces: the schedule's choice (key offsets, task list), the queries' sin/cos and the
  // pre-rotated keys (the caller's `workspace`, or the op's own).
  const int head_dim = static_cast<int>(a.head_dim);
  bool tensor_cores = false;
  at::Tensor tc_key_offsets, tc_tasks, own_workspace;
  if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    tensor_cores = rerope_cuda::rerope_tc_head_dim(head_dim) && device.major >= 8 &&
                   rerope_cuda::rerope_paged_tc_smem_bytes(head_dim) <= smem_optin && a.q_heads <= 65535 &&
                   rerope_cuda::rerope_paged_tc_aligned(p, sizeof(T)) &&
                   rerope_cuda::rerope_paged_tc_possible(a.tokens, a.requests);
  }
  if (tensor_cores) {
    const int64_t capacity = a.max_blocks * a.block_size;
    const auto element_bytes = static_cast<int64_t>(sizeof(T));
    rerope_cuda::PagedTcWorkspace layout;
    unsigned char* base = nullptr;
    if (a.workspace) {  // the engine's reservation: as many pre-rotated keys as it holds beyond the queries' part
      layout = rerope_cuda::rerope_paged_workspace_within(a.workspace->numel(), a.tokens, a.kv_heads, a.head_dim,
                                                          element_bytes);
      TORCH_CHECK(layout.keys >= 0, kPagedOp, ": workspace has ", a.workspace->numel(), " bytes, this call needs ",
                  layout.bytes);  // (the shared check refuses it first)
      base = aligned_base(a.workspace->data_ptr());
    } else {
      layout = rerope_cuda::rerope_paged_workspace_layout(
          a.tokens, a.kv_heads, a.head_dim, element_bytes,
          rerope_cuda::rerope_paged_tc_key_budget(a.tokens, a.requests, capacity));
      own_workspace = at::empty({layout.bytes}, options.dtype(at::kByte));
      base = aligned_base(own_workspace.data_ptr());
    }
    const int64_t most = a.requests * capacity;
    p.paged_tc = true;
    p.paged_tc_key_budget = layout.keys < most ? layout.keys : most;
    const int64_t tc_task_count = rerope_cuda::rerope_paged_max_tc_tasks(a.tokens, a.requests);
    TORCH_CHECK(tc_task_count <= std::numeric_limits<int>::max(), kPagedOp, ": too many query rows for one launch");
    tc_key_offsets = at::empty({a.requests + 1}, options.dtype(at::kInt));
    tc_tasks = at::empty({tc_task_count * 4}, options.dtype(at::kInt));
    p.paged_tc_key_offsets = tc_key_offsets.data_ptr<int>();
    p.paged_tc_tasks = reinterpret_cast<rerope_cuda::PagedTask*>(tc_tasks.data_ptr<int>());
    p.num_paged_tc_tasks = static_cast<int>(tc_task_count);
    p.q_rotation = reinterpret_cast<float*>(base + layout.q_rotation);
    p.k_near = p.paged_tc_key_budget > 0 ? base + layout.k_near : nullptr;
    p.k_far = p.paged_tc_key_budget > 0 ? base + layout.k_far : nullptr;  // Leaky: keys at p/k; ReRoPE: the raw keys
  }
  // The key rates, the schedule, the SIMT rows (with the split combine) and the tensor-core rows, in the
  // tile shape the device allows.
  const std::size_t missing = rerope_cuda::with_simt_shape(head_dim, smem_optin, [&]<class Shape>() {
    launch_paged<T, Shape>(a, p, stream, device.multiprocessors);
  });
  TORCH_CHECK(missing == 0, kPagedOp, ": head dim ", a.head_dim, " needs ", missing,
              " bytes of shared memory per block on CUDA, and this GPU (compute capability ", device.major, ".",
              device.minor, ") allows ", smem_optin);
}

}  // namespace

namespace {

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, const std::optional<at::Tensor>& workspace, int64_t group, int64_t chunk_size, int64_t far_start) {
  const ReropePagedArgs a = check_rerope_paged_args(q, key_cache, value_cache, block_table, seq_lens,
                                                    query_start_loc, inv_freq, window, leaky_k, scale, scale_factors,
                                                    logn_length, interleaved, workspace, group, chunk_size, far_start);
  TORCH_CHECK(a.q.is_cuda(), kPagedOp, ": the CUDA kernel got tensors on ", a.q.device());
  const c10::cuda::CUDAGuard guard(a.q.device());
  at::Tensor out = at::empty({a.tokens, a.q_heads, a.head_dim}, a.q.options());
  at::Tensor lse = at::empty({a.tokens, a.q_heads}, a.q.options().dtype(at::kFloat));
  if (a.tokens == 0 || a.requests == 0) return {out, lse};
  // int index sums (a key split's end, a tile's first key, a row's first token) stay below INT_MAX.
  constexpr int64_t kMaxLength = std::numeric_limits<int>::max() - 4096;
  TORCH_CHECK(a.tokens <= kMaxLength && a.max_blocks * a.block_size <= kMaxLength && a.num_blocks <= kMaxLength,
              kPagedOp, ": sizes must be <= ", kMaxLength, " on CUDA, got ", a.tokens, " tokens, ", a.num_blocks,
              " pages and ", a.max_blocks * a.block_size, " slots per block-table row");
  TORCH_CHECK(a.kv_heads <= 65535, kPagedOp, ": at most 65535 k/v heads on CUDA, got ", a.kv_heads);

  ReropeParams p;
  p.q = a.q.data_ptr();
  p.q_stride_l = a.q.stride(0), p.q_stride_h = a.q.stride(1);
  p.k = a.key_cache.data_ptr();
  p.v = a.value_cache.data_ptr();
  p.k_stride_b = a.key_cache.stride(0), p.k_stride_h = a.key_cache.stride(1), p.k_stride_l = a.key_cache.stride(2);
  p.v_stride_b = a.value_cache.stride(0), p.v_stride_h = a.value_cache.stride(1);
  p.v_stride_l = a.value_cache.stride(2);
  p.block_table = a.block_table.data_ptr<int>();
  p.seq_lens = a.seq_lens.data_ptr<int>();
  p.query_start_loc = a.query_start_loc.data_ptr<int>();
  p.inv_freq = a.inv_freq.data_ptr<float>();
  p.inv_freq_stride = a.per_request_inv_freq ? a.rotary_pairs : 0;
  p.scale_factors = a.scale_factors ? a.scale_factors->data_ptr<float>() : nullptr;
  p.requests = static_cast<int>(a.requests), p.num_blocks = static_cast<int>(a.num_blocks);
  p.block_size = static_cast<int>(a.block_size), p.max_blocks = static_cast<int>(a.max_blocks);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.batch = 1, p.q_heads = static_cast<int>(a.q_heads), p.kv_heads = static_cast<int>(a.kv_heads);
  p.q_len = static_cast<int>(a.tokens), p.k_len = 0;
  p.head_dim = static_cast<int>(a.head_dim), p.rotary_pairs = static_cast<int>(a.rotary_pairs);
  p.rule = a.rule, p.logn_length = a.logn_length;
  p.inv_log_train = a.inv_log_train;
  p.scale = a.scale, p.causal = true, p.interleaved = a.interleaved;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_SWITCH(a.q.scalar_type(), "rerope_attention_paged_cuda",
                     AT_DISPATCH_CASE_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, [&] {
                       using T = typename CudaElement<scalar_t>::type;
                       if constexpr (!std::is_same_v<T, double>) launch<T>(a, p, stream);
                     }));
  return {out, lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_cuda(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start) {
  return paged_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, leaky_k,
                         scale, scale_factors, logn_length, interleaved, std::nullopt, group, chunk_size, far_start);
}

std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_cuda(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace) {
  return paged_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window, leaky_k,
                         scale, scale_factors, logn_length, interleaved, workspace, group, chunk_size, far_start);
}

void rerope_cache_write_cuda_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping) {
  check_rerope_cache_write(key_cache, value_cache, key, value, slot_mapping);
  TORCH_CHECK(key.is_cuda(), kWriteOp, ": the CUDA kernel got tensors on ", key.device());
  const c10::cuda::CUDAGuard guard(key.device());
  if (key.numel() == 0) return;
  // Unit last strides for the kernel (the caches have them: checked); slots as int64 on the device.
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  rerope_cuda::CacheWriteParams p;
  p.key_cache = key_cache.data_ptr(), p.value_cache = value_cache.data_ptr();
  p.key = k.data_ptr(), p.value = v.data_ptr(), p.slot_mapping = slots.data_ptr<int64_t>();
  p.key_stride_t = k.stride(0), p.key_stride_h = k.stride(1);
  p.value_stride_t = v.stride(0), p.value_stride_h = v.stride(1);
  p.cache_stride_block = key_cache.stride(0), p.cache_stride_h = key_cache.stride(1);
  p.cache_stride_slot = key_cache.stride(2);
  p.vcache_stride_block = value_cache.stride(0), p.vcache_stride_h = value_cache.stride(1);
  p.vcache_stride_slot = value_cache.stride(2);
  p.tokens = k.size(0), p.slots = key_cache.size(0) * key_cache.size(2);
  p.kv_heads = static_cast<int>(k.size(1)), p.head_dim = static_cast<int>(k.size(2));
  p.block_size = static_cast<int>(key_cache.size(2));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_SWITCH(key.scalar_type(), "rerope_cache_write_cuda",
                     AT_DISPATCH_CASE_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, [&] {
                       using T = typename CudaElement<scalar_t>::type;
                       rerope_cuda::launch_rerope_cache_write<T>(p, stream, ThrowOnLaunchError<kWriteOp>{});
                     }));
}

}  // namespace ropescale
