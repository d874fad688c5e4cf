#pragma once
// A weight packed once for the GEMMs that read it: y [m, n] = alpha x [m, k] W^T + beta y with
// W [n, k] (a linear layer's weight, PyTorch's layout) copied into the sgemm kernel's B panels
// when it is made, not on every call.
//
// Why: ops::gemm copies B into panels on every call, which costs k n floats moved per call
// against m k n multiply-adds: nothing for a training step's 1,024 token rows, as much as the
// product itself when m is a few tokens (decoding one token per sequence). Inference weights
// do not change, so the copy is made once ("plan, then run"). Results: the same micro-kernel
// calls, K blocks and rule as ops::gemm on the same kernel (sgemm.hpp), so the same bits as the
// unpacked product, and each row of y the same whatever m and the thread count. On the BLAS
// path (no loom kernel for this CPU) the weight is kept as it is and cblas_sgemm runs.

#include <loom/core/buffer.hpp>
#include <loom/core/memory.hpp>
#include <loom/ops/host/gemm.hpp>

#include <algorithm>
#include <cstring>

namespace loom::ops {

class packed_weight {
 public:
  packed_weight() = default;
  /// Packs w [n, k] (unit stride in dimension 1) for `kernel` (the current one by default; a
  /// kernel this CPU lacks is a loom::error).
  explicit packed_weight(tensor_view<const float, host, 2> w, host_sgemm kernel = host_sgemm_kernel(),
                         memory_resource& mr = default_resource<host>())
      : kernel_(detail::checked_host_sgemm(kernel, "ops::packed_weight")), n_(w.extent(0)), k_(w.extent(1)) {
    LOOM_CHECK(w.stride(1) == 1 || k_ <= 1, "ops::packed_weight: w must have unit stride in dimension 1 (strides ",
               detail::str(w.strides()), ")");
    const index_t ldw = n_ > 1 ? w.stride(0) : k_;
    LOOM_CHECK(ldw >= k_, "ops::packed_weight: w's row stride ", ldw, " is smaller than its ", k_, " columns");
    if (n_ == 0 || k_ == 0) return;
    switch (kernel_) {
#if LOOM_HAS_SGEMM_X86
      case host_sgemm::avx512: pack<detail::sgemm_avx512>(w.data(), ldw, mr); break;
      case host_sgemm::avx2: pack<detail::sgemm_avx2>(w.data(), ldw, mr); break;
#endif
      default:  // BLAS reads the weight as it is: a contiguous copy
        data_ = buffer<float>(static_cast<std::size_t>(n_ * k_), mr);
        for (index_t i = 0; i < n_; ++i) std::memcpy(data_.data() + i * k_, w.data() + i * ldw, static_cast<std::size_t>(k_) * sizeof(float));
    }
  }

  index_t out_features() const noexcept { return n_; }
  index_t in_features() const noexcept { return k_; }
  host_sgemm kernel() const noexcept { return kernel_; }
  /// Bytes of the packed copy (panels are padded to the kernel's width).
  std::size_t bytes() const noexcept { return data_.bytes(); }
  /// Bytes a packed copy of a [n, k] weight takes for `kernel`, without packing one: what a
  /// memory plan counts before any weight is read (the same layouts as the constructor).
  static std::size_t bytes_for(index_t n, index_t k, host_sgemm kernel = host_sgemm_kernel()) {
    kernel = detail::checked_host_sgemm(kernel, "ops::packed_weight::bytes_for");
    if (n == 0 || k == 0) return 0;
    index_t floats = n * k;  // BLAS: a contiguous copy
    switch (kernel) {
#if LOOM_HAS_SGEMM_X86
      case host_sgemm::avx512: floats = detail::sgemm_packed_layout<detail::sgemm_avx512>{n, k}.floats(); break;
      case host_sgemm::avx2: floats = detail::sgemm_packed_layout<detail::sgemm_avx2>{n, k}.floats(); break;
#endif
      default: break;
    }
    return static_cast<std::size_t>(floats) * sizeof(float);
  }
  const float* data() const noexcept { return data_.data(); }

