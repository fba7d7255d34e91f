// SIMT emulation of the CUDA device programming model for host compilers.
//
// Lets unmodified CUDA kernel source (written against portable.h) compile with
// g++/clang (C++20) and run on the CPU with real launch semantics:
//   * every CUDA thread of a block is a std::thread, so __syncthreads(), warp
//     shuffles/votes and atomics behave like real concurrent code (and can be
//     checked with ThreadSanitizer);
//   * blocks run one after another in blockIdx order (x fastest). CUDA promises
//     no inter-block concurrency, so this is a legal schedule; it is also why
//     `__shared__` can simply mean `static`. A kernel that needs blocks to run
//     at the same time (grid-wide sync, spin-waiting on another block) hangs
//     here, and it may hang on a GPU too.
//
// Restrictions (see README.md):
//   * warp collectives (__shfl*_sync, __syncwarp, __ballot/any/all_sync) are
//     emulated for masks that name every lane still running in the warp. A
//     collective whose mask leaves out a participating lane throws; one whose
//     left-out lanes are blocked elsewhere ends in the sync-timeout error.
//   * lanes that do not take part (missing lanes of a partial last warp,
//     exited lanes) are skipped by shuffles: the caller gets its own value.
//   * launches are serialised process-wide (static __shared__ storage);
//     launching from inside a kernel throws.
//   * __CUDA_ARCH__ is not defined: device-only `#if __CUDA_ARCH__` paths are
//     not compiled here.
//
// Execution details that matter to kernel authors:
//   * all threads of a block are started before any runs kernel code, so
//     their bodies really overlap (ThreadSanitizer then sees missing barriers);
//   * a thread that returns (or throws) leaves every barrier of its block, as
//     exited threads do on hardware, so the others do not wait for it;
//   * a barrier wait longer than ROPESCALE_EMU_SYNC_TIMEOUT_MS (default
//     120000; 0 = forever) throws instead of hanging CI;
//   * dynamic shared memory, and every static __shared__ variable, is filled
//     with 0xFF bytes (NaN floats, -1 integers) before each block;
//   * blocks run in blockIdx order, or in a shuffled or reversed order
//     (ROPESCALE_EMU_BLOCK_ORDER, ScopedBlockOrder), so results that depend on
//     the order of blocks show up as differences between runs;
//   * dynamic shared memory above 48 KiB needs the kernel's opt-in
//     (cudaFuncAttributeMaxDynamicSharedMemorySize, through
//     ROPESCALE_OPT_IN_DYNAMIC_SMEM), and static + dynamic shared memory is
//     capped at the emulated target's per-block maximum (sm_80 by default;
//     sm_86 for the 99 KiB parts: sm_86, sm_89, sm_120). Each target is its
//     own "device": opt-ins are per (device, kernel), as on a GPU.
//
// API (besides the CUDA names themselves):
//   ropescale_emu::launch(grid, block, dynamic_smem_bytes, kernel, args...)
//   ropescale_emu::dynamic_shared_memory()     base of the block's dynamic smem
//   ropescale_emu::ScopedSyncTimeout           override the barrier timeout
//   ropescale_emu::ScopedBlockOrder            run blocks in order, shuffled, reversed
//   ropescale_emu::ScopedTarget                sm_80 (default), sm_86 or sm_90 shared-memory caps
//   ropescale_emu::current_device()            the emulated target as a device index
//   ropescale_emu::shared_memory_per_block_optin()   its cudaDevAttrMaxSharedMemoryPerBlockOptin
//   ropescale_emu::set_max_dynamic_shared_memory(kernel, bytes)   the opt-in
//   ropescale_emu::launch_error, device_error  exception types
// Tensor-core and asynchronous-copy primitives (mma.sync, ldmatrix, cp.async)
// are in warp_matrix.h, included at the end of this file.
//
// Include portable.h rather than this file from kernel headers.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.h is for host compilers; nvcc has the real CUDA built-ins"
#endif
#if __cplusplus < 202002L
#error "cuda_emulation.h needs C++20 (std::atomic_ref, std::bit_cast, __VA_OPT__)"
#endif

// CUDA's fp16/bf16 headers are host-compilable. They bring vector_types.h
// (dim3, uint3, float2, ...) and crt/host_defines.h (which defines the CUDA
// qualifiers for host compilers). Include them first so the definitions below
// override theirs; host_defines.h is include-guarded, so later includes of
// CUDA headers cannot undo them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <map>
#include <mutex>
#include <new>
#include <numbers>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __constant__
#undef __managed__
#undef __shared__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
// One block runs at a time, so one static instance per declaration is exactly
// "shared by the threads of a block". Such a variable is placed in the linker
// section `ropescale_emu_shared`, which the launch fills with 0xFF bytes before
// each block (on a GPU the contents start undefined), so a read before the
// block's first write shows up as NaN / -1. Two limits of GCC (12): it drops
// the section attribute of a static local in a function template, so
// __shared__ variables of template kernels are NOT poisoned and keep their
// contents from block to block (ropescale's kernels use dynamic shared memory
// only, which is always poisoned); and it refuses ("section type conflict")
// to mix, in one translation unit, such variables of `inline` functions with
// those of non-inline functions or of an anonymous namespace.
#if defined(__ELF__)
#define __shared__ __attribute__((section("ropescale_emu_shared"))) static
#define ROPESCALE_EMU_POISONS_STATIC_SHARED 1
#else
#define __shared__ static
#define ROPESCALE_EMU_POISONS_STATIC_SHARED 0
#endif
// `inline` (not always_inline): keeps the ODR meaning of device functions
// defined in headers without forcing the host compiler to inline.
#define __forceinline__ inline
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif
// g++ understands __restrict__ natively; __align__ comes from host_defines.h.

