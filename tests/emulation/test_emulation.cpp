// Tests of the CPU SIMT emulation: CUDA-style kernels from emu_test_kernels.cuh
// run through ROPESCALE_LAUNCH_KERNEL and are compared with plain host loops.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "emu_matrix_kernels.cuh"
#include "emu_test_kernels.cuh"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr cudaStream_t kDefaultStream = nullptr;

// Small integers, so float sums are exact in any order.
std::vector<float> small_integer_floats(std::size_t n, unsigned seed) {
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i)
    values[i] = static_cast<float>((i * 7919u + seed) % 17) - 8.0f;
  return values;
}

}  // namespace

TEST_CASE("3D grid and 3D block index math", "[launch]") {
  const dim3 grid(3, 2, 2);
  const dim3 block(4, 3, 2);
  const unsigned threads = block.x * block.y * block.z;
  std::vector<unsigned> out(grid.x * grid.y * grid.z * threads, 0xffffffffu);
  emu_test::launch_write_coords(grid, block, out.data(), kDefaultStream);

  std::vector<unsigned> expected;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx)
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx)
              expected.push_back(emu_test::pack_coords(uint3{bx, by, bz}, uint3{tx, ty, tz}));
  CHECK(out == expected);
}

TEST_CASE("block reduction with __shared__ and __syncthreads", "[shared][syncthreads]") {
  constexpr int kBlock = 256;
  const int n = 5 * kBlock + 77;  // last block is partly out of range
  const std::vector<float> in = small_integer_floats(n, 3);
  const int blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> sums(blocks, -1.0f);
  emu_test::launch_block_sum<kBlock>(in.data(), sums.data(), n, kDefaultStream);

  std::vector<float> expected(blocks, 0.0f);
  for (int i = 0; i < n; ++i) expected[i / kBlock] += in[i];
  CHECK(sums == expected);
}

TEST_CASE("warp shuffles: xor, down, up, broadcast, width, value types", "[warp]") {
  const unsigned blocks = 3, threads = 64;
  const unsigned n = blocks * threads;
  const std::vector<float> in = small_integer_floats(n, 11);
  std::vector<float> xor_sum(n), down_sum(n / 32), scan(n), broadcast(n), segment_sum(n);
  std::vector<double> double_sum(n);
  std::vector<int> int_sum(n);
  const emu_test::WarpOpsOutputs out{xor_sum.data(),     down_sum.data(),   scan.data(),
                                     broadcast.data(),   segment_sum.data(), double_sum.data(),
                                     int_sum.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::warp_ops_kernel, dim3(blocks), dim3(threads), 0, kDefaultStream,
                          in.data(), out);

  std::vector<float> e_xor(n), e_down(n / 32), e_scan(n), e_broadcast(n), e_segment(n);
  std::vector<double> e_double(n);
  std::vector<int> e_int(n);
  for (unsigned w = 0; w < n / 32; ++w) {
    float total = 0.0f;
    for (unsigned l = 0; l < 32; ++l) total += in[w * 32 + l];
    e_down[w] = total;
    float prefix = 0.0f;
    for (unsigned l = 0; l < 32; ++l) {
      const unsigned i = w * 32 + l;
      prefix += in[i];
      e_xor[i] = total;
      e_scan[i] = prefix;
      e_broadcast[i] = in[w * 32 + 5];
      e_double[i] = total;
      e_int[i] = static_cast<int>(total);
      const unsigned segment_start = i & ~7u;
      e_segment[i] = 0.0f;
      for (unsigned s = 0; s < 8; ++s) e_segment[i] += in[segment_start + s];
    }
  }
  CHECK(xor_sum == e_xor);
  CHECK(down_sum == e_down);
  CHECK(scan == e_scan);
  CHECK(broadcast == e_broadcast);
  CHECK(segment_sum == e_segment);
  CHECK(double_sum == e_double);
  CHECK(int_sum == e_int);
}

