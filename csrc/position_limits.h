// The range of positions (and distances) the ops are accurate for, checked at every op boundary.
#pragma once

#include <cstdint>

namespace ropescale {

// Largest |position| the rotation ops and rerope_attention accept: 2^31 - 1 (int32's range). The
// angle position * inv_freq is formed in double and reduced by 2*pi in two parts
// (rotary_reduced_angle): measured against an exact (200-bit) angle over the default table (dim
// 128, base 1e4), the cos/sin error is 1.2e-7 (float32 rounding) up to 2^29, 1.4e-7 at 2^30,
// 2.1e-7 at 2^31, then doubles per bit: 3.7e-7 at 2^32, 8.6e-5 at 2^40, 1.8e-2 at 2^48, 0.37 at 2^52.
// The research quantities (similarity_decay, effective_context_length, feature_gap,
// base_lower_bound) take distances and lengths up to the same bound, for the same reason (m * theta
// in double) and so that no loop runs forever.
inline constexpr int64_t kMaxPosition = (int64_t{1} << 31) - 1;

}  // namespace ropescale
