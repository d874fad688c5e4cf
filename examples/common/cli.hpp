#pragma once
// Command-line helpers shared by loom's example programs: a bad argument is reported as
// "flag --x needs a number, got 'abc'" followed by the program's usage, never as a bare
// std::stoi exception.

#include <sstream>
#include <stdexcept>
#include <string>

namespace examples::cli {

/// A wrong command line: the program prints the message and its usage and exits with 2.
struct bad_args : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The value of `flag` parsed as a T; the whole text must be a T.
template <class T>
T number(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  T x{};
  is >> x;
  if (!is || !is.eof()) throw bad_args("flag " + flag + " needs a number, got '" + v + "'");
  return x;
}

}  // namespace examples::cli