// Same declaration as CUDA's driver_types.h, so including the runtime headers
// as well does not clash. Streams are ignored by the emulation.
typedef struct CUstream_st* cudaStream_t;

// ---------------------------------------------------------------------------
// Built-in variables: per emulated thread.
// ---------------------------------------------------------------------------
inline thread_local uint3 threadIdx{};
inline thread_local uint3 blockIdx{};
inline thread_local dim3 blockDim{};
inline thread_local dim3 gridDim{};
inline constexpr int warpSize = 32;

namespace ropescale_emu {

// Thrown by launch() for what a CUDA launch reports as an error.
struct launch_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Thrown for misuse of a device intrinsic that CUDA would not detect (or that
// the emulation does not support), and for a barrier wait that timed out.
struct device_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr unsigned kMaxThreadsPerBlock = 1024;
// Shared memory per block: 48 KiB without the opt-in; with it, up to the
// target's maximum (static + dynamic; CUDA C Programming Guide, "Compute
// Capabilities", technical specifications table).
inline constexpr std::size_t kDefaultSharedBytes = 48 * 1024;
inline constexpr std::size_t kSm80MaxSharedBytesPerBlock = 166912;  // 163 KiB (A100)
inline constexpr std::size_t kSm90MaxSharedBytesPerBlock = 232448;  // 227 KiB (H100)
// 99 KiB: sm_86 (A10, A40, RTX 30), sm_89 (L4, L40S, RTX 40), sm_120 (RTX 50).
inline constexpr std::size_t kSm86MaxSharedBytesPerBlock = 101376;
inline constexpr std::size_t kMaxDynamicSharedBytes = kSm90MaxSharedBytesPerBlock;
enum class Target { kSm80, kSm90, kSm86 };
enum class BlockOrder { kInOrder, kShuffled, kReversed };

namespace detail {

// ---- barrier timeout: turns a deadlocked kernel into an exception ----------
inline std::atomic<long long>& sync_timeout_ms() {
  static std::atomic<long long> value = [] {
    const char* env = std::getenv("ROPESCALE_EMU_SYNC_TIMEOUT_MS");
    return env ? std::atoll(env) : 120'000LL;
  }();
  return value;
}

// A reusable barrier for a fixed group of threads, with two extras:
//  * a thread that leaves the group (returns from the kernel or throws) calls
//    arrive_and_drop(), so the others do not wait for it forever;
//  * data exchange: `deposit` runs under the lock on arrival, the last arriver
//    runs `on_phase_complete`, and `collect` runs under the lock once the phase
//    is over. Everything shared is touched only under the mutex, so the
//    happens-before edges are plain mutex edges (ThreadSanitizer-friendly).
class SyncPoint {
 public:
  SyncPoint(unsigned participants, std::function<void()> on_phase_complete,
            bool may_time_out = true)
      : expected_(participants),
        may_time_out_(may_time_out),
        on_phase_complete_(std::move(on_phase_complete)) {}
  SyncPoint(const SyncPoint&) = delete;
  SyncPoint& operator=(const SyncPoint&) = delete;

  template <class Deposit, class Collect>
  auto arrive_and_wait(const char* operation, Deposit&& deposit, Collect&& collect) {
    std::unique_lock lock(mutex_);
    const std::uint64_t phase = phase_;
    deposit(phase);
    if (++arrived_ == expected_) {
      complete_phase_locked();
    } else if (!wait_for_phase_end(lock, phase)) {
      --arrived_;  // withdraw; the thread's exit path will drop it from the group
      throw device_error(std::string("ropescale_emu: ") + operation +
                         " waited longer than ROPESCALE_EMU_SYNC_TIMEOUT_MS; deadlock "
                         "(divergent barrier or partial-mask warp collective)?");
    }
    return collect(phase);
  }

  void arrive_and_drop() {
    std::lock_guard lock(mutex_);
    --expected_;
    if (arrived_ != 0 && arrived_ == expected_) complete_phase_locked();
  }

 private:
  bool wait_for_phase_end(std::unique_lock<std::mutex>& lock, std::uint64_t phase) {
    const auto phase_over = [&] { return phase_ != phase; };
    const long long timeout = may_time_out_ ? sync_timeout_ms().load() : 0;
    if (timeout <= 0) {
      cv_.wait(lock, phase_over);
      return true;
    }
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout), phase_over);
  }
  void complete_phase_locked() {
    on_phase_complete_();
    arrived_ = 0;
    ++phase_;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned expected_;
  const bool may_time_out_;
  unsigned arrived_ = 0;
  std::uint64_t phase_ = 0;
  std::function<void()> on_phase_complete_;
};

// Per-warp exchange used by shuffles, votes and __syncwarp.
struct WarpState {
  explicit WarpState(unsigned lane_count)
      : live_mask(lane_count >= 32 ? ~0u : (1u << lane_count) - 1u),
        sync(lane_count, [this] { publish(); }) {}

  std::atomic<std::uint32_t> live_mask;  // lanes not yet exited: __activemask()
  SyncPoint sync;

  // Guarded by sync's mutex. Value slots are double-buffered by phase parity:
  // a fast lane may deposit for phase p+1 while slow lanes still read phase p;
  // phase p+2 cannot start before every lane has finished reading phase p.
  struct alignas(8) Slot {
    unsigned char bytes[8];
  };
  Slot slots[2][32];
  std::uint32_t pending_arrived = 0, pending_votes = 0, pending_mask_and = ~0u;
  std::uint32_t arrived = 0, votes = 0;  // result of the last completed phase
  bool mask_error = false;
  // Wide slots for the warp-wide matrix instructions (mma.sync, ldmatrix):
  // every lane deposits up to kWideSlotBytes and reads every lane's deposit.
  // Same parity double-buffering as `slots`.
  static constexpr std::size_t kWideSlotBytes = 64;
  struct alignas(16) WideSlot {
    unsigned char bytes[kWideSlotBytes];
  };
  WideSlot wide_slots[2][32];

 private:
  void publish() {
    arrived = pending_arrived;
    votes = pending_votes;
    mask_error = (pending_mask_and & arrived) != arrived;
    pending_arrived = pending_votes = 0;
    pending_mask_and = ~0u;
  }
};

struct BlockState {
  explicit BlockState(unsigned thread_count)
      : start_gate(thread_count, [] {}, /*may_time_out=*/false),
        barrier(thread_count, [this] {
          true_count = pending_true;
          participants = pending_participants;
          pending_true = pending_participants = 0;
        }) {
    for (unsigned first = 0; first < thread_count; first += 32)
      warps.push_back(std::make_unique<WarpState>(std::min(32u, thread_count - first)));
  }

  // All threads of the block pass this gate before running the kernel, so
  // their kernel bodies really overlap. Without it, short bodies would run one
  // after another, ordered by the worker pool's mutex, and ThreadSanitizer
  // would miss races between them.
  SyncPoint start_gate;
  SyncPoint barrier;  // __syncthreads
  unsigned pending_true = 0, pending_participants = 0;  // guarded by barrier's mutex
  unsigned true_count = 0, participants = 0;
  std::vector<std::unique_ptr<WarpState>> warps;
};

struct ThreadContext {
  BlockState* block = nullptr;
  WarpState* warp = nullptr;
  unsigned lane = 0;
  unsigned char* dynamic_smem = nullptr;
  std::size_t dynamic_smem_bytes = 0;
};
inline thread_local ThreadContext tls_context{};

inline ThreadContext& current_thread(const char* operation) {
  ThreadContext& ctx = tls_context;
  if (ctx.block == nullptr)
    throw device_error(std::string("ropescale_emu: ") + operation +
                       " called outside an emulated kernel");
  return ctx;
}

// ---- block barrier ----------------------------------------------------------
struct BlockVote {
  unsigned true_count, participants;
};
inline BlockVote block_sync(const char* operation, bool predicate) {
  BlockState& block = *current_thread(operation).block;
  return block.barrier.arrive_and_wait(
      operation,
      [&](std::uint64_t) {
        block.pending_true += predicate ? 1u : 0u;
        ++block.pending_participants;
      },
      [&](std::uint64_t) { return BlockVote{block.true_count, block.participants}; });
}

// ---- warp collective: every live lane deposits a value and a vote ---------
template <class T>
struct WarpResult {
  T value;              // the source lane's value, or the caller's own one
  std::uint32_t votes;  // lanes that voted true
  std::uint32_t lanes;  // lanes that took part
};

template <class T>
WarpResult<T> warp_collective(const char* operation, unsigned mask, const T& value, bool vote,
                              int source_lane) {
  static_assert(sizeof(T) <= 8 && alignof(T) <= 8, "warp shuffles move at most 8 bytes");
  static_assert(std::is_trivially_destructible_v<T> && std::is_copy_constructible_v<T>,
                "warp shuffles need a plain value type");
  ThreadContext& ctx = current_thread(operation);
  WarpState& warp = *ctx.warp;
  const unsigned lane = ctx.lane;
  return warp.sync.arrive_and_wait(
      operation,
      [&](std::uint64_t phase) {
        ::new (static_cast<void*>(warp.slots[phase & 1][lane].bytes)) T(value);
        warp.pending_arrived |= 1u << lane;
        if (vote) warp.pending_votes |= 1u << lane;
        warp.pending_mask_and &= mask;
      },
      [&](std::uint64_t phase) -> WarpResult<T> {
        if (warp.mask_error)
          throw device_error(std::string("ropescale_emu: ") + operation +
                             ": mask leaves out a participating lane; only masks naming "
                             "every running lane of the warp are emulated");
        const bool source_present =
            source_lane >= 0 && source_lane < 32 && ((warp.arrived >> source_lane) & 1u);
        if (!source_present) return {value, warp.votes, warp.arrived};
        const T* source = std::launder(
            reinterpret_cast<const T*>(warp.slots[phase & 1][source_lane].bytes));
        return {*source, warp.votes, warp.arrived};
      });
}

// A warp-wide instruction with the .sync.aligned qualifiers (mma.sync,
// ldmatrix): all 32 lanes must execute it, none may have exited. Every lane
// gets every lane's `value`, indexed by lane.
template <class T>
std::array<T, 32> warp_all_gather(const char* operation, const T& value) {
  static_assert(sizeof(T) <= WarpState::kWideSlotBytes && alignof(T) <= 16,
                "warp_all_gather moves at most 64 bytes per lane");
  static_assert(std::is_trivially_copyable_v<T>, "warp_all_gather needs a plain value type");
  ThreadContext& ctx = current_thread(operation);
  WarpState& warp = *ctx.warp;
  const unsigned lane = ctx.lane;
  return warp.sync.arrive_and_wait(
      operation,
      [&](std::uint64_t phase) {
        std::memcpy(warp.wide_slots[phase & 1][lane].bytes, &value, sizeof(T));
        warp.pending_arrived |= 1u << lane;
      },
      [&](std::uint64_t phase) {
        if (warp.arrived != 0xffffffffu) {
          char lanes[16];
          std::snprintf(lanes, sizeof lanes, "0x%08x", warp.arrived);
          throw device_error(std::string("ropescale_emu: ") + operation +
                             " is .sync.aligned: all 32 lanes of the warp must execute it "
                             "(lanes present: " + lanes + ")");
        }
        std::array<T, 32> all;
        for (unsigned l = 0; l < 32; ++l)
          std::memcpy(&all[l], warp.wide_slots[phase & 1][l].bytes, sizeof(T));
        return all;
      });
}

inline int checked_width(const char* operation, int width) {
  if (width < 1 || width > 32 || !std::has_single_bit(static_cast<unsigned>(width)))
    throw device_error(std::string("ropescale_emu: ") + operation +
                       ": width must be a power of two in [1, 32]");
  return width;
}

// ---- worker threads, reused across blocks and launches ----------------------
class WorkerPool {
 public:
  ~WorkerPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  // Runs task(i) for every i in [0, count), each on its own thread, and waits.
  void run(unsigned count, const std::function<void(unsigned)>& task) {
    std::unique_lock lock(mutex_);
    while (workers_.size() < count) {
      const auto id = static_cast<unsigned>(workers_.size());
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
    task_ = &task;
    task_threads_ = count;
    remaining_ = count;
    ++generation_;
    work_ready_.notify_all();
    all_done_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
  }

 private:
  void worker_loop(unsigned id) {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock,
                       [&] { return stopping_ || (generation_ != seen && id < task_threads_); });
      if (stopping_) return;
      seen = generation_;
      const std::function<void(unsigned)>* task = task_;
      lock.unlock();
      (*task)(id);
      lock.lock();
      if (--remaining_ == 0) all_done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_ready_, all_done_;
  std::vector<std::thread> workers_;
  const std::function<void(unsigned)>* task_ = nullptr;
  unsigned task_threads_ = 0, remaining_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
};

inline WorkerPool& worker_pool() {
  static WorkerPool pool;
  return pool;
}
inline std::mutex& launch_mutex() {
  static std::mutex mutex;
  return mutex;
}

// ---- static __shared__ variables: the linker section they live in ----------
}  // namespace detail
}  // namespace ropescale_emu
#if ROPESCALE_EMU_POISONS_STATIC_SHARED
// Defined by the linker when some variable is in the section; null otherwise.
extern "C" __attribute__((weak)) unsigned char __start_ropescale_emu_shared[];
extern "C" __attribute__((weak)) unsigned char __stop_ropescale_emu_shared[];
#endif
namespace ropescale_emu {
namespace detail {

// [begin, end) of every static __shared__ variable of the program.
inline std::pair<unsigned char*, unsigned char*> static_shared_range() {
#if ROPESCALE_EMU_POISONS_STATIC_SHARED
  if (__start_ropescale_emu_shared != nullptr && __stop_ropescale_emu_shared != nullptr)
    return {__start_ropescale_emu_shared, __stop_ropescale_emu_shared};
#endif
  return {nullptr, nullptr};
}
// The emulation cannot tell which kernel declares which static __shared__
// variable, so every launch is charged all of them: an over-estimate, which
// errs on the strict side of the shared-memory limits.
inline std::size_t static_shared_bytes() {
  const auto [begin, end] = static_shared_range();
  return static_cast<std::size_t>(end - begin);
}

// Whether [p, p + bytes) lies in the running block's shared memory (dynamic,
// or a static __shared__ variable).
inline bool in_shared_memory(const void* p, std::size_t bytes) {
  const ThreadContext& ctx = tls_context;
  const auto* c = static_cast<const unsigned char*>(p);
  const auto inside = [&](const unsigned char* begin, const unsigned char* end) {
    return begin != nullptr && c >= begin && c + bytes <= end;
  };
  const auto [sbegin, send] = static_shared_range();
  return inside(ctx.dynamic_smem, ctx.dynamic_smem + ctx.dynamic_smem_bytes) || inside(sbegin, send);
}

// ---- launch settings: target, block order, per-kernel shared memory opt-in --
inline std::atomic<Target>& target_setting() {
  static std::atomic<Target> value{Target::kSm80};
  return value;
}
inline std::size_t max_shared_bytes_per_block() {
  switch (target_setting().load()) {
    case Target::kSm90: return kSm90MaxSharedBytesPerBlock;
    case Target::kSm86: return kSm86MaxSharedBytesPerBlock;
    default: return kSm80MaxSharedBytesPerBlock;
  }
}

struct BlockOrderSetting {
  BlockOrder order;
  unsigned seed;
};
// ROPESCALE_EMU_BLOCK_ORDER = in_order (default) | reversed | shuffled[:seed]
inline BlockOrderSetting block_order_from_env() {
  const char* env = std::getenv("ROPESCALE_EMU_BLOCK_ORDER");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "in_order") == 0)
    return {BlockOrder::kInOrder, 0};
  if (std::strcmp(env, "reversed") == 0) return {BlockOrder::kReversed, 0};
  if (std::strncmp(env, "shuffled", 8) == 0)
    return {BlockOrder::kShuffled,
            env[8] == ':' ? static_cast<unsigned>(std::strtoul(env + 9, nullptr, 10)) : 1u};
  throw launch_error(std::string("ropescale_emu: ROPESCALE_EMU_BLOCK_ORDER must be in_order, "
                                 "reversed or shuffled[:seed], got ") + env);
}
inline std::mutex& settings_mutex() {
  static std::mutex mutex;
  return mutex;
}
inline BlockOrderSetting& block_order_setting() {  // guarded by settings_mutex()
  static BlockOrderSetting value = block_order_from_env();
  return value;
}
// Opt-ins per (device, kernel): cudaFuncSetAttribute applies to the current device only.
inline std::map<std::pair<Target, const void*>, std::size_t>& dynamic_smem_opt_ins() {  // settings_mutex()
  static std::map<std::pair<Target, const void*>, std::size_t> value;
  return value;
}

// The blocks of a grid in the order they run: blockIdx order (x fastest), or
// reversed, or shuffled with the seed plus a per-launch counter (so successive
// launches differ, and a run is reproducible).
inline std::vector<uint3> block_schedule(dim3 grid) {
  std::vector<uint3> blocks;
  blocks.reserve(std::size_t{grid.x} * grid.y * grid.z);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) blocks.push_back(uint3{bx, by, bz});
  BlockOrderSetting setting;
  static std::uint64_t launches = 0;
  std::uint64_t launch_index;
  {
    std::lock_guard lock(settings_mutex());
    setting = block_order_setting();
    launch_index = launches++;
  }
  if (setting.order == BlockOrder::kReversed) {
    std::reverse(blocks.begin(), blocks.end());
  } else if (setting.order == BlockOrder::kShuffled) {
    std::mt19937_64 gen(setting.seed * 0x9E3779B97F4A7C15ull + launch_index);
    std::shuffle(blocks.begin(), blocks.end(), gen);
  }
  return blocks;
}

