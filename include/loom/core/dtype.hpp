#pragma once
// Element types loom moves and computes with, and their run-time descriptions.
//
// Collectives, checkpoints and configs need to name an element type at run time (to agree
// on it across ranks, to write it into a file header); templates need it at compile time.
// `loom::element` is the concept; `dtype_of<T>` maps a type to its run-time tag.

#include <loom/core/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class dtype : std::uint8_t { f32, f64, f16, bf16, i8, u8, i16, u16, i32, u32, i64, u64 };

template <class T> struct dtype_traits;  // primary template left undefined: not an element type
#define LOOM_DTYPE_TRAIT(T, tag, text)                                  \
  template <> struct dtype_traits<T> {                                  \
    static constexpr ::loom::dtype value = ::loom::dtype::tag;          \
    static constexpr std::string_view name = text;                      \
  }
LOOM_DTYPE_TRAIT(float, f32, "float32");
LOOM_DTYPE_TRAIT(double, f64, "float64");
LOOM_DTYPE_TRAIT(half, f16, "float16");
LOOM_DTYPE_TRAIT(bfloat16, bf16, "bfloat16");
LOOM_DTYPE_TRAIT(std::int8_t, i8, "int8");
LOOM_DTYPE_TRAIT(std::uint8_t, u8, "uint8");
LOOM_DTYPE_TRAIT(std::int16_t, i16, "int16");
LOOM_DTYPE_TRAIT(std::uint16_t, u16, "uint16");
LOOM_DTYPE_TRAIT(std::int32_t, i32, "int32");
LOOM_DTYPE_TRAIT(std::uint32_t, u32, "uint32");
LOOM_DTYPE_TRAIT(std::int64_t, i64, "int64");
LOOM_DTYPE_TRAIT(std::uint64_t, u64, "uint64");
#undef LOOM_DTYPE_TRAIT

/// Requires: T is one of loom's element types (float, double, half, bfloat16, fixed-width ints).
template <class T>
concept element = requires { dtype_traits<std::remove_cv_t<T>>::value; };

/// Requires: T is a floating-point element type (float, double, half, bfloat16).
template <class T>
concept floating_element = element<T> && (std::same_as<std::remove_cv_t<T>, float> || std::same_as<std::remove_cv_t<T>, double> ||
                                          std::same_as<std::remove_cv_t<T>, half> || std::same_as<std::remove_cv_t<T>, bfloat16>);

/// Requires: T is a type loom's kernels and layers compute in (float; double for gradient
/// checks). Here, not in ops/, so that naming a model's types does not pull in a backend.
template <class T>
concept compute_type = std::same_as<T, float> || std::same_as<T, double>;

/// Requires: P is a type parameters may be stored in (float, double, half, bfloat16).
template <class P>
concept param_type = floating_element<P>;

template <element T>
inline constexpr dtype dtype_of = dtype_traits<std::remove_cv_t<T>>::value;

constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::f64: case dtype::i64: case dtype::u64: return 8;
    case dtype::f32: case dtype::i32: case dtype::u32: return 4;
    case dtype::f16: case dtype::bf16: case dtype::i16: case dtype::u16: return 2;
    case dtype::i8: case dtype::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "float32";
    case dtype::f64: return "float64";
    case dtype::f16: return "float16";
    case dtype::bf16: return "bfloat16";
    case dtype::i8: return "int8";
    case dtype::u8: return "uint8";
    case dtype::i16: return "int16";
    case dtype::u16: return "uint16";
    case dtype::i32: return "int32";
    case dtype::u32: return "uint32";
    case dtype::i64: return "int64";
    case dtype::u64: return "uint64";
  }
  return "unknown";
}

/// Parses "float32", "fp32", "float16", "fp16", "bfloat16", "bf16", "int32", ... ; throws naming the text otherwise.
inline dtype parse_dtype(std::string_view s) {
  if (s == "float32" || s == "fp32" || s == "float") return dtype::f32;
  if (s == "float64" || s == "fp64" || s == "double") return dtype::f64;
  if (s == "float16" || s == "fp16" || s == "half") return dtype::f16;
  if (s == "bfloat16" || s == "bf16") return dtype::bf16;
  for (dtype t : {dtype::i8, dtype::u8, dtype::i16, dtype::u16, dtype::i32, dtype::u32, dtype::i64, dtype::u64})
    if (s == dtype_name(t)) return t;
  LOOM_THROW("unknown element type '", s, "' (expected float32, float64, float16, bfloat16, int8..int64, uint8..uint64)");
}

}  // namespace loom
