#pragma once
// One warp's product on the tensor cores: mma.sync m16n8k16 with bf16 operands and fp32
// accumulation (sm_80 and later), D [16][8] = A [16][16] B [16][8] + C, and where each lane's
// fragment elements sit in those matrices (the PTX ISA's layout), so that a kernel fills its
// fragments from shared memory by these maps. What paged decode and attention need to leave the
// CUDA cores (docs/cuda.md, "What remains").
//
// Under the emulator (g++, tests/ops/cuda/emulation.hpp) the warp's lanes share their
// fragments, each rebuilds A and B and computes its own D elements in fp32, in k order: the same
// function up to the order of the additions, which the hardware does not specify. The layout
// maps are what the emulator cannot check (it inverts the maps it is given); the GPU test does,
// against a host product. Like CUB's block reduction (reduce.cuh), the emulated branch is
// behind LOOM_CUDA_EMULATION: a warp-collective instruction has no per-thread form.

#include <loom/core/config.hpp>
#include <loom/core/float16.hpp>

#include <bit>
#include <cstdint>

namespace loom::ops::mma {

/// The m16n8k16 fragments: lane l holds 8 elements of A (4 registers, 2 bf16 each, the lower
/// index in the low half), 4 of B (2 registers) and 4 of C and D (fp32).
struct m16n8k16 {
  static constexpr int m = 16, n = 8, k = 16;
  /// Row and column of element i (0-7) of lane l's A fragment (register i / 2).
  LOOM_HOST_DEVICE static constexpr int a_row(int l, int i) { return (l >> 2) + ((i >> 1) & 1) * 8; }
  LOOM_HOST_DEVICE static constexpr int a_col(int l, int i) { return (l & 3) * 2 + (i & 1) + (i >> 2) * 8; }
  /// Row (k) and column (n) of element i (0-3) of lane l's B fragment (register i / 2).
  LOOM_HOST_DEVICE static constexpr int b_row(int l, int i) { return (l & 3) * 2 + (i & 1) + (i >> 1) * 8; }
  LOOM_HOST_DEVICE static constexpr int b_col(int l, int) { return l >> 2; }
  /// Row and column of element i (0-3) of lane l's C and D fragments.
  LOOM_HOST_DEVICE static constexpr int c_row(int l, int i) { return (l >> 2) + (i >> 1) * 8; }
  LOOM_HOST_DEVICE static constexpr int c_col(int l, int i) { return (l & 3) * 2 + (i & 1); }
};

/// Two bf16 values in one register, `lo` in the low half.
LOOM_HOST_DEVICE constexpr std::uint32_t pack_bf16(bfloat16 lo, bfloat16 hi) noexcept {
  return static_cast<std::uint32_t>(lo.bits) | (static_cast<std::uint32_t>(hi.bits) << 16);
}

/// d = a b + c over the warp (every lane calls, converged).
__device__ inline void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                                const float (&c)[4]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  __trap();  // no bf16 tensor-core product before sm_80
#endif
#elif defined(LOOM_CUDA_EMULATION)
  using L = m16n8k16;
  const auto half = [](std::uint32_t w, int i) { return std::bit_cast<float>((i & 1 ? w >> 16 : w & 0xffffu) << 16); };
  const std::uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  float A[16][16], B[16][8];
  ::loom::emulation::warp_share(mine, [&](const std::uint32_t(*all)[16]) {
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 8; ++i) A[L::a_row(l, i)][L::a_col(l, i)] = half(all[l][i / 2], i);
      for (int i = 0; i < 4; ++i) B[L::b_row(l, i)][L::b_col(l, i)] = half(all[l][4 + i / 2], i);
    }
  });
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int kk = 0; kk < L::k; ++kk) s += A[L::c_row(lane, i)][kk] * B[kk][L::c_col(lane, i)];
    d[i] = s;
  }
#else
  (void)a, (void)b;  // nvcc's host pass: never called
  for (int i = 0; i < 4; ++i) d[i] = c[i];
#endif
}

}  // namespace loom::ops::mma
