// Emulation of the sm_80 warp-level matrix and asynchronous-copy instructions
// that ropescale's tensor-core kernels use, written from the PTX ISA (9.0):
//   * mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
//       section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating
//       point type" (the A, B and C/D fragment layouts, transcribed below);
//   * ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
//       section "Warp-level matrix load instruction: ldmatrix";
//   * cp.async.{ca,cg}.shared.global (16 bytes, with src-size),
//     cp.async.commit_group, cp.async.wait_group, cp.async.wait_all
//       section "Data Movement and Conversion Instructions: cp.async" and the
//       two sections after it.
// mma.sync and ldmatrix are warp-collective (.sync.aligned): every lane hands
// its operands to the warp's exchange (warp_all_gather), which throws unless
// all 32 lanes take part, and then computes its own part of the result from
// every lane's operands through the documented layouts.
//
// Included by cuda_emulation.h; kernels reach these through the wrappers in
// ropescale/portable.h (inline PTX under nvcc).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>

namespace ropescale_emu {

// ---- fragment layouts: PTX ISA 9.0, section 9.7.14.5.8 ---------------------
// groupID = %laneid >> 2, threadID_in_group = %laneid % 4. Each .b32 register
// holds two 16-bit elements, the one with the lower index in the lower half
// (a0 and a1 in the first register, a2 and a3 in the second, ...).
namespace mma_layout {

struct Coord {
  int row, col;
};

// A, 16 x 16 (.row), elements a0..a7:
//   row = groupID      for a_i with i < 2 || 4 <= i < 6, groupID + 8 otherwise
//   col = threadID_in_group * 2 + (i & 1)        for i < 4
//         threadID_in_group * 2 + (i & 1) + 8    for i >= 4
constexpr Coord a_element(int lane, int i) {
  const int group = lane >> 2, thread_in_group = lane % 4;
  return {(i < 2 || (i >= 4 && i < 6)) ? group : group + 8,
          thread_in_group * 2 + (i & 1) + (i >= 4 ? 8 : 0)};
}
// B, 16 x 8 (.col), elements b0..b3:
//   row = threadID_in_group * 2 + (i & 1)        for i < 2
//         threadID_in_group * 2 + (i & 1) + 8    for i >= 2
//   col = groupID
constexpr Coord b_element(int lane, int i) {
  const int group = lane >> 2, thread_in_group = lane % 4;
  return {thread_in_group * 2 + (i & 1) + (i >= 2 ? 8 : 0), group};
}
// C and D, 16 x 8, f32 elements c0..c3 (one per register):
//   row = groupID for i < 2, groupID + 8 for i >= 2
//   col = threadID_in_group * 2 + (i & 1)
constexpr Coord c_element(int lane, int i) {
  const int group = lane >> 2, thread_in_group = lane % 4;
  return {i < 2 ? group : group + 8, thread_in_group * 2 + (i & 1)};
}

}  // namespace mma_layout

namespace detail {

inline std::uint16_t half_bits(std::uint32_t reg, int half) {
  return static_cast<std::uint16_t>(half == 0 ? reg & 0xffffu : reg >> 16);
}
template <class T>
float element_to_float(std::uint16_t bits) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma.m16n8k16 takes f16 or bf16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  } else {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
}

[[noreturn]] inline void throw_device(const std::string& what) {
  throw device_error("ropescale_emu: " + what);
}

}  // namespace detail

// mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32 {d}, {a}, {b}, {c}: D = A B + C
// for the warp, with A 16x16, B 16x8, C and D 16x8 in the fragments above.
// The products of f16/bf16 operands are exact in f32; the sum is accumulated
// in f32, k in ascending order from C (the hardware's order and its internal
// rounding are not documented: compare with tolerances above f32 rounding).
template <class T>
void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                  const float (&c)[4]) {
  struct Operands {
    std::uint32_t a[4], b[2];
  };
  Operands mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  const std::array<Operands, 32> all =
      detail::warp_all_gather("mma.sync.aligned.m16n8k16", mine);
  // The whole A and B, placed by the documented layout from every lane.
  std::uint16_t a_matrix[16][16], b_matrix[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      const mma_layout::Coord at = mma_layout::a_element(lane, i);
      a_matrix[at.row][at.col] = detail::half_bits(all[lane].a[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
      const mma_layout::Coord at = mma_layout::b_element(lane, i);
      b_matrix[at.row][at.col] = detail::half_bits(all[lane].b[i / 2], i % 2);
    }
  }
  const int lane = static_cast<int>(detail::current_thread("mma.sync").lane);
  float result[4];
  for (int i = 0; i < 4; ++i) {
    const mma_layout::Coord at = mma_layout::c_element(lane, i);
    float sum = c[i];
    for (int k = 0; k < 16; ++k)
      sum = std::fma(detail::element_to_float<T>(a_matrix[at.row][k]),
                     detail::element_to_float<T>(b_matrix[k][at.col]), sum);
    result[i] = sum;
  }
  std::memcpy(d, result, sizeof result);
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 {r}, [p]:
// loads kNum 8x8 matrices of 16-bit elements from shared memory. Row j of
// matrix m starts at the address given by lane 8m + j (lanes 0-7 for .x1,
// 0-15 for .x2, all for .x4; the other lanes' addresses are ignored); each row
// is 16 contiguous bytes, 16-byte aligned. Lane l receives in r[m] the
// elements (row l/4, columns 2(l%4) and 2(l%4)+1) of matrix m, the lower
// column in the lower half; with .trans, the matrix is read transposed:
// (rows 2(l%4) and 2(l%4)+1, column l/4).
template <int kNum, bool kTrans>
void ldmatrix_m8n8_b16(std::uint32_t (&r)[kNum], const void* row_address) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const char* name = kTrans ? "ldmatrix.sync.aligned.m8n8.trans" : "ldmatrix.sync.aligned.m8n8";
  const std::array<const void*, 32> rows = detail::warp_all_gather(name, row_address);
  for (int l = 0; l < 8 * kNum; ++l) {
    const auto address = reinterpret_cast<std::uintptr_t>(rows[l]);
    if (address % 16 != 0)
      detail::throw_device(std::string(name) + ": lane " + std::to_string(l) +
                           "'s row address is not 16-byte aligned");
    if (!detail::in_shared_memory(rows[l], 16))
      detail::throw_device(std::string(name) + ": lane " + std::to_string(l) +
                           "'s row is not in the block's shared memory");
  }
  const int lane = static_cast<int>(detail::current_thread(name).lane);
  const int group = lane >> 2, thread_in_group = lane % 4;
  const auto element = [&](int m, int row, int col) {
    std::uint16_t bits;
    std::memcpy(&bits, static_cast<const unsigned char*>(rows[8 * m + row]) + 2 * col, 2);
    return std::uint32_t{bits};
  };
  for (int m = 0; m < kNum; ++m) {
    if constexpr (kTrans)
      r[m] = element(m, 2 * thread_in_group, group) |
             element(m, 2 * thread_in_group + 1, group) << 16;
    else
      r[m] = element(m, group, 2 * thread_in_group) |
             element(m, group, 2 * thread_in_group + 1) << 16;
  }
}

// cp.async.{ca,cg}.shared.global [dst], [src], kBytes, src_bytes: copies
// kBytes from global to shared memory asynchronously, zero-filling past
// src_bytes. The destination is undefined until the thread's
// cp.async.wait_group / wait_all that covers the copy, and other threads see
// it only after a barrier that follows that wait. The emulation makes this
// strict: the destination is filled with 0xFF bytes (NaN) at issue, and the
// data lands only at the wait.
template <int kBytes>
void cp_async(const char* name, void* dst, const void* src, int src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  detail::current_thread(name);
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  if (d % kBytes != 0 || s % kBytes != 0)
    detail::throw_device(std::string(name) + ": addresses must be aligned to the copy size");
  if (src_bytes < 0 || src_bytes > kBytes)
    detail::throw_device(std::string(name) + ": src-size must be in [0, cp-size]");
  if (!detail::in_shared_memory(dst, kBytes))
    detail::throw_device(std::string(name) + ": the destination is not in shared memory");
  if (src_bytes > 0 && detail::in_shared_memory(src, kBytes))
    detail::throw_device(std::string(name) + ": the source must be global memory");
  std::memset(dst, 0xFF, kBytes);
  detail::tls_async_copies.open.push_back({static_cast<unsigned char*>(dst),
                                           static_cast<const unsigned char*>(src),
                                           static_cast<unsigned>(kBytes),
                                           static_cast<unsigned>(src_bytes)});
}

namespace detail {
inline void complete_async_copies(const std::vector<AsyncCopy>& copies) {
  for (const AsyncCopy& copy : copies) {
    if (copy.src_size > 0) std::memcpy(copy.dst, copy.src, copy.src_size);
    std::memset(copy.dst + copy.src_size, 0, copy.size - copy.src_size);
  }
}
}  // namespace detail

// cp.async.commit_group: the copies issued since the last commit form a group
// (possibly empty).
inline void cp_async_commit_group() {
  detail::current_thread("cp.async.commit_group");
  auto& state = detail::tls_async_copies;
  state.committed.push_back(std::move(state.open));
  state.open.clear();
}

// cp.async.wait_group n: waits until at most the n most recent committed
// groups are pending; older groups are complete. Uncommitted copies are not
// waited for.
inline void cp_async_wait_group(int n) {
  detail::current_thread("cp.async.wait_group");
  auto& state = detail::tls_async_copies;
  while (state.committed.size() > static_cast<std::size_t>(n < 0 ? 0 : n)) {
    detail::complete_async_copies(state.committed.front());
    state.committed.pop_front();
  }
}

// cp.async.wait_all: commit_group followed by wait_group 0.
inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

}  // namespace ropescale_emu
