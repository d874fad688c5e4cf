#pragma once
// A CUDA block on one host thread, so that a kernel's logic (indexing, masks, tiles, warp
// reductions, barriers) is tested by the CPU CI, which has no GPU. Include this first, then
// loom's .cuh files: a test run with the emulated runtime's headers first on its include path
// (loom_add_test(... EMULATED ...): emulated_runtime/) calls the headers' own launch code
// (LOOM_LAUNCH, ops/cuda/launch.hpp), and emulate_launch runs a kernel alone on host data.
// A CUDA thread is a fiber with its own stack, and a scheduler resumes the block's fibers in
// thread order, each until it waits; __syncthreads is a barrier of the block's threads; the
// warp intrinsics exchange values through a per-warp array between two barriers of its 32
// threads (every lane must reach them, as with a full mask on a GPU); the grid's blocks run
// one after another; `__shared__` arrays are static (one per kernel, shared by the block's
// threads) and dynamic shared memory (LOOM_DYNAMIC_SHARED_FLOATS) is one array of
// dynamic_shared_bytes. Threads that wait at different barriers forever (a __syncthreads
// inside a branch not every thread takes) end the launch with an exception instead of a hang.
// Why fibers rather than a std::thread per CUDA thread: every shuffle is two barriers of 32
// threads, and switching fibers costs a fraction of waking OS threads (docs/cuda.md).
// What it cannot show: races the GPU's memory model allows but these barriers order,
// performance, and anything of a real device (register spills, shared-memory limits).

#define LOOM_CUDA_EMULATION 1

#if defined(__x86_64__) && !defined(LOOM_EMULATION_UCONTEXT)
#define LOOM_EMULATION_OWN_SWITCH 1
#else
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)
#define __shared__ static

