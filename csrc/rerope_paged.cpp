// Input checks of rerope_attention_paged and rerope_cache_write_ (docs/DESIGN.md, "Paged ReRoPE
// attention"), shared by the CPU and CUDA entry points and by the Meta kernels (FakeTensorMode,
// torch.compile): one check per op, so the op and its fake refuse the same inputs with the same message.
// On CPU tensors the metadata VALUES are checked too (a page index outside the cache, a sequence
// longer than its pages, lengths that disagree), so no kernel ever reads outside the cache.
#include "rerope_paged.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "position_limits.h"
#include "rerope_attention.h"
#include "ropescale/rerope_paged_plan.h"

namespace ropescale {

namespace {

constexpr const char* kOp = "rerope_attention_paged";
constexpr const char* kWriteOp = "rerope_cache_write_";

void check_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q, const char* q_name) {
  TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on ", q.device(), " like ", q_name, ", got ",
              t.device());
}

void check_index_tensor(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be an integer tensor (int32 or int64), got ", t.scalar_type());
}

// The cache layout both ops read and write: [num_blocks, Hkv, block_size, D], the last two dims
// contiguous (a page of one head is one block of memory), any stride on the first two.
void check_cache_meta(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& q, const char* q_name) {
  TORCH_CHECK(key_cache.dim() == 4, op, ": key_cache must be 4-D [num_blocks, Hkv, block_size, D], got shape ",
              key_cache.sym_sizes());
  TORCH_CHECK(value_cache.dim() == 4, op, ": value_cache must be 4-D [num_blocks, Hkv, block_size, D], got shape ",
              value_cache.sym_sizes());
  check_device(op, key_cache, "key_cache", q, q_name);
  check_device(op, value_cache, "value_cache", q, q_name);
  TORCH_CHECK(key_cache.sym_sizes() == value_cache.sym_sizes(), op,
              ": key_cache and value_cache must have the same shape, got ", key_cache.sym_sizes(), " and ",
              value_cache.sym_sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), op,
              ": key_cache and value_cache must have the same dtype, got ", key_cache.scalar_type(), " and ",
              value_cache.scalar_type());
  TORCH_CHECK(key_cache.sym_size(1) > 0 && key_cache.sym_size(2) > 0, op,
              ": key_cache must have at least one head and a block_size >= 1, got shape ", key_cache.sym_sizes());
  for (const auto& [cache, name] : {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    // A size-1 dim may carry any stride; otherwise a page row is D apart and D is unit-stride.
    TORCH_CHECK((cache->sym_size(3) == 1 || cache->sym_stride(3) == 1) &&
                    (cache->sym_size(2) == 1 || cache->sym_stride(2) == cache->sym_size(3)),
                op, ": ", name, " must have its last two dims (block_size, D) contiguous, got strides ",
                cache->sym_strides());
  }
}

// The bytes a `workspace` must hold for a call of `tokens` query rows: what the CUDA tensor-core prefill
// needs whatever its budget (the queries' sin/cos, rerope_paged_workspace_layout with no pre-rotated key)
// where the dtype and head dim are the tensor cores', else 0. From the sizes alone, so that every
// backend (CPU, CUDA, Meta) refuses the same workspaces.
c10::SymInt required_workspace_bytes(at::ScalarType dtype, const c10::SymInt& tokens, const c10::SymInt& head_dim) {
  const auto d = head_dim.maybe_as_int();
  if ((dtype != at::kHalf && dtype != at::kBFloat16) || !d || !rerope_cuda::rerope_paged_tc_head_dim(*d)) return 0;
  constexpr int64_t align = rerope_cuda::kPagedWorkspaceAlign;
  const c10::SymInt q_bytes = tokens * (*d / 2) * 16;
  return align + (q_bytes + (align - 1)) / align * align;  // rerope_paged_workspace_layout(tokens, ..., 0).bytes
}

}  // namespace

