#pragma once
// Token sampling on the GPU: kv/sampler.hpp's rules (repetition penalty, temperature, top-k,
// top-p, the draw keyed by (request seed, token position)) for a batch of rows of logits, so
// the engine reads back one token a sequence instead of a row of the vocabulary. The same
// logits, parameters, history and position give the host sampler's token: the arithmetic is
// ops/math/sampling.hpp's on both sides, sums in candidate order, in double.
//
// A block a row:
//   penalty  - the row's history marks its tokens in a byte mask (so a repeated token is
//              penalised once, as on the host), then threads over the vocabulary penalise the
//              marked logits and clear the mask (it stays zero between calls);
//   greedy   - a block argmax (ties: the lower id), no sort;
//   sampling - the row's (logit, id) pairs sorted in candidate order by a bitonic sort over a
//              power-of-two copy in global memory (padding: -inf, id INT32_MAX, after every
//              real candidate), its steps within 4096-element chunks in shared memory, the
//              kept candidates' weights in parallel, then one thread makes the top-p cut and
//              the draw over them in order (ops::math::draw_candidate).
// Cost: the sort is O(V log^2 V) a row and the draw a sequential pass over the kept
// candidates (all of them without top-k); a radix select of the top-k, or of the top-p mass,
// would cut both (not done yet). Any correct sort gives the host's order (ids are unique, so
// candidate order is total), which is why the sort may change without changing a token. Draws u are computed on the host (counter_rng, as the host
// sampler does) and passed with the row's parameters.

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/device.hpp>
#include <loom/core/error.hpp>
#include <loom/core/random.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/kv/sampler.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/sampling.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace loom::kv {
namespace kernels {

inline constexpr unsigned sample_block = 256;
inline constexpr std::int64_t sort_chunk = 4096;  // elements sorted in shared memory at a time: 32 KiB

/// What the kernel reads of a row: its parameters, its draw, its part of the batch's history.
struct sample_row {
  sampling_params params;
  float u = 0.f;                                   ///< the row's uniform draw
  std::int64_t history_begin = 0, history_end = 0;  ///< the row's tokens in the batch's history array
};

/// The sort's length for a vocabulary of n (n >= 1): the smallest power of two >= n.
inline std::int64_t sample_padded(std::int64_t n) {
  return static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(n)));
}

