// The rotary CPU kernel, compiled once per instruction set (CPU_CAPABILITY = DEFAULT, AVX2,
// AVX512, as ATen's own kernels are; CMakeLists.txt) and picked at run time by cpu/rotary.cpp.
// Work is split over tiles of tokens (and, when there are few tokens, over groups of rows too, so
// decode still uses every core). A task first computes the cos/sin of every pair of its tokens once
// (include/ropescale/rotary.h: the same pair math as the CUDA kernel, fp32 for half types; tables
// of the operands' dtype or float32 read into that compute type), then rotates every row (head,
// batch row) of q and k that shares them with at::vec vectors.
//
// Everything here but the entry point has internal linkage, so no function compiled with AVX
// instructions can stand in for another translation unit's copy at link time.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rotary_args.h"

namespace ropescale {
namespace {

using rotary::PairCoeffs;
using rotary::Params;

// Tokens per task: enough contiguous work per row for streaming, few enough that their cos/sin
// (4 x 16 x rotary_dim/2 values) stay in L1.
constexpr int64_t kTileTokens = 16;
// Below this many elements a single thread is faster than waking the pool.
constexpr int64_t kMinParallelElements = 1 << 15;

// Loads and stores kStep elements of T as kVecs vectors of the compute type.
template <class T, class Enable = void>
struct RowIO {  // float, double: computed in their own type
  using Vec = at::vec::Vectorized<T>;
  static constexpr int kVecs = 1;
  static constexpr int64_t kStep = Vec::size();
  static void load(const T* p, Vec* v) { v[0] = Vec::loadu(p); }
  static void store(T* p, const Vec* v) { v[0].store(p); }
};

template <class T>
struct RowIO<T, std::enable_if_t<at::is_reduced_floating_point_v<T>>> {  // Half, BFloat16: in fp32
  using Vec = at::vec::Vectorized<float>;
  static constexpr int kVecs = 2;
  static constexpr int64_t kStep = at::vec::Vectorized<T>::size();
  static void load(const T* p, Vec* v) {
    std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
  static void store(T* p, const Vec* v) { at::vec::convert_from_float<T>(v[0], v[1]).store(p); }
};

// The coefficients of one token, as four arrays over the pairs.
template <class Acc>
struct TokenCoeffs {
  const Acc *cos_a, *sin_a, *cos_b, *sin_b;

