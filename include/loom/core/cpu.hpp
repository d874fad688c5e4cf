#pragma once
// What this CPU runs, asked once per feature. loom's x86 kernels (ops/host/sgemm_avx2.hpp,
// sgemm_avx512.hpp, quant/nf4.hpp's expansion) choose their instruction set at run time, so one
// binary runs -- and its tests test -- every path the CPU has, and names the others skipped.
// LOOM_CPU_X86: compiled for x86 by GCC or Clang (their __builtin_cpu_* queries and target
// attributes); elsewhere every query answers false and the portable paths run.

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__)
#define LOOM_CPU_X86 1
#else
#define LOOM_CPU_X86 0
#endif

namespace loom::cpu {

/// AVX2 and FMA (the AVX2 kernels use both; every CPU with AVX2 that loom targets has FMA).
inline bool has_avx2_fma() noexcept {
#if LOOM_CPU_X86
  // __builtin_cpu_init: a query may run before the constructors that would otherwise call it
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0);
  return ok;
#else
  return false;
#endif
}

/// AVX-512 Foundation.
inline bool has_avx512f() noexcept {
#if LOOM_CPU_X86
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") != 0);
  return ok;
#else
  return false;
#endif
}

}  // namespace loom::cpu
