#pragma once
// MPI status-code checker: every MPI call loom makes goes through LOOM_MPI_CHECK, which turns
// a failing return code into loom::error with MPI's own error string. (Communicators set
// MPI_ERRORS_RETURN so that failures reach this checker instead of aborting the job.)

#include <loom/core/error.hpp>

#include <mpi.h>

#include <string>

namespace loom::detail {

inline void check_mpi(int rc, const char* call, const char* file, int line) {
  if (LOOM_LIKELY(rc == MPI_SUCCESS)) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw_error_at(file, line, concat("MPI call ", call, " failed with code ", rc, ": ", std::string(text, len)));
}

}  // namespace loom::detail

#define LOOM_MPI_CHECK(call) ::loom::detail::check_mpi((call), #call, __FILE__, __LINE__)
