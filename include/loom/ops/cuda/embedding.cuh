#pragma once
// Token embedding on a CUDA device: the gather of table rows and its backward, the scatter-add
// into the table's gradient. Mirror of ops/host/embedding.hpp (same names and meaning; the cuda
// tag, a small workspace and a stream added).
//
// Why the backward has no atomics: a float atomicAdd per element would add a token's rows in
// whatever order the threads arrive, so the gradient would change from run to run. Here each
// thread owns one column of the rows of one residue class of token ids (id % buckets) and
// walks the tokens in order, adding only its class's rows: every element of dtable is summed
// in token order by one thread, the host's order, so the result is the host's to the bit and
// the same on every run. The buckets only widen the grid (columns x buckets threads); a
// thread reads every token id (one broadcast load per warp) and only its class's rows.
//
// Why forward waits: the host version throws on an id outside the vocabulary. The ids live on
// the device, so the kernel records the first bad position (and writes a zero row there), then
// forward waits for the stream and reports it as the host does. Backward does not wait: it
// skips a bad id (no write outside the table); forward, which precedes it, reported it.

#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/load.hpp>

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/ops/checks.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <type_traits>

namespace loom::ops {

namespace kernels {

template <class Tok, class P, class T>
__global__ void embedding_forward(const Tok* __restrict__ tokens, const P* __restrict__ table, T* __restrict__ out,
                                  index_t n, index_t vocab, index_t d, unsigned long long* first_bad) {
  for (index_t e = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; e < n * d;
       e += static_cast<index_t>(blockDim.x) * gridDim.x) {
    const index_t i = e / d, j = e % d;
    const auto tok = static_cast<std::int64_t>(tokens[i]);
    if (tok >= 0 && tok < vocab) {
      out[e] = load<T>(table[tok * d + j]);
    } else {
      out[e] = T(0);
      if (j == 0) atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

/// Classes of token ids embedding_backward's threads split the rows into: enough threads
/// (buckets x columns) to fill a large GPU, never more classes than ids.
inline index_t embedding_buckets(index_t vocab, index_t d) {
  constexpr index_t target_threads = index_t{1} << 17;
  return std::clamp<index_t>((target_threads + d - 1) / d, 1, std::max<index_t>(vocab, 1));
}

/// Thread (bucket b, column j) adds, in token order, row i of dout into dtable[tokens[i]] for
/// every token whose id is b modulo `buckets`.
template <class Tok, class T>
__global__ void embedding_backward(const Tok* __restrict__ tokens, const T* __restrict__ dout, T* __restrict__ dtable,
                                   index_t n, index_t vocab, index_t d, index_t buckets) {
  const index_t t = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x;
  if (t >= buckets * d) return;
  const index_t b = t / d, j = t % d;
  for (index_t i = 0; i < n; ++i) {
    const auto tok = static_cast<std::int64_t>(tokens[i]);
    if (tok < 0 || tok >= vocab || tok % buckets != b) continue;
    dtable[tok * d + j] += dout[i * d + j];
  }
}

}  // namespace kernels

/// Device scratch of embedding_forward: the position of the first id outside the vocabulary.
struct embedding_workspace {
  buffer<unsigned long long, cuda> first_bad;  // [1]; the row count when every id is good
  explicit embedding_workspace(memory_resource& r = default_resource<cuda>()) : first_bad(1, r) {}
};

/// out[n, :] = table[tokens[n], :]; tokens: [n], table: [vocab, dim], out: [n, dim]. Waits for
/// `stream`; an id outside [0, vocab) is a loom::error naming it and its position.
template <compute_type T, class P, class Token>
  requires param_type<std::remove_const_t<P>> && std::integral<std::remove_const_t<Token>>
void embedding_forward(cuda, tensor_view<Token, cuda, 1> tokens, tensor_view<P, cuda, 2> table, tensor_view<T, cuda, 2> out,
                       embedding_workspace& ws, cudaStream_t stream = nullptr) {
  const char* fn = "ops::embedding_forward(cuda)";
  const index_t n = tokens.numel(), v = table.extent(0), d = table.extent(1);
  detail::require_contiguous(tokens, fn, "tokens"), detail::require_contiguous(table, fn, "table");
  detail::require_contiguous(out, fn, "out");
  detail::require_shape(out, extents<2>{n, d}, fn, "out");
  if (n == 0 || d == 0) return;
  unsigned long long bad = static_cast<unsigned long long>(n);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.first_bad.data(), &bad, sizeof bad, cudaMemcpyHostToDevice, stream));
  LOOM_LAUNCH(kernels::embedding_forward, kernels::grid_for(n * d, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      tokens.data(), table.data(), out.data(), n, v, d, ws.first_bad.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&bad, ws.first_bad.data(), sizeof bad, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad < static_cast<unsigned long long>(n)) {
    std::remove_const_t<Token> tok{};
    LOOM_CUDA_CHECK(cudaMemcpy(&tok, tokens.data() + bad, sizeof tok, cudaMemcpyDeviceToHost));
    LOOM_CHECK(false, fn, ": token id ", static_cast<std::int64_t>(tok), " at position ", bad,
               " is outside the vocabulary [0, ", v, ")");
  }
}

/// dtable[tokens[n], :] += dout[n, :], summed in token order (the host's bits). Asynchronous;
/// an id outside the vocabulary is skipped (embedding_forward reports it).
template <compute_type T, class Token>
  requires std::integral<std::remove_const_t<Token>>
void embedding_backward(cuda, tensor_view<Token, cuda, 1> tokens, device_in_view<T, 2> dout, tensor_view<T, cuda, 2> dtable,
                        cudaStream_t stream = nullptr) {
  const char* fn = "ops::embedding_backward(cuda)";
  const index_t n = tokens.numel(), v = dtable.extent(0), d = dtable.extent(1);
  detail::require_contiguous(tokens, fn, "tokens");
  detail::require_contiguous(dout, fn, "dout"), detail::require_contiguous(dtable, fn, "dtable");
  detail::require_shape(dout, extents<2>{n, d}, fn, "dout");
  if (n == 0 || d == 0) return;
  const index_t buckets = kernels::embedding_buckets(v, d);
  const index_t threads = buckets * d;
  LOOM_CHECK(threads / kernels::elementwise_block < kernels::grid_cap, fn, ": dim=", d, " above the supported ",
             kernels::grid_cap * index_t{kernels::elementwise_block});
  LOOM_LAUNCH(kernels::embedding_backward, kernels::grid_for(threads, kernels::elementwise_block),
              kernels::elementwise_block, 0, stream)(
      tokens.data(), dout.data(), dtable.data(), n, v, d, buckets);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::ops