int64_t rerope_paged_workspace_bytes(int64_t tokens, int64_t kv_heads, int64_t head_dim, at::ScalarType dtype,
                                     int64_t max_keys) {
  TORCH_CHECK(tokens >= 0, "rerope_paged_workspace_bytes: tokens must be >= 0, got ", tokens);
  TORCH_CHECK(kv_heads >= 1, "rerope_paged_workspace_bytes: kv_heads must be >= 1, got ", kv_heads);
  TORCH_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= kReropeMaxHeadDim,
              "rerope_paged_workspace_bytes: head_dim must be even and in [2, ", kReropeMaxHeadDim, "], got ", head_dim);
  TORCH_CHECK(max_keys >= -1, "rerope_paged_workspace_bytes: max_keys must be >= 0 (or -1 for the default), got ",
              max_keys);
  if ((dtype != at::kHalf && dtype != at::kBFloat16) || !rerope_cuda::rerope_paged_tc_head_dim(head_dim)) return 0;
  const int64_t keys = max_keys < 0 ? rerope_cuda::rerope_paged_default_key_budget(tokens)
                                    : (max_keys < (int64_t{1} << 30) ? max_keys : (int64_t{1} << 30));
  return rerope_cuda::rerope_paged_workspace_layout(tokens, kv_heads, head_dim, 2, keys).bytes;
}

void check_rerope_paged_meta(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
                             double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors,
                             int64_t logn_length, bool allow_float64, const std::optional<at::Tensor>& workspace,
                             int64_t group, int64_t chunk_size, int64_t far_start) {
  TORCH_CHECK(q.dim() == 3, kOp, ": q must be 3-D [T, Hq, D], got shape ", q.sym_sizes());
  // Devices first: a tensor on another device (meta among CPU tensors) must never reach a kernel.
  check_cache_meta(kOp, key_cache, value_cache, q, "q");
  check_device(kOp, block_table, "block_table", q, "q");
  check_device(kOp, seq_lens, "seq_lens", q, "q");
  check_device(kOp, query_start_loc, "query_start_loc", q, "q");
  check_device(kOp, inv_freq, "inv_freq", q, "q");
  if (scale_factors) check_device(kOp, *scale_factors, "scale_factors", q, "q");
  if (workspace) check_device(kOp, *workspace, "workspace", q, "q");

  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  (allow_float64 && dtype == at::kDouble),
              kOp, ": q must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(key_cache.scalar_type() == dtype, kOp, ": key_cache and value_cache must have q's dtype ", dtype,
              ", got ", key_cache.scalar_type());
  const c10::SymInt& head_dim = q.sym_size(2);
  TORCH_CHECK(key_cache.sym_size(3) == head_dim, kOp, ": q and key_cache must have the same head dim, got ",
              head_dim, " and ", key_cache.sym_size(3));
  const c10::SymInt& q_heads = q.sym_size(1);
  const c10::SymInt& kv_heads = key_cache.sym_size(1);
  TORCH_CHECK(q_heads % kv_heads == 0, kOp, ": the number of q heads (", q_heads,
              ") must be a multiple of the number of k/v heads (", kv_heads, ")");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim > 0 && head_dim <= kReropeMaxHeadDim, kOp,
              ": head dim D must be even and in [2, ", kReropeMaxHeadDim, "], got ", head_dim);

  check_index_tensor(kOp, block_table, "block_table");
  check_index_tensor(kOp, seq_lens, "seq_lens");
  check_index_tensor(kOp, query_start_loc, "query_start_loc");
  TORCH_CHECK(seq_lens.dim() == 1, kOp, ": seq_lens must be 1-D [R], got shape ", seq_lens.sym_sizes());
  const c10::SymInt& requests = seq_lens.sym_size(0);
  TORCH_CHECK(block_table.dim() == 2 && block_table.sym_size(0) == requests, kOp,
              ": block_table must have shape [R, max_blocks] with R = ", requests, " (seq_lens), got shape ",
              block_table.sym_sizes());
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.sym_size(0) == requests + 1, kOp,
              ": query_start_loc must have shape [R + 1] = [", requests + 1, "], got shape ",
              query_start_loc.sym_sizes());

  TORCH_CHECK(inv_freq.is_floating_point() && (inv_freq.dim() == 1 || inv_freq.dim() == 2), kOp,
              ": inv_freq must be a floating tensor [P] or [R, P], got shape ", inv_freq.sym_sizes(), " of ",
              inv_freq.scalar_type());
  TORCH_CHECK(inv_freq.dim() == 1 || inv_freq.sym_size(0) == requests, kOp,
              ": a 2-D inv_freq must have one row per request, [", requests, ", P], got shape ",
              inv_freq.sym_sizes());
  const c10::SymInt& pairs = inv_freq.sym_size(inv_freq.dim() - 1);
  TORCH_CHECK(pairs >= 1 && 2 * pairs <= head_dim, kOp, ": inv_freq must have between 1 and D/2 = ", head_dim / 2,
              " entries per row (rotary_dim / 2), got ", pairs);
  if (scale_factors) {
    TORCH_CHECK(scale_factors->is_floating_point() && scale_factors->dim() == 1 &&
                    scale_factors->sym_size(0) == requests,
                kOp, ": scale_factors must be a floating tensor [R] = [", requests, "], got shape ",
                scale_factors->sym_sizes(), " of ", scale_factors->scalar_type());
  }

  check_region_arguments(kOp, window, leaky_k, group, chunk_size, far_start, /*causal=*/true);
  TORCH_CHECK(logn_length == 0 || logn_length >= 2, kOp,
              ": logn_length must be 0 (off) or >= 2 (the training length), got ", logn_length);
  TORCH_CHECK(scale == -1.0 || (std::isfinite(scale) && scale > 0.0 && scale <= std::numeric_limits<float>::max()),
              kOp, ": scale must be finite and > 0 (or -1, None in Python, for 1/sqrt(D)), got ", scale);
  if (workspace) {
    TORCH_CHECK(workspace->scalar_type() == at::kByte && workspace->dim() == 1, kOp,
                ": workspace must be a 1-D uint8 tensor (rerope_paged_workspace_bytes bytes), got shape ",
                workspace->sym_sizes(), " of ", workspace->scalar_type());
    TORCH_CHECK(workspace->sym_size(0) == 1 || workspace->sym_stride(0) == 1, kOp,
                ": workspace must be contiguous, got stride ", workspace->sym_stride(0));
    const c10::SymInt required = required_workspace_bytes(dtype, q.sym_size(0), head_dim);
    TORCH_CHECK(workspace->sym_size(0) >= required, kOp, ": workspace has ", workspace->sym_size(0),
                " bytes, a call with T = ", q.sym_size(0), " query rows needs at least ", required,
                " (rerope_paged_workspace_bytes(tokens, kv_heads, head_dim, dtype) for the most tokens a call has)");
  }
}

