#pragma once
// Host reduction kernels shared by the communicators: out[i] = op over sources s of src_s[i].
//
// Why here: thread_comm reduces peers' buffers directly; mpi_comm needs the same arithmetic
// for the element types MPI has no reduction for (half, bfloat16 are widened to float) and
// for `avg`. One kernel keeps the numerics identical: half and bfloat16 accumulate in float
// and round once at the end, integers stay integers (avg truncates toward zero), sources are
// combined in rank order 0, 1, ..., n-1 so results are deterministic.
//
// The inner loops run over blocks of 256 elements with the accumulator in a stack array, so
// the compiler vectorises them and nothing is allocated.

#include <loom/comm/communicator.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>

namespace loom::comm {

/// The type a reduction of T accumulates in: float for half and bfloat16, T otherwise.
template <element T>
using accumulator_t = std::conditional_t<std::is_same_v<T, half> || std::is_same_v<T, bfloat16>, float, T>;

namespace detail {

template <element T, class Combine>
void reduce_block_loop(std::span<const void* const> srcs, std::size_t offset, T* dst, std::size_t count,
                       Combine combine, bool average) {
  using A = accumulator_t<T>;
  constexpr std::size_t block = 256;
  A acc[block];
  const A n = static_cast<A>(srcs.size());
  for (std::size_t base = 0; base < count; base += block) {
    const std::size_t m = std::min(block, count - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + offset + base;
    for (std::size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    for (std::size_t s = 1; s < srcs.size(); ++s) {
      const T* p = static_cast<const T*>(srcs[s]) + offset + base;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine(acc[i], static_cast<A>(p[i]));
    }
    if (average)
      for (std::size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(acc[i] / n);
    for (std::size_t i = 0; i < m; ++i) dst[base + i] = static_cast<T>(acc[i]);
  }
}

}  // namespace detail

/// dst[i] = op over s of srcs[s][offset + i], for i < count. dst may alias srcs[s] + offset.
template <element T>
void reduce_into(reduce_op op, std::span<const void* const> srcs, std::size_t offset, T* dst, std::size_t count) {
  LOOM_CHECK(!srcs.empty(), "reduce_into: no sources");
  using A = accumulator_t<T>;
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg:
      return detail::reduce_block_loop<T>(srcs, offset, dst, count, [](A a, A b) { return static_cast<A>(a + b); },
                                          op == reduce_op::avg);
    case reduce_op::max:
      return detail::reduce_block_loop<T>(srcs, offset, dst, count, [](A a, A b) { return b > a ? b : a; }, false);
    case reduce_op::min:
      return detail::reduce_block_loop<T>(srcs, offset, dst, count, [](A a, A b) { return b < a ? b : a; }, false);
  }
  LOOM_THROW("reduce_into: unknown reduce_op ", static_cast<int>(op));
}

/// Calls fn(T{}) with T the element type named by t.
template <class F>
decltype(auto) visit_dtype(dtype t, F&& fn) {
  switch (t) {
    case dtype::f32: return fn(float{});
    case dtype::f64: return fn(double{});
    case dtype::f16: return fn(half{});
    case dtype::bf16: return fn(bfloat16{});
    case dtype::i8: return fn(std::int8_t{});
    case dtype::u8: return fn(std::uint8_t{});
    case dtype::i16: return fn(std::int16_t{});
    case dtype::u16: return fn(std::uint16_t{});
    case dtype::i32: return fn(std::int32_t{});
    case dtype::u32: return fn(std::uint32_t{});
    case dtype::i64: return fn(std::int64_t{});
    case dtype::u64: return fn(std::uint64_t{});
  }
  LOOM_THROW("visit_dtype: unknown dtype ", static_cast<int>(t));
}

/// reduce_into with the element type chosen at run time.
inline void reduce_into(dtype t, reduce_op op, std::span<const void* const> srcs, std::size_t offset, void* dst,
                        std::size_t count) {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_into<T>(op, srcs, offset, static_cast<T*>(dst), count);
  });
}

}  // namespace loom::comm