TEST_CASE("block of 48 threads: partial last warp, votes, block votes", "[warp][partial]") {
  const unsigned blocks = 2, threads = 48, warps = 2;
  std::vector<int> in(blocks * threads);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>((i * 37) % 97);
  std::vector<int> warp_sums(blocks * warps, -1), any_all(blocks * warps * 2, -1),
      block_votes(blocks * 3, -1);
  std::vector<unsigned> ballots(blocks * warps), active(blocks * warps);
  const emu_test::PartialWarpOutputs out{warp_sums.data(), ballots.data(), active.data(),
                                         any_all.data(), block_votes.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::partial_warp_kernel, dim3(blocks), dim3(threads), 0,
                          kDefaultStream, in.data(), out);

  for (unsigned b = 0; b < blocks; ++b) {
    int odd_in_block = 0, large_in_block = 0;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned lanes = w == 0 ? 32 : threads - 32;  // 16 in the last warp
      int sum = 0, any_large = 0;
      unsigned ballot = 0;
      for (unsigned l = 0; l < lanes; ++l) {
        const int v = in[b * threads + w * 32 + l];
        sum += v;
        if (v % 2 != 0) ballot |= 1u << l;
        any_large |= v > 90;
      }
      const unsigned slot = b * warps + w;
      INFO("block " << b << " warp " << w);
      CHECK(warp_sums[slot] == sum);
      CHECK(ballots[slot] == ballot);
      CHECK(active[slot] == (lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u));
      CHECK(any_all[2 * slot] == any_large);
      CHECK(any_all[2 * slot + 1] == 1);
      odd_in_block += std::popcount(ballot);
      large_in_block |= any_large;
    }
    CHECK(block_votes[3 * b] == odd_in_block);
    CHECK(block_votes[3 * b + 1] == large_in_block);
    CHECK(block_votes[3 * b + 2] == 1);
  }
}

TEST_CASE("dynamic shared memory sized at launch", "[shared][dynamic]") {
  const unsigned misaligned_sentinel = 0;
  SECTION("float, 96 threads") {
    const unsigned blocks = 4, threads = 96;
    std::vector<float> in = small_integer_floats(blocks * threads, 5), out(in.size(), -100.0f);
    unsigned misaligned = misaligned_sentinel;
    emu_test::launch_reverse_in_block(in.data(), out.data(), &misaligned, blocks, threads,
                                      kDefaultStream);
    std::vector<float> expected(in.size());
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        expected[b * threads + t] = in[b * threads + threads - 1 - t];
    CHECK(out == expected);
    CHECK(misaligned == 0);
  }
  SECTION("double, 1024 threads (8 KiB)") {
    const unsigned blocks = 2, threads = 1024;
    std::vector<double> in(blocks * threads), out(in.size(), -1.0);
    std::iota(in.begin(), in.end(), 0.5);
    unsigned misaligned = misaligned_sentinel;
    emu_test::launch_reverse_in_block(in.data(), out.data(), &misaligned, blocks, threads,
                                      kDefaultStream);
    bool all_reversed = true;
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        all_reversed &= out[b * threads + t] == in[b * threads + threads - 1 - t];
    CHECK(all_reversed);
    CHECK(misaligned == 0);
  }
}