// ---- cp.async: per-thread queues of copies in flight ------------------------
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  unsigned size, src_size;  // src_size < size: the rest is zero-filled
};
struct AsyncCopyState {
  std::vector<AsyncCopy> open;                   // issued, not yet committed
  std::deque<std::vector<AsyncCopy>> committed;  // oldest first
  void clear() {
    open.clear();
    committed.clear();
  }
};
inline thread_local AsyncCopyState tls_async_copies;

inline void validate_launch(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes,
                            const void* kernel) {
  const auto fail = [](const std::string& what) {
    throw launch_error("ropescale_emu: invalid configuration argument: " + what);
  };
  if (block.x == 0 || block.y == 0 || block.z == 0) fail("block dimension is 0");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("grid dimension is 0");
  if (block.x > 1024 || block.y > 1024 || block.z > 64) fail("block dimension above limit");
  if (std::uint64_t{block.x} * block.y * block.z > kMaxThreadsPerBlock)
    fail("more than 1024 threads per block (" +
         std::to_string(std::uint64_t{block.x} * block.y * block.z) + ")");
  if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) fail("grid dimension above limit");
  const std::size_t static_bytes = static_shared_bytes();
  std::size_t opt_in = 0;
  bool opted_in = false;
  {
    std::lock_guard lock(settings_mutex());
    const auto it = dynamic_smem_opt_ins().find({target_setting().load(), kernel});
    if (it != dynamic_smem_opt_ins().end()) opted_in = true, opt_in = it->second;
  }
  const std::string sizes = std::to_string(static_bytes) + " B static (all static __shared__ of "
                            "the program) + " + std::to_string(dynamic_smem_bytes) + " B dynamic";
  if (!opted_in && static_bytes + dynamic_smem_bytes > kDefaultSharedBytes)
    fail("shared memory " + sizes + " above 48 KiB without the kernel's opt-in "
         "(cudaFuncAttributeMaxDynamicSharedMemorySize)");
  if (opted_in && dynamic_smem_bytes > opt_in)
    fail("dynamic shared memory " + std::to_string(dynamic_smem_bytes) +
         " B above the kernel's opt-in of " + std::to_string(opt_in) + " B");
  if (static_bytes + dynamic_smem_bytes > max_shared_bytes_per_block())
    fail("shared memory " + sizes + " above the target's " +
         std::to_string(max_shared_bytes_per_block()) + " B per block");
}

