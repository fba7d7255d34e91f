// The inv_freq / attention-factor / research ops: argument checks at the op boundary, then the
// double-precision math of include/ropescale/frequencies.h, then a CPU tensor (float32 unless a
// dtype is asked for).
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>

#include "position_limits.h"
#include "ropescale/frequencies.h"

namespace ropescale {
namespace {

// Ctrl-C for the long loops (similarity_decay, effective_context_length, base_lower_bound,
// feature_gap). torch runs an op with the GIL released, so Python's handler cannot interrupt it:
// instead the loops call poll() (frequencies.h), and every 20 ms the thread that called the op asks
// Python to run its pending signal handlers (python_signal_raised, registration.cpp: SIGINT raises
// KeyboardInterrupt). Then every thread of the op stops at its next poll, and the op rethrows the
// Python exception (throw_python_error), which torch hands back to Python unchanged.
class Interrupts {
 public:
  struct Stop : std::exception {
    const char* what() const noexcept override { return "interrupted"; }
  };

  // Called often, from any thread of the op.
  void poll() {
    if (interrupted_.load(std::memory_order_relaxed)) throw Stop{};
    if (std::this_thread::get_id() != caller_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check_) return;
    next_check_ = now + std::chrono::milliseconds(20);
    if (!python_signal_raised()) return;
    interrupted_.store(true);
    throw Stop{};
  }

  freq::Poll poller() {
    return [this] { poll(); };
  }

  // Runs work(); an interrupt ends it with the Python exception.
  template <class Work>
  auto run(Work&& work) -> decltype(work()) {
    try {
      return work();
    } catch (...) {
      if (interrupted_.load()) throw_python_error();
      throw;
    }
  }

 private:
  const std::thread::id caller_ = std::this_thread::get_id();
  std::chrono::steady_clock::time_point next_check_ = std::chrono::steady_clock::now();
  std::atomic<bool> interrupted_{false};
};

void check_distance(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(value <= kMaxPosition, op, ": ", name, " must be <= ", kMaxPosition,
              " (2^31 - 1: beyond it m * theta loses accuracy, and the loop would run for days), got ", value);
}

void check_dim(const char* op, int64_t dim, const char* name = "dim") {
  TORCH_CHECK(dim > 0 && dim % 2 == 0, op, ": ", name, " must be a positive even number, got ", dim);
}

void check_base(const char* op, double base) {
  TORCH_CHECK(std::isfinite(base) && base > 1.0, op, ": base must be > 1, got ", base);
}

void check_factor(const char* op, double factor) {
  TORCH_CHECK(std::isfinite(factor) && factor >= 1.0, op, ": factor must be >= 1, got ", factor);
}

void check_length(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(value > 0, op, ": ", name, " must be > 0, got ", value);
}

// YaRN's ramp bounds (yarn and Grok's yarn_log): finite, beta_fast > beta_slow > 0.
void check_betas(const char* op, double beta_fast, double beta_slow) {
  TORCH_CHECK(std::isfinite(beta_slow) && beta_slow > 0.0, op, ": beta_slow must be > 0, got ", beta_slow);
  TORCH_CHECK(std::isfinite(beta_fast) && beta_fast > beta_slow, op, ": beta_fast must be > beta_slow, got beta_fast=",
              beta_fast, ", beta_slow=", beta_slow);
}

at::Tensor to_tensor(const std::vector<double>& values, std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_type = dtype.value_or(at::kFloat);
  TORCH_CHECK(at::isFloatingType(out_type), "inv_freq tables are floating point; dtype ", out_type,
              " was asked for");
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), out.data_ptr<double>());
  return out.to(out_type);
}

// inv_freq's metadata: 1-D, floating. Shared by the CPU kernels and the Meta kernels.
void check_inv_freq_meta(const char* op, const at::Tensor& inv_freq) {
  TORCH_CHECK(inv_freq.dim() == 1, op, ": inv_freq must be 1-D, got shape ", inv_freq.sym_sizes());
  TORCH_CHECK(at::isFloatingType(inv_freq.scalar_type()), op, ": inv_freq must be floating point, got ",
              inv_freq.scalar_type());
}

