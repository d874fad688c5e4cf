#pragma once
// Rotary position embeddings (RoPE), in place on [batch, seq, heads, head_dim] activations.
//
// Two conventions rotate different pairs of a head's channels by the angle pos * f_i,
// f_i = theta^(-2i / head_dim), i < head_dim / 2:
//   interleaved  (Meta's llama, llama2.c):   pairs (2i, 2i+1)
//   half_split   (Hugging Face transformers): pairs (i, i + head_dim/2)
// A checkpoint's q/k weights are laid out for one of them; using the other is a silent bug,
// so the convention is an explicit argument. The cos/sin table is computed once (in double,
// rounded to T) for all positions; backward is the rotation by the negative angle.
//
// Partial rotary (ChatGLM2/3 rotate the first half of each head; GPT-NeoX's rotary_pct): a
// table made with rotary_dim < head_dim rotates only the first rotary_dim channels of every
// head, with f_i = theta^(-2i / rotary_dim) and the pairs above taken within those channels;
// the others pass through unchanged.

#include <loom/core/buffer.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/math/rope.hpp>  // rope_style, the pair rotation shared with ops/cuda/rope.cuh

#include <cmath>
#include <cstdint>
#include <span>

namespace loom::ops {

/// cos and sin of pos * f_i for pos < max_seq, i < rotary_dim/2: [max_seq, rotary_dim/2] each.
template <compute_type T>
struct rope_table {
  index_t max_seq = 0, head_dim = 0;
  index_t rotary_dim = 0;  ///< the leading channels of a head that rotate (head_dim: all)
  double theta = 0;        ///< the base: with the sizes above, what the table is a function of
  buffer<T> cos, sin;

  rope_table() = default;
  /// rotary_dim_ = 0: the whole head rotates.
  rope_table(index_t max_seq_, index_t head_dim_, double theta_, index_t rotary_dim_ = 0)
      : max_seq(max_seq_), head_dim(head_dim_), rotary_dim(rotary_dim_ ? rotary_dim_ : head_dim_), theta(theta_),
        cos(check(max_seq_, head_dim_, theta_, rotary_dim)), sin(cos.size()) {
    const index_t half = rotary_dim / 2;
    for (index_t p = 0; p < max_seq; ++p)
      for (index_t i = 0; i < half; ++i) {
        const double angle = double(p) * std::pow(theta, -2.0 * double(i) / double(rotary_dim));
        cos[p * half + i] = T(std::cos(angle));
        sin[p * half + i] = T(std::sin(angle));
      }
  }

 private:
  static std::size_t check(index_t max_seq, index_t head_dim, double theta, index_t rotary_dim) {
    LOOM_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_table: head_dim must be even and > 0, got head_dim=", head_dim);
    LOOM_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
               "rope_table: rotary_dim must be even and in (0, head_dim=", head_dim, "], got rotary_dim=", rotary_dim);
    LOOM_CHECK(max_seq > 0, "rope_table: max_seq must be > 0, got max_seq=", max_seq);
    LOOM_CHECK(theta > 0, "rope_table: theta must be > 0, got theta=", theta);
    return static_cast<std::size_t>(max_seq * (rotary_dim / 2));
  }
};