LOOM_KERNEL void __launch_bounds__(sample_block)
    sample_rows(float* __restrict__ logits, std::int32_t vocab, std::int64_t padded, const sample_row* __restrict__ rows,
                const token_id* __restrict__ history, unsigned char* __restrict__ seen, float* __restrict__ keys,
                token_id* __restrict__ ids, double* __restrict__ weights, token_id* __restrict__ out) {
  const unsigned b = blockIdx.x, t = threadIdx.x, step = blockDim.x;
  const sample_row r = rows[b];
  const sampling_params& p = r.params;
  float* row = logits + static_cast<std::int64_t>(b) * vocab;
  if (p.repetition_penalty != 1.f) {
    unsigned char* mask = seen + static_cast<std::int64_t>(b) * vocab;
    for (std::int64_t i = r.history_begin + t; i < r.history_end; i += step) mask[history[i]] = 1;
    __syncthreads();
    for (std::int32_t j = static_cast<std::int32_t>(t); j < vocab; j += static_cast<std::int32_t>(step))
      if (mask[j]) row[j] = ops::math::repetition_penalized(row[j], p.repetition_penalty), mask[j] = 0;
    __syncthreads();
  }
  if (p.greedy()) {  // the first candidate in order
    __shared__ float best_logit[sample_block];
    __shared__ token_id best_id[sample_block];
    float bl = -std::numeric_limits<float>::infinity();
    token_id bi = std::numeric_limits<token_id>::max();
    for (std::int32_t j = static_cast<std::int32_t>(t); j < vocab; j += static_cast<std::int32_t>(step))
      if (ops::math::sampled_before(row[j], j, bl, bi)) bl = row[j], bi = j;
    best_logit[t] = bl, best_id[t] = bi;
    __syncthreads();
    for (unsigned half = sample_block / 2; half > 0; half /= 2) {
      if (t < half && ops::math::sampled_before(best_logit[t + half], best_id[t + half], best_logit[t], best_id[t]))
        best_logit[t] = best_logit[t + half], best_id[t] = best_id[t + half];
      __syncthreads();
    }
    if (t == 0) out[b] = best_id[0];
    return;
  }
  float* key = keys + static_cast<std::int64_t>(b) * padded;
  token_id* id = ids + static_cast<std::int64_t>(b) * padded;
  for (std::int64_t j = t; j < padded; j += step) {
    const bool real = j < vocab;
    key[j] = real ? row[j] : -std::numeric_limits<float>::infinity();
    id[j] = real ? static_cast<token_id>(j) : std::numeric_limits<token_id>::max();
  }
  __syncthreads();
  // Bitonic sort into candidate order: in a run whose bit k is clear the pair (i, i ^ j) is put
  // in order, in the others in reverse, until the last merge (k = padded) orders everything.
  // Steps with j < sort_chunk pair elements of one aligned chunk, so they run in shared memory,
  // chunk after chunk: first every merge up to the chunk's size, then for each larger merge the
  // steps of its j below the chunk. Only the steps with j >= sort_chunk pass through global
  // memory (10 of 120 at a 32000-word vocabulary): each of those is a round trip per element.
  __shared__ float chunk_key[sort_chunk];
  __shared__ token_id chunk_id[sort_chunk];
  const std::int64_t chunk = padded < sort_chunk ? padded : std::int64_t{sort_chunk};
  const auto order = [](float* kk, token_id* ii, std::int64_t i, std::int64_t l, bool up) {  // (i, l) into direction up
    if (ops::math::sampled_before(kk[i], ii[i], kk[l], ii[l]) != up) {
      const float kt = kk[i];
      const token_id it = ii[i];
      kk[i] = kk[l], ii[i] = ii[l], kk[l] = kt, ii[l] = it;
    }
  };
  const auto chunk_steps = [&](std::int64_t c0, std::int64_t k_first, std::int64_t k_last) {
    for (std::int64_t i = t; i < chunk; i += step) chunk_key[i] = key[c0 + i], chunk_id[i] = id[c0 + i];
    __syncthreads();
    for (std::int64_t k = k_first; k <= k_last; k <<= 1)
      for (std::int64_t j = (k < chunk ? k : chunk) >> 1; j > 0; j >>= 1) {
        for (std::int64_t i = t; i < chunk; i += step)
          if ((i ^ j) > i) order(chunk_key, chunk_id, i, i ^ j, ((c0 + i) & k) == 0);
        __syncthreads();
      }
    for (std::int64_t i = t; i < chunk; i += step) key[c0 + i] = chunk_key[i], id[c0 + i] = chunk_id[i];
    __syncthreads();
  };
  for (std::int64_t c0 = 0; c0 < padded; c0 += chunk) chunk_steps(c0, 2, chunk);
  for (std::int64_t k = 2 * chunk; k <= padded; k <<= 1) {
    for (std::int64_t j = k >> 1; j >= chunk; j >>= 1) {
      for (std::int64_t i = t; i < padded; i += step)
        if ((i ^ j) > i) order(key, id, i, i ^ j, (i & k) == 0);
      __syncthreads();
    }
    for (std::int64_t c0 = 0; c0 < padded; c0 += chunk) chunk_steps(c0, k, k);
  }
  const std::int32_t keep = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  double* w = weights + static_cast<std::int64_t>(b) * padded;
  const double max = key[0];
  for (std::int32_t i = static_cast<std::int32_t>(t); i < keep; i += static_cast<std::int32_t>(step))
    w[i] = ops::math::sampling_weight(key[i], max, p.temperature);
  __syncthreads();
  if (t == 0) out[b] = id[ops::math::draw_candidate(w, keep, p.top_p, r.u)];
}

}  // namespace kernels

/// Device scratch of sample(): the rows' parameters and history, the penalty's byte mask (kept
/// zero between calls), and the sort's keys, ids and weights; host staging of the first two.
struct sampling_workspace {
  buffer<kernels::sample_row, cuda> rows;
  buffer<token_id, cuda> history;
  buffer<unsigned char, cuda> seen;
  buffer<float, cuda> keys;
  buffer<token_id, cuda> ids;
  buffer<double, cuda> weights;
  std::vector<kernels::sample_row> host_rows;
  std::vector<token_id> host_history;

  explicit sampling_workspace(memory_resource& r = default_resource<cuda>())
      : rows(0, r), history(0, r), seen(0, r), keys(0, r), ids(0, r), weights(0, r), mr_(&r) {}