TEST_CASE("atomics across blocks", "[atomic]") {
  const int n = 1000, num_bins = 7;
  std::vector<int> values(n);
  for (int i = 0; i < n; ++i) values[i] = (i * 131) % 1009;
  std::vector<int> bins(num_bins, 0);
  float float_total = 0.0f;
  double double_total = 0.0;
  unsigned count = 0, claims = 0;
  int max_value = -1, owner = -1;
  const emu_test::AtomicOutputs out{bins.data(), &float_total, &double_total, &count,
                                    &max_value,  &owner,       &claims};
  // 8 blocks of 128 threads: the last 24 threads return early.
  ROPESCALE_LAUNCH_KERNEL(emu_test::atomics_kernel, dim3(8), dim3(128), 0, kDefaultStream,
                          values.data(), n, num_bins, out);

  std::vector<int> e_bins(num_bins, 0);
  double e_total = 0.0;
  for (int v : values) {
    ++e_bins[v % num_bins];
    e_total += v;
  }
  CHECK(bins == e_bins);
  CHECK(float_total == static_cast<float>(e_total));  // < 2^24: exact in any order
  CHECK(double_total == 0.5 * e_total);
  CHECK(count == static_cast<unsigned>(n));
  CHECK(max_value == *std::max_element(values.begin(), values.end()));
  CHECK(claims == 1);
  CHECK(owner >= 0);
  CHECK(owner < n);

  unsigned counter = 0;
  float float_counter = 0.0f;
  const int iterations = 200;
  ROPESCALE_LAUNCH_KERNEL(emu_test::contended_counter_kernel, dim3(3), dim3(256), 0,
                          kDefaultStream, &counter, &float_counter, iterations);
  CHECK(counter == 3u * 256u * iterations);
  CHECK(float_counter == static_cast<float>(3 * 256 * iterations));  // < 2^24: exact
}

TEST_CASE("__half and __nv_bfloat16 conversions, arithmetic and shuffles", "[half]") {
  const unsigned n = 64;
  std::vector<float> in(n);
  for (unsigned i = 0; i < n; ++i)
    in[i] = i < 32 ? static_cast<float>(i) * 0.25f - 4.0f   // exactly representable in both
                   : std::sin(static_cast<float>(i)) * 200.0f;  // needs rounding; x*x < 65504
  std::vector<float> half_rt(n), bf16_rt(n), half_sq(n), half_nb(n), bf16_nb(n);
  const emu_test::HalfOutputs out{half_rt.data(), bf16_rt.data(), half_sq.data(), half_nb.data(),
                                  bf16_nb.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::half_kernel, dim3(2), dim3(32), 0, kDefaultStream, in.data(),
                          out);

  for (unsigned i = 0; i < n; ++i) {
    INFO("i = " << i << ", x = " << in[i]);
    const float x = in[i];
    if (i < 32) {
      CHECK(half_rt[i] == x);
      CHECK(bf16_rt[i] == x);
    }
    // Round-to-nearest: relative error at most half an ulp (2^-11 half, 2^-8 bf16).
    CHECK(std::fabs(half_rt[i] - x) <= std::ldexp(std::fabs(x), -11));
    CHECK(std::fabs(bf16_rt[i] - x) <= std::ldexp(std::fabs(x), -8));
    const float rounded = half_rt[i];
    CHECK(std::fabs(half_sq[i] - rounded * rounded) <= std::ldexp(rounded * rounded, -11));
    CHECK(half_nb[i] == half_rt[i ^ 1]);
    CHECK(bf16_nb[i] == bf16_rt[i ^ 1]);
  }
}

TEST_CASE("template kernel with a comma in its name", "[launch]") {
  const int n = 300;
  std::vector<float> in = small_integer_floats(n, 1), out(n, 0.0f), expected(n);
  for (int i = 0; i < n; ++i) expected[i] = 3.0f * in[i];
  emu_test::launch_scale_by_3(in.data(), out.data(), n, kDefaultStream);
  CHECK(out == expected);
}

