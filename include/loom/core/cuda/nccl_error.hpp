#pragma once
// NCCL status-code checker: LOOM_NCCL_CHECK(call) throws loom::error naming the call and
// NCCL's description (and the last error NCCL logged, which names the failing peer).

#include <loom/core/error.hpp>

#include <nccl.h>

namespace loom::detail {

inline void check_nccl(ncclResult_t rc, const char* call, const char* file, int line) {
  if (LOOM_LIKELY(rc == ncclSuccess)) return;
  throw_error_at(file, line, concat("NCCL call ", call, " failed: ", ncclGetErrorString(rc), " (code ", static_cast<int>(rc), ")"));
}

}  // namespace loom::detail

#define LOOM_NCCL_CHECK(call) ::loom::detail::check_nccl((call), #call, __FILE__, __LINE__)
