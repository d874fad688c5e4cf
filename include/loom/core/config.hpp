#pragma once
// loom configuration: version, host/device annotations, compiler hints.
//
// Every loom header includes this first. The LOOM_HOST_DEVICE annotation lets the small
// value types (half, bfloat16, philox) be used inside CUDA kernels when a header is compiled
// by nvcc, while plain g++ sees ordinary inline functions.

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 1
#define LOOM_VERSION_PATCH 0

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#define LOOM_DEVICE __device__
#else
#define LOOM_HOST_DEVICE
#define LOOM_DEVICE
#endif

/// LOOM_FORCE_INLINE: inlined even where the compiler's size heuristics would not, for small
/// math helpers called inside vectorised loops (a call there stops the loop from vectorising)
/// and in kernels; nvcc's spelling works on __host__ __device__ functions.
#if defined(__CUDACC__)
#define LOOM_FORCE_INLINE __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define LOOM_FORCE_INLINE inline __attribute__((always_inline))
#else
#define LOOM_FORCE_INLINE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LOOM_LIKELY(x) __builtin_expect(!!(x), 1)
#define LOOM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define LOOM_RESTRICT __restrict__
#else
#define LOOM_LIKELY(x) (x)
#define LOOM_UNLIKELY(x) (x)
#define LOOM_RESTRICT
#endif

namespace loom {
/// Library version as a single integer: major * 10000 + minor * 100 + patch.
inline constexpr int version = LOOM_VERSION_MAJOR * 10000 + LOOM_VERSION_MINOR * 100 + LOOM_VERSION_PATCH;
}  // namespace loom
