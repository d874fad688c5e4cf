#pragma once
// Softmax cross-entropy on a CUDA device, averaged over the targets that are not ignored.
// Mirror of ops/host/cross_entropy.hpp (same names and meaning; the cuda tag, a workspace and
// a stream added). The element math (log-sum-exp, the gradient element, ops::exp) is
// ops/math/softmax.hpp's, the functions the host kernels call; the row maximum and sum are CUB
// block reductions (one block per row).
//
// Why a workspace and a synchronisation in forward: the host version throws on a target
// outside [0, vocab) and returns the mean loss. Here the targets live on the device, so the
// forward counts them and finds the first bad one on the device, then waits for the stream and
// reports either as the host does. Backward does not wait: it recounts on the device and
// skips a bad target (no write outside the row); forward, which precedes it, reported it.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/cuda/reduce.cuh>
#include <loom/ops/math/softmax.hpp>

#include <concepts>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/ops/checks.hpp>
#include <cuda_runtime.h>

namespace loom::ops {

namespace kernels {

template <class Tgt>
__global__ void __launch_bounds__(row_block) count_targets(const Tgt* __restrict__ targets, index_t n, index_t vocab,
                                                           std::int64_t ignore, unsigned long long* stats) {
  unsigned long long count = 0;
  for (index_t i = threadIdx.x; i < n; i += row_block) {
    const auto t = static_cast<std::int64_t>(targets[i]);
    if (t == ignore) continue;
    if (t >= 0 && t < vocab)
      ++count;
    else
      atomicMin(stats + 1, static_cast<unsigned long long>(i));
  }
  const unsigned long long total = block_sum(count);
  if (threadIdx.x == 0) stats[0] = total;
}

/// One block per row: lse, the row's loss term and (dlogits non-null) the gradient of the mean.
template <class T, class Tgt>
__global__ void __launch_bounds__(row_block)
    cross_entropy_rows(const T* __restrict__ logits, const Tgt* __restrict__ targets, T* __restrict__ lse,
                       float* __restrict__ row_loss, T* __restrict__ dlogits, const unsigned long long* stats, index_t v,
                       std::int64_t ignore) {
  const T* x = logits + blockIdx.x * v;
  T mx = x[0];
  for (index_t j = threadIdx.x; j < v; j += row_block) mx = x[j] > mx ? x[j] : mx;
  mx = block_max(mx);
  T sum = 0;
  for (index_t j = threadIdx.x; j < v; j += row_block) sum += ops::exp(x[j] - mx);
  const T l = math::log_sum_exp(mx, block_sum(sum));
  const auto t = static_cast<std::int64_t>(targets[blockIdx.x]);
  const bool counted = t != ignore && t >= 0 && t < v;
  if (threadIdx.x == 0) {
    lse[blockIdx.x] = l;
    row_loss[blockIdx.x] = counted ? static_cast<float>(l - x[t]) : 0.f;
  }
  if (!dlogits) return;
  const T scale = stats[0] ? T(1) / T(stats[0]) : T(0);
  T* g = dlogits + blockIdx.x * v;
  for (index_t j = threadIdx.x; j < v; j += row_block) {
    g[j] = counted ? math::cross_entropy_grad(x[j], l, scale) : T(0);
    if (counted && j == t) g[j] -= scale;
  }
}

LOOM_KERNEL void __launch_bounds__(row_block) mean_loss(const float* __restrict__ row_loss, index_t n,
                                                       const unsigned long long* stats, float* loss) {
  double s = 0;
  for (index_t i = threadIdx.x; i < n; i += row_block) s += row_loss[i];
  const double total = block_sum(s);
  if (threadIdx.x == 0) *loss = stats[0] ? static_cast<float>(total / double(stats[0])) : 0.f;
}

template <class T, class Tgt>
__global__ void __launch_bounds__(row_block)
    cross_entropy_backward(const T* __restrict__ logits, const Tgt* __restrict__ targets, const T* __restrict__ lse,
                           T* __restrict__ dlogits, const unsigned long long* stats, index_t v, T dloss,
                           std::int64_t ignore, bool accumulate) {
  const T* x = logits + blockIdx.x * v;
  T* g = dlogits + blockIdx.x * v;
  const auto t = static_cast<std::int64_t>(targets[blockIdx.x]);
  const bool counted = t != ignore && t >= 0 && t < v;
  const T scale = stats[0] ? dloss / T(stats[0]) : T(0);
  const T l = lse[blockIdx.x];
  for (index_t j = threadIdx.x; j < v; j += row_block) {
    if (!counted) {
      if (!accumulate) g[j] = T(0);
      continue;
    }
    T gj = accumulate ? g[j] + math::cross_entropy_grad(x[j], l, scale) : math::cross_entropy_grad(x[j], l, scale);
    if (j == t) gj -= scale;
    g[j] = gj;
  }
}

// Vocab-parallel cross-entropy (nn/tp/cross_entropy.hpp's steps, on the device): this rank
// holds columns [first, first + vl) of every row; the caller all-reduces what each step makes
// (the row maxima, then the sums and target logits) and forms lse = max + log(sum) between them.

/// One block per row: the row's largest local logit (-inf for an empty shard).
template <class T>
__global__ void __launch_bounds__(row_block)
    vocab_parallel_row_max(const T* __restrict__ logits, index_t vl, T* __restrict__ row_max) {
  const T* x = logits + blockIdx.x * vl;
  T mx = -INFINITY;
  for (index_t j = threadIdx.x; j < vl; j += row_block) mx = x[j] > mx ? x[j] : mx;
  mx = block_max(mx);
  if (threadIdx.x == 0) row_max[blockIdx.x] = mx;
}

/// One block per row: sums[2 row] = sum_j e^(x_j - row_max) over the local columns,
/// sums[2 row + 1] = the target's logit when this rank holds it (else 0).
template <class T, class Tgt>
__global__ void __launch_bounds__(row_block)
    vocab_parallel_row_sums(const T* __restrict__ logits, const Tgt* __restrict__ targets, index_t vl, index_t first,
                            const T* __restrict__ row_max, T* __restrict__ sums, std::int64_t ignore) {
  const T* x = logits + blockIdx.x * vl;
  const T m = row_max[blockIdx.x];
  T s = 0;
  for (index_t j = threadIdx.x; j < vl; j += row_block) s += ops::exp(x[j] - m);
  s = block_sum(s);
  if (threadIdx.x != 0) return;
  const auto t = static_cast<std::int64_t>(targets[blockIdx.x]);
  sums[2 * blockIdx.x] = s;
  sums[2 * blockIdx.x + 1] = t != ignore && t >= first && t < first + vl ? x[t - first] : T(0);
}

/// One block per row: dlogits_local += scale (softmax - onehot(target)) over the local
/// columns (rows whose target is ignore_index untouched); lse from the all-reduced sums.
template <class T, class Tgt>
__global__ void __launch_bounds__(row_block)
    vocab_parallel_backward(const T* __restrict__ logits, const Tgt* __restrict__ targets, const T* __restrict__ lse,
                            T* __restrict__ dlogits, index_t vl, index_t first, T scale, std::int64_t ignore) {
  const auto t = static_cast<std::int64_t>(targets[blockIdx.x]);
  if (t == ignore) return;  // the whole block
  const T* x = logits + blockIdx.x * vl;
  T* g = dlogits + blockIdx.x * vl;
  const T l = lse[blockIdx.x];
  for (index_t j = threadIdx.x; j < vl; j += row_block) {
    T gj = g[j] + math::cross_entropy_grad(x[j], l, scale);
    if (j == t - first) gj -= scale;
    g[j] = gj;
  }
}

}  // namespace kernels

/// Device scratch of the cross-entropy kernels for up to `rows` rows: each row's loss, the
/// count of targets and the position of the first bad one, and the mean loss.
struct cross_entropy_workspace {
  buffer<float, cuda> row_loss;          // [rows]
  buffer<unsigned long long, cuda> stats;  // [0] counted targets, [1] first bad position (rows: none)
  buffer<float, cuda> loss;              // [1]
  explicit cross_entropy_workspace(index_t rows, memory_resource& r = default_resource<cuda>())
      : row_loss(static_cast<std::size_t>(rows), r), stats(2, r), loss(1, r) {}
};

namespace detail {
template <class T, class Tgt>
void check_cross_entropy(const tensor_view<const T, cuda, 2>& logits, const tensor_view<Tgt, cuda, 1>& targets,
                         index_t lse_rows, const cross_entropy_workspace& ws, const char* fn) {
  const index_t n = logits.extent(0);
  require_contiguous(logits, fn, "logits");
  require_shape(targets, extents<1>{n}, fn, "targets");
  LOOM_CHECK(lse_rows == n, fn, ": lse has ", lse_rows, " rows, logits ", n);
  LOOM_CHECK(logits.extent(1) > 0, fn, ": vocabulary size must be > 0, got vocab=", logits.extent(1));
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  LOOM_CHECK(static_cast<index_t>(ws.row_loss.size()) >= n, fn, ": the workspace holds ", ws.row_loss.size(),
             " rows, needs ", n);
}

/// Counts the targets on the device (stats[0]; stats[1]: first bad position, else rows).
template <class Tgt>
void count_targets(tensor_view<Tgt, cuda, 1> targets, index_t vocab, std::int64_t ignore, cross_entropy_workspace& ws,
                   cudaStream_t stream) {
  const unsigned long long init[2] = {0, static_cast<unsigned long long>(targets.numel())};
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.stats.data(), init, sizeof init, cudaMemcpyHostToDevice, stream));
  LOOM_LAUNCH(kernels::count_targets, 1, kernels::row_block, 0, stream)(targets.data(), targets.numel(), vocab, ignore,
                                                                       ws.stats.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}
}  // namespace detail