  PairCoeffs<Acc> pair(int64_t i) const { return {cos_a[i], sin_a[i], cos_b[i], sin_b[i]}; }
};

template <class T, class Acc>
void rotate_pair_scalar(const T* in, T* out, int64_t a, int64_t b, const PairCoeffs<Acc>& c) {
  Acc ya, yb;
  rotary::rotate(c, static_cast<Acc>(in[a]), static_cast<Acc>(in[b]), &ya, &yb);
  out[a] = static_cast<T>(ya);
  out[b] = static_cast<T>(yb);
}

// One row's rotated features. Half-split pairs (i, i + half) are two contiguous loads; interleaved
// pairs are split into even/odd vectors and merged back.
template <class T, bool kInterleaved, class Acc>
void rotate_row(const T* in, T* out, int64_t half, const TokenCoeffs<Acc>& c) {
  using IO = RowIO<T>;
  using Vec = typename IO::Vec;
  constexpr int kVecs = IO::kVecs;
  constexpr int64_t kWidth = Vec::size();
  const auto rotate_vec = [&](int64_t j, Vec& xa, Vec& xb) {
    const Vec ya = xa * Vec::loadu(c.cos_a + j) - xb * Vec::loadu(c.sin_a + j);
    const Vec yb = xb * Vec::loadu(c.cos_b + j) + xa * Vec::loadu(c.sin_b + j);
    xa = ya;
    xb = yb;
  };
  int64_t i = 0;
  for (; i + IO::kStep <= half; i += IO::kStep) {
    if constexpr (kInterleaved) {
      // Elements [2i, 2i + 2 kStep) as 2 kVecs vectors; pairs i + m*kWidth.. come from vectors 2m, 2m+1.
      Vec v[2 * kVecs];
      IO::load(in + 2 * i, v);
      IO::load(in + 2 * i + IO::kStep, v + kVecs);
      for (int m = 0; m < kVecs; ++m) {
        auto [xa, xb] = at::vec::deinterleave2(v[2 * m], v[2 * m + 1]);
        rotate_vec(i + m * kWidth, xa, xb);
        std::tie(v[2 * m], v[2 * m + 1]) = at::vec::interleave2(xa, xb);
      }
      IO::store(out + 2 * i, v);
      IO::store(out + 2 * i + IO::kStep, v + kVecs);
    } else {
      Vec xa[kVecs], xb[kVecs];
      IO::load(in + i, xa);
      IO::load(in + half + i, xb);
      for (int m = 0; m < kVecs; ++m) rotate_vec(i + m * kWidth, xa[m], xb[m]);
      IO::store(out + i, xa);
      IO::store(out + half + i, xb);
    }
  }
  for (; i < half; ++i) {
    const rotary::PairIndex e = rotary::pair_elements(kInterleaved, half, i);
    rotate_pair_scalar(in, out, e.a, e.b, c.pair(i));
  }
}

// cos/sin of position * inv_freq[i] for i < pairs, vectorised: the angle is reduced in double as
// rotary_reduced_angle does (a loop the compiler vectorises), then at::vec's sin/cos (Sleef, 3.5 ulp
// on the reduced angle) replace per-pair libm calls, which dominated whenever few rows share a
// token's coefficients (decode, GQA k/v heads, re-rotating a pre-RoPE cache, ReRoPE's key tables).
void vector_cos_sin(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out,
                    bool native_angles = false) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kChunk = 64;  // reduced angles on the stack, a chunk at a time
  float reduced[kChunk];
  for (int64_t first = 0; first < pairs; first += kChunk) {
    const int64_t count = std::min(kChunk, pairs - first);
    if (native_angles) {  // an engine's native table: the float32 product, not reduced (native_sincos)
      for (int64_t i = 0; i < count; ++i) reduced[i] = static_cast<float>(position) * inv_freq[first + i];
    } else {
      for (int64_t i = 0; i < count; ++i)
        reduced[i] = static_cast<float>(rotary_reduced_angle(position, inv_freq[first + i]));
    }
    int64_t i = 0;
    for (; i + Vec::size() <= count; i += Vec::size()) {
      const Vec angle = Vec::loadu(reduced + i);
      angle.cos().store(cos_out + first + i);
      angle.sin().store(sin_out + first + i);
    }
    for (; i < count; ++i) {
      cos_out[first + i] = std::cos(reduced[i]);
      sin_out[first + i] = std::sin(reduced[i]);
    }
  }
}

// Coefficients of every pair of a token at `position` (the kPositions table) into the four arrays
// of `base`: the symmetric pair (c, s, c, s) times scale, (c, -s, c, -s) for the conjugate.
void position_coeffs_row(double position, const float* inv_freq, int64_t half, float scale, bool conjugate,
                         float* base, bool native_angles = false) {
  vector_cos_sin(position, inv_freq, half, base, base + half, native_angles);
  const float sin_scale = conjugate ? -scale : scale;
  for (int64_t i = 0; i < half; ++i) {
    base[i] *= scale;
    base[half + i] *= sin_scale;
    base[2 * half + i] = base[i];
    base[3 * half + i] = base[half + i];
  }
}

template <bool kInterleaved, class T, class Table>
void rotary_cpu_kernel(const Params<T, Table>& p) {
  using Acc = at::opmath_type<T>;
  const int64_t half = p.half();
  const int64_t tokens = p.tokens();
  const int64_t rows = rotary::rows_per_token(p);
  const int64_t tiles = (tokens + kTileTokens - 1) / kTileTokens;
  // Few tokens (decode): also split the rows of a tile, so every thread gets work.
  const int64_t threads = at::get_num_threads();
  const int64_t groups = tiles >= 4 * threads ? 1 : std::min(rows, (4 * threads + tiles - 1) / tiles);
  const int64_t tasks = tiles * groups;
  const int64_t elements = tokens * rows * p.head_dim;
  const int64_t grain = elements < kMinParallelElements ? tasks : 1;
  const auto to_acc = [](Table v) { return static_cast<Acc>(v); };

  // Positions with float math: the vectorised coefficients.
  constexpr bool kFloatAcc = std::is_same_v<Acc, float>;
  const bool vector_positions = kFloatAcc && p.table == rotary::TableKind::kPositions;

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<Acc> buffer(4 * kTileTokens * half);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / groups, group = task % groups;
      const int64_t first_token = tile * kTileTokens;
      const int64_t tile_tokens = std::min(kTileTokens, tokens - first_token);
      // cos/sin of every pair of the tile's tokens, once.
      TokenCoeffs<Acc> coeffs[kTileTokens];
      for (int64_t t = 0; t < tile_tokens; ++t) {
        Acc* base = buffer.data() + 4 * t * half;
        coeffs[t] = {base, base + half, base + 2 * half, base + 3 * half};
        const int64_t token = first_token + t;
        const int64_t table_row = token / p.seq_len, seq = token % p.seq_len;
        if constexpr (kFloatAcc) {
          if (vector_positions) {
            const rotary::TokenTable table = rotary::token_table(p, table_row, seq);
            position_coeffs_row(rotary::token_position(p, table_row, seq), table.inv_freq, half,
                                static_cast<float>(table.scale), p.conjugate, base, table.native_angles);
            continue;
          }
        }
        for (int64_t i = 0; i < half; ++i) {
          const PairCoeffs<Acc> c = rotary::pair_coeffs<Acc>(p, table_row, seq, i, to_acc);
          base[i] = c.cos_a;
          base[half + i] = c.sin_a;
          base[2 * half + i] = c.cos_b;
          base[3 * half + i] = c.sin_b;
        }
      }
      // Every row of the group, token by token (consecutive tokens of a row are usually adjacent).
      const int64_t row_begin = group * rows / groups, row_end = (group + 1) * rows / groups;
      for (int64_t row = row_begin; row < row_end; ++row) {
        for (int64_t t = 0; t < tile_tokens; ++t) {
          const int64_t token = first_token + t;
          const int64_t table_row = token / p.seq_len, seq = token % p.seq_len;
          const rotary::Row<T> r = rotary::locate_row(p, table_row, seq, static_cast<uint32_t>(row));
          rotate_row<T, kInterleaved>(r.in, r.out, half, coeffs[t]);
          if (p.copy_tail)
            std::memcpy(r.out + p.rotary_dim, r.in + p.rotary_dim, (p.head_dim - p.rotary_dim) * sizeof(T));
        }
      }
    }
  });
}

}  // namespace

namespace cpu {
namespace CPU_CAPABILITY {

void cos_sin(double position, const float* inv_freq, int64_t pairs, float* cos_out, float* sin_out) {
  vector_cos_sin(position, inv_freq, pairs, cos_out, sin_out);
}

void rotary_kernel(const RotaryArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.in[0].scalar_type(), "rotary_cpu", [&] {
    with_rotary_params<scalar_t>(args, [](const auto& p) {
      if (p.interleaved)
        rotary_cpu_kernel<true>(p);
      else
        rotary_cpu_kernel<false>(p);
    });
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace ropescale