// Runs `kernel_body` once per thread of every block.
inline void run_grid(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes, const void* kernel,
                     const std::function<void()>& kernel_body) {
  validate_launch(grid, block, dynamic_smem_bytes, kernel);
  if (tls_context.block != nullptr)
    throw launch_error("ropescale_emu: kernel launch from inside a kernel is not supported");
  std::lock_guard launch_lock(launch_mutex());

  const unsigned thread_count = block.x * block.y * block.z;
  constexpr std::align_val_t kSmemAlign{128};
  const std::size_t smem_size = std::max<std::size_t>(dynamic_smem_bytes, 16);
  std::unique_ptr<unsigned char, void (*)(unsigned char*)> smem(
      static_cast<unsigned char*>(::operator new(smem_size, kSmemAlign)),
      [](unsigned char* p) { ::operator delete(p, kSmemAlign); });
  const auto [static_begin, static_end] = static_shared_range();

  std::mutex error_mutex;
  std::exception_ptr first_error;

  for (const uint3 block_index : block_schedule(grid)) {
    // Shared memory is undefined at block start; 0xFF bytes read as NaN
    // floats / -1 ints, which makes a missing initialisation visible.
    std::memset(smem.get(), 0xFF, smem_size);
    if (static_begin != nullptr) std::memset(static_begin, 0xFF, static_end - static_begin);
    BlockState block_state(thread_count);
    const std::function<void(unsigned)> thread_body = [&](unsigned tid) {
      WarpState& warp = *block_state.warps[tid / 32];
      tls_context = ThreadContext{&block_state, &warp, tid % 32, smem.get(), dynamic_smem_bytes};
      tls_async_copies.clear();
      threadIdx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
      blockIdx = block_index;
      blockDim = block;
      gridDim = grid;
      try {
        block_state.start_gate.arrive_and_wait(
            "block start", [](std::uint64_t) {}, [](std::uint64_t) { return 0; });
        kernel_body();
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
      }
      // An exited thread no longer takes part in barriers (as on hardware).
      // Copies it never waited for are dropped: their data is never seen.
      tls_async_copies.clear();
      warp.live_mask.fetch_and(~(1u << (tid % 32)));
      warp.sync.arrive_and_drop();
      block_state.barrier.arrive_and_drop();
      tls_context = ThreadContext{};
    };
    worker_pool().run(thread_count, thread_body);
    if (first_error) std::rethrow_exception(first_error);
  }
}

}  // namespace detail

