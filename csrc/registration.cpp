// Every ropescale op: its schema (one comment each) and its kernels per backend, Meta included: the
// Meta kernels run each op's own checks (the same C++ functions as its CPU and CUDA kernels), so
// FakeTensorMode and torch.compile refuse what the op refuses. The Python side
// (python/ropescale/ops.py) adds autograd, and fake kernels only for the ops without tensor inputs
// (which no Meta kernel can serve); nothing else registers ops.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>  // python_error
#include <torch/library.h>
#include <torch/python.h>

#include "ops.h"
#include "rerope_attention.h"
#include "rerope_paged.h"
#include "rotary_args.h"

#include <string>
#include <vector>

TORCH_LIBRARY(ropescale, m) {
  // theta_i = base^(-2i/dim), the unscaled RoPE table.
  m.def("default_inv_freq(int dim, float base, *, ScalarType? dtype=None) -> Tensor");
  // Position interpolation: theta_i / factor.
  m.def("linear_inv_freq(int dim, float base, float factor, *, ScalarType? dtype=None) -> Tensor");
  // Proportional (Gemma 4): theta_i / factor over head_dim for the first floor(p*head_dim/2) pairs, 0 after.
  m.def(
      "proportional_inv_freq(int head_dim, float base, float factor, float partial_rotary_factor, *, "
      "ScalarType? dtype=None) -> Tensor");
  // NTK-aware: the default table at base * factor^(dim/(dim-2)).
  m.def("ntk_inv_freq(int dim, float base, float factor, *, ScalarType? dtype=None) -> Tensor");
  // Dynamic NTK: NTK with the factor grown to the current length (default table while seq_len <= L).
  m.def(
      "dynamic_ntk_inv_freq(int dim, float base, float factor, int original_max_position, int seq_len, *, "
      "ScalarType? dtype=None) -> Tensor");
  // YaRN's NTK-by-parts table (the ramp between theta/s and theta over [beta_slow, beta_fast] turns).
  m.def(
      "yarn_inv_freq(int dim, float base, float factor, int original_max_position, float beta_fast=32, "
      "float beta_slow=1, bool truncate=True, *, ScalarType? dtype=None) -> Tensor");
  // Grok's yarn_log (SGLang): YaRN's ramp, the two tables blended geometrically, the mask times extrapolation_factor.
  m.def(
      "yarn_log_inv_freq(int dim, float base, float factor, int original_max_position, float beta_fast=32, "
      "float beta_slow=1, float extrapolation_factor=1, *, ScalarType? dtype=None) -> Tensor");
  // YaRN's factor on cos/sin: 0.1*ln(s)+1, or the mscale/mscale_all_dim ratio when both are set.
  m.def("yarn_attention_factor(float factor, float mscale=1, float mscale_all_dim=0) -> float");
  // Llama 3.1's piecewise wavelength rule.
  m.def(
      "llama3_inv_freq(int dim, float base, float factor, float low_freq_factor, float high_freq_factor, "
      "int original_max_position, *, ScalarType? dtype=None) -> Tensor");
  // LongRoPE: theta_i / short_factor[i], or / long_factor[i] once seq_len > original_max_position.
  m.def(
      "longrope_inv_freq(int dim, float base, float[] short_factor, float[] long_factor, "
      "int original_max_position, int seq_len, *, ScalarType? dtype=None) -> Tensor");
  // LongRoPE's factor on cos/sin: sqrt(1 + ln(s)/ln(L)).
  m.def("longrope_attention_factor(float factor, int original_max_position) -> float");
  // Resonance RoPE: wavelengths rounded to integers (all, or those < original_max_position when > 0).
  m.def("resonance_inv_freq(Tensor inv_freq, int original_max_position=0) -> Tensor");
  // B_m = sum_i cos(m*theta_i) for m in [0, max_distance], float64 (Men et al.).
  m.def("similarity_decay(Tensor inv_freq, int max_distance) -> Tensor");
  // Largest L <= max_distance with B_m >= 0 for all m <= L.
  m.def("effective_context_length(Tensor inv_freq, int max_distance) -> int");
  // Smallest base whose B_m stays >= 0 over [0, context_length] (Men et al., Table 2).
  m.def("base_lower_bound(int context_length, int dim) -> float");
  // Resonance feature gap per pair over test positions [train_length, test_length), float64.
  m.def("feature_gap(Tensor inv_freq, int train_length, int test_length) -> Tensor");
  // ---- Rotation (CPU + CUDA): x/q/k are [batch, heads, seq, head_dim]; cos/sin are transformers'
  // full-width tables [.., seq, rotary_dim] (or half_width ones, [.., seq, rotary_dim/2]) broadcast
  // over heads; conjugate=True applies the transposed map (the inverse rotation): the backward pass.
  // x * cos + rotate(x) * sin on the first rotary_dim features, the rest copied.
  m.def("apply_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, *, bool half_width=False, "
        "bool conjugate=False) -> Tensor");
  // apply_rotary, in place.
  m.def("apply_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, *, bool half_width=False, "
        "bool conjugate=False) -> ()");
  // q and k in one pass (their batch and head counts may differ, as with GQA).
  m.def("apply_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, *, "
        "bool half_width=False, bool conjugate=False) -> (Tensor, Tensor)");
  // apply_rotary_qk, in place.
  m.def("apply_rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved=False, *, "
        "bool half_width=False, bool conjugate=False) -> ()");
  // Rotation by positions [seq] or [batch, seq] x float32 inv_freq, sin/cos computed on the fly with
  // the angle reduced in double (accurate at long positions); scale multiplies cos and sin.
  m.def("apply_rotary_pos(Tensor x, Tensor positions, Tensor inv_freq, float scale=1., bool interleaved=False, *, "
        "bool conjugate=False) -> Tensor");
  // apply_rotary_pos, in place.
  m.def("apply_rotary_pos_(Tensor(a!) x, Tensor positions, Tensor inv_freq, float scale=1., "
        "bool interleaved=False, *, bool conjugate=False) -> ()");
  // apply_rotary_pos on q and k in one pass.
  m.def("apply_rotary_pos_qk(Tensor q, Tensor k, Tensor positions, Tensor inv_freq, float scale=1., "
        "bool interleaved=False, *, bool conjugate=False) -> (Tensor, Tensor)");
  // apply_rotary_pos_qk, in place.
  m.def("apply_rotary_pos_qk_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor inv_freq, float scale=1., "
        "bool interleaved=False, *, bool conjugate=False) -> ()");
  // An engine's packed tokens q [T, Hq, D], k [T, Hk, D] rotated at positions [T], each with its request's
  // table: row request_index[t] of inv_freq [R, rotary_dim/2] (float32), cos and sin times attention_factors[r];
  // native_angles[r]: that request's angles formed as an engine's native table forms them (float32 product).
  m.def("apply_rotary_per_request(Tensor q, Tensor k, Tensor positions, Tensor request_index, Tensor inv_freq, "
        "Tensor attention_factors, bool interleaved=False, Tensor? native_angles=None) -> (Tensor, Tensor)");
  // apply_rotary_per_request, in place (k may have 0 heads: q alone).
  m.def("apply_rotary_per_request_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor request_index, "
        "Tensor inv_freq, Tensor attention_factors, bool interleaved=False, Tensor? native_angles=None) -> ()");
  // ReRoPE / Leaky ReRoPE attention over un-rotated q, k (pre-RoPE cache): (out, natural-log lse); with
  // group > 0 Self-Extend, with chunk_size > 0 Dual Chunk Attention (window = its local_size); far_start >= 0
  // moves the far side's first relative position from window to far_start (STRING: leaky_k=1, far_start=W).
  m.def(
      "rerope_attention(Tensor q, Tensor k, Tensor v, Tensor q_positions, Tensor k_positions, Tensor inv_freq, "
      "int window, float leaky_k=0, float scale=-1, int logn_length=0, bool causal=True, bool interleaved=False, "
      "*, int group=0, int chunk_size=0, int far_start=-1) -> (Tensor out, Tensor lse)");
  // The engine form: requests packed along T, raw keys/values read through vLLM's paged cache, positions
  // implicit (key slot j at j, the q_len queries last), a rotation table and scale factor per request.
  m.def(
      "rerope_attention_paged(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor inv_freq, int window, float leaky_k=0, float scale=-1, "
      "Tensor? scale_factors=None, int logn_length=0, bool interleaved=False, *, int group=0, int chunk_size=0, int far_start=-1) "
      "-> (Tensor out, Tensor lse)");
  // The same over the caller's CUDA scratch (uint8, rerope_paged_workspace_bytes), reserved once by an engine
  // (an overload: a mutated argument; the default overload stays functional, with its autograd refusal).
  m.def(
      "rerope_attention_paged.workspace(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor inv_freq, int window, float leaky_k=0, float scale=-1, "
      "Tensor? scale_factors=None, int logn_length=0, bool interleaved=False, *, int group=0, int chunk_size=0, int far_start=-1, "
      "Tensor(a!) workspace) "
      "-> (Tensor out, Tensor lse)");
  // Bytes of rerope_attention_paged's workspace for up to `tokens` query rows per call (0 where CUDA needs
  // none: fp32, head dims off the tensor cores), with room to pre-rotate `max_keys` keys (-1: the default).
  m.def("rerope_paged_workspace_bytes(int tokens, int kv_heads, int head_dim, ScalarType dtype, int max_keys=-1) "
        "-> int");
  // Stores raw key/value rows [T, Hkv, D] into the pages at slot_mapping (negative slots skipped), in place.
  m.def("rerope_cache_write_(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
        "Tensor slot_mapping) -> ()");
  // ---- The checks of the rotary ops and rerope_attention as ops (metadata; CPU positions' range),
  // for the plain-PyTorch paths that compute those ops (rerope_attention_composite, the reference
  // kernels): they refuse what the op refuses, with its message, eagerly and under torch.compile.
  // `op` names the op in messages.
  m.def("_check_rotary(str op, Tensor x, Tensor? k, Tensor cos, Tensor sin, bool interleaved=False, "
        "bool half_width=False) -> ()");
  m.def("_check_rotary_pos(str op, Tensor x, Tensor? k, Tensor positions, Tensor inv_freq, float scale=1.) -> ()");
  m.def("_check_rotary_per_request(str op, Tensor q, Tensor k, Tensor positions, Tensor request_index, "
        "Tensor inv_freq, Tensor attention_factors, Tensor? native_angles=None) -> ()");
  // allow_float64: rerope_attention_composite also takes float64 (gradcheck, references).
  m.def("_check_rerope_attention(Tensor q, Tensor k, Tensor v, Tensor q_positions, Tensor k_positions, "
        "Tensor inv_freq, int window, float leaky_k=0, float scale=-1, int logn_length=0, "
        "bool allow_float64=False, *, int group=0, int chunk_size=0, int far_start=-1, bool causal=True) -> ()");
  m.def("_check_rerope_attention_paged(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor inv_freq, int window, float leaky_k=0, float scale=-1, "
        "Tensor? scale_factors=None, int logn_length=0, bool allow_float64=False, Tensor? workspace=None, *, "
        "int group=0, int chunk_size=0, int far_start=-1) -> ()");
  m.def("_check_rerope_cache_write(Tensor key_cache, Tensor value_cache, Tensor key, Tensor value, "
        "Tensor slot_mapping) -> ()");
}