// int32 metadata for the kernels; an int64 value outside int32 would wrap into a wrong (and possibly
// in-range) page or length, so on the CPU it is refused first.
static at::Tensor to_int32(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kLong && t.device().is_cpu() && t.numel() > 0) {
    const int64_t low = t.min().item<int64_t>(), high = t.max().item<int64_t>();
    TORCH_CHECK(low >= std::numeric_limits<int32_t>::min() && high <= std::numeric_limits<int32_t>::max(), kOp,
                ": ", name, " holds ", high > std::numeric_limits<int32_t>::max() ? high : low,
                ", outside int32 (no cache has that many slots)");
  }
  return t.to(at::kInt).contiguous();
}

void check_rerope_paged_values(const ReropePagedArgs& a) {
  if (!a.q.device().is_cpu()) return;
  const int32_t* starts = a.query_start_loc.data_ptr<int32_t>();
  const int32_t* lengths = a.seq_lens.data_ptr<int32_t>();
  const int32_t* table = a.block_table.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0, kOp, ": query_start_loc[0] must be 0, got ", starts[0]);
  TORCH_CHECK(starts[a.requests] == a.tokens, kOp, ": query_start_loc[R] = query_start_loc[", a.requests,
              "] must be T = ", a.tokens, " (q's rows), got ", starts[a.requests]);
  const int64_t capacity = a.max_blocks * a.block_size;
  for (int64_t r = 0; r < a.requests; ++r) {
    const int64_t q_len = static_cast<int64_t>(starts[r + 1]) - starts[r], seq_len = lengths[r];
    TORCH_CHECK(q_len >= 0, kOp, ": query_start_loc must be non-decreasing, got query_start_loc[", r, "] = ",
                starts[r], " > query_start_loc[", r + 1, "] = ", starts[r + 1], " (request ", r, ")");
    TORCH_CHECK(seq_len >= 0 && seq_len <= capacity, kOp, ": request ", r, ": seq_lens[", r, "] = ", seq_len,
                " must be in [0, max_blocks * block_size] = [0, ", capacity, "] (the pages its block_table row holds)");
    TORCH_CHECK(seq_len - 1 <= kMaxPosition, kOp, ": request ", r, ": seq_lens[", r, "] = ", seq_len,
                " puts positions past ", kMaxPosition, " (2^31 - 1: beyond it the rotation angles lose accuracy)");
    TORCH_CHECK(q_len <= seq_len, kOp, ": request ", r, " has ", q_len,
                " queries (query_start_loc[r+1] - query_start_loc[r]) but seq_lens[", r, "] = ", seq_len,
                " keys: its queries are the last q_len of its sequence, so q_len must be <= seq_len");
    const int64_t pages = (seq_len + a.block_size - 1) / a.block_size;
    for (int64_t page = 0; page < pages; ++page) {
      const int64_t block = table[r * a.max_blocks + page];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, kOp, ": request ", r, ": block_table[", r, ", ", page,
                  "] = ", block, " is outside the cache's [0, num_blocks) = [0, ", a.num_blocks, ")");
    }
  }
  if (a.scale_factors) {
    const at::Tensor bad = ~(at::isfinite(*a.scale_factors) & (*a.scale_factors > 0));
    if (bad.any().item<bool>()) {
      const int64_t r = bad.nonzero()[0][0].item<int64_t>();
      TORCH_CHECK(false, kOp, ": request ", r, ": scale_factors[", r, "] must be finite and > 0, got ",
                  a.scale_factors->select(0, r).item<float>());
    }
  }
}