  /// Room for `batch` rows of `vocab` logits (padded to a power of two) and `tokens` of history.
  void reserve(std::int64_t batch, std::int64_t vocab, std::size_t tokens, cudaStream_t stream) {
    const auto n = static_cast<std::size_t>(batch), padded = static_cast<std::size_t>(kernels::sample_padded(vocab));
    grow(rows, n), grow(history, std::max<std::size_t>(tokens, 1));
    if (seen.size() < n * static_cast<std::size_t>(vocab)) {
      seen = buffer<unsigned char, cuda>(n * static_cast<std::size_t>(vocab), *mr_);
      LOOM_CUDA_CHECK(cudaMemsetAsync(seen.data(), 0, seen.size(), stream));
    }
    grow(keys, n * padded), grow(ids, n * padded), grow(weights, n * padded);
  }

 private:
  template <class T>
  void grow(buffer<T, cuda>& b, std::size_t n) {
    if (b.size() < n) b = buffer<T, cuda>(n, *mr_);
  }
  memory_resource* mr_;
};

/// out[b] = the token kv::sampler::sample picks from row b of `logits` [batch, vocab] with
/// params[b], histories[b] (the prompt and the tokens generated so far; read only with a
/// repetition penalty) and positions[b]. The penalty changes the logits in place, as the host
/// sampler's. Asynchronous on `stream`; the host data is read before return (copies from
/// pageable memory are staged by the runtime), so the workspace may be reused at once.
inline void sample(cuda, tensor_view<float, cuda, 2> logits, std::span<const sampling_params> params,
                   std::span<const std::span<const token_id>> histories, std::span<const std::int64_t> positions,
                   tensor_view<token_id, cuda, 1> out, sampling_workspace& ws, cudaStream_t stream = nullptr) {
  const char* fn = "kv::sample(cuda)";
  const std::int64_t batch = logits.extent(0), v = logits.extent(1);
  LOOM_CHECK(logits.is_contiguous(), fn, ": logits must be contiguous");
  LOOM_CHECK(v >= 1 && v <= std::int64_t(1) << 30, fn, ": vocab=", v, " outside [1, 2^30]");
  LOOM_CHECK(static_cast<std::int64_t>(params.size()) == batch && static_cast<std::int64_t>(histories.size()) == batch &&
                 static_cast<std::int64_t>(positions.size()) == batch && out.extent(0) == batch,
             fn, ": ", batch, " rows of logits, ", params.size(), " params, ", histories.size(), " histories, ",
             positions.size(), " positions, ", out.extent(0), " outputs");
  LOOM_CHECK(out.is_contiguous(), fn, ": out must be contiguous");
  if (batch == 0) return;
  ws.host_rows.assign(static_cast<std::size_t>(batch), {});
  ws.host_history.clear();
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto& p = params[static_cast<std::size_t>(b)];
    p.validate();
    auto& r = ws.host_rows[static_cast<std::size_t>(b)];
    r.params = p;
    r.u = counter_rng(p.seed, sampling_stream).uniform(static_cast<std::uint64_t>(positions[static_cast<std::size_t>(b)]));
    r.history_begin = static_cast<std::int64_t>(ws.host_history.size());
    if (p.repetition_penalty != 1.f)
      for (token_id tok : histories[static_cast<std::size_t>(b)]) {
        LOOM_CHECK(tok >= 0 && tok < v, fn, ": history token ", tok, " of row ", b, " outside the vocabulary of ", v);
        ws.host_history.push_back(tok);
      }
    r.history_end = static_cast<std::int64_t>(ws.host_history.size());
  }
  ws.reserve(batch, v, ws.host_history.size(), stream);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.rows.data(), ws.host_rows.data(), ws.host_rows.size() * sizeof(kernels::sample_row),
                                  cudaMemcpyHostToDevice, stream));
  if (!ws.host_history.empty())
    LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.history.data(), ws.host_history.data(), ws.host_history.size() * sizeof(token_id),
                                    cudaMemcpyHostToDevice, stream));
  LOOM_LAUNCH(kernels::sample_rows, static_cast<unsigned>(batch), kernels::sample_block, 0, stream)
  (logits.data(), static_cast<std::int32_t>(v), kernels::sample_padded(v), ws.rows.data(), ws.history.data(), ws.seen.data(),
   ws.keys.data(), ws.ids.data(), ws.weights.data(), out.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::kv
