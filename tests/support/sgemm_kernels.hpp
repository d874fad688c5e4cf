#pragma once
// Runs a test body once per float GEMM kernel (ops::host_sgemm: avx512, avx2, blas), each
// under set_host_sgemm, in one process: a CPU with AVX-512 tests all three, one with only
// AVX2 tests avx2 and blas, any other CPU blas. A kernel the CPU lacks is reported as
// skipped, by name, in doctest's output (a MESSAGE), so no result depends on which
// CPU CI gets without hiding what was not run.
#include <loom/ops/host/gemm.hpp>

#include <doctest/doctest.h>

#include <string>

namespace loom::test {

/// Sets the float GEMM kernel while alive, restoring the previous one after.
struct sgemm_kernel_scope {
  ops::host_sgemm old = ops::host_sgemm_kernel();
  explicit sgemm_kernel_scope(ops::host_sgemm k) { ops::set_host_sgemm(k); }
  ~sgemm_kernel_scope() { ops::set_host_sgemm(old); }
  sgemm_kernel_scope(const sgemm_kernel_scope&) = delete;
  sgemm_kernel_scope& operator=(const sgemm_kernel_scope&) = delete;
};

/// Whether kernel k promises results that do not depend on how a GEMM is split over threads
/// (loom's kernels do; BLAS does not).
inline bool split_invariant(ops::host_sgemm k) { return k != ops::host_sgemm::blas; }

/// body(kernel) for every kernel this CPU runs, with that kernel set; the others reported as
/// skipped by name. Returns how many kernels ran.
template <class Body>
int for_each_sgemm_kernel(const char* what, Body&& body) {
  int ran = 0;
  for (const ops::host_sgemm k : ops::all_host_sgemm) {
    if (!ops::host_sgemm_supported(k)) {
      const std::string line = std::string("skipped: ") + what + " on the " + ops::name(k) +
                               " sgemm kernel (this CPU lacks its instruction set)";
      MESSAGE(line);
      continue;
    }
    const sgemm_kernel_scope use(k);
    INFO("sgemm kernel ", ops::name(k));
    body(k);
    ++ran;
  }
  return ran;
}

}  // namespace loom::test
