// C++ entry points of every ropescale op. Names equal the schema names in registration.cpp and the
// Python wrappers in python/ropescale/ops.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace ropescale {

// ---- frequencies.cpp: inv_freq tables (CPU, double precision inside) ----
at::Tensor default_inv_freq(int64_t dim, double base, std::optional<at::ScalarType> dtype);
at::Tensor linear_inv_freq(int64_t dim, double base, double factor, std::optional<at::ScalarType> dtype);
at::Tensor proportional_inv_freq(int64_t head_dim, double base, double factor, double partial_rotary_factor,
                                 std::optional<at::ScalarType> dtype);
at::Tensor ntk_inv_freq(int64_t dim, double base, double factor, std::optional<at::ScalarType> dtype);
at::Tensor dynamic_ntk_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                                int64_t seq_len, std::optional<at::ScalarType> dtype);
at::Tensor yarn_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position, double beta_fast,
                         double beta_slow, bool truncate, std::optional<at::ScalarType> dtype);
at::Tensor yarn_log_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                             double beta_fast, double beta_slow, double extrapolation_factor,
                             std::optional<at::ScalarType> dtype);
double yarn_attention_factor(double factor, double mscale, double mscale_all_dim);
at::Tensor llama3_inv_freq(int64_t dim, double base, double factor, double low_freq_factor, double high_freq_factor,
                           int64_t original_max_position, std::optional<at::ScalarType> dtype);
at::Tensor longrope_inv_freq(int64_t dim, double base, at::ArrayRef<double> short_factor,
                             at::ArrayRef<double> long_factor, int64_t original_max_position, int64_t seq_len,
                             std::optional<at::ScalarType> dtype);
double longrope_attention_factor(double factor, int64_t original_max_position);
at::Tensor resonance_inv_freq(const at::Tensor& inv_freq, int64_t original_max_position);
// Meta kernels of the inv_freq-taking ops: the ops' own metadata and scalar checks, empty outputs.
at::Tensor resonance_inv_freq_meta(const at::Tensor& inv_freq, int64_t original_max_position);
at::Tensor similarity_decay_meta(const at::Tensor& inv_freq, int64_t max_distance);
at::Tensor feature_gap_meta(const at::Tensor& inv_freq, int64_t train_length, int64_t test_length);

// ---- registration.cpp: Python's signals, for the long loops of frequencies.cpp ----
// Runs Python's pending signal handlers (takes the GIL); true when one raised (KeyboardInterrupt for
// SIGINT), the exception then pending in Python. False when Python is not running.
bool python_signal_raised();
// Throws the pending Python exception as torch's python_error, which torch re-raises in Python.
[[noreturn]] void throw_python_error();

// ---- frequencies.cpp: research quantities ----
at::Tensor similarity_decay(const at::Tensor& inv_freq, int64_t max_distance);
int64_t effective_context_length(const at::Tensor& inv_freq, int64_t max_distance);
double base_lower_bound(int64_t context_length, int64_t dim);
at::Tensor feature_gap(const at::Tensor& inv_freq, int64_t train_length, int64_t test_length);

// ---- rotary.cpp: rotation of q/k by cos/sin tables or by positions (CPU + CUDA) ----
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                        bool half_width, bool conjugate);
void apply_rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                   bool half_width, bool conjugate);
std::tuple<at::Tensor, at::Tensor> apply_rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin, bool interleaved, bool half_width,
                                                   bool conjugate);
void apply_rotary_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleaved, bool half_width, bool conjugate);
at::Tensor apply_rotary_pos(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq, double scale,
                            bool interleaved, bool conjugate);
void apply_rotary_pos_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq, double scale,
                       bool interleaved, bool conjugate);
std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& positions, const at::Tensor& inv_freq,
                                                       double scale, bool interleaved, bool conjugate);
void apply_rotary_pos_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                          const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate);
std::tuple<at::Tensor, at::Tensor> apply_rotary_per_request(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& positions, const at::Tensor& request_index,
                                                            const at::Tensor& inv_freq,
                                                            const at::Tensor& attention_factors, bool interleaved,
                                                            const std::optional<at::Tensor>& native_angles);