namespace loom::emulation {
inline constexpr std::size_t dynamic_shared_bytes = std::size_t(1) << 18;
inline float* dynamic_shared_floats() {
  alignas(16) static float memory[dynamic_shared_bytes / sizeof(float)];  // a GPU aligns it at least so
  return memory;
}

// ---- Switching stacks ------------------------------------------------------------------
// x86-64: a switch saves the callee-saved registers on the stack it leaves and restores them
// from the one it enters (no system call; glibc's swapcontext also saves the signal mask, a
// system call a switch, which made fibers no faster than threads). Elsewhere, or with
// LOOM_EMULATION_UCONTEXT defined (to test that path on x86-64): ucontext.
#if defined(LOOM_EMULATION_OWN_SWITCH)
extern "C" void loom_emulation_switch(void** save_sp, void* next_sp);
asm(R"(
  .pushsection .text
  .weak loom_emulation_switch
  .type loom_emulation_switch, @function
loom_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size loom_emulation_switch, .-loom_emulation_switch
  .popsection
)");
struct fiber_context {
  void* sp = nullptr;
};
/// A context that starts `entry` on [stack, stack + bytes): the frame loom_emulation_switch
/// pops (six registers, then the return address: entry), above it entry's own return slot.
inline void make_fiber(fiber_context& c, char* stack, std::size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t(15);
  auto* frame = reinterpret_cast<void**>(top) - 8;  // 6 registers, entry, a null return address
  for (int r = 0; r < 6; ++r) frame[r] = nullptr;
  frame[6] = reinterpret_cast<void*>(entry);
  frame[7] = nullptr;
  c.sp = frame;
}
inline void switch_fiber(fiber_context& from, fiber_context& to) { loom_emulation_switch(&from.sp, to.sp); }
#else
struct fiber_context {
  ucontext_t uc{};
};
inline void make_fiber(fiber_context& c, char* stack, std::size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;  // a fiber never returns from entry: it switches back for good
  makecontext(&c.uc, entry, 0);
}
inline void switch_fiber(fiber_context& from, fiber_context& to) { swapcontext(&from.uc, &to.uc); }
#endif

/// Stack of each fiber: kernels keep a few registers' worth of locals; the margin is for
/// sanitizer and -O0 builds.
inline constexpr std::size_t fiber_stack_bytes = std::size_t(256) << 10;

/// The fibers of the block being run and the scheduler's context they return to.
struct block_fibers {
  fiber_context scheduler{};
  std::vector<fiber_context> context;
  char* stacks = nullptr;  // fiber t's: [stacks + t fiber_stack_bytes, + fiber_stack_bytes)
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer follows the switches (its fake stacks and the stack bounds it checks).
  const void* scheduler_bottom = nullptr;
  std::size_t scheduler_size = 0;
  std::vector<void*> fake_stack;
#endif
  std::vector<char> finished;  // this block's body has returned
  bool last_block = false;     // the grid's last: a fiber whose body returns ends for good
  std::function<void()> body;  // the kernel call, the same for every thread of the grid
  unsigned current = 0;
  std::uint64_t progress = 0;  // arrivals and finishes: unchanged over a whole round = deadlock
};
inline block_fibers* this_block = nullptr;

/// Leaves fiber `current` for the scheduler (finished: for good).
inline void to_scheduler(bool finished = false) {
  auto* b = this_block;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(finished ? nullptr : &b->fake_stack[b->current], b->scheduler_bottom, b->scheduler_size);
#else
  (void)finished;
#endif
  switch_fiber(b->context[b->current], b->scheduler);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(b->fake_stack[b->current], &b->scheduler_bottom, &b->scheduler_size);
#endif
}
/// Resumes fiber t from the scheduler.
inline void to_fiber(unsigned t) {
  auto* b = this_block;
  b->current = t;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, b->stacks + t * fiber_stack_bytes, fiber_stack_bytes);
#endif
  switch_fiber(b->scheduler, b->context[t]);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

/// A barrier of `expected` fibers: the last to arrive goes on, the others yield until it has.
struct barrier {
  unsigned expected, arrived = 0;
  std::uint64_t generation = 0;
  void arrive_and_wait() {
    const auto g = generation;
    ++this_block->progress;
    if (++arrived == expected) {
      arrived = 0, ++generation;
      return;
    }
    while (generation == g) to_scheduler();
  }
};

struct warp_lanes {
  barrier meet{32};
  float f[32];
  int i[32];
  std::uint32_t words[32][16];  // warp_share's
};
inline warp_lanes* this_warp = nullptr;
inline barrier* block_barrier = nullptr;

/// All 32 lanes publish their N words, then each calls use(words) on every lane's ([32][16],
/// row = lane): a warp-collective instruction's operands (ops/cuda/mma.cuh's matrix product).
template <std::size_t N, class F>
inline void warp_share(const std::uint32_t (&mine)[N], F&& use) {
  static_assert(N <= 16, "warp_share: at most 16 words a lane");
  const unsigned lane = threadIdx.x % 32;
  for (std::size_t i = 0; i < N; ++i) this_warp->words[lane][i] = mine[i];
  this_warp->meet.arrive_and_wait();
  use(static_cast<const std::uint32_t(*)[16]>(this_warp->words));
  this_warp->meet.arrive_and_wait();
}

/// All 32 lanes publish v, then each reads lane `from(lane)`'s value.
template <class F>
inline float exchange(float v, F&& from) {
  const unsigned lane = threadIdx.x % 32;
  this_warp->f[lane] = v;
  this_warp->meet.arrive_and_wait();
  const float r = this_warp->f[from(lane) % 32];
  this_warp->meet.arrive_and_wait();
  return r;
}
}  // namespace loom::emulation

using std::isfinite;  // CUDA's device isfinite is a global function

