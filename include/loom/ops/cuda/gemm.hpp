#pragma once
// GEMM on a CUDA device through cuBLAS: C[M, N] = alpha * A[M, K] B[K, N] + beta * C on
// row-major device views, in fp32, or bf16 / fp16 operands with fp32 accumulation (and an fp32
// or 16-bit C). The counterpart of ops/host/gemm.hpp's gemm for the cuda tag.
//
// Why plain C++ (.hpp, compiled by g++ or nvcc): nothing here runs on the device; cuBLAS does.
// Row-major views are handed to column-major cuBLAS as their transposes (C^T = B^T A^T), so no
// copy is made; a view that is the transpose of a row-major matrix (strides (1, ld)) is passed
// with the transpose flag instead. The handle is an RAII type bound to one stream: cuBLAS
// handles are not thread-safe, so each thread or rank keeps its own.

#include <loom/core/cuda/cublas_error.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/checks.hpp>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>
#include <utility>

namespace loom::ops {

/// An owned cuBLAS handle, bound to a stream (nullptr: the default stream).
class cublas_handle {
 public:
  explicit cublas_handle(cudaStream_t stream = nullptr) {
    LOOM_CUBLAS_CHECK(cublasCreate(&h_));
    set_stream(stream);
  }
  cublas_handle(cublas_handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  cublas_handle& operator=(cublas_handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;
  ~cublas_handle() { reset(); }

  void set_stream(cudaStream_t stream) { LOOM_CUBLAS_CHECK(cublasSetStream(h_, stream)); }
  cublasHandle_t get() const noexcept { return h_; }

 private:
  void reset() noexcept {
    if (h_) (void)cublasDestroy(h_);
    h_ = nullptr;
  }
  cublasHandle_t h_ = nullptr;
};

namespace detail {
template <class T>
constexpr cudaDataType_t cuda_type() {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<U, bfloat16>) return CUDA_R_16BF;
  else if constexpr (std::is_same_v<U, half>) return CUDA_R_16F;
  else static_assert(sizeof(U) == 0, "ops::gemm(cuda): operands must be float, bfloat16 or half");
}

/// How cuBLAS (column-major) sees a row-major [rows, cols] view: its transpose as is (strides
/// (ld, 1)), or, for the transpose of a row-major matrix (strides (1, ld)), the matrix itself.
struct cublas_operand {
  bool transposed;  // the view is a transpose: pass the matrix with CUBLAS_OP_T
  int ld;
};
template <class V>
cublas_operand cublas_layout(const V& v, const char* what) {
  const index_t r = v.extent(0), c = v.extent(1);
  if (v.stride(1) == 1 && (v.stride(0) >= std::max<index_t>(c, 1) || r <= 1))
    return {false, static_cast<int>(std::max<index_t>(v.stride(0), std::max<index_t>(c, 1)))};
  if (v.stride(0) == 1 && (v.stride(1) >= std::max<index_t>(r, 1) || c <= 1))
    return {true, static_cast<int>(std::max<index_t>(v.stride(1), std::max<index_t>(r, 1)))};
  LOOM_CHECK(false, "ops::gemm(cuda): ", what, " must be row-major or the transpose of a row-major matrix (strides ",
             str(v.strides()), ")");
  return {};
}
}  // namespace detail

/// C[i] = alpha * A[i] B[i] + beta * C[i] for every i of a batch of device matrices, in one
/// cuBLAS call (strided batched): A [batch, M, K], B [batch, K, N], C [batch, M, N]. Each
/// matrix as in gemm() below (A and B row-major or transposed, C row-major); the batch strides
/// are the views' first strides, and A's or B's may be 0: one matrix for the whole batch.
/// Grouped-query attention is one call per layer: a kv head's group of query heads, stacked
/// ([group * seq, head_dim]: the heads of a group are adjacent), against that kv head's keys.
template <class TA, class TB, class TC>
void gemm_batched(cuda, const cublas_handle& handle, tensor_view<TA, cuda, 3> a, tensor_view<TB, cuda, 3> b,
                  tensor_view<TC, cuda, 3> c, float alpha = 1.f, float beta = 0.f) {
  static_assert(std::is_same_v<std::remove_const_t<TA>, std::remove_const_t<TB>>,
                "ops::gemm(cuda): A and B must have the same element type");
  static_assert(std::is_same_v<TC, float> || std::is_same_v<TC, std::remove_const_t<TA>>,
                "ops::gemm(cuda): C must be float or A's element type");
  const char* fn = "ops::gemm(cuda)";
  const index_t batch = a.extent(0), m = a.extent(1), k = a.extent(2), n = b.extent(2);
  LOOM_CHECK(b.extent(0) == batch && c.extent(0) == batch, fn, ": batches differ: A ", batch, ", B ", b.extent(0), ", C ",
             c.extent(0));
  LOOM_CHECK(b.extent(1) == k, fn, ": A is ", detail::str(a.shape()), " and B is ", detail::str(b.shape()), ": inner sizes differ");
  detail::require_shape(c, extents<3>{batch, m, n}, fn, "C");
  LOOM_CHECK(c.stride(2) == 1 && c.stride(1) >= n, fn, ": C must be row-major (strides ", detail::str(c.strides()), ")");
  LOOM_CHECK(batch <= 1 || c.stride(0) >= m * c.stride(1), fn, ": C's matrices overlap (strides ", detail::str(c.strides()), ")");
  LOOM_CHECK(m <= index_t(1) << 31 && n <= index_t(1) << 31 && k <= index_t(1) << 31 && batch <= index_t(1) << 31, fn,
             ": sizes must fit in int, got M=", m, " N=", n, " K=", k, " batch=", batch);
  if (m == 0 || n == 0 || batch == 0) return;
  const auto la = detail::cublas_layout(a[0], "A"), lb = detail::cublas_layout(b[0], "B");
  // Column-major C^T[N, M] = B^T[N, K] A^T[K, M]: cuBLAS's first operand is B.
  LOOM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle.get(), lb.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, la.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b.data(), detail::cuda_type<TB>(), lb.ld,
      static_cast<long long>(b.stride(0)), a.data(), detail::cuda_type<TA>(), la.ld, static_cast<long long>(a.stride(0)), &beta,
      c.data(), detail::cuda_type<TC>(), static_cast<int>(std::max<index_t>(c.stride(1), 1)),
      static_cast<long long>(c.stride(0)), static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// C[M, N] = alpha * A[M, K] B[K, N] + beta * C on device views, accumulated in fp32. A and B
/// (same element type: float, bfloat16 or half) may be transposed views; C (float or A's type)
/// must be row-major. Asynchronous on the handle's stream. (A batch of one.)
template <class TA, class TB, class TC>
void gemm(cuda, const cublas_handle& handle, tensor_view<TA, cuda, 2> a, tensor_view<TB, cuda, 2> b,
          tensor_view<TC, cuda, 2> c, float alpha = 1.f, float beta = 0.f) {
  const auto one = [](auto v) {
    using V = decltype(v);
    return tensor_view<typename V::element_type, cuda, 3>(v.data(), extents<3>{1, v.extent(0), v.extent(1)},
                                                          extents<3>{0, v.stride(0), v.stride(1)});
  };
  gemm_batched(cuda{}, handle, one(a), one(b), one(c), alpha, beta);
}

}  // namespace loom::ops