TEST_CASE("launch errors and device errors propagate as exceptions", "[errors]") {
  SECTION("more than 1024 threads per block") {
    std::vector<unsigned> out(1025);
    CHECK_THROWS_AS(emu_test::launch_write_coords(dim3(1), dim3(1025), out.data(), kDefaultStream),
                    ropescale_emu::launch_error);
    CHECK_THROWS_WITH(
        emu_test::launch_write_coords(dim3(1), dim3(32, 32, 2), out.data(), kDefaultStream),
        Catch::Contains("1024"));
    CHECK_THROWS_AS(emu_test::launch_write_coords(dim3(0), dim3(32), out.data(), kDefaultStream),
                    ropescale_emu::launch_error);
    // Exactly 1024 is allowed.
    std::vector<unsigned> ok(1024, 0xffffffffu);
    CHECK_NOTHROW(emu_test::launch_write_coords(dim3(1), dim3(1024), ok.data(), kDefaultStream));
    CHECK(ok[1023] == emu_test::pack_coords(uint3{0, 0, 0}, uint3{1023, 0, 0}));
  }
  SECTION("a trapping thread does not hang the others at the barrier") {
    int passed_barrier = 0;
    CHECK_THROWS_AS(ROPESCALE_LAUNCH_KERNEL(emu_test::trap_in_one_thread_kernel, dim3(1),
                                            dim3(64), 0, kDefaultStream, &passed_barrier),
                    ropescale_emu::device_error);
    CHECK(passed_barrier == 63);
  }
  SECTION("partial-mask warp collectives are reported") {
    std::vector<int> out(32);
    CHECK_THROWS_WITH(ROPESCALE_LAUNCH_KERNEL(emu_test::split_mask_shuffle_kernel, dim3(1),
                                              dim3(32), 0, kDefaultStream, out.data()),
                      Catch::Contains("mask"));
  }
  SECTION("a deadlock becomes a timeout error") {
    const ropescale_emu::ScopedSyncTimeout short_timeout(std::chrono::milliseconds(300));
    CHECK_THROWS_WITH(ROPESCALE_LAUNCH_KERNEL(emu_test::divergent_barrier_kernel, dim3(1),
                                              dim3(32), 0, kDefaultStream),
                      Catch::Contains("deadlock"));
  }
  SECTION("device intrinsics outside a kernel") {
    CHECK_THROWS_AS(__syncthreads(), ropescale_emu::device_error);
    CHECK_THROWS_AS(__shfl_sync(0xffffffffu, 1, 0), ropescale_emu::device_error);
  }
  SECTION("the emulation still works after errors") {
    std::vector<unsigned> out(64, 0xffffffffu);
    emu_test::launch_write_coords(dim3(2), dim3(32), out.data(), kDefaultStream);
    CHECK(out[63] == emu_test::pack_coords(uint3{1, 0, 0}, uint3{31, 0, 0}));
  }
}

TEST_CASE("host fallbacks of device math intrinsics", "[math]") {
  float s = 0.0f, c = 0.0f;
  sincosf(0.5f, &s, &c);
  CHECK(s == Approx(std::sin(0.5f)));
  CHECK(c == Approx(std::cos(0.5f)));
  sincospif(0.5f, &s, &c);
  CHECK(s == Approx(1.0f));
  CHECK(c == Approx(0.0f).margin(1e-7));
  CHECK(rsqrtf(4.0f) == 0.5f);
  CHECK(__expf(1.0f) == Approx(2.7182818f));
  CHECK(__fdividef(1.0f, 4.0f) == 0.25f);
  CHECK(__float_as_int(1.0f) == 0x3f800000);
  CHECK(__int_as_float(0x40000000) == 2.0f);
  CHECK(__float2int_rn(2.5f) == 2);  // round half to even
  CHECK(__float2int_rn(1e20f) == 2147483647);
  CHECK(min(3, 5u) == 3u);
  CHECK(max(-1.0f, 2.0f) == 2.0f);
  CHECK(__popc(0xf0f0u) == 8);
  CHECK(__ffs(8) == 4);
  const float value = 7.0f;
  CHECK(__ldg(&value) == 7.0f);
}

// ---- tensor-core and asynchronous-copy primitives ----------------------------------------------
// Every value is a small integer, so f16/bf16 hold it exactly and every f32 sum of products is
// exact in any order: the kernels must reproduce the plain product below bit for bit.

