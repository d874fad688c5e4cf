#pragma once
// Paged attention on the host: append keys/values to the paged pool, then attend over it, for
// prefill (many query tokens per sequence, causal) and decode (one query token per sequence),
// with grouped-query heads (num_heads a multiple of num_kv_heads; query head h reads kv head
// h / (num_heads / num_kv_heads)).
//
// Why these names and arguments: they are FlashInfer's (append_paged_kv_cache,
// batch_prefill_with_paged_kv_cache, batch_decode_with_paged_kv_cache, ragged queries by
// qo_indptr, the cache by a paged_kv_csr) overloaded on the device tag, so the CUDA backend
// (kv/cuda/*.cuh) slots in under the same names. Queries are the last q_len tokens of their
// sequence: query i of a sequence with kv_len keys sits at position kv_len - q_len + i and
// sees keys 0..that position. Softmax is computed online (running max and sum, one pass over
// the keys, float accumulation) so that nothing is allocated per call; the same dot product
// and softmax step serve the contiguous-KV reference of the tests (attend_row), which
// therefore agrees with the paged kernel bit for bit.

#include <loom/core/device.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/ops/math/softmax.hpp>  // the online-softmax update, shared with the GPU kernels

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::kv {

namespace detail {
/// q . k over head_dim elements in one fixed order: eight running partial sums (independent,
/// so they fill vector lanes without reassociation), then a fixed pairwise sum. The paged
/// kernels and attend_row share it and the softmax step below, so they agree bit for bit.
template <class K>
inline float dot(const float* q, const K* k, std::int32_t head_dim) {
  float part[8] = {};
  std::int32_t d = 0;
  for (; d + 8 <= head_dim; d += 8)
    for (int i = 0; i < 8; ++i) part[i] += q[d + i] * static_cast<float>(k[d + i]);
  for (; d < head_dim; ++d) part[0] += q[d] * static_cast<float>(k[d]);
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

/// One key of online softmax: score s (scaled), running max m and sum l, acc += p v.
template <class V>
inline void softmax_step(float s, const V* v, std::int32_t head_dim, float& m, float& l, float* acc) {
  float p, c;
  if (ops::math::online_softmax_push(s, m, l, p, c))  // rescale what was accumulated under the old max
    for (std::int32_t d = 0; d < head_dim; ++d) acc[d] *= c;
  for (std::int32_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}
}  // namespace detail

/// One query head attends over n keys: out[d] = sum_j softmax(scale * q.k_j)_j v_j[d].
/// key(j) / value(j) return pointers to head_dim elements (any element type convertible to
/// float). `acc` is scratch of head_dim floats.
template <class KeyAt, class ValueAt>
inline void attend_row(const float* q, std::int64_t n, std::int32_t head_dim, float scale, KeyAt&& key,
                       ValueAt&& value, float* acc, float* out) {
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  for (std::int32_t d = 0; d < head_dim; ++d) acc[d] = 0.f;
  for (std::int64_t j = 0; j < n; ++j) detail::softmax_step(detail::dot(q, key(j), head_dim) * scale, value(j), head_dim, m, l, acc);
  const float inv = n > 0 ? 1.f / l : 0.f;
  for (std::int32_t d = 0; d < head_dim; ++d) out[d] = acc[d] * inv;
}

namespace detail {
// Shapes as text for messages (loom::error's streaming does not find extents' operator<< by ADL).
template <std::size_t R>
std::string shape_str(const extents<R>& e) {
  std::ostringstream os;
  ::loom::operator<<(os, e);
  return os.str();
}

template <class T>
void check_attention_shapes(const char* fn, const tensor_view<const T, host, 5>& cache, std::int64_t num_heads,
                            std::int64_t head_dim, const paged_kv_csr& csr) {
  LOOM_CHECK(cache.extent(1) == 2, fn, ": cache dimension 1 must be 2 (keys, values), got ", cache.extent(1));
  LOOM_CHECK(cache.extent(2) == csr.block_size, fn, ": cache block_size=", cache.extent(2),
             " differs from csr.block_size=", csr.block_size);
  LOOM_CHECK(cache.extent(4) == head_dim, fn, ": cache head_dim=", cache.extent(4), " differs from query head_dim=",
             head_dim);
  LOOM_CHECK(num_heads % cache.extent(3) == 0, fn, ": num_heads (", num_heads,
             ") must be a multiple of num_kv_heads (", cache.extent(3), ")");
  LOOM_CHECK(static_cast<std::int32_t>(csr.indptr.size()) == csr.batch() + 1, fn, ": csr.indptr has ",
             csr.indptr.size(), " entries for a batch of ", csr.batch());
  LOOM_CHECK(head_dim <= 1024, fn, ": head_dim=", head_dim, " above the supported 1024");
  LOOM_CHECK(cache.is_contiguous(), fn, ": the cache view must be contiguous");
  for (std::int32_t b : csr.indices)
    LOOM_CHECK(b >= 0 && b < cache.extent(0), fn, ": block id ", b, " out of range [0, ", cache.extent(0), ")");
}

// Queries rows [row0, row0 + q_len) of sequence b attend over its paged keys and values.
// Keys are the outer loop and a group of heads the inner one, so each token's keys and values
// (all heads, one contiguous row) are read once per group, front to back, as they lie in the
// block; per head the arithmetic is attend_row's, step for step. `scratch`: scratch_floats.
inline constexpr std::int64_t scratch_floats = 2048;  // head_dim <= 1024: at least one head per pass
template <class T>
void attend_sequence(const tensor_view<const float, host, 3>& q, const tensor_view<const T, host, 5>& cache,
                     const paged_kv_csr& csr, std::int32_t b, std::int64_t row0, std::int64_t q_len, bool causal,
                     float scale, float* scratch, const tensor_view<float, host, 3>& out) {
  const std::int64_t nh = q.extent(1), group = nh / cache.extent(3), kv_len = csr.kv_len(b);
  const auto dim = static_cast<std::int32_t>(q.extent(2));
  const std::int32_t bs = csr.block_size;
  LOOM_CHECK(q_len >= 0 && q_len <= kv_len, "paged attention: sequence ", b, " has q_len=", q_len,
             " above kv_len=", kv_len);
  const std::int32_t* pages = csr.indices.data() + csr.indptr[b];
  const std::int64_t block_stride = cache.stride(0), token_stride = cache.stride(2), kv_half = cache.stride(1);
  const std::int64_t kv_head_stride = cache.stride(3);
  // heads per pass: their accumulators fit the scratch, with a running max and sum each
  const std::int64_t per_pass = scratch_floats / (dim + 2);
  float* acc = scratch;
  for (std::int64_t i = 0; i < q_len; ++i) {
    const std::int64_t row = row0 + i;
    const std::int64_t n = causal ? kv_len - q_len + i + 1 : kv_len;
    for (std::int64_t h0 = 0; h0 < nh; h0 += per_pass) {
      const std::int64_t hn = std::min(per_pass, nh - h0);
      float* m = acc + hn * dim;
      float* l = m + hn;
      for (std::int64_t h = 0; h < hn; ++h) m[h] = -std::numeric_limits<float>::infinity(), l[h] = 0.f;
      for (std::int64_t d = 0; d < hn * dim; ++d) acc[d] = 0.f;
      for (std::int64_t j = 0; j < n; ++j) {
        // token j: slot j % bs of block pages[j / bs] (a sequence holds fewer than 2^31 tokens)
        const auto t = static_cast<std::int32_t>(j);
        const T* keys = cache.data() + pages[t / bs] * block_stride + (t % bs) * token_stride;
        for (std::int64_t h = 0; h < hn; ++h) {
          const T* k = keys + ((h0 + h) / group) * kv_head_stride;
          detail::softmax_step(detail::dot(&q(row, h0 + h, 0), k, dim) * scale, k + kv_half, dim, m[h], l[h],
                               acc + h * dim);
        }
      }
      for (std::int64_t h = 0; h < hn; ++h) {
        const float inv = n > 0 ? 1.f / l[h] : 0.f;
        float* o = &out(row, h0 + h, 0);
        for (std::int32_t d = 0; d < dim; ++d) o[d] = acc[h * dim + d] * inv;
      }
    }
  }
}
}  // namespace detail

/// Writes the keys and values of new tokens into the pool. Token i belongs to sequence
/// batch_indices[i] of `csr` at position positions[i] (which must lie inside that sequence's
/// kv_len, i.e. blocks were prepared and csr built for the grown length).
///   k, v: [num_tokens, num_kv_heads, head_dim]; cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
template <class T>
void append_paged_kv_cache(host, tensor_view<const float, host, 3> k, tensor_view<const float, host, 3> v,
                           std::span<const std::int32_t> batch_indices, std::span<const std::int64_t> positions,
                           tensor_view<T, host, 5> cache, const paged_kv_csr& csr) {
  const std::int64_t n = k.extent(0), hk = cache.extent(3), dim = cache.extent(4);
  LOOM_CHECK(v.shape() == k.shape(), "append_paged_kv_cache: k shape ", detail::shape_str(k.shape()), " differs from v shape ", detail::shape_str(v.shape()));
  LOOM_CHECK(k.extent(1) == hk && k.extent(2) == dim, "append_paged_kv_cache: k shape ", detail::shape_str(k.shape()),
             " does not match the cache's [*, ", hk, ", ", dim, "]");
  LOOM_CHECK(static_cast<std::int64_t>(batch_indices.size()) == n && static_cast<std::int64_t>(positions.size()) == n,
             "append_paged_kv_cache: ", n, " tokens but ", batch_indices.size(), " batch indices and ",
             positions.size(), " positions");
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t b = batch_indices[static_cast<std::size_t>(i)];
    const std::int64_t p = positions[static_cast<std::size_t>(i)];
    LOOM_CHECK(b >= 0 && b < csr.batch(), "append_paged_kv_cache: batch index ", b, " of token ", i, " out of range");
    LOOM_CHECK(p >= 0 && p < csr.kv_len(b), "append_paged_kv_cache: position ", p, " of token ", i,
               " beyond the sequence's kv_len=", csr.kv_len(b));
    const std::int32_t page = csr.indices[static_cast<std::size_t>(csr.indptr[b] + p / csr.block_size)];
    const std::int64_t off = p % csr.block_size;
    for (std::int64_t h = 0; h < hk; ++h)
      for (std::int64_t d = 0; d < dim; ++d) {
        cache(page, 0, off, h, d) = T(k(i, h, d));
        cache(page, 1, off, h, d) = T(v(i, h, d));
      }
  }
}

struct attention_params {
  float sm_scale = 0.f;  // 0: 1/sqrt(head_dim)
  bool causal = true;
};

/// Ragged batch prefill: sequence b has queries q[qo_indptr[b] : qo_indptr[b+1]], the last of
/// its csr.kv_len(b) tokens.  q, out: [total_q, num_heads, head_dim].
template <class T>
void batch_prefill_with_paged_kv_cache(host, tensor_view<const float, host, 3> q, std::span<const std::int32_t> qo_indptr,
                                       tensor_view<T, host, 5> cache_in, const paged_kv_csr& csr,
                                       tensor_view<float, host, 3> out, attention_params params = {}) {
  const tensor_view<const std::remove_const_t<T>, host, 5> cache(cache_in);
  const std::int64_t nh = q.extent(1), dim = q.extent(2);
  detail::check_attention_shapes("batch_prefill_with_paged_kv_cache", cache, nh, dim, csr);
  LOOM_CHECK(out.shape() == q.shape(), "batch_prefill_with_paged_kv_cache: out shape ", detail::shape_str(out.shape()),
             " differs from q shape ", detail::shape_str(q.shape()));
  LOOM_CHECK(static_cast<std::int32_t>(qo_indptr.size()) == csr.batch() + 1 && qo_indptr.back() == q.extent(0),
             "batch_prefill_with_paged_kv_cache: qo_indptr has ", qo_indptr.size(), " entries ending at ",
             qo_indptr.empty() ? -1 : qo_indptr.back(), " for a batch of ", csr.batch(), " and ", q.extent(0),
             " query tokens");
  LOOM_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged attention: head_dim of q and out must be contiguous");
  const float scale = params.sm_scale > 0.f ? params.sm_scale : 1.f / std::sqrt(static_cast<float>(dim));
  float scratch[detail::scratch_floats];
  for (std::int32_t b = 0; b < csr.batch(); ++b)
    detail::attend_sequence(q, cache, csr, b, qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b], params.causal, scale, scratch,
                            out);
}

/// Batch decode: one query token per sequence, attending over all csr.kv_len(b) tokens.
///   q, out: [batch, num_heads, head_dim]
template <class T>
void batch_decode_with_paged_kv_cache(host, tensor_view<const float, host, 3> q, tensor_view<T, host, 5> cache_in,
                                      const paged_kv_csr& csr, tensor_view<float, host, 3> out,
                                      attention_params params = {}) {
  const tensor_view<const std::remove_const_t<T>, host, 5> cache(cache_in);
  const std::int64_t nh = q.extent(1), dim = q.extent(2);
  detail::check_attention_shapes("batch_decode_with_paged_kv_cache", cache, nh, dim, csr);
  LOOM_CHECK(q.extent(0) == csr.batch(), "batch_decode_with_paged_kv_cache: q has ", q.extent(0),
             " rows for a batch of ", csr.batch());
  LOOM_CHECK(out.shape() == q.shape(), "batch_decode_with_paged_kv_cache: out shape ", detail::shape_str(out.shape()),
             " differs from q shape ", detail::shape_str(q.shape()));
  LOOM_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged attention: head_dim of q and out must be contiguous");
  const float scale = params.sm_scale > 0.f ? params.sm_scale : 1.f / std::sqrt(static_cast<float>(dim));
  float scratch[detail::scratch_floats];
  for (std::int32_t b = 0; b < csr.batch(); ++b) detail::attend_sequence(q, cache, csr, b, b, 1, true, scale, scratch, out);
}

}  // namespace loom::kv
