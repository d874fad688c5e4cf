#pragma once
// GEMM on the host: C = alpha * A B + beta * C on row-major views. float runs on loom's own
// kernel (sgemm.hpp) for the best instruction set the CPU has, AVX-512F or AVX2+FMA, else
// (other CPUs: ARM) on CBLAS (OpenBLAS); double always on CBLAS. host_sgemm_kernel() /
// set_host_sgemm() / LOOM_SGEMM choose.
//
// Why views: a transposed view (`w.transpose(0, 1)`, unit stride in dimension 0) is passed to
// the kernel as a transposed operand without a copy, and a head's slice of a [B, T, H, hd]
// activation (row stride H*hd) is passed with its leading dimension. So attention and linear
// layers call one function and never copy to make an operand contiguous. float and double
// (sgemm, dgemm); the same name will exist in ops/cuda on the loom::cuda tag.
//
// Threads: on a host_pool() of several threads a large enough product is split into row (or
// column) blocks of C, one single-thread kernel call per pool thread, instead of handing the
// whole call to OpenBLAS's threads (which then never run: a product too small to split runs
// on one thread as well); gemm is gemm_batch of one product. Measured on the 2-core machine
// (docs/benchmarks.md, "Training step"): the 64- and 128-wide GEMMs of a small model run up
// to 60% faster that way, large ones the same, and loom's kernels and the GEMMs then share
// one set of threads, so nothing waits for another pool's threads to wake up or yield
// between a GEMM and the next kernel.

#include <loom/ops/host/common.hpp>
#include <loom/ops/host/sgemm_avx2.hpp>
#include <loom/ops/host/sgemm_avx512.hpp>

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

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
/// of OpenBLAS's register tiles, so a part boundary adds no edge tiles there (loom's kernel,
/// 12 rows a tile, gets one shorter row block per part: under 1% of a step in `perf`).
inline constexpr index_t gemm_tile = 16;
/// Multiply-adds a pool part gets at least (about 45 microseconds on one core): below that
/// the hand-over costs more than the second core saves.
inline constexpr index_t gemm_min_part_macs = index_t(1) << 21;

}  // namespace detail

/// The kernel behind float GEMMs on the host: one of loom's (sgemm.hpp; results the same
/// bits on either, on any thread count) or BLAS (cblas_sgemm; results depend on how a GEMM
/// is split, so bit-identity across thread counts does not hold there; always for double).
/// The default is the first the CPU supports of avx512, avx2, blas. Set by the environment,
/// LOOM_SGEMM=avx512|avx2|blas|auto, read on first use, or by set_host_sgemm() (tests and
/// benchmarks run every kernel in one process).
enum class host_sgemm { avx512, avx2, blas };

/// "avx512", "avx2" or "blas".
inline const char* name(host_sgemm k) noexcept {
  switch (k) {
    case host_sgemm::avx512: return "avx512";
    case host_sgemm::avx2: return "avx2";
    case host_sgemm::blas: return "blas";
  }
  return "?";
}

/// Whether this CPU runs kernel k (BLAS runs everywhere).
inline bool host_sgemm_supported(host_sgemm k) noexcept {
#if LOOM_HAS_SGEMM_X86
  if (k == host_sgemm::avx512) return detail::sgemm_avx512::supported();
  if (k == host_sgemm::avx2) return detail::sgemm_avx2::supported();
#endif
  return k == host_sgemm::blas;
}

/// Every kernel, fastest first: avx512, avx2, blas.
inline constexpr host_sgemm all_host_sgemm[] = {host_sgemm::avx512, host_sgemm::avx2, host_sgemm::blas};

namespace detail {
inline host_sgemm checked_host_sgemm(host_sgemm k, const char* source) {
  LOOM_CHECK(host_sgemm_supported(k), source, ": loom's ", name(k), " sgemm kernel needs a CPU with ",
             k == host_sgemm::avx512 ? "AVX-512F" : "AVX2 and FMA", " (x86-64, built with GCC or Clang); this one has none");
  return k;
}
/// LOOM_SGEMM's value (null or empty: auto) as a kernel; a loom::error names a bad one.
inline host_sgemm parse_host_sgemm(const char* v) {
  if (!v || !*v || std::strcmp(v, "auto") == 0) {
    for (const host_sgemm k : all_host_sgemm)
      if (host_sgemm_supported(k)) return k;
  }
  for (const host_sgemm k : all_host_sgemm)
    if (std::strcmp(v, name(k)) == 0) return checked_host_sgemm(k, "LOOM_SGEMM");
  LOOM_THROW("LOOM_SGEMM='", std::string(v).substr(0, 32), "' is not avx512, avx2, blas or auto");
}
inline std::atomic<host_sgemm>& host_sgemm_choice() {
  static std::atomic<host_sgemm> choice{parse_host_sgemm(std::getenv("LOOM_SGEMM"))};
  return choice;
}
}  // namespace detail

