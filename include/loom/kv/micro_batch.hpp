#pragma once
// micro_batch: a step plan cut into micro-batches of whole chunks, for a model whose layers
// are split into pipeline stages (examples/llama/generate/llama_engine.hpp): while stage s
// runs micro-batch m, stage s + 1 runs m - 1, so the stages work at the same time instead of
// each waiting for the whole step to pass the one before it.
//
// Why whole chunks: a chunk is one sequence's tokens of the step; its rows attend over the
// keys and values the chunk itself appends. Kept whole, each micro-batch is a plan of its own
// (its tokens, qo_indptr and block tables rebased to start at 0), which the paged append and
// attention run unchanged; no sequence appears in two micro-batches, so no micro-batch reads
// keys that another one writes. Why cut by tokens rather than by chunk count: a step mixes
// one-token decode rows with prefill chunks of many tokens, and a stage's time follows its
// tokens.
//
// The whole plan's copy-on-write block copies are not part of any micro-batch: they are made
// once, before the step (kv::engine).

#include <loom/core/error.hpp>
#include <loom/kv/scheduler.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace loom::kv {

/// Chunk boundaries of `p` cut into min(m, chunks) micro-batches (micro-batch k: chunks
/// [bounds[k], bounds[k + 1])), each non-empty, with about the same number of tokens:
/// boundary k is the first chunk that starts at or after k/m of the tokens. The same plan
/// gives the same cut on every rank. `bounds` is reused.
inline void split_micro_batches(const step_plan& p, std::int32_t m, std::vector<std::int32_t>& bounds) {
  LOOM_CHECK(m >= 1, "kv::split_micro_batches: micro-batches must be >= 1, got ", m);
  const auto chunks = static_cast<std::int32_t>(p.chunks.size());
  const std::int32_t n = std::min(m, chunks);
  const std::int64_t tokens = p.num_tokens();
  bounds.assign(1, 0);
  for (std::int32_t k = 1; k < n; ++k) {
    std::int32_t c = bounds.back() + 1;  // at least one chunk in the micro-batch before
    while (c < chunks - (n - k) && static_cast<std::int64_t>(p.qo_indptr[static_cast<std::size_t>(c)]) * n < k * tokens) ++c;
    bounds.push_back(c);  // and at least one for each micro-batch after
  }
  if (chunks > 0) bounds.push_back(chunks);
}

/// The chunks [c0, c1) of `p` as a plan of their own, into `out` (its vectors reused): their
/// chunks, tokens (batch indices counted from c0), qo_indptr and block tables, each rebased
/// to start at 0 (the plan's decode chunks come first, so its num_decode is cut at c0 and c1).
/// No block copies (they belong to the whole step) and no preemptions.
inline void slice_plan(const step_plan& p, std::int32_t c0, std::int32_t c1, step_plan& out) {
  LOOM_CHECK(0 <= c0 && c0 <= c1 && static_cast<std::size_t>(c1) <= p.chunks.size(), "kv::slice_plan: chunks [", c0, ", ",
             c1, ") of a plan of ", p.chunks.size());
  const auto b0 = static_cast<std::size_t>(c0), b1 = static_cast<std::size_t>(c1);
  const auto t0 = static_cast<std::size_t>(p.qo_indptr[b0]), t1 = static_cast<std::size_t>(p.qo_indptr[b1]);
  const auto k0 = static_cast<std::size_t>(p.csr.indptr[b0]), k1 = static_cast<std::size_t>(p.csr.indptr[b1]);
  out.chunks.assign(p.chunks.begin() + c0, p.chunks.begin() + c1);
  out.copies.clear();
  out.preempted.clear();
  out.token_ids.assign(p.token_ids.begin() + static_cast<std::ptrdiff_t>(t0), p.token_ids.begin() + static_cast<std::ptrdiff_t>(t1));
  out.positions.assign(p.positions.begin() + static_cast<std::ptrdiff_t>(t0), p.positions.begin() + static_cast<std::ptrdiff_t>(t1));
  out.batch_indices.resize(t1 - t0);
  for (std::size_t t = t0; t < t1; ++t) out.batch_indices[t - t0] = p.batch_indices[t] - c0;
  out.qo_indptr.resize(b1 - b0 + 1);
  out.csr.indptr.resize(b1 - b0 + 1);
  for (std::size_t b = b0; b <= b1; ++b) {
    out.qo_indptr[b - b0] = p.qo_indptr[b] - static_cast<std::int32_t>(t0);
    out.csr.indptr[b - b0] = p.csr.indptr[b] - static_cast<std::int32_t>(k0);
  }
  out.csr.indices.assign(p.csr.indices.begin() + static_cast<std::ptrdiff_t>(k0), p.csr.indices.begin() + static_cast<std::ptrdiff_t>(k1));
  out.csr.last_page_len.assign(p.csr.last_page_len.begin() + c0, p.csr.last_page_len.begin() + c1);
  out.csr.block_size = p.csr.block_size;
  out.num_decode = std::clamp(p.num_decode - c0, 0, c1 - c0);  // decodes come first
}

}  // namespace loom::kv