// Ops without tensor inputs have no backend to dispatch on: CompositeExplicitAutograd serves them
// everywhere (and keeps autograd from tracing their internals).
TORCH_LIBRARY_IMPL(ropescale, CompositeExplicitAutograd, m) {
  m.impl("default_inv_freq", &ropescale::default_inv_freq);
  m.impl("linear_inv_freq", &ropescale::linear_inv_freq);
  m.impl("proportional_inv_freq", &ropescale::proportional_inv_freq);
  m.impl("ntk_inv_freq", &ropescale::ntk_inv_freq);
  m.impl("dynamic_ntk_inv_freq", &ropescale::dynamic_ntk_inv_freq);
  m.impl("yarn_inv_freq", &ropescale::yarn_inv_freq);
  m.impl("yarn_log_inv_freq", &ropescale::yarn_log_inv_freq);
  m.impl("yarn_attention_factor", &ropescale::yarn_attention_factor);
  m.impl("llama3_inv_freq", &ropescale::llama3_inv_freq);
  m.impl("longrope_inv_freq", &ropescale::longrope_inv_freq);
  m.impl("longrope_attention_factor", &ropescale::longrope_attention_factor);
  m.impl("base_lower_bound", &ropescale::base_lower_bound);
  m.impl("rerope_paged_workspace_bytes", &ropescale::rerope_paged_workspace_bytes);
  // Metadata (and CPU data) only: one kernel for every device, Meta and fake tensors included.
  m.impl("_check_rotary", &ropescale::check_rotary);
  m.impl("_check_rotary_pos", &ropescale::check_rotary_pos);
  m.impl("_check_rotary_per_request", &ropescale::check_rotary_per_request);
  m.impl("_check_rerope_attention", &ropescale::check_rerope_attention);
  m.impl("_check_rerope_attention_paged", &ropescale::check_rerope_attention_paged_op);
  m.impl("_check_rerope_cache_write", &ropescale::check_rerope_cache_write);
}