/// The kernel float GEMMs use now.
inline host_sgemm host_sgemm_kernel() { return detail::host_sgemm_choice().load(std::memory_order_relaxed); }
/// Chooses the kernel of later float GEMMs (one the CPU lacks is a loom::error).
inline void set_host_sgemm(host_sgemm k) {
  detail::host_sgemm_choice().store(detail::checked_host_sgemm(k, "set_host_sgemm"), std::memory_order_relaxed);
}

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

namespace detail {

/// A checked GEMM: operands, their BLAS layouts and the call for a block of C.
template <compute_type T>
struct gemm_plan {
  const T* a = nullptr;
  const T* b = nullptr;
  T* c = nullptr;
  index_t m = 0, n = 0, k = 0;
  index_t a_row = 0, b_col = 0, ldc = 0;  // element steps: A's rows, B's columns, C's rows
  blas_operand la{}, lb{};
  T alpha = T(1), beta = T(0);
  host_sgemm kernel = host_sgemm::blas;  // float: loom's kernel or BLAS

  index_t row_tiles() const noexcept { return (m + gemm_tile - 1) / gemm_tile; }
  index_t macs() const noexcept { return m * n * std::max<index_t>(k, 1); }

  /// C[i0:i1, j0:j1] from A's rows i0:i1 and B's columns j0:j1: one kernel call (loom's or
  /// BLAS) on the calling thread.
  void block(index_t i0, index_t i1, index_t j0, index_t j1) const {
    if (i1 <= i0 || j1 <= j0) return;
    T* cp = c + i0 * ldc + j0;
    if (k == 0) {  // BLAS skips the product; apply beta ourselves for a well-defined result
      for (index_t i = 0; i < i1 - i0; ++i)
        for (index_t j = 0; j < j1 - j0; ++j) cp[i * ldc + j] = beta == T(0) ? T(0) : beta * cp[i * ldc + j];
      return;
    }
    const T* ap = a + i0 * a_row;
    const T* bp = b + j0 * b_col;
    const int bm = static_cast<int>(i1 - i0), bn = static_cast<int>(j1 - j0), bk = static_cast<int>(k);
    if constexpr (std::is_same_v<T, float>) {
      const bool at = la.trans == CblasTrans, bt = lb.trans == CblasTrans;
#if LOOM_HAS_SGEMM_X86
      if (kernel == host_sgemm::avx512) return sgemm<sgemm_avx512>(at, bt, bm, bn, k, alpha, ap, la.ld, bp, lb.ld, beta, cp, ldc);
      if (kernel == host_sgemm::avx2) return sgemm<sgemm_avx2>(at, bt, bm, bn, k, alpha, ap, la.ld, bp, lb.ld, beta, cp, ldc);
#endif
      cblas_sgemm(CblasRowMajor, la.trans, lb.trans, bm, bn, bk, alpha, ap, la.ld, bp, lb.ld, beta, cp, static_cast<int>(ldc));
    } else {
      cblas_dgemm(CblasRowMajor, la.trans, lb.trans, bm, bn, bk, alpha, ap, la.ld, bp, lb.ld, beta, cp, static_cast<int>(ldc));
    }
  }
  /// Part p of `parts`: rows [p R / P, (p + 1) R / P) of C in whole tiles (R = row_tiles()),
  /// or, when C has fewer row tiles than parts, the same share of its column tiles. Products
  /// with the same C are split the same way.
  void part(index_t p, index_t parts) const {
    const index_t rt = row_tiles();
    if (rt >= parts) {
      block(std::min(m, p * rt / parts * gemm_tile), std::min(m, (p + 1) * rt / parts * gemm_tile), 0, n);
    } else {
      const index_t ct = (n + gemm_tile - 1) / gemm_tile;
      block(0, m, std::min(n, p * ct / parts * gemm_tile), std::min(n, (p + 1) * ct / parts * gemm_tile));
    }
  }
};

template <class TA, class TB, compute_type T>
inline gemm_plan<T> plan_gemm(const tensor_view<TA, host, 2>& a, const tensor_view<TB, host, 2>& b,
                              const tensor_view<T, host, 2>& c, T alpha, T beta) {
  const index_t m = a.extent(0), k = a.extent(1), n = b.extent(1);
  LOOM_CHECK(b.extent(0) == k, "ops::gemm: inner dimensions differ: A is ", str(a.shape()), ", B is ", str(b.shape()));
  LOOM_CHECK(c.extent(0) == m && c.extent(1) == n, "ops::gemm: C has shape ", str(c.shape()), ", expected [", m, ", ", n, "]");
  gemm_plan<T> g{a.data(), b.data(), c.data(), m, n, k, a.stride(0), b.stride(1), 0, {}, {}, alpha, beta};
  if (m == 0 || n == 0) return g;
  LOOM_CHECK(c.stride(1) == 1 || n == 1, "ops::gemm: C must have unit stride in dimension 1 (strides ", str(c.strides()), ")");
  g.ldc = m > 1 ? c.stride(0) : n;
  LOOM_CHECK(g.ldc >= n, "ops::gemm: C's row stride ", g.ldc, " is smaller than its ", n, " columns");
  if (k > 0) g.la = blas_layout(a, "A"), g.lb = blas_layout(b, "B");
  // alpha == 0: BLAS leaves A B out (inf * 0 would otherwise make NaNs); rare, so BLAS does it
  if constexpr (std::is_same_v<T, float>)
    if (alpha != T(0)) g.kernel = host_sgemm_kernel();
  return g;
}

}  // namespace detail