namespace detail {
/// Rotates the first `rot` channels of the `heads` vectors of one token (v: [heads, hd]) by
/// the table row of its position (c, sn: cos and sin); sign -1 rotates back.
template <compute_type T>
inline void rope_token(T* v, index_t heads, index_t hd, index_t rot, const T* c, const T* sn, rope_style style, T sign) {
  const index_t half = rot / 2;
  for (index_t hi = 0; hi < heads; ++hi, v += hd) {
    // one loop per convention: with the style a constant, each vectorises
    if (style == rope_style::interleaved) {
      LOOM_SIMD
      for (index_t i = 0; i < half; ++i) {
        const auto pr = math::rope_pair_of(rope_style::interleaved, i, half);
        math::rope_rotate(v[pr.lo], v[pr.hi], c[i], sign * sn[i]);
      }
    } else {
      LOOM_SIMD
      for (index_t i = 0; i < half; ++i) {
        const auto pr = math::rope_pair_of(rope_style::half_split, i, half);
        math::rope_rotate(v[pr.lo], v[pr.hi], c[i], sign * sn[i]);
      }
    }
  }
}

template <compute_type T>
inline void rope_rotate(tensor_view<T, host, 4> x, const rope_table<T>& table, rope_style style, index_t pos0, T sign,
                        const char* fn) {
  const index_t b = x.extent(0), s = x.extent(1), h = x.extent(2), hd = x.extent(3), half = table.rotary_dim / 2;
  require_contiguous(x, fn, "x");
  LOOM_CHECK(hd == table.head_dim, fn, ": head_dim of x (", hd, ") differs from the table's (", table.head_dim, ")");
  LOOM_CHECK(pos0 >= 0 && pos0 + s <= table.max_seq, fn, ": positions [", pos0, ", ", pos0 + s,
             ") exceed the table's max_seq=", table.max_seq);
  detail::parallel_rows(b * s, rows_grain(h * hd), [&](index_t row0, index_t row1) {
    for (index_t row = row0; row < row1; ++row) {
      const index_t t = row % s;
      rope_token(x.data() + row * h * hd, h, hd, table.rotary_dim, table.cos.data() + (pos0 + t) * half,
                 table.sin.data() + (pos0 + t) * half, style, sign);
    }
  });
}
}  // namespace detail

/// Rotates x [tokens, heads, head_dim] in place, token i at positions[i]: the ragged batches of
/// inference (prefill chunks and decode tokens of many sequences in one step).
template <compute_type T>
inline void rope_forward(host, tensor_view<T, host, 3> x, const rope_table<T>& table, rope_style style,
                         std::span<const std::int64_t> positions) {
  const char* fn = "ops::rope_forward";
  const index_t n = x.extent(0), h = x.extent(1), hd = x.extent(2), half = table.rotary_dim / 2;
  detail::require_contiguous(x, fn, "x");
  LOOM_CHECK(hd == table.head_dim, fn, ": head_dim of x (", hd, ") differs from the table's (", table.head_dim, ")");
  LOOM_CHECK(static_cast<index_t>(positions.size()) == n, fn, ": ", positions.size(), " positions for ", n, " tokens");
  for (index_t i = 0; i < n; ++i)
    LOOM_CHECK(positions[static_cast<std::size_t>(i)] >= 0 && positions[static_cast<std::size_t>(i)] < table.max_seq, fn,
               ": token ", i, " has position ", positions[static_cast<std::size_t>(i)], " outside [0, ", table.max_seq, ")");
  detail::parallel_rows(n, detail::rows_grain(h * hd), [&](index_t r0, index_t r1) {
    for (index_t i = r0; i < r1; ++i) {
      const index_t p = positions[static_cast<std::size_t>(i)];
      detail::rope_token(x.data() + i * h * hd, h, hd, table.rotary_dim, table.cos.data() + p * half,
                         table.sin.data() + p * half, style, T(1));
    }
  });
}

/// Rotates x [batch, seq, heads, head_dim] in place; token t has position pos0 + t.
template <compute_type T>
inline void rope_forward(host, tensor_view<T, host, 4> x, const rope_table<T>& table, rope_style style,
                         index_t pos0 = 0) {
  detail::rope_rotate(x, table, style, pos0, T(1), "ops::rope_forward");
}

/// Turns dL/d(rotated x) into dL/dx in place (the inverse rotation).
template <compute_type T>
inline void rope_backward(host, tensor_view<T, host, 4> dx, const rope_table<T>& table, rope_style style,
                          index_t pos0 = 0) {
  detail::rope_rotate(dx, table, style, pos0, T(-1), "ops::rope_backward");
}

}  // namespace loom::ops