// Launches `kernel` like kernel<<<grid, block, dynamic_smem_bytes>>>(args...)
// and returns when it has finished (launches are synchronous). Arguments are
// converted once to the kernel's parameter types, as CUDA does, and each
// thread gets its own copy. The first exception thrown by any kernel thread is
// rethrown here; remaining blocks are not run.
template <class... Params, class... Args>
void launch(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes, void (*kernel)(Params...),
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  detail::run_grid(grid, block, dynamic_smem_bytes, reinterpret_cast<const void*>(kernel),
                   [&] { std::apply(kernel, params); });
}

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
// bytes): lets later launches of `kernel` use up to `bytes` of dynamic shared
// memory. Returns 0, or 1 (cudaErrorInvalidValue) when bytes is negative or
// static + bytes exceeds the target's per-block maximum.
template <class... Params>
int set_max_dynamic_shared_memory(void (*kernel)(Params...), int bytes) {
  if (bytes < 0 ||
      detail::static_shared_bytes() + static_cast<std::size_t>(bytes) >
          detail::max_shared_bytes_per_block())
    return 1;
  std::lock_guard lock(detail::settings_mutex());
  detail::dynamic_smem_opt_ins()[{detail::target_setting().load(), reinterpret_cast<const void*>(kernel)}] =
      static_cast<std::size_t>(bytes);
  return 0;
}