/// Mean loss; logits: [rows, vocab]; targets: [rows]; lse: [rows] (saved for backward); and,
/// when `dlogits` has data, dlogits = d(mean loss)/dlogits (dloss = 1, written: the host's
/// cross_entropy_forward_backward). Waits for `stream`; a target outside [0, vocab) that is
/// not ignore_index is a loom::error naming it.
template <compute_type T, class Tgt>
requires std::integral<std::remove_const_t<Tgt>>
T cross_entropy_forward(cuda, device_in_view<T, 2> logits, tensor_view<Tgt, cuda, 1> targets,
                        tensor_view<T, cuda, 1> lse, cross_entropy_workspace& ws, tensor_view<T, cuda, 2> dlogits = {},
                        cross_entropy_options opt = {}, cudaStream_t stream = nullptr) {
  const char* fn = "ops::cross_entropy_forward(cuda)";
  const index_t n = logits.extent(0), v = logits.extent(1);
  detail::check_cross_entropy(logits, targets, lse.extent(0), ws, fn);
  if (dlogits.data()) {
    detail::require_contiguous(dlogits, fn, "dlogits");
    detail::require_shape(dlogits, logits.shape(), fn, "dlogits");
  }
  if (n == 0) return T(0);
  detail::count_targets(targets, v, opt.ignore_index, ws, stream);
  LOOM_LAUNCH(kernels::cross_entropy_rows, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      logits.data(), targets.data(), lse.data(), ws.row_loss.data(), dlogits.data(), ws.stats.data(), v, opt.ignore_index);
  LOOM_CUDA_CHECK(cudaGetLastError());
  LOOM_LAUNCH(kernels::mean_loss, 1,
              kernels::row_block, 0, stream)(ws.row_loss.data(), n, ws.stats.data(), ws.loss.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
  unsigned long long stats[2];
  float loss = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(stats, ws.stats.data(), sizeof stats, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&loss, ws.loss.data(), sizeof loss, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (stats[1] < static_cast<unsigned long long>(n)) {
    std::remove_const_t<Tgt> bad{};
    LOOM_CUDA_CHECK(cudaMemcpy(&bad, targets.data() + stats[1], sizeof bad, cudaMemcpyDeviceToHost));
    LOOM_CHECK(false, fn, ": target ", static_cast<std::int64_t>(bad), " at position ", stats[1],
               " is outside the vocabulary [0, ", v, ") and is not ignore_index=", opt.ignore_index);
  }
  return static_cast<T>(loss);
}

/// dlogits += d(dloss * mean loss)/dlogits (dlogits = ... when !accumulate); shapes as in
/// forward. Asynchronous.
template <compute_type T, class Tgt>
requires std::integral<std::remove_const_t<Tgt>>
void cross_entropy_backward(cuda, device_in_view<T, 2> logits, tensor_view<Tgt, cuda, 1> targets, device_in_view<T, 1> lse, tensor_view<T, cuda, 2> dlogits,
                            cross_entropy_workspace& ws, T dloss = T(1), cross_entropy_options opt = {},
                            bool accumulate = true, cudaStream_t stream = nullptr) {
  const char* fn = "ops::cross_entropy_backward(cuda)";
  const index_t n = logits.extent(0), v = logits.extent(1);
  detail::check_cross_entropy(logits, targets, lse.extent(0), ws, fn);
  detail::require_contiguous(dlogits, fn, "dlogits");
  detail::require_shape(dlogits, logits.shape(), fn, "dlogits");
  if (n == 0) return;
  detail::count_targets(targets, v, opt.ignore_index, ws, stream);
  LOOM_LAUNCH(kernels::cross_entropy_backward, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      logits.data(), targets.data(), lse.data(), dlogits.data(), ws.stats.data(), v, dloss, opt.ignore_index, accumulate);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// The vocab-parallel steps (kernels above; nn/tp/cross_entropy.hpp composes them with its
/// all-reduces): logits_local [rows, vl] are columns [first, first + vl) of the vocabulary.
/// row_max [rows] = each row's local maximum. Asynchronous.
template <compute_type T>
void vocab_parallel_row_max(cuda, device_in_view<T, 2> logits_local, tensor_view<T, cuda, 1> row_max,
                            cudaStream_t stream = nullptr) {
  const char* fn = "ops::vocab_parallel_row_max(cuda)";
  const index_t n = logits_local.extent(0);
  detail::require_contiguous(logits_local, fn, "logits_local");
  detail::require_shape(row_max, extents<1>{n}, fn, "row_max");
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::vocab_parallel_row_max, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      logits_local.data(), logits_local.extent(1), row_max.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// sums [rows, 2] = (sum_j e^(x_j - row_max), the target's logit if held here, else 0), with
/// row_max the all-reduced maximum. Targets are not checked here (the layer counts them).
template <compute_type T, class Tgt>
  requires std::integral<std::remove_const_t<Tgt>>
void vocab_parallel_row_sums(cuda, device_in_view<T, 2> logits_local, tensor_view<Tgt, cuda, 1> targets, index_t first,
                             device_in_view<T, 1> row_max, tensor_view<T, cuda, 2> sums, cross_entropy_options opt = {},
                             cudaStream_t stream = nullptr) {
  const char* fn = "ops::vocab_parallel_row_sums(cuda)";
  const index_t n = logits_local.extent(0);
  detail::require_contiguous(logits_local, fn, "logits_local");
  detail::require_shape(targets, extents<1>{n}, fn, "targets");
  detail::require_shape(row_max, extents<1>{n}, fn, "row_max");
  detail::require_shape(sums, extents<2>{n, 2}, fn, "sums");
  detail::require_contiguous(sums, fn, "sums");
  LOOM_CHECK(first >= 0, fn, ": first must be >= 0, got first=", first);
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::vocab_parallel_row_sums, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      logits_local.data(), targets.data(), logits_local.extent(1), first, row_max.data(), sums.data(), opt.ignore_index);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// dlogits_local += scale (softmax - onehot(target)) on this rank's columns, lse [rows] the
/// full rows' log-sum-exp (scale: dloss / counted targets). Asynchronous.
template <compute_type T, class Tgt>
  requires std::integral<std::remove_const_t<Tgt>>
void vocab_parallel_backward(cuda, device_in_view<T, 2> logits_local, tensor_view<Tgt, cuda, 1> targets, index_t first,
                             device_in_view<T, 1> lse, tensor_view<T, cuda, 2> dlogits_local, T scale,
                             cross_entropy_options opt = {}, cudaStream_t stream = nullptr) {
  const char* fn = "ops::vocab_parallel_backward(cuda)";
  const index_t n = logits_local.extent(0);
  detail::require_contiguous(logits_local, fn, "logits_local");
  detail::require_shape(targets, extents<1>{n}, fn, "targets");
  detail::require_shape(lse, extents<1>{n}, fn, "lse");
  detail::require_shape(dlogits_local, logits_local.shape(), fn, "dlogits_local");
  detail::require_contiguous(dlogits_local, fn, "dlogits_local");
  LOOM_CHECK(n <= kernels::grid_cap, fn, ": rows=", n, " above the supported ", kernels::grid_cap);
  if (n == 0) return;
  LOOM_LAUNCH(kernels::vocab_parallel_backward, static_cast<unsigned>(n), kernels::row_block, 0, stream)(
      logits_local.data(), targets.data(), lse.data(), dlogits_local.data(), logits_local.extent(1), first, scale,
      opt.ignore_index);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
