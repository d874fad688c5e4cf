#pragma once
// Errors: one exception type, one checking macro.
//
// Why: a bad argument must produce a message a user can act on (which argument, which value,
// where), never a crash, a hang or a silently wrong result, and a header must never call
// exit(). LOOM_CHECK(cond, parts...) streams every part into the message, so call sites name
// the argument and its value:
//
//   LOOM_CHECK(n_heads % n_kv_heads == 0, "n_heads (", n_heads, ") must be divisible by n_kv_heads (", n_kv_heads, ")");
//
// The thrown loom::error's what() reads: "<message> [check `cond` failed at file:line]".
// Status codes of CUDA, NCCL and MPI each go through one checker (core/cuda/error.hpp,
// core/nccl_error.hpp, core/mpi_error.hpp) that throws the same type.

#include <loom/core/config.hpp>

#include <array>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace loom {

/// The one exception type loom throws for bad input, failed checks and failed backends.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// Streams one part of a message. Fixed-size arrays and vectors (shapes, extents) print as
/// [a, b, c]: std::array has no operator<< of its own and ADL would not find ours.
template <class T>
void stream_part(std::ostream& os, const T& v) {
  os << v;
}
template <class T, std::size_t N>
void stream_part(std::ostream& os, const std::array<T, N>& a) {
  os << '[';
  for (std::size_t i = 0; i < N; ++i) os << (i ? ", " : "") << a[i];
  os << ']';
}
template <class T, class A>
void stream_part(std::ostream& os, const std::vector<T, A>& a) {
  os << '[';
  for (std::size_t i = 0; i < a.size(); ++i) os << (i ? ", " : "") << a[i];
  os << ']';
}

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (stream_part(os, parts), ...);
  return os.str();
}

[[noreturn]] inline void throw_check_failure(const char* expr, const char* file, int line,
                                             const std::string& message) {
  std::ostringstream os;
  os << (message.empty() ? std::string("check failed") : message) << " [check `" << expr
     << "` failed at " << file << ':' << line << ']';
  throw ::loom::error(os.str());
}

[[noreturn]] inline void throw_error_at(const char* file, int line, const std::string& message) {
  std::ostringstream os;
  os << message << " [at " << file << ':' << line << ']';
  throw ::loom::error(os.str());
}

}  // namespace detail
}  // namespace loom

/// Throws loom::error if `cond` is false; the remaining arguments are streamed into the message.
#define LOOM_CHECK(cond, ...)                                                                   \
  do {                                                                                          \
    if (LOOM_UNLIKELY(!(cond)))                                                                 \
      ::loom::detail::throw_check_failure(#cond, __FILE__, __LINE__,                            \
                                          ::loom::detail::concat(__VA_ARGS__));                 \
  } while (0)

/// Throws loom::error unconditionally with the streamed arguments as message.
#define LOOM_THROW(...) ::loom::detail::throw_error_at(__FILE__, __LINE__, ::loom::detail::concat(__VA_ARGS__))
