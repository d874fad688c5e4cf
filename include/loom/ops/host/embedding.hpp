#pragma once
// Token embedding: a gather of table rows, and its backward, a scatter-add into the table's
// gradient. Token ids are checked against the vocabulary (a bad id is a loom::error naming
// the id and its position, never an out-of-bounds read).

#include <loom/ops/host/common.hpp>

#include <cstdint>

namespace loom::ops {

/// out[n, :] = table[tokens[n], :]; tokens: [n], table: [vocab, dim], out: [n, dim].
template <compute_type T, param_type P, class Token>
  requires std::integral<std::remove_const_t<Token>>
inline void embedding_forward(host, tensor_view<Token, host, 1> tokens, tensor_view<P, host, 2> table,
                              tensor_view<T, host, 2> out) {
  const char* fn = "ops::embedding_forward";
  const index_t n = tokens.numel(), v = table.extent(0), d = table.extent(1);
  detail::require_contiguous(tokens, fn, "tokens"), detail::require_contiguous(table, fn, "table");
  detail::require_contiguous(out, fn, "out");
  detail::require_shape(out, extents<2>{n, d}, fn, "out");
  for (index_t i = 0; i < n; ++i) {
    const auto tok = static_cast<std::int64_t>(tokens(i));
    LOOM_CHECK(tok >= 0 && tok < v, fn, ": token id ", tok, " at position ", i, " is outside the vocabulary [0, ", v, ")");
    const P* src = table.data() + tok * d;
    T* dst = out.data() + i * d;
    LOOM_SIMD
    for (index_t j = 0; j < d; ++j) dst[j] = load<T>(src[j]);
  }
}

/// dtable[tokens[n], :] += dout[n, :]
template <compute_type T, class Token>
  requires std::integral<std::remove_const_t<Token>>
inline void embedding_backward(host, tensor_view<Token, host, 1> tokens, in_view<T, 2> dout,
                               tensor_view<T, host, 2> dtable) {
  const char* fn = "ops::embedding_backward";
  const index_t n = tokens.numel(), v = dtable.extent(0), d = dtable.extent(1);
  detail::require_contiguous(dout, fn, "dout"), detail::require_contiguous(dtable, fn, "dtable");
  detail::require_shape(dout, extents<2>{n, d}, fn, "dout");
  for (index_t i = 0; i < n; ++i) {
    const auto tok = static_cast<std::int64_t>(tokens(i));
    LOOM_CHECK(tok >= 0 && tok < v, fn, ": token id ", tok, " at position ", i, " is outside the vocabulary [0, ", v, ")");
    const T* src = dout.data() + i * d;
    T* dst = dtable.data() + tok * d;
    LOOM_SIMD
    for (index_t j = 0; j < d; ++j) dst[j] += src[j];
  }
}

}  // namespace loom::ops