TORCH_LIBRARY_IMPL(ropescale, CPU, m) {
  m.impl("resonance_inv_freq", &ropescale::resonance_inv_freq);
  m.impl("similarity_decay", &ropescale::similarity_decay);
  m.impl("effective_context_length", &ropescale::effective_context_length);
  m.impl("feature_gap", &ropescale::feature_gap);
  m.impl("rerope_attention", &ropescale::rerope_attention_cpu);
  m.impl("rerope_attention_paged", &ropescale::rerope_attention_paged_cpu);
  m.impl("rerope_attention_paged.workspace", &ropescale::rerope_attention_paged_workspace_cpu);
  m.impl("rerope_cache_write_", &ropescale::rerope_cache_write_cpu_);
}

// The rotary ops check their arguments and pick the kernel of the operands' device themselves
// (rotary.cpp), so the same functions serve both backends (CPU here, CUDA below).
template <class Impl>
static void register_rotary_impls(Impl&& impl) {
  impl("apply_rotary", &ropescale::apply_rotary);
  impl("apply_rotary_", &ropescale::apply_rotary_);
  impl("apply_rotary_qk", &ropescale::apply_rotary_qk);
  impl("apply_rotary_qk_", &ropescale::apply_rotary_qk_);
  impl("apply_rotary_pos", &ropescale::apply_rotary_pos);
  impl("apply_rotary_pos_", &ropescale::apply_rotary_pos_);
  impl("apply_rotary_pos_qk", &ropescale::apply_rotary_pos_qk);
  impl("apply_rotary_pos_qk_", &ropescale::apply_rotary_pos_qk_);
  impl("apply_rotary_per_request", &ropescale::apply_rotary_per_request);
  impl("apply_rotary_per_request_", &ropescale::apply_rotary_per_request_);
}