 private:
  template <class K>
  void pack(const float* w, index_t ldw, memory_resource& mr) {
    data_ = buffer<float>(static_cast<std::size_t>(detail::sgemm_packed_layout<K>{n_, k_}.floats()), mr);
    detail::sgemm_pack_weight<K>(w, ldw, n_, k_, data_.data());
  }

  host_sgemm kernel_ = host_sgemm::blas;
  index_t n_ = 0, k_ = 0;
  buffer<float> data_;
};

namespace detail {
/// y's columns split in whole panels (loom's kernels) over the pool, or its rows when there
/// are enough of them; every element computed by one kernel call over all of k.
template <class K>
inline void gemm_prepacked(index_t m, index_t n, index_t k, float alpha, const float* x, index_t ldx, const float* packed,
                           float beta, float* y, index_t ldy) {
  thread_pool& pool = host_pool();
  const index_t panels = sgemm_packed_layout<K>{n, k}.panels();
  const int parts = pool.parts(m * n * k, gemm_min_part_macs);
  const index_t row_tiles = (m + gemm_tile - 1) / gemm_tile;
  if (row_tiles >= parts) {
    pool.parallel_for(parts, 1, [&](int, index_t p0, index_t p1) {
      for (index_t p = p0; p < p1; ++p) {
        const index_t i0 = std::min(m, p * row_tiles / parts * gemm_tile), i1 = std::min(m, (p + 1) * row_tiles / parts * gemm_tile);
        if (i1 > i0) sgemm_prepacked<K>(i1 - i0, n, k, alpha, x + i0 * ldx, ldx, packed, 0, panels, beta, y + i0 * ldy, ldy);
      }
    });
  } else {
    pool.parallel_for(parts, 1, [&](int, index_t p0, index_t p1) {
      for (index_t p = p0; p < p1; ++p) {
        const index_t q0 = p * panels / parts, q1 = (p + 1) * panels / parts;
        if (q1 > q0) sgemm_prepacked<K>(m, n, k, alpha, x, ldx, packed, q0, q1, beta, y, ldy);
      }
    });
  }
}
}  // namespace detail

/// y [m, n] = alpha x [m, k] W^T + beta y for a packed W [n, k] (y overwritten when beta == 0;
/// x and y with unit stride in dimension 1).
inline void gemm(host h, tensor_view<const float, host, 2> x, const packed_weight& w, tensor_view<float, host, 2> y,
                 float alpha = 1.f, float beta = 0.f) {
  const index_t m = x.extent(0), n = w.out_features(), k = w.in_features();
  LOOM_CHECK(x.extent(1) == k, "ops::gemm: x has ", x.extent(1), " features, the packed weight ", k);
  LOOM_CHECK(y.extent(0) == m && y.extent(1) == n, "ops::gemm: y has shape ", detail::str(y.shape()), ", expected [", m,
             ", ", n, "]");
  if (m == 0 || n == 0) return;
  LOOM_CHECK((x.stride(1) == 1 || k <= 1) && (y.stride(1) == 1 || n == 1),
             "ops::gemm: x and y must have unit stride in dimension 1 for a packed weight");
  const index_t ldx = m > 1 ? x.stride(0) : k, ldy = m > 1 ? y.stride(0) : n;
  const bool loom_kernel = w.kernel() != host_sgemm::blas && k > 0 && alpha != 0.f;
#if LOOM_HAS_SGEMM_X86
  if (loom_kernel && w.kernel() == host_sgemm::avx512)
    return detail::gemm_prepacked<detail::sgemm_avx512>(m, n, k, alpha, x.data(), ldx, w.data(), beta, y.data(), ldy);
  if (loom_kernel && w.kernel() == host_sgemm::avx2)
    return detail::gemm_prepacked<detail::sgemm_avx2>(m, n, k, alpha, x.data(), ldx, w.data(), beta, y.data(), ldy);
#endif
  if (w.kernel() != host_sgemm::blas || k == 0) {  // alpha == 0 or k == 0: y = beta y, as BLAS defines it
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) y(i, j) = beta == 0.f ? 0.f : beta * y(i, j);
    return;
  }
  gemm(h, x, make_view(w.data(), n, k).transpose(0, 1), y, alpha, beta);  // BLAS, split over the pool as usual
}

}  // namespace loom::ops
