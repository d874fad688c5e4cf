#pragma once
// GEMM on the host through CBLAS (OpenBLAS): C = alpha * A B + beta * C on row-major views.
//
// Why views: a transposed view (`w.transpose(0, 1)`, unit stride in dimension 0) is passed to
// BLAS as a transposed operand without a copy, and a head's slice of a [B, T, H, hd]
// activation (row stride H*hd) is passed with its leading dimension. So attention and linear
// layers call one function and never copy to make an operand contiguous. float and double
// (sgemm, dgemm); the same name will exist in ops/cuda on the loom::cuda tag.

#include <loom/ops/host/common.hpp>

#include <cblas.h>

#include <algorithm>

namespace loom::ops {
namespace detail {

struct blas_operand {
  CBLAS_TRANSPOSE trans;
  int ld;
};

/// How BLAS sees a [rows, cols] view: row-major as is, or the transpose of a row-major matrix.
template <class V>
inline blas_operand blas_layout(const V& v, const char* what) {
  const index_t rows = v.extent(0), cols = v.extent(1);
  if (v.stride(1) == 1 || cols == 1) {
    const index_t ld = rows > 1 ? v.stride(0) : cols;
    if (ld >= std::max<index_t>(cols, 1)) return {CblasNoTrans, static_cast<int>(ld)};
  }
  if (v.stride(0) == 1 || rows == 1) {
    const index_t ld = cols > 1 ? v.stride(1) : rows;
    if (ld >= std::max<index_t>(rows, 1)) return {CblasTrans, static_cast<int>(ld)};
  }
  LOOM_THROW("ops::gemm: operand ", what, " with shape ", str(v.shape()), " and strides ", str(v.strides()),
             " has no unit stride (BLAS needs a row-major or transposed row-major matrix)");
}

}  // namespace detail

/// While alive, OpenBLAS runs each call on one thread (the old count is restored after): for
/// GEMMs issued from several loom pool threads at once, which would otherwise each try to
/// use OpenBLAS's whole thread pool. Does nothing when `on` is false, when OpenBLAS already
/// runs one thread, or with another CBLAS.
class blas_single_thread_scope {
 public:
  explicit blas_single_thread_scope(bool on = true) {
#if defined(OPENBLAS_VERSION)
    if (on && openblas_get_num_threads() > 1) {
      old_ = openblas_get_num_threads();
      openblas_set_num_threads(1);
    }
#else
    (void)on;
#endif
  }
  ~blas_single_thread_scope() {
#if defined(OPENBLAS_VERSION)
    if (old_ > 1) openblas_set_num_threads(old_);
#endif
  }
  blas_single_thread_scope(const blas_single_thread_scope&) = delete;
  blas_single_thread_scope& operator=(const blas_single_thread_scope&) = delete;

 private:
  int old_ = 0;
};

/// C[M, N] = alpha * A[M, K] B[K, N] + beta * C. A and B may be transposed views; C must have
/// unit stride in its last dimension.
template <class TA, class TB, compute_type T>
  requires std::same_as<std::remove_const_t<TA>, T> && std::same_as<std::remove_const_t<TB>, T>
inline void gemm(host, tensor_view<TA, host, 2> a, tensor_view<TB, host, 2> b, tensor_view<T, host, 2> c,
                 T alpha = T(1), T beta = T(0)) {
  const index_t m = a.extent(0), k = a.extent(1), n = b.extent(1);
  LOOM_CHECK(b.extent(0) == k, "ops::gemm: inner dimensions differ: A is ", detail::str(a.shape()), ", B is ", detail::str(b.shape()));
  LOOM_CHECK(c.extent(0) == m && c.extent(1) == n, "ops::gemm: C has shape ", detail::str(c.shape()), ", expected [", m, ", ", n, "]");
  if (m == 0 || n == 0) return;
  LOOM_CHECK(c.stride(1) == 1 || n == 1, "ops::gemm: C must have unit stride in dimension 1 (strides ", detail::str(c.strides()), ")");
  const index_t ldc = m > 1 ? c.stride(0) : n;
  LOOM_CHECK(ldc >= n, "ops::gemm: C's row stride ", ldc, " is smaller than its ", n, " columns");
  if (k == 0) {  // BLAS skips the product; apply beta ourselves for a well-defined result
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) c(i, j) = beta == T(0) ? T(0) : beta * c(i, j);
    return;
  }
  const auto la = detail::blas_layout(a, "A"), lb = detail::blas_layout(b, "B");
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, la.trans, lb.trans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), alpha, a.data(), la.ld, b.data(), lb.ld, beta, c.data(),
                static_cast<int>(ldc));
  else
    cblas_dgemm(CblasRowMajor, la.trans, lb.trans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), alpha, a.data(), la.ld, b.data(), lb.ld, beta, c.data(),
                static_cast<int>(ldc));
}

}  // namespace loom::ops