// A 1-D floating inv_freq tensor on the CPU, read in double precision.
std::vector<double> read_inv_freq(const char* op, const at::Tensor& inv_freq) {
  check_inv_freq_meta(op, inv_freq);
  TORCH_CHECK(inv_freq.device().is_cpu(), op, ": inv_freq must be a CPU tensor, got ", inv_freq.device());
  const at::Tensor values = inv_freq.to(at::kDouble).contiguous();
  std::vector<double> out(values.data_ptr<double>(), values.data_ptr<double>() + values.numel());
  for (double theta : out)
    TORCH_CHECK(std::isfinite(theta) && theta >= 0.0, op, ": inv_freq must be finite and >= 0, got ", theta);
  return out;
}

}  // namespace

at::Tensor default_inv_freq(int64_t dim, double base, std::optional<at::ScalarType> dtype) {
  check_dim("default_inv_freq", dim);
  check_base("default_inv_freq", base);
  return to_tensor(freq::default_inv_freq(dim, base), dtype);
}

at::Tensor linear_inv_freq(int64_t dim, double base, double factor, std::optional<at::ScalarType> dtype) {
  check_dim("linear_inv_freq", dim);
  check_base("linear_inv_freq", base);
  check_factor("linear_inv_freq", factor);
  return to_tensor(freq::linear_inv_freq(dim, base, factor), dtype);
}

at::Tensor proportional_inv_freq(int64_t head_dim, double base, double factor, double partial_rotary_factor,
                                 std::optional<at::ScalarType> dtype) {
  check_dim("proportional_inv_freq", head_dim, "head_dim");
  check_base("proportional_inv_freq", base);
  check_factor("proportional_inv_freq", factor);
  TORCH_CHECK(std::isfinite(partial_rotary_factor) && partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0,
              "proportional_inv_freq: partial_rotary_factor must be in (0, 1], got ", partial_rotary_factor);
  return to_tensor(freq::proportional_inv_freq(head_dim, base, factor, partial_rotary_factor), dtype);
}

at::Tensor ntk_inv_freq(int64_t dim, double base, double factor, std::optional<at::ScalarType> dtype) {
  check_dim("ntk_inv_freq", dim);
  check_base("ntk_inv_freq", base);
  check_factor("ntk_inv_freq", factor);
  TORCH_CHECK(dim > 2, "ntk_inv_freq: dim must be > 2 (the exponent is d/(d-2)), got ", dim);
  return to_tensor(freq::default_inv_freq(dim, freq::ntk_base(dim, base, factor)), dtype);
}

at::Tensor dynamic_ntk_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                                int64_t seq_len, std::optional<at::ScalarType> dtype) {
  check_dim("dynamic_ntk_inv_freq", dim);
  check_base("dynamic_ntk_inv_freq", base);
  check_factor("dynamic_ntk_inv_freq", factor);
  TORCH_CHECK(dim > 2, "dynamic_ntk_inv_freq: dim must be > 2 (the exponent is d/(d-2)), got ", dim);
  check_length("dynamic_ntk_inv_freq", "original_max_position", original_max_position);
  TORCH_CHECK(seq_len >= 0, "dynamic_ntk_inv_freq: seq_len must be >= 0, got ", seq_len);
  const double dyn_base = freq::dynamic_ntk_base(dim, base, factor, original_max_position, seq_len);
  return to_tensor(freq::default_inv_freq(dim, dyn_base), dtype);
}

at::Tensor yarn_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position, double beta_fast,
                         double beta_slow, bool truncate, std::optional<at::ScalarType> dtype) {
  check_dim("yarn_inv_freq", dim);
  check_base("yarn_inv_freq", base);
  check_factor("yarn_inv_freq", factor);
  check_length("yarn_inv_freq", "original_max_position", original_max_position);
  check_betas("yarn_inv_freq", beta_fast, beta_slow);
  return to_tensor(
      freq::yarn_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow, truncate), dtype);
}

at::Tensor yarn_log_inv_freq(int64_t dim, double base, double factor, int64_t original_max_position,
                             double beta_fast, double beta_slow, double extrapolation_factor,
                             std::optional<at::ScalarType> dtype) {
  check_dim("yarn_log_inv_freq", dim);
  check_base("yarn_log_inv_freq", base);
  check_factor("yarn_log_inv_freq", factor);
  check_length("yarn_log_inv_freq", "original_max_position", original_max_position);
  check_betas("yarn_log_inv_freq", beta_fast, beta_slow);
  TORCH_CHECK(std::isfinite(extrapolation_factor) && extrapolation_factor >= 0.0 && extrapolation_factor <= 1.0,
              "yarn_log_inv_freq: extrapolation_factor must be in [0, 1] (the weight of the original table), got ",
              extrapolation_factor);
  return to_tensor(freq::yarn_log_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow,
                                           extrapolation_factor),
                   dtype);
}