ReropePagedArgs check_rerope_paged_args(const at::Tensor& q, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_table,
                                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                        const at::Tensor& inv_freq, int64_t window, double leaky_k, double scale,
                                        const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
                                        bool interleaved, const std::optional<at::Tensor>& workspace, int64_t group,
                                        int64_t chunk_size, int64_t far_start) {
  check_rerope_paged_meta(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                          leaky_k, scale, scale_factors, logn_length, /*allow_float64=*/false, workspace,
                          group, chunk_size, far_start);
  ReropePagedArgs a;
  a.tokens = q.size(0);
  a.q_heads = q.size(1);
  a.head_dim = q.size(2);
  a.num_blocks = key_cache.size(0);
  a.kv_heads = key_cache.size(1);
  a.block_size = key_cache.size(2);
  a.requests = seq_lens.size(0);
  a.max_blocks = block_table.size(1);
  a.rotary_pairs = inv_freq.size(inv_freq.dim() - 1);
  a.per_request_inv_freq = inv_freq.dim() == 2;
  // Kernels read q rows with a unit stride on the head dim; any other strides are fine.
  a.q = q.stride(2) == 1 ? q : q.contiguous();
  a.key_cache = key_cache;
  a.value_cache = value_cache;
  a.block_table = to_int32(block_table, "block_table");
  a.seq_lens = to_int32(seq_lens, "seq_lens");
  a.query_start_loc = to_int32(query_start_loc, "query_start_loc");
  a.inv_freq = (inv_freq.dim() == 1 ? inv_freq.unsqueeze(0) : inv_freq).to(at::kFloat).contiguous();
  if (scale_factors) a.scale_factors = scale_factors->to(at::kFloat).contiguous();
  a.workspace = workspace;
  a.rule = make_region_rule(window, leaky_k, group, chunk_size, far_start);
  a.logn_length = logn_length;
  a.inv_log_train = logn_length > 0 ? 1.0 / std::log(static_cast<double>(logn_length)) : 0.0;
  a.scale = static_cast<float>(scale == -1.0 ? 1.0 / std::sqrt(static_cast<double>(a.head_dim)) : scale);
  a.interleaved = interleaved;
  check_rerope_paged_values(a);
  return a;
}