namespace {

template <typename T>
T to_element(float x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half(x);
  else
    return __float2bfloat16(x);
}

// The reference: d = a b + c, row-major, written as the plain triple loop (independent of any
// fragment layout).
std::vector<float> plain_product(const std::vector<float>& a, const std::vector<float>& b,
                                 const std::vector<float>& c, int m, int k, int n) {
  std::vector<float> d(static_cast<std::size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double sum = c.empty() ? 0.0 : c[i * n + j];
      for (int p = 0; p < k; ++p) sum += static_cast<double>(a[i * k + p]) * b[p * n + j];
      d[i * n + j] = static_cast<float>(sum);
    }
  return d;
}

std::vector<float> small_integers(std::size_t n, unsigned seed, int range) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(gen));
  return v;
}

template <typename T>
std::vector<float> run_mma_from_global(const std::vector<float>& a, const std::vector<float>& b,
                                       const std::vector<float>& c, int mapping) {
  std::vector<T> at(a.size()), bt(b.size());
  for (std::size_t i = 0; i < a.size(); ++i) at[i] = to_element<T>(a[i]);
  for (std::size_t i = 0; i < b.size(); ++i) bt[i] = to_element<T>(b[i]);
  std::vector<float> d(16 * 8, -12345.0f);
  ROPESCALE_LAUNCH_KERNEL(emu_test::mma_from_global_kernel<T>, dim3(1), dim3(32), 0,
                          kDefaultStream, at.data(), bt.data(), c.data(), d.data(), mapping);
  return d;
}

template <typename T>
void check_mma_layout() {
  for (unsigned seed = 1; seed <= 3; ++seed) {
    const auto a = small_integers(16 * 16, seed, 8), b = small_integers(16 * 8, seed + 10, 8),
               c = small_integers(16 * 8, seed + 20, 100);
    const auto expected = plain_product(a, b, c, 16, 16, 8);
    INFO("seed " << seed);
    CHECK(run_mma_from_global<T>(a, b, c, emu_test::kDocumented) == expected);
    // A wrong lane mapping on the loading side gives a different matrix: the comparison sees it.
    CHECK(run_mma_from_global<T>(a, b, c, emu_test::kRowHalvesSwapped) != expected);
    CHECK(run_mma_from_global<T>(a, b, c, emu_test::kGroupThreadSwapped) != expected);
    CHECK(run_mma_from_global<T>(a, b, c, emu_test::kBHalvesSwapped) != expected);
  }
  // One-hot operands pin every element to its place: A = e_(i,k), B = e_(k,j) give D = e_(i,j).
  for (int i = 0; i < 16; i += 5)
    for (int k = 0; k < 16; k += 3)
      for (int j = 0; j < 8; j += 3) {
        std::vector<float> a(256, 0.0f), b(128, 0.0f), c(128, 0.0f);
        a[i * 16 + k] = 1.0f;
        b[k * 8 + j] = 2.0f;
        std::vector<float> expected(128, 0.0f);
        expected[i * 8 + j] = 2.0f;
        INFO("i " << i << " k " << k << " j " << j);
        CHECK(run_mma_from_global<T>(a, b, c, emu_test::kDocumented) == expected);
      }
}

}  // namespace

TEST_CASE("mma.m16n8k16 follows the PTX fragment layout (f16, bf16)", "[mma]") {
  SECTION("f16") { check_mma_layout<__half>(); }
  SECTION("bf16") { check_mma_layout<__nv_bfloat16>(); }
  SECTION("f16 products are exact, the sum is f32") {
    // f16 holds 2047 and 2045 (11 significant bits); their product needs 22 bits, and + 0.5 one
    // more: exact in f32 (24 bits), far from any f16.
    std::vector<float> a(256, 0.0f), b(128, 0.0f), c(128, 0.0f);
    a[0] = 2047.0f, b[0] = 2045.0f;
    c[0] = 0.5f;
    const auto d = run_mma_from_global<__half>(a, b, c, emu_test::kDocumented);
    CHECK(d[0] == 2047.0f * 2045.0f + 0.5f);
  }
}