double yarn_attention_factor(double factor, double mscale, double mscale_all_dim) {
  TORCH_CHECK(std::isfinite(factor) && factor > 0.0, "yarn_attention_factor: factor must be > 0, got ", factor);
  TORCH_CHECK(std::isfinite(mscale) && std::isfinite(mscale_all_dim),
              "yarn_attention_factor: mscale and mscale_all_dim must be finite");
  return freq::yarn_attention_factor(factor, mscale, mscale_all_dim);
}

at::Tensor llama3_inv_freq(int64_t dim, double base, double factor, double low_freq_factor, double high_freq_factor,
                           int64_t original_max_position, std::optional<at::ScalarType> dtype) {
  check_dim("llama3_inv_freq", dim);
  check_base("llama3_inv_freq", base);
  check_factor("llama3_inv_freq", factor);
  check_length("llama3_inv_freq", "original_max_position", original_max_position);
  TORCH_CHECK(low_freq_factor > 0.0, "llama3_inv_freq: low_freq_factor must be > 0, got ", low_freq_factor);
  TORCH_CHECK(high_freq_factor > low_freq_factor, "llama3_inv_freq: high_freq_factor must be > low_freq_factor, got ",
              "high_freq_factor=", high_freq_factor, ", low_freq_factor=", low_freq_factor);
  return to_tensor(
      freq::llama3_inv_freq(dim, base, factor, low_freq_factor, high_freq_factor, original_max_position), dtype);
}

at::Tensor longrope_inv_freq(int64_t dim, double base, at::ArrayRef<double> short_factor,
                             at::ArrayRef<double> long_factor, int64_t original_max_position, int64_t seq_len,
                             std::optional<at::ScalarType> dtype) {
  check_dim("longrope_inv_freq", dim);
  check_base("longrope_inv_freq", base);
  check_length("longrope_inv_freq", "original_max_position", original_max_position);
  TORCH_CHECK(seq_len >= 0, "longrope_inv_freq: seq_len must be >= 0, got ", seq_len);
  TORCH_CHECK(static_cast<int64_t>(short_factor.size()) == dim / 2,
              "longrope_inv_freq: short_factor must have dim/2 = ", dim / 2, " entries, got ", short_factor.size());
  TORCH_CHECK(static_cast<int64_t>(long_factor.size()) == dim / 2,
              "longrope_inv_freq: long_factor must have dim/2 = ", dim / 2, " entries, got ", long_factor.size());
  for (double f : short_factor) TORCH_CHECK(f > 0.0, "longrope_inv_freq: short_factor entries must be > 0, got ", f);
  for (double f : long_factor) TORCH_CHECK(f > 0.0, "longrope_inv_freq: long_factor entries must be > 0, got ", f);
  return to_tensor(freq::longrope_inv_freq(dim, base, short_factor.vec(), long_factor.vec(), original_max_position,
                                           seq_len),
                   dtype);
}

double longrope_attention_factor(double factor, int64_t original_max_position) {
  TORCH_CHECK(std::isfinite(factor) && factor > 0.0, "longrope_attention_factor: factor must be > 0, got ", factor);
  TORCH_CHECK(original_max_position > 1, "longrope_attention_factor: original_max_position must be > 1, got ",
              original_max_position);
  return freq::longrope_attention_factor(factor, original_max_position);
}

namespace {

// The scalar checks of the inv_freq-taking ops, shared with their Meta kernels.
void check_resonance_args(int64_t original_max_position) {
  TORCH_CHECK(original_max_position >= 0, "resonance_inv_freq: original_max_position must be >= 0, got ",
              original_max_position);
}

void check_similarity_decay_args(int64_t max_distance) {
  TORCH_CHECK(max_distance >= 0, "similarity_decay: max_distance must be >= 0, got ", max_distance);
  check_distance("similarity_decay", "max_distance", max_distance);
}

void check_feature_gap_args(int64_t train_length, int64_t test_length) {
  check_length("feature_gap", "train_length", train_length);
  TORCH_CHECK(test_length >= train_length, "feature_gap: test_length must be >= train_length, got test_length=",
              test_length, ", train_length=", train_length);
  check_distance("feature_gap", "test_length", test_length);
}

}  // namespace