void check_rerope_cache_write(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3, kWriteOp, ": key must be 3-D [T, Hkv, D], got shape ", key.sym_sizes());
  check_cache_meta(kWriteOp, key_cache, value_cache, key, "key");
  check_device(kWriteOp, value, "value", key, "key");
  check_device(kWriteOp, slot_mapping, "slot_mapping", key, "key");
  TORCH_CHECK(value.sym_sizes() == key.sym_sizes(), kWriteOp, ": key and value must have the same shape, got ",
              key.sym_sizes(), " and ", value.sym_sizes());
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble, kWriteOp,
              ": key_cache must be float32, float16, bfloat16 or float64, got ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, kWriteOp,
              ": key and value must have the cache's dtype ", dtype, ", got ", key.scalar_type(), " and ",
              value.scalar_type());
  TORCH_CHECK(key.sym_size(1) == key_cache.sym_size(1) && key.sym_size(2) == key_cache.sym_size(3), kWriteOp,
              ": key must have the cache's heads and head dim [T, ", key_cache.sym_size(1), ", ",
              key_cache.sym_size(3), "], got shape ", key.sym_sizes());
  check_index_tensor(kWriteOp, slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.sym_size(0) == key.sym_size(0), kWriteOp,
              ": slot_mapping must have shape [T] = [", key.sym_size(0), "], got shape ", slot_mapping.sym_sizes());
  if (slot_mapping.device().is_cpu() && slot_mapping.numel() > 0) {
    const int64_t slots = key_cache.size(0) * key_cache.size(2);
    const int64_t largest = slot_mapping.max().item<int64_t>();
    if (largest >= slots) {
      const int64_t t = (slot_mapping >= slots).nonzero()[0][0].item<int64_t>();
      TORCH_CHECK(false, kWriteOp, ": slot_mapping[", t, "] = ", slot_mapping[t].item<int64_t>(),
                  " is past the cache's num_blocks * block_size = ", slots, " slots");
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_meta(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start) {
  check_rerope_paged_meta(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                          leaky_k, scale, scale_factors, logn_length, /*allow_float64=*/false, std::nullopt,
                          group, chunk_size, far_start);
  at::Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  at::Tensor lse = at::empty_symint({q.sym_size(0), q.sym_size(1)}, q.options().dtype(at::kFloat));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_meta(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace) {
  check_rerope_paged_meta(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                          leaky_k, scale, scale_factors, logn_length, /*allow_float64=*/false, workspace,
                          group, chunk_size, far_start);
  at::Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  at::Tensor lse = at::empty_symint({q.sym_size(0), q.sym_size(1)}, q.options().dtype(at::kFloat));
  return {out, lse};
}

void rerope_cache_write_meta_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping) {
  check_rerope_cache_write(key_cache, value_cache, key, value, slot_mapping);
}

void check_rerope_attention_paged_op(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
                                     double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors,
                                     int64_t logn_length, bool allow_float64,
                                     const std::optional<at::Tensor>& workspace, int64_t group, int64_t chunk_size, int64_t far_start) {
  check_rerope_paged_meta(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq, window,
                          leaky_k, scale, scale_factors, logn_length, allow_float64, workspace, group,
                          chunk_size, far_start);
  if (!q.device().is_cpu()) return;
  // The value checks read the normalised metadata; the float64 oracle's q passes as float32 here.
  ReropePagedArgs a;
  a.q = q;
  a.tokens = q.size(0);
  a.num_blocks = key_cache.size(0);
  a.block_size = key_cache.size(2);
  a.requests = seq_lens.size(0);
  a.max_blocks = block_table.size(1);
  a.block_table = to_int32(block_table, "block_table");
  a.seq_lens = to_int32(seq_lens, "seq_lens");
  a.query_start_loc = to_int32(query_start_loc, "query_start_loc");
  if (scale_factors) a.scale_factors = scale_factors->to(at::kFloat).contiguous();
  check_rerope_paged_values(a);
}

}  // namespace ropescale