TORCH_LIBRARY_IMPL(ropescale, CPU, m) {
  register_rotary_impls([&](const char* name, auto kernel) { m.impl(name, kernel); });
}

TORCH_LIBRARY_IMPL(ropescale, Meta, m) {
  m.impl("apply_rotary", &ropescale::apply_rotary_meta);
  m.impl("apply_rotary_", &ropescale::apply_rotary_meta_);
  m.impl("apply_rotary_qk", &ropescale::apply_rotary_qk_meta);
  m.impl("apply_rotary_qk_", &ropescale::apply_rotary_qk_meta_);
  m.impl("apply_rotary_pos", &ropescale::apply_rotary_pos_meta);
  m.impl("apply_rotary_pos_", &ropescale::apply_rotary_pos_meta_);
  m.impl("apply_rotary_pos_qk", &ropescale::apply_rotary_pos_qk_meta);
  m.impl("apply_rotary_pos_qk_", &ropescale::apply_rotary_pos_qk_meta_);
  m.impl("apply_rotary_per_request", &ropescale::apply_rotary_per_request_meta);
  m.impl("apply_rotary_per_request_", &ropescale::apply_rotary_per_request_meta_);
  m.impl("rerope_attention", &ropescale::rerope_attention_meta);
  m.impl("rerope_attention_paged", &ropescale::rerope_attention_paged_meta);
  m.impl("rerope_attention_paged.workspace", &ropescale::rerope_attention_paged_workspace_meta);
  m.impl("rerope_cache_write_", &ropescale::rerope_cache_write_meta_);
  m.impl("resonance_inv_freq", &ropescale::resonance_inv_freq_meta);
  m.impl("similarity_decay", &ropescale::similarity_decay_meta);
  m.impl("feature_gap", &ropescale::feature_gap_meta);
}

// The in-place rotary ops are not differentiable. Without this kernel autograd would run them
// silently and return wrong gradients; instead a tensor argument that requires grad is an error,
// and the version counter of each mutated tensor is bumped, so autograd notices when a tensor
// saved for another op's backward is rotated in place.
static void in_place_without_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                                      torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const std::string& qualified = op.schema().name();
  const std::string name = qualified.substr(qualified.find("::") + 2);
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> mutated;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(!(at::GradMode::is_enabled() && t.defined() && t.requires_grad()), name, ": ", arguments[i].name(), " requires grad, but the in-place rotation is not differentiable; use the "
                "out-of-place op (without the trailing underscore)");
    if (arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite()) mutated.push_back(t);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : mutated) t.unsafeGetTensorImpl()->bump_version();
}

