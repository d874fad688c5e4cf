#pragma once
// Command-line helpers shared by loom's example programs: a bad argument is reported as
// "flag --x needs a number, got 'abc'" followed by the program's usage, never as a bare
// std::stoi exception.

#include <loom/core/dtype.hpp>

#include <cstdio>
#include <functional>
#include <optional>
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

/// The value of a --precision flag: fp32, bf16 or fp16 (or float32, bfloat16, float16).
inline loom::dtype precision(const std::string& flag, const std::string& v) {
  if (v != "fp32" && v != "bf16" && v != "fp16" && v != "float32" && v != "bfloat16" && v != "float16")
    throw bad_args(flag + " must be fp32, bf16 or fp16, got '" + v + "'");
  return loom::parse_dtype(v);
}

/// The argument loop every example shares. Calls on(flag, value) for each argument in turn;
/// value() consumes and returns the next argument (bad_args "flag --x needs a value" when
/// there is none). `on` returns false for an argument it does not take: bad_args "unknown
/// argument '--x'". Returns false, having called nothing more, at --help or -h (the caller
/// prints its usage and exits 0).
template <class On>
bool parse(int argc, char** argv, On&& on) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return false;
    std::function<std::string()> value = [&]() -> std::string {
      if (i + 1 >= argc) throw bad_args("flag " + a + " needs a value");
      return argv[++i];
    };
    if (!on(a, value)) throw bad_args("unknown argument '" + a + "'");
  }
  return true;
}

/// The whole command-line step of a program's main: parse() with `on`, then `check()` (checks
/// across flags). Returns the code to leave main with, or nothing to go on: 0 after printing
/// `usage` to stdout for --help; 2 after printing "<prog>: <message>" and `usage` to stderr
/// when `on` or `check` throws (bad_args, loom::error, any std::exception).
template <class On, class Check>
std::optional<int> command_line(int argc, char** argv, const char* prog, const char* usage, On&& on, Check&& check) {
  try {
    if (!parse(argc, argv, on)) {
      std::fputs(usage, stdout);
      return 0;
    }
    check();
    return std::nullopt;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n%s", prog, e.what(), usage);
    return 2;
  }
}

}  // namespace examples::cli