namespace {

// The documented ldmatrix result, written from the PTX ISA's description: lane l gets in register
// m the cells (row l/4, columns 2(l%4), 2(l%4)+1) of matrix m, or transposed (rows 2(l%4),
// 2(l%4)+1, column l/4); the lower column (row) in the lower 16 bits.
std::vector<uint32_t> documented_ldmatrix(const std::vector<uint16_t>& mats, int num, bool trans) {
  std::vector<uint32_t> out(32 * num);
  for (int lane = 0; lane < 32; ++lane)
    for (int m = 0; m < num; ++m) {
      const auto cell = [&](int row, int col) { return uint32_t{mats[m * 64 + row * 8 + col]}; };
      const int r = lane / 4, c = 2 * (lane % 4);
      out[lane * num + m] = trans ? cell(c, r) | cell(c + 1, r) << 16 : cell(r, c) | cell(r, c + 1) << 16;
    }
  return out;
}

template <int kNum, bool kTrans>
void check_ldmatrix() {
  std::vector<uint16_t> mats(kNum * 64);
  for (std::size_t i = 0; i < mats.size(); ++i) mats[i] = static_cast<uint16_t>(0x1000 + i * 7);
  const std::size_t smem = kNum * 8 * emu_test::kLdmatrixStride * sizeof(uint16_t);
  std::vector<uint32_t> out(32 * kNum, 0);
  ROPESCALE_LAUNCH_KERNEL((emu_test::ldmatrix_kernel<kNum, kTrans>), dim3(1), dim3(32), smem,
                          kDefaultStream, mats.data(), out.data(), 0);
  const auto expected = documented_ldmatrix(mats, kNum, kTrans);
  CHECK(out == expected);
  // The row addresses are per lane: handing rows to the wrong lanes changes the result.
  ROPESCALE_LAUNCH_KERNEL((emu_test::ldmatrix_kernel<kNum, kTrans>), dim3(1), dim3(32), smem,
                          kDefaultStream, mats.data(), out.data(), 1);
  CHECK(out != expected);
  // And the documented layout is not symmetric in .trans.
  CHECK(documented_ldmatrix(mats, kNum, !kTrans) != expected);
}

}  // namespace

TEST_CASE("ldmatrix x1/x2/x4 and .trans follow the PTX layout", "[ldmatrix]") {
  SECTION("x1") { check_ldmatrix<1, false>(); }
  SECTION("x2") { check_ldmatrix<2, false>(); }
  SECTION("x4") { check_ldmatrix<4, false>(); }
  SECTION("x1.trans") { check_ldmatrix<1, true>(); }
  SECTION("x2.trans") { check_ldmatrix<2, true>(); }
  SECTION("x4.trans") { check_ldmatrix<4, true>(); }
}

namespace {
template <typename T>
void check_ldmatrix_mma() {
  const auto a = small_integers(256, 5, 6), b = small_integers(128, 6, 6);
  std::vector<T> at(256), bt(128);
  for (int i = 0; i < 256; ++i) at[i] = to_element<T>(a[i]);
  for (int i = 0; i < 128; ++i) bt[i] = to_element<T>(b[i]);
  std::vector<float> d_trans(128, -1.0f), d_x1(128, -1.0f);
  const std::size_t smem = (16 * 24 + 16 * 16 + 8 * 24) * sizeof(T);
  ROPESCALE_LAUNCH_KERNEL(emu_test::ldmatrix_mma_kernel<T>, dim3(1), dim3(32), smem, kDefaultStream,
                          at.data(), bt.data(), d_trans.data(), d_x1.data());
  const auto expected = plain_product(a, b, {}, 16, 16, 8);
  CHECK(d_trans == expected);
  CHECK(d_x1 == expected);
}
}  // namespace

TEST_CASE("ldmatrix feeding mma gives the plain product", "[ldmatrix][mma]") {
  SECTION("f16") { check_ldmatrix_mma<__half>(); }
  SECTION("bf16") { check_ldmatrix_mma<__nv_bfloat16>(); }
}

