// The key pre-passes, shared by the SIMT and the tensor-core kernels: the turn rates of the rotation
// table(s), the first kernel of every launch that rotates keys, and every key rotated once into a
// workspace (the dense prefills; the paged tensor-core pre-pass rotates with rotate_key_pair too).
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_params.h"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// One rotation pair of one key (position `pos`, the table's turn rates `rates`) for every kv head, from
// one sin/cos: the near side at p into p.k_near and, where p.k_far is set, the far side into p.k_far
// (Leaky: at p/k; plain ReRoPE: the raw key, for the paged tensor-core prefill), rounded like T, as Out;
// a pair past the rotary ones copies two un-rotated dims. The head's source row is src_row(h), its
// destination row offset dst_row(h). The angles come from turn rates (turn_angles.h), the same
// arithmetic as the key tiles the SIMT body and the paged tensor-core prefill rotate themselves.
template <typename T, typename Out, class SrcRow, class DstRow>
__device__ __forceinline__ void rotate_key_pair(const ReropeParams& p, const KeyRate* rates, int64_t pos, int pair,
                                                SrcRow&& src_row, DstRow&& dst_row) {
  Out* const k_near = static_cast<Out*>(p.k_near);
  Out* const k_far = static_cast<Out*>(p.k_far);
  const bool far_rotated = p.rule.far_key_rotated();
  const bool rotated = pair < p.rotary_pairs;
  int first = 2 * pair, second = 2 * pair + 1;
  float near_sin = 0.0f, near_cos = 1.0f, far_sin = 0.0f, far_cos = 1.0f;
  if (rotated) {
    rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
    const KeyRate rate = rates[pair];
    const int sides = k_far && far_rotated ? 2 : 1;
#pragma unroll 1
    for (int side = 0; side < sides; ++side) {  // one copy of the sin/cos code (two spill 4 bytes on sm_90)
      float sin_v, cos_v;
      position_sincos(side == 0 ? pos : p.rule.far_key_index(pos), side == 0 ? rate.near : rate.far, &sin_v, &cos_v);
      if (side == 0)
        near_sin = sin_v, near_cos = cos_v;
      else
        far_sin = sin_v, far_cos = cos_v;
    }
  }
  for (int h = 0; h < p.kv_heads; ++h) {
    const T* src = src_row(h);
    const float x1 = to_acc(src[first]), x2 = to_acc(src[second]);
    const int64_t dst = dst_row(h);
    float a, c;  // rounded like T (a no-op for fp32; for Out = T, the one rounding to T)
    rotate_key_pair_fma(x1, x2, near_cos, near_sin, &a, &c);
    k_near[dst + first] = from_acc<Out>(round_to<T>(a));
    k_near[dst + second] = from_acc<Out>(round_to<T>(c));
    if (k_far) {
      if (far_rotated)
        rotate_key_pair_fma(x1, x2, far_cos, far_sin, &a, &c);
      else
        a = x1, c = x2;
      k_far[dst + first] = from_acc<Out>(round_to<T>(a));
      k_far[dst + second] = from_acc<Out>(round_to<T>(c));
    }
  }
}

// Prefill pre-pass: every key rotated once (rotate_key_pair), near side at p into k_near, and for Leaky
// ReRoPE the far side at p/k into k_far, [B, Hkv, Lk, D] as Out (float for the SIMT prefill, T for the
// tensor-core one: rounded to the input dtype). One thread per (batch, key, pair).
template <typename T, typename Out>
__global__ void __launch_bounds__(256) rerope_rotate_keys_kernel(const ReropeParams p) {
  const int half_dim = p.head_dim / 2;
  const int64_t total = static_cast<int64_t>(p.batch) * p.k_len * half_dim;
  const T* k = static_cast<const T*>(p.k);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int pair = static_cast<int>(idx % half_dim);
    const int j = static_cast<int>((idx / half_dim) % p.k_len);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(half_dim) * p.k_len));
    const T* src = k + b * p.k_stride_b + j * p.k_stride_l;
    rotate_key_pair<T, Out>(p, p.key_rates, p.k_positions[static_cast<int64_t>(b) * p.k_len + j], pair,
                            [&](int h) { return src + h * p.k_stride_h; },
                            [&](int h) {
                              return ((static_cast<int64_t>(b) * p.kv_heads + h) * p.k_len + j) * p.head_dim;
                            });
  }
}

// The turn rates (turn_angles.h) of every rotation pair of the launch's table(s) into p.key_rates:
// row r's pair i at r * inv_freq_stride + i, with one row per request when inv_freq_stride != 0 (a paged
// launch with a table per request), else one row. FP64 once per (table, pair) here, so that the kernels
// that rotate keys need none per key. One thread per (row, pair). (A template only so that the header may
// be included by several translation units of one program.)
template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock) rerope_key_rates_kernel(const ReropeParams p, int rows) {
  const int64_t total = static_cast<int64_t>(rows) * p.rotary_pairs;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / p.rotary_pairs;
    const int pair = static_cast<int>(idx % p.rotary_pairs);
    p.key_rates[idx] = key_rate(p.inv_freq[row * p.inv_freq_stride + pair], p.rule.far_key_rotated(),
                                 p.rule.far_key_multiplier());
  }
}

// Rows of p.key_rates a launch needs (KeyRate [rows, rotary_pairs], allocated by the caller): one per
// request for a paged launch with a table per request, else one.
inline int64_t rerope_key_rate_rows(const ReropeParams& p) { return p.inv_freq_stride != 0 ? p.requests : 1; }

// The first kernel of every launch that rotates keys: p.key_rates from p.inv_freq.
template <class Check>
inline void launch_rerope_key_rates(const ReropeParams& p, cudaStream_t stream, Check&& check) {
  const int64_t rows = rerope_key_rate_rows(p);
  const int64_t items = rows * p.rotary_pairs;
  if (items == 0) return;
  const int64_t blocks = (items + 255) / 256 < 1024 ? (items + 255) / 256 : 1024;
  ROPESCALE_LAUNCH_KERNEL(rerope_key_rates_kernel<256>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, p,
                          static_cast<int>(rows));
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the key turn-rates kernel");
}

}  // namespace ropescale::rerope_cuda