/// One product of a gemm_batch: C = alpha A B + beta C (views as for gemm), on device D (a
/// layer's list of products is the same on both: nn::device_context::gemm_all).
template <compute_type T, class D = host>
struct gemm_op {
  tensor_view<const T, D, 2> a, b;
  tensor_view<T, D, 2> c;
  T alpha = T(1), beta = T(0);
};

/// The products in list order, as one split over host_pool() instead of one per product:
/// part p of P computes rows [p R_i / P, (p + 1) R_i / P) (R_i: product i's 16-row tiles) of
/// every product, in list order (columns, likewise, of a product with fewer row tiles than
/// parts). P: the pool's size, at most one part per 2^21 multiply-adds of the whole batch.
/// Products that share a C form a group; a group with a product too small to give every part
/// 2^21 multiply-adds runs whole, in one part (groups spread over the parts), because BLAS
/// computes tiny products by another kernel and the bits would then depend on the split.
/// For the linear layers of one block (q/k/v from one input; a layer's weight and input
/// gradients; dx summed over several layers): one fork-join instead of several. Bit for bit
/// the result of gemm() on each product in turn, provided products whose C overlap have the
/// same C (they accumulate in list order) and no product reads another's C.
template <compute_type T>
inline void gemm_batch(host, std::span<const gemm_op<T>> ops) {
  struct item {
    detail::gemm_plan<T> plan;
    std::size_t group;  // index of the first product with the same C
  };
  std::vector<item> items;
  items.reserve(ops.size());
  index_t macs = 0;
  for (const auto& op : ops) {
    const auto g = detail::plan_gemm(op.a, op.b, op.c, op.alpha, op.beta);
    std::size_t group = items.size();
    for (std::size_t j = 0; j < items.size(); ++j)
      if (items[j].plan.c == g.c && items[j].plan.m == g.m && items[j].plan.n == g.n && items[j].plan.ldc == g.ldc) {
        group = items[j].group;
        break;
      }
    items.push_back({g, group});
    macs += g.macs();
  }
  thread_pool& pool = host_pool();
  const int parts = pool.parts(macs, detail::gemm_min_part_macs);
  std::vector<char> whole(items.size(), 0);  // per group: run unsplit
  for (const auto& it : items)
    if (it.plan.macs() < parts * detail::gemm_min_part_macs) whole[it.group] = 1;
  const blas_single_thread_scope one_blas_thread(pool.size() > 1);
  pool.parallel_for(parts, 1, [&](int, index_t p0, index_t p1) {
    for (index_t p = p0; p < p1; ++p)
      for (const auto& it : items) {
        if (!whole[it.group])
          it.plan.part(p, parts);
        else if (static_cast<index_t>(it.group % static_cast<std::size_t>(parts)) == p)
          it.plan.block(0, it.plan.m, 0, it.plan.n);
      }
  });
}
template <compute_type T>
inline void gemm_batch(host h, std::initializer_list<gemm_op<T>> ops) {
  gemm_batch(h, std::span<const gemm_op<T>>(ops.begin(), ops.size()));
}

/// C[M, N] = alpha * A[M, K] B[K, N] + beta * C. A and B may be transposed views; C must have
/// unit stride in its last dimension. On a pool of several threads: split by 16-row tiles of
/// C (by columns when C has fewer row tiles than parts), see gemm_batch.
template <class TA, class TB, compute_type T>
  requires std::same_as<std::remove_const_t<TA>, T> && std::same_as<std::remove_const_t<TB>, T>
inline void gemm(host h, tensor_view<TA, host, 2> a, tensor_view<TB, host, 2> b, tensor_view<T, host, 2> c,
                 T alpha = T(1), T beta = T(0)) {
  const auto g = detail::plan_gemm(a, b, c, alpha, beta);
  thread_pool& pool = host_pool();
  if (pool.parts(g.macs(), detail::gemm_min_part_macs) > 1) return gemm_batch(h, {gemm_op<T>{a, b, c, alpha, beta}});
  const blas_single_thread_scope one_blas_thread(pool.size() > 1);  // too small to split (or 1 thread)
  g.block(0, g.m, 0, g.n);
}

}  // namespace loom::ops