TEST_CASE("cp.async groups: zero fill, wait_group, and in-flight data is poisoned", "[cp_async]") {
  std::vector<float4> src(128);
  for (int i = 0; i < 128; ++i) src[i] = float4{i + 0.25f, i + 0.5f, -1.0f * i, 7.0f};
  std::vector<float4> own(64), pending(64), other(64);
  const emu_test::CpAsyncOutputs out{own.data(), pending.data(), other.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::cp_async_kernel, dim3(1), dim3(64), 128 * sizeof(float4),
                          kDefaultStream, src.data(), out);
  const auto same = [](float4 x, float4 y) { return std::memcmp(&x, &y, sizeof x) == 0; };
  const auto expected_chunk = [&](int chunk) {  // after the copy, with its zero fill
    if (chunk < 64) return src[chunk];
    const int t = chunk - 64;
    float4 v = src[chunk];
    if (t % 3 == 2) v = float4{0.0f, 0.0f, 0.0f, 0.0f};                  // 0 source bytes
    if (t % 3 == 1) v.z = 0.0f, v.w = 0.0f;                              // 8 source bytes
    return v;
  };
  for (int t = 0; t < 64; ++t) {
    INFO("thread " << t);
    CHECK(same(own[t], src[t]));
    CHECK(same(other[t], expected_chunk(127 - t)));
    // Still in flight after wait_group 1: the emulation hands out 0xFF bytes (NaN).
    uint32_t bits[4];
    std::memcpy(bits, &pending[t], sizeof bits);
    CHECK((bits[0] == 0xffffffffu && bits[3] == 0xffffffffu));
  }
}

TEST_CASE("misused matrix instructions are reported", "[mma][ldmatrix][cp_async][errors]") {
  std::vector<__half> halves(64, __float2half(1.0f));
  std::vector<float> floats(256, 0.0f);
  const std::size_t smem = 1024;
  auto launch = [&](unsigned threads, int misuse) {
    ROPESCALE_LAUNCH_KERNEL(emu_test::matrix_misuse_kernel, dim3(1), dim3(threads), smem, kDefaultStream,
                            halves.data(), floats.data(), misuse);
  };
  const std::pair<int, const char*> misuses[] = {
      {0, "all 32 lanes"}, {1, "shared memory"}, {2, "aligned"}, {3, "not in shared memory"}};
  for (const auto& [misuse, message] : misuses) {
    CAPTURE(misuse);
    CHECK_THROWS_WITH(launch(32, misuse), Catch::Contains(message));
  }
  // mma in a partial warp (48 threads: the second warp has 16 lanes).
  CHECK_THROWS_WITH(launch(48, 0), Catch::Contains("all 32 lanes"));
}

// ---- launch rules that make the emulation stricter than a lucky GPU run ---------------------------

TEST_CASE("static __shared__ memory is poisoned before every block", "[shared][poison]") {
  if (!ROPESCALE_EMU_POISONS_STATIC_SHARED) {
    WARN("no ELF section for static __shared__ on this platform: not poisoned");
    return;
  }
  constexpr int kCells = emu_test::kCells;
  std::vector<int> out(3 * kCells, 0);
  ROPESCALE_LAUNCH_KERNEL(emu_test::static_shared_first_read_kernel, dim3(3), dim3(kCells), 0,
                          kDefaultStream, out.data());
  CHECK(out == std::vector<int>(3 * kCells, -1));  // 0xFF bytes; never the previous block's 1000 + b
}

