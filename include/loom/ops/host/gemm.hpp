#pragma once
// GEMM on the host through CBLAS (OpenBLAS): C = alpha * A B + beta * C on row-major views.
//
// Why views: a transposed view (`w.transpose(0, 1)`, unit stride in dimension 0) is passed to
// BLAS as a transposed operand without a copy, and a head's slice of a [B, T, H, hd]
// activation (row stride H*hd) is passed with its leading dimension. So attention and linear
// layers call one function and never copy to make an operand contiguous. float and double
// (sgemm, dgemm); the same name will exist in ops/cuda on the loom::cuda tag.
//
// Threads: on a host_pool() of several threads a large enough product is split into row (or
// column) blocks of C, one single-threaded BLAS call per pool thread, instead of handing the
// whole call to OpenBLAS's threads (which then never run: a product too small to split runs
// on one thread as well). Measured on the 2-core machine (docs/benchmarks.md,
// "Training step"): the 128-wide GEMMs of a small model run 5-60% faster that way, large ones
// the same, and loom's kernels and the GEMMs then share one set of threads, so nothing
// waits for another pool's threads to wake up or yield between a GEMM and the next kernel.

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

/// GEMM parts on the pool cover whole tiles of this many rows (or columns) of C: a multiple
/// of OpenBLAS's register tiles, so a part boundary adds no edge tiles.
inline constexpr index_t gemm_tile = 16;
/// Multiply-adds a pool part gets at least (about 45 microseconds on one core): below that
/// the hand-over costs more than the second core saves.
inline constexpr index_t gemm_min_part_macs = index_t(1) << 21;
/// Tiles per part when one tile holds gemm_tile lines of `macs_per_line` multiply-adds.
inline index_t gemm_grain(index_t macs_per_line) {
  const index_t per_tile = gemm_tile * std::max<index_t>(macs_per_line, 1);
  return std::max<index_t>(1, (gemm_min_part_macs + per_tile - 1) / per_tile);
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
  // C[i0:i1, j0:j1] from A's rows i0:i1 and B's columns j0:j1 (offsets through the views'
  // strides, so transposed operands need nothing special).
  auto block = [&](index_t i0, index_t i1, index_t j0, index_t j1) {
    const T* ap = a.data() + i0 * a.stride(0);
    const T* bp = b.data() + j0 * b.stride(1);
    T* cp = c.data() + i0 * ldc + j0;
    const int bm = static_cast<int>(i1 - i0), bn = static_cast<int>(j1 - j0), bk = static_cast<int>(k);
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, la.trans, lb.trans, bm, bn, bk, alpha, ap, la.ld, bp, lb.ld, beta, cp, static_cast<int>(ldc));
    else
      cblas_dgemm(CblasRowMajor, la.trans, lb.trans, bm, bn, bk, alpha, ap, la.ld, bp, lb.ld, beta, cp, static_cast<int>(ldc));
  };
  // On a pool of several threads, loom splits the product itself: C's rows (or, when there
  // are too few, its columns) in parts of whole tiles, each part one single-threaded BLAS call.
  // Every element of C still comes from one call over the whole K, so the result is the same
  // bit for bit on any number of threads.
  using detail::gemm_tile;
  thread_pool& pool = host_pool();
  const index_t row_tiles = (m + gemm_tile - 1) / gemm_tile, col_tiles = (n + gemm_tile - 1) / gemm_tile;
  const index_t rows_grain = detail::gemm_grain(n * k), cols_grain = detail::gemm_grain(m * k);
  if (pool.parts(row_tiles, rows_grain) > 1) {
    const blas_single_thread_scope one_blas_thread;
    pool.parallel_for(row_tiles, rows_grain, [&](int, index_t t0, index_t t1) {
      block(t0 * gemm_tile, std::min(t1 * gemm_tile, m), 0, n);
    });
  } else if (pool.parts(col_tiles, cols_grain) > 1) {
    const blas_single_thread_scope one_blas_thread;
    pool.parallel_for(col_tiles, cols_grain, [&](int, index_t t0, index_t t1) {
      block(0, m, t0 * gemm_tile, std::min(t1 * gemm_tile, n));
    });
  } else {  // too small to split: still one thread, the pool's threads are the only ones
    const blas_single_thread_scope one_blas_thread(pool.size() > 1);
    block(0, m, 0, n);
  }
}

}  // namespace loom::ops