void apply_rotary_per_request_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                               const at::Tensor& request_index, const at::Tensor& inv_freq,
                               const at::Tensor& attention_factors, bool interleaved,
                               const std::optional<at::Tensor>& native_angles);
// Meta kernels of the rotary ops (rotary.cpp): the ops' own checks, then empty outputs.
at::Tensor apply_rotary_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                             bool half_width, bool conjugate);
void apply_rotary_meta_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                        bool half_width, bool conjugate);
std::tuple<at::Tensor, at::Tensor> apply_rotary_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        bool interleaved, bool half_width, bool conjugate);
void apply_rotary_qk_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                           bool interleaved, bool half_width, bool conjugate);
at::Tensor apply_rotary_pos_meta(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
                                 double scale, bool interleaved, bool conjugate);
void apply_rotary_pos_meta_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
                            double scale, bool interleaved, bool conjugate);
std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& positions, const at::Tensor& inv_freq,
                                                            double scale, bool interleaved, bool conjugate);
void apply_rotary_pos_qk_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                               const at::Tensor& inv_freq, double scale, bool interleaved, bool conjugate);

std::tuple<at::Tensor, at::Tensor> apply_rotary_per_request_meta(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& positions,
                                                                 const at::Tensor& request_index,
                                                                 const at::Tensor& inv_freq,
                                                                 const at::Tensor& attention_factors, bool interleaved,
                                                                 const std::optional<at::Tensor>& native_angles);
void apply_rotary_per_request_meta_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                    const at::Tensor& request_index, const at::Tensor& inv_freq,
                                    const at::Tensor& attention_factors, bool interleaved,
                                    const std::optional<at::Tensor>& native_angles);
// The rotary checks as ops (rotary.cpp): ropescale::_check_rotary / _check_rotary_pos.
void check_rotary(c10::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& k, const at::Tensor& cos,
                  const at::Tensor& sin, bool interleaved, bool half_width);
void check_rotary_pos(c10::string_view op, const at::Tensor& x, const std::optional<at::Tensor>& k,
                      const at::Tensor& positions, const at::Tensor& inv_freq, double scale);
void check_rotary_per_request(c10::string_view op, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& positions, const at::Tensor& request_index,
                              const at::Tensor& inv_freq, const at::Tensor& attention_factors,
                              const std::optional<at::Tensor>& native_angles);

// ---- rerope_attention: cpu/rerope_attention.cpp, cuda/rerope_attention.cu ----
std::tuple<at::Tensor, at::Tensor> rerope_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& q_positions,
                                                        const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                        int64_t window, double leaky_k, double scale,
                                                        int64_t logn_length, bool causal, bool interleaved,
                                                        int64_t group, int64_t chunk_size, int64_t far_start);
// ---- rerope_attention_paged, rerope_cache_write_: cpu/rerope_attention.cpp (checks: rerope_paged.cpp) ----
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_cpu(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start);
// The overload rerope_attention_paged.workspace (the caller's scratch, `Tensor(a!) workspace`).
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_cpu(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace);
// The bytes of rerope_attention_paged's `workspace` for up to `tokens` query rows (rerope_paged.cpp).
int64_t rerope_paged_workspace_bytes(int64_t tokens, int64_t kv_heads, int64_t head_dim, at::ScalarType dtype,
                                     int64_t max_keys);
void rerope_cache_write_cpu_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& slot_mapping);
#ifdef ROPESCALE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> rerope_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, const at::Tensor& inv_freq,
                                                         int64_t window, double leaky_k, double scale,
                                                         int64_t logn_length, bool causal, bool interleaved,
                                                         int64_t group, int64_t chunk_size, int64_t far_start);
// ---- rerope_attention_paged, rerope_cache_write_ on CUDA: cuda/rerope_paged.cu (checks: rerope_paged.cpp) ----
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_cuda(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start);
std::tuple<at::Tensor, at::Tensor> rerope_attention_paged_workspace_cuda(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& inv_freq, int64_t window,
    double leaky_k, double scale, const std::optional<at::Tensor>& scale_factors, int64_t logn_length,
    bool interleaved, int64_t group, int64_t chunk_size, int64_t far_start, const at::Tensor& workspace);
void rerope_cache_write_cuda_(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& slot_mapping);
#endif

}  // namespace ropescale
