#pragma once
// The message of the loom::error a callable throws, for tests that check what an error names.
#include <loom/core/error.hpp>

#include <string>

namespace loom::test {

/// The message of the loom::error that `f` throws ("" if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const loom::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace loom::test