// Runs the blocks of later launches in this order for the current scope.
class ScopedBlockOrder {
 public:
  explicit ScopedBlockOrder(BlockOrder order, unsigned seed = 1) {
    std::lock_guard lock(detail::settings_mutex());
    previous_ = detail::block_order_setting();
    detail::block_order_setting() = {order, seed};
  }
  ~ScopedBlockOrder() {
    std::lock_guard lock(detail::settings_mutex());
    detail::block_order_setting() = previous_;
  }
  ScopedBlockOrder(const ScopedBlockOrder&) = delete;
  ScopedBlockOrder& operator=(const ScopedBlockOrder&) = delete;

 private:
  detail::BlockOrderSetting previous_;
};

// Emulates the shared-memory caps of this target for the current scope. Each target is a separate
// device (its own kernel opt-ins).
class ScopedTarget {
 public:
  explicit ScopedTarget(Target target) : previous_(detail::target_setting().exchange(target)) {}
  ~ScopedTarget() { detail::target_setting().store(previous_); }
  ScopedTarget(const ScopedTarget&) = delete;
  ScopedTarget& operator=(const ScopedTarget&) = delete;

 private:
  Target previous_;
};

// cudaGetDevice: the emulated target as a device index.
inline int current_device() { return static_cast<int>(detail::target_setting().load()); }

// cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin) of the emulated target.
inline int shared_memory_per_block_optin() { return static_cast<int>(detail::max_shared_bytes_per_block()); }

// Base of the dynamic shared memory of the running block (see
// ROPESCALE_DYNAMIC_SMEM); 128-byte aligned.
inline unsigned char* dynamic_shared_memory() {
  return detail::current_thread("dynamic shared memory").dynamic_smem;
}

// Sets the barrier timeout for the current scope (0 = wait forever).
class ScopedSyncTimeout {
 public:
  explicit ScopedSyncTimeout(std::chrono::milliseconds timeout)
      : previous_(detail::sync_timeout_ms().exchange(timeout.count())) {}
  ~ScopedSyncTimeout() { detail::sync_timeout_ms().store(previous_); }
  ScopedSyncTimeout(const ScopedSyncTimeout&) = delete;
  ScopedSyncTimeout& operator=(const ScopedSyncTimeout&) = delete;