inline void __syncthreads() { loom::emulation::block_barrier->arrive_and_wait(); }
inline float __shfl_sync(unsigned, float v, int src) {
  return loom::emulation::exchange(v, [&](unsigned) { return static_cast<unsigned>(src); });
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return loom::emulation::exchange(v, [&](unsigned lane) { return lane ^ static_cast<unsigned>(mask); });
}
inline int __any_sync(unsigned, int p) {
  auto* w = loom::emulation::this_warp;
  w->i[threadIdx.x % 32] = p != 0;
  w->meet.arrive_and_wait();
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= w->i[l];
  w->meet.arrive_and_wait();
  return any;
}

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  unsigned long long old = *address;  // one host thread runs every fiber: no other writer
  if (value < old) *address = value;
  return old;
}

namespace loom::emulation {

/// Stacks for `threads` fibers, one buffer for every launch of the process: mapping and
/// faulting in fresh ones each launch was most of a small launch's cost. Pages no fiber has
/// touched stay unmapped.
inline char* fiber_stacks(unsigned threads) {
  static std::unique_ptr<char[]> stacks;
  static unsigned count = 0;
  if (count < threads) stacks.reset(new char[threads * fiber_stack_bytes]), count = threads;
  return stacks.get();
}

[[noreturn]] inline void fiber_entry() {
  auto* b = this_block;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &b->scheduler_bottom, &b->scheduler_size);
#endif
  for (;;) {
    b->body();
    b->finished[b->current] = 1;
    ++b->progress;
    if (b->last_block) break;
    to_scheduler();  // parked: the scheduler resumes it here for the grid's next block
  }
  to_scheduler(/*finished=*/true);
  __builtin_unreachable();  // the scheduler never resumes a finished fiber
}

/// body() as the code of each of `threads` fibers (a multiple of 32) of this thread, block by
/// block of `grid` in x, then y, then z order; returns when the whole grid has run.
template <class F>
void emulate_grid(F body, dim3 grid, unsigned threads) {
  if (threads == 0 || threads % 32 != 0)
    throw std::invalid_argument("emulate_launch: threads must be a positive multiple of 32, got " +
                                std::to_string(threads));
  gridDim = grid, blockDim = {threads, 1, 1};
  block_fibers fibers;
  fibers.context.resize(threads);
  fibers.finished.resize(threads);
  fibers.body = std::move(body);
  fibers.stacks = fiber_stacks(threads);
#if defined(__SANITIZE_ADDRESS__)
  fibers.fake_stack.resize(threads);
#endif
  std::vector<warp_lanes> warps(threads / 32);
  barrier block{threads};
  this_block = &fibers, block_barrier = &block;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        fibers.last_block = x + 1 == grid.x && y + 1 == grid.y && z + 1 == grid.z;
        for (unsigned t = 0; t < threads; ++t) {
          // made once a launch: later blocks resume the fibers the earlier ones parked (under
          // ASan a fresh fiber maps a fake stack, and ending one unmaps it: per block and
          // thread, that was most of a many-block launch's time)
          if (x + y + z == 0) make_fiber(fibers.context[t], fibers.stacks + t * fiber_stack_bytes, fiber_stack_bytes, fiber_entry);
          fibers.finished[t] = 0;
        }
        for (unsigned live = threads; live > 0;) {
          const auto before = fibers.progress;
          for (unsigned t = 0; t < threads; ++t) {
            if (fibers.finished[t]) continue;
            threadIdx = {t, 0, 0};
            this_warp = &warps[t / 32];
            to_fiber(t);
            live -= fibers.finished[t];
          }
          if (live > 0 && fibers.progress == before)
            throw std::logic_error("emulate_launch: the block's threads wait at different barriers (deadlock) in block (" +
                                   std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ")");
        }
      }
  this_block = nullptr, block_barrier = nullptr, this_warp = nullptr;
}

/// kernel<<<grid, threads>>>(args...): a kernel alone, on host data (a launch through the
/// headers' launch code goes through LOOM_LAUNCH and the emulated runtime instead:
/// emulated_runtime/cuda_runtime_api.h).
template <class... P, class... A>
void emulate_launch(void (*kernel)(P...), dim3 grid, unsigned threads, A... args) {
  emulate_grid([&] { kernel(args...); }, grid, threads);
}
}  // namespace loom::emulation
