// ATen-side pieces of rerope_attention_paged and rerope_cache_write_ (docs/DESIGN.md, "Paged ReRoPE
// attention") shared by the CPU and CUDA entry points and the Meta kernels: the checks (done once, at
// the op boundary) and the normalised arguments both backends run from.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "ropescale/rerope_math.h"

namespace ropescale {

struct ReropePagedArgs {
  at::Tensor q;                             // [T, Hq, D], unit stride on the last dim
  at::Tensor key_cache, value_cache;        // [num_blocks, Hkv, block_size, D], last two dims contiguous
  at::Tensor block_table;                   // int32 [R, max_blocks], contiguous
  at::Tensor seq_lens;                      // int32 [R], contiguous
  at::Tensor query_start_loc;               // int32 [R + 1], contiguous
  at::Tensor inv_freq;                      // float32 [R or 1, rotary_pairs], contiguous
  std::optional<at::Tensor> scale_factors;  // float32 [R], contiguous; none = 1
  std::optional<at::Tensor> workspace;      // uint8 [bytes] (CUDA scratch; rerope_paged_workspace_bytes), or none
  int64_t tokens = 0, requests = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_pairs = 0;
  int64_t num_blocks = 0, block_size = 0, max_blocks = 0;
  bool per_request_inv_freq = false;  // inv_freq has one row per request
  int64_t logn_length = 0;
  RegionRule rule;             // ReRoPE / Leaky ReRoPE, Self-Extend or Dual Chunk (rerope_math.h)
  double inv_log_train = 0.0;  // 1/ln(logn_length), 0 when log-n is off
  float scale = 0.0f;          // softmax scale (1/sqrt(D) when the caller passed -1)
  bool interleaved = false;
};

// Metadata checks of rerope_attention_paged (devices, dtypes, shapes, head counts, D, the scalars, the
// workspace's device, dtype and size), shared by the CPU, CUDA and Meta kernels; symbolic sizes are fine.
// Messages name the op and the argument.
void check_rerope_paged_meta(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
                             double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors,
                             int64_t logn_length, bool allow_float64, const std::optional<at::Tensor>& workspace,
                             int64_t group, int64_t chunk_size, int64_t far_start);

// The data checks (CPU tensors only; on CUDA they would cost a host sync per call, so there they are
// the caller's contract and the kernel guards its reads): query_start_loc[0] == 0, non-decreasing,
// ends at T; 0 <= q_len <= seq_lens[r] <= max_blocks * block_size; every page a request reads in
// [0, num_blocks). The error names the request.
void check_rerope_paged_values(const ReropePagedArgs& args);

// Validates (meta, then values on CPU) and normalises the arguments: int64 metadata and float64
// inv_freq converted, inv_freq made 2-D, the last dims made unit-stride.
ReropePagedArgs check_rerope_paged_args(const at::Tensor& q, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_table,
                                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                        const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                        const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
                                        bool interleaved, const std::optional<at::Tensor>& workspace, int64_t group,
                                        int64_t chunk_size, int64_t far_start);

// rerope_cache_write_'s checks (metadata; slot range on CPU): key/value [T, Hkv, D] matching the
// cache's heads and D, slot_mapping integer [T], slots < num_blocks * block_size.
void check_rerope_cache_write(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping);

// The Meta kernels: the shared checks, then empty outputs of the right shapes (rerope_cache_write_: the
// checks alone).
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_meta(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start);
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_meta(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace);
void rerope_cache_write_meta_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping);

// The op ropescale::_check_rerope_attention_paged: the metadata check and (CPU) the value checks, for
// the plain-PyTorch paths that compute the op (the float64 oracle: allow_float64; the reference
// kernels), so that they refuse what the op refuses with its messages.
void check_rerope_attention_paged_op(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
                                     double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors,
                                     int64_t logn_length, bool allow_float64,
                                     const std::optional<at::Tensor>& workspace, int64_t group, int64_t chunk_size, int64_t far_start);

}  // namespace ropescale