 private:
  long long previous_;
};

}  // namespace ropescale_emu

// ---------------------------------------------------------------------------
// Synchronisation
// ---------------------------------------------------------------------------
inline void __syncthreads() { ropescale_emu::detail::block_sync("__syncthreads", false); }
inline int __syncthreads_count(int predicate) {
  return static_cast<int>(
      ropescale_emu::detail::block_sync("__syncthreads_count", predicate != 0).true_count);
}
inline int __syncthreads_and(int predicate) {
  const auto vote = ropescale_emu::detail::block_sync("__syncthreads_and", predicate != 0);
  return vote.true_count == vote.participants;
}
inline int __syncthreads_or(int predicate) {
  return ropescale_emu::detail::block_sync("__syncthreads_or", predicate != 0).true_count != 0;
}

// ---------------------------------------------------------------------------
// Warp primitives
// ---------------------------------------------------------------------------
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ropescale_emu::detail::warp_collective("__syncwarp", mask, 0, false, -1);
}
inline unsigned __activemask() {
  return ropescale_emu::detail::current_thread("__activemask").warp->live_mask.load();
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ropescale_emu::detail::warp_collective("__ballot_sync", mask, 0, predicate != 0, -1)
             .votes &
         mask;
}
inline int __any_sync(unsigned mask, int predicate) {
  return ropescale_emu::detail::warp_collective("__any_sync", mask, 0, predicate != 0, -1).votes !=
         0;
}
inline int __all_sync(unsigned mask, int predicate) {
  const auto r = ropescale_emu::detail::warp_collective("__all_sync", mask, 0, predicate != 0, -1);
  return r.votes == r.lanes;
}

// Source lanes follow the CUDA programming guide: lanes are split into
// segments of `width`; an out-of-segment source returns the caller's value.
template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_sync").lane);
  const int source = (lane & ~(w - 1)) + (src_lane & (w - 1));
  return warp_collective("__shfl_sync", mask, var, false, source).value;
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_up_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_up_sync").lane);
  const long long source = static_cast<long long>(lane) - delta;
  const bool in_segment = source >= (lane & ~(w - 1));
  return warp_collective("__shfl_up_sync", mask, var, false,
                         in_segment ? static_cast<int>(source) : -1)
      .value;
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_down_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_down_sync").lane);
  const long long source = static_cast<long long>(lane) + delta;
  const bool in_segment = source < (lane & ~(w - 1)) + w;
  return warp_collective("__shfl_down_sync", mask, var, false,
                         in_segment ? static_cast<int>(source) : -1)
      .value;
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_xor_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_xor_sync").lane);
  const int source = lane ^ (lane_mask & 31);
  const bool allowed = source < (lane & ~(w - 1)) + w;  // earlier segments are allowed
  return warp_collective("__shfl_xor_sync", mask, var, false, allowed ? source : -1).value;
}

// ---------------------------------------------------------------------------
// Atomics (all sequentially consistent) and fences
// ---------------------------------------------------------------------------
namespace ropescale_emu::detail {
template <class T, class Update>
T atomic_update(T* address, Update update) {  // CAS loop; returns the old value
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (!ref.compare_exchange_weak(old, update(old))) {
  }
  return old;
}
}  // namespace ropescale_emu::detail

#define ROPESCALE_EMU_ATOMIC_RMW(T)                                                          \
  inline T atomicAdd(T* a, T v) { return std::atomic_ref<T>(*a).fetch_add(v); }              \
  inline T atomicExch(T* a, T v) { return std::atomic_ref<T>(*a).exchange(v); }
#define ROPESCALE_EMU_ATOMIC_INT(T)                                                          \
  ROPESCALE_EMU_ATOMIC_RMW(T)                                                                \
  inline T atomicSub(T* a, T v) { return std::atomic_ref<T>(*a).fetch_sub(v); }              \
  inline T atomicAnd(T* a, T v) { return std::atomic_ref<T>(*a).fetch_and(v); }              \
  inline T atomicOr(T* a, T v) { return std::atomic_ref<T>(*a).fetch_or(v); }                \
  inline T atomicXor(T* a, T v) { return std::atomic_ref<T>(*a).fetch_xor(v); }              \
  inline T atomicMax(T* a, T v) {                                                            \
    return ropescale_emu::detail::atomic_update(a, [v](T old) { return old < v ? v : old; }); \
  }                                                                                          \
  inline T atomicMin(T* a, T v) {                                                            \
    return ropescale_emu::detail::atomic_update(a, [v](T old) { return v < old ? v : old; }); \
  }                                                                                          \
  inline T atomicCAS(T* a, T compare, T v) {                                                 \
    std::atomic_ref<T>(*a).compare_exchange_strong(compare, v);                              \
    return compare; /* the old value, whether or not the swap happened */                    \
  }