TORCH_LIBRARY_IMPL(ropescale, Autograd, m) {
  for (const char* name :
       {"apply_rotary_", "apply_rotary_qk_", "apply_rotary_pos_", "apply_rotary_pos_qk_", "apply_rotary_per_request_"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&in_place_without_autograd>());
}

// A library built without CUDA kernels (a CUDA torch but no nvcc, or ROPESCALE_CUDA=OFF) still
// registers the CUDA key of every op that has a CUDA kernel, with this one: a CUDA tensor gets an error
// that says how to rebuild, instead of the dispatcher's "Could not run ... from the 'CUDA' backend".
[[maybe_unused]] static void built_without_cuda(const c10::OperatorHandle& op, torch::jit::Stack*) {
  const std::string& name = op.schema().name();
  TORCH_CHECK(false, name.substr(name.find("::") + 2),
              ": this ropescale library was built without CUDA kernels (build_info()['cuda'] is False: no nvcc "
              "was found when it was built, or ROPESCALE_CUDA=OFF), so it cannot run on CUDA tensors. Install "
              "the CUDA toolkit matching torch.version.cuda, put nvcc on PATH (or set CUDA_HOME) and reinstall: "
              "ROPESCALE_CUDA=ON pip install --no-build-isolation --force-reinstall --no-deps ropescale "
              "(or `.` in a checkout)");
}

#ifdef ROPESCALE_WITH_CUDA
#define ROPESCALE_CUDA_IMPL(name, kernel) m.impl(name, kernel)
#else
#define ROPESCALE_CUDA_IMPL(name, kernel) \
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&built_without_cuda>())
#endif
TORCH_LIBRARY_IMPL(ropescale, CUDA, m) {
  register_rotary_impls([&](const char* name, [[maybe_unused]] auto kernel) { ROPESCALE_CUDA_IMPL(name, kernel); });
  ROPESCALE_CUDA_IMPL("rerope_attention", &ropescale::rerope_attention_cuda);
  ROPESCALE_CUDA_IMPL("rerope_attention_paged", &ropescale::rerope_attention_paged_cuda);
  ROPESCALE_CUDA_IMPL("rerope_attention_paged.workspace", &ropescale::rerope_attention_paged_workspace_cuda);
  ROPESCALE_CUDA_IMPL("rerope_cache_write_", &ropescale::rerope_cache_write_cuda_);
}
#undef ROPESCALE_CUDA_IMPL

namespace ropescale {

bool python_signal_raised() {
  if (!Py_IsInitialized()) return false;
  const PyGILState_STATE gil = PyGILState_Ensure();
  const bool raised = PyErr_CheckSignals() != 0;
  PyGILState_Release(gil);
  return raised;
}

void throw_python_error() {
  python_error error;
  error.persist();  // takes the pending exception out of Python's state, restored when torch catches it
  throw error;
}

}  // namespace ropescale

namespace {

// What this binary was built with, for bug reports and for tests that must know whether the CUDA
// kernels are really in the library.
pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = ROPESCALE_TORCH_VERSION;
  info["cuda_requested"] = ROPESCALE_CUDA_REQUESTED;  // ROPESCALE_CUDA: AUTO, ON or OFF
#ifdef ROPESCALE_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = ROPESCALE_CUDA_ARCHS_STRING;
  info["cuda_version"] = ROPESCALE_CUDA_VERSION_STRING;
#else
  info["cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_version"] = "";
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, module) {
  module.doc() = "ropescale native library: ops live in torch.ops.ropescale";
  module.def("build_info", &build_info, "torch version built against, whether CUDA kernels were compiled, CUDA archs");
  module.def("rotary_cpu_isa", &ropescale::rotary_cpu_isa,
             "instruction set of the rotary CPU kernel in use: AVX512, AVX2 or DEFAULT (ATEN_CPU_CAPABILITY lowers it)");
  module.def("rerope_attention_cpu_isa", &ropescale::rerope_attention_cpu_isa,
             "instruction set of the rerope_attention CPU kernel in use: AVX512, AVX2 or DEFAULT (as rotary_cpu_isa)");
}