TEST_CASE("blocks run in order, reversed or shuffled", "[launch][order]") {
  const dim3 grid(4, 3, 2);
  const unsigned n = 24;
  const auto run = [&] {
    unsigned counter = 0;
    std::vector<unsigned> tickets(n, 0xffffffffu);
    ROPESCALE_LAUNCH_KERNEL(emu_test::block_ticket_kernel, grid, dim3(32), 0, kDefaultStream, &counter,
                            tickets.data());
    return tickets;
  };
  std::vector<unsigned> in_order(n);
  std::iota(in_order.begin(), in_order.end(), 0u);
  {
    const ropescale_emu::ScopedBlockOrder order(ropescale_emu::BlockOrder::kInOrder);
    CHECK(run() == in_order);
  }
  {
    const ropescale_emu::ScopedBlockOrder order(ropescale_emu::BlockOrder::kReversed);
    std::vector<unsigned> reversed(in_order.rbegin(), in_order.rend());
    CHECK(run() == reversed);
  }
  {
    const ropescale_emu::ScopedBlockOrder order(ropescale_emu::BlockOrder::kShuffled, 7);
    const auto first = run(), second = run();
    CHECK(std::set<unsigned>(first.begin(), first.end()) == std::set<unsigned>(in_order.begin(), in_order.end()));
    CHECK(first != in_order);
    CHECK(first != second);  // every launch draws its own order
  }
}

TEST_CASE("shared memory limits: 48 KiB without the opt-in, the target's cap with it, per device", "[shared][limits]") {
  std::vector<unsigned char> out(1, 0);
  const auto launch = [&](int bytes) {
    ROPESCALE_LAUNCH_KERNEL(emu_test::dynamic_smem_kernel, dim3(1), dim3(64), static_cast<std::size_t>(bytes),
                            kDefaultStream, out.data(), bytes);
  };
  CHECK_NOTHROW(launch(32 * 1024));
  CHECK_THROWS_WITH(launch(48 * 1024 + 16), Catch::Contains("without the kernel's opt-in"));
  CHECK(ROPESCALE_OPT_IN_DYNAMIC_SMEM(emu_test::dynamic_smem_kernel, 100 * 1024) == 0);
  CHECK_NOTHROW(launch(100 * 1024));
  CHECK(out[0] == 1);
  CHECK_THROWS_WITH(launch(100 * 1024 + 16), Catch::Contains("opt-in of"));
  // sm_80 (the default target) caps a block at 163 KiB; sm_90 at 227 KiB.
  CHECK(ROPESCALE_OPT_IN_DYNAMIC_SMEM(emu_test::dynamic_smem_kernel, 200 * 1024) != 0);
  {
    const ropescale_emu::ScopedTarget hopper(ropescale_emu::Target::kSm90);
    CHECK(ROPESCALE_OPT_IN_DYNAMIC_SMEM(emu_test::dynamic_smem_kernel, 200 * 1024) == 0);
    CHECK_NOTHROW(launch(200 * 1024));
  }
  // Opt-ins are per device (target): sm_90's does not carry over to sm_80.
  CHECK_THROWS_WITH(launch(200 * 1024), Catch::Contains("opt-in of 102400 B"));
  {
    // The 99 KiB parts (sm_86, sm_89, sm_120): a device of its own, with its own opt-ins.
    const ropescale_emu::ScopedTarget ampere(ropescale_emu::Target::kSm86);
    CHECK(ropescale_emu::current_device() != static_cast<int>(ropescale_emu::Target::kSm80));
    CHECK(ropescale_emu::shared_memory_per_block_optin() == 101376);
    CHECK_THROWS_WITH(launch(60 * 1024), Catch::Contains("without the kernel's opt-in"));
    CHECK(ROPESCALE_OPT_IN_DYNAMIC_SMEM(emu_test::dynamic_smem_kernel, 101376) != 0);  // + the static bytes
    CHECK(ROPESCALE_OPT_IN_DYNAMIC_SMEM(emu_test::dynamic_smem_kernel, 96 * 1024) == 0);
    CHECK_NOTHROW(launch(96 * 1024));
    CHECK_THROWS_WITH(launch(100 * 1024), Catch::Contains("opt-in of 98304 B"));
  }
  CHECK(ropescale_emu::shared_memory_per_block_optin() == 166912);
}