ROPESCALE_EMU_ATOMIC_INT(int)
ROPESCALE_EMU_ATOMIC_INT(unsigned)
ROPESCALE_EMU_ATOMIC_INT(unsigned long long)
ROPESCALE_EMU_ATOMIC_RMW(float)
ROPESCALE_EMU_ATOMIC_RMW(double)
#undef ROPESCALE_EMU_ATOMIC_INT
#undef ROPESCALE_EMU_ATOMIC_RMW
inline long long atomicMax(long long* a, long long v) {
  return ropescale_emu::detail::atomic_update(a, [v](long long old) { return old < v ? v : old; });
}
inline long long atomicMin(long long* a, long long v) {
  return ropescale_emu::detail::atomic_update(a, [v](long long old) { return v < old ? v : old; });
}
inline unsigned atomicInc(unsigned* a, unsigned limit) {  // wraps to 0 past `limit`
  return ropescale_emu::detail::atomic_update(
      a, [limit](unsigned old) { return old >= limit ? 0u : old + 1u; });
}
inline unsigned atomicDec(unsigned* a, unsigned limit) {  // wraps to `limit` below 0
  return ropescale_emu::detail::atomic_update(
      a, [limit](unsigned old) { return (old == 0 || old > limit) ? limit : old - 1u; });
}
inline __half atomicAdd(__half* a, __half v) {
  return ropescale_emu::detail::atomic_update(a, [v](__half old) { return __hadd(old, v); });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
  return ropescale_emu::detail::atomic_update(a,
                                              [v](__nv_bfloat16 old) { return __hadd(old, v); });
}

#if defined(__SANITIZE_THREAD__)  // g++
#define ROPESCALE_EMU_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define ROPESCALE_EMU_TSAN 1
#endif
#endif
inline void __threadfence() {
#if defined(ROPESCALE_EMU_TSAN)
  // TSan does not model fences. A seq_cst RMW on a shared atomic is what it
  // does understand; with blocks never running concurrently, that suffices.
  static std::atomic<int> fence_token{0};
  fence_token.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
inline void __threadfence_block() { __threadfence(); }
inline void __threadfence_system() { __threadfence(); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
[[noreturn]] inline void __trap() { throw ropescale_emu::device_error("ropescale_emu: __trap()"); }

// ---------------------------------------------------------------------------
// Math and bit intrinsics missing from host <cmath>. Fast-math intrinsics map
// to the accurate functions; compare results with GPU-like tolerances.
// ---------------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x), *c = std::cos(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline double __fma_rn(double x, double y, double z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
#if !defined(__GLIBC__) || __GLIBC__ < 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ < 41)
// glibc >= 2.41 declares the C23 sinpi/cospi functions itself.
// fmod is exact, so reducing to (-2, 2) before multiplying by pi loses nothing.
inline float sinpif(float x) {
  return static_cast<float>(std::sin(std::numbers::pi * std::fmod(double{x}, 2.0)));
}
inline float cospif(float x) {
  return static_cast<float>(std::cos(std::numbers::pi * std::fmod(double{x}, 2.0)));
}
#endif
inline void sincospif(float x, float* s, float* c) { *s = sinpif(x), *c = cospif(x); }
#if !defined(__USE_GNU)  // glibc declares these as GNU extensions
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x), *c = std::cos(x); }
inline void sincos(double x, double* s, double* c) { *s = std::sin(x), *c = std::cos(x); }
#endif

namespace ropescale_emu::detail {
template <class Int>
Int saturating_cast(double x) {  // CUDA's float->int conversions saturate, NaN -> 0
  using limits = std::numeric_limits<Int>;
  if (std::isnan(x)) return 0;
  if (x <= static_cast<double>(limits::min())) return limits::min();
  if (x >= static_cast<double>(limits::max())) return limits::max();
  return static_cast<Int>(x);
}
}  // namespace ropescale_emu::detail
// nearbyint rounds half to even in the default rounding mode, like _rn.
inline int __float2int_rn(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::nearbyint(x));
}
inline int __float2int_rz(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::trunc(x));
}
inline int __float2int_rd(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::floor(x));
}
inline int __float2int_ru(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::ceil(x));
}
inline unsigned __float2uint_rn(float x) {
  return ropescale_emu::detail::saturating_cast<unsigned>(std::nearbyint(x));
}
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}

template <class T>
inline T __ldg(const T* address) {  // read-only cache load: a plain load on the host
  return *address;
}

// CUDA's global min/max overloads (same-type and signed/unsigned mixes).
#define ROPESCALE_EMU_MIN_MAX(A, B, R)                       \
  inline R min(A a, B b) {                                   \
    const R x = static_cast<R>(a), y = static_cast<R>(b);    \
    return y < x ? y : x;                                    \
  }                                                          \
  inline R max(A a, B b) {                                   \
    const R x = static_cast<R>(a), y = static_cast<R>(b);    \
    return x < y ? y : x;                                    \
  }
ROPESCALE_EMU_MIN_MAX(int, int, int)
ROPESCALE_EMU_MIN_MAX(unsigned, unsigned, unsigned)
ROPESCALE_EMU_MIN_MAX(int, unsigned, unsigned)
ROPESCALE_EMU_MIN_MAX(unsigned, int, unsigned)
ROPESCALE_EMU_MIN_MAX(long, long, long)
ROPESCALE_EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
ROPESCALE_EMU_MIN_MAX(long long, long long, long long)
ROPESCALE_EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
ROPESCALE_EMU_MIN_MAX(long long, unsigned long long, unsigned long long)
ROPESCALE_EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
#undef ROPESCALE_EMU_MIN_MAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin(double{a}, b); }
inline double max(float a, double b) { return std::fmax(double{a}, b); }
inline double min(double a, float b) { return std::fmin(a, double{b}); }
inline double max(double a, float b) { return std::fmax(a, double{b}); }

// mma.sync, ldmatrix and cp.async, emulated from the PTX ISA fragment layouts.
#include "ropescale_emu/warp_matrix.h"