at::Tensor resonance_inv_freq(const at::Tensor& inv_freq, int64_t original_max_position) {
  check_inv_freq_meta("resonance_inv_freq", inv_freq);
  check_resonance_args(original_max_position);
  std::vector<double> theta = read_inv_freq("resonance_inv_freq", inv_freq);
  for (size_t i = 0; i < theta.size(); ++i) {
    if (!freq::resonance_rounds(theta[i], original_max_position)) continue;
    TORCH_CHECK(theta[i] < 2.0 * freq::kTwoPi, "resonance_inv_freq: inv_freq[", i, "] = ", theta[i],
                " has a wavelength that rounds to 0");
    theta[i] = freq::resonance_theta(theta[i]);
  }
  // Every floating dtype embeds exactly in double, so untouched dimensions come back bit-equal.
  return to_tensor(theta, inv_freq.scalar_type());
}

at::Tensor similarity_decay(const at::Tensor& inv_freq, int64_t max_distance) {
  check_inv_freq_meta("similarity_decay", inv_freq);
  check_similarity_decay_args(max_distance);
  const std::vector<double> theta = read_inv_freq("similarity_decay", inv_freq);
  at::Tensor out = at::empty({max_distance + 1}, at::TensorOptions().dtype(at::kDouble));
  double* curve = out.data_ptr<double>();
  Interrupts interrupts;
  interrupts.run([&] {
    at::parallel_for(0, max_distance + 1, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        if ((m & freq::kPollMask) == 0) interrupts.poll();
        double sum = 0.0;
        for (double t : theta) sum += std::cos(static_cast<double>(m) * t);
        curve[m] = sum;
      }
    });
  });
  return out;
}

int64_t effective_context_length(const at::Tensor& inv_freq, int64_t max_distance) {
  const std::vector<double> theta = read_inv_freq("effective_context_length", inv_freq);
  TORCH_CHECK(max_distance >= 0, "effective_context_length: max_distance must be >= 0, got ", max_distance);
  check_distance("effective_context_length", "max_distance", max_distance);
  Interrupts interrupts;
  return interrupts.run([&] { return freq::effective_context_length(theta, max_distance, interrupts.poller()); });
}

double base_lower_bound(int64_t context_length, int64_t dim) {
  check_length("base_lower_bound", "context_length", context_length);
  check_distance("base_lower_bound", "context_length", context_length);
  check_dim("base_lower_bound", dim);
  Interrupts interrupts;
  return interrupts.run([&] {
    return freq::base_lower_bound(context_length, dim, 1.001, 1e-7, 1e15, interrupts.poller()).base;
  });
}

at::Tensor feature_gap(const at::Tensor& inv_freq, int64_t train_length, int64_t test_length) {
  check_inv_freq_meta("feature_gap", inv_freq);
  check_feature_gap_args(train_length, test_length);
  const std::vector<double> theta = read_inv_freq("feature_gap", inv_freq);
  at::Tensor out = at::empty({static_cast<int64_t>(theta.size())}, at::TensorOptions().dtype(at::kDouble));
  double* gap = out.data_ptr<double>();
  Interrupts interrupts;
  const freq::Poll poll = interrupts.poller();
  interrupts.run([&] {
    at::parallel_for(0, static_cast<int64_t>(theta.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) gap[i] = freq::feature_gap(theta[i], train_length, test_length, poll);
    });
  });
  return out;
}

at::Tensor resonance_inv_freq_meta(const at::Tensor& inv_freq, int64_t original_max_position) {
  check_inv_freq_meta("resonance_inv_freq", inv_freq);
  check_resonance_args(original_max_position);
  return at::empty_like(inv_freq);
}

at::Tensor similarity_decay_meta(const at::Tensor& inv_freq, int64_t max_distance) {
  check_inv_freq_meta("similarity_decay", inv_freq);
  check_similarity_decay_args(max_distance);
  return at::empty({max_distance + 1}, inv_freq.options().dtype(at::kDouble));
}

at::Tensor feature_gap_meta(const at::Tensor& inv_freq, int64_t train_length, int64_t test_length) {
  check_inv_freq_meta("feature_gap", inv_freq);
  check_feature_gap_args(train_length, test_length);
  return at::empty_symint({inv_freq.sym_size(0)}, inv_freq.options().dtype(at::kDouble));
}

}  // namespace ropescale
