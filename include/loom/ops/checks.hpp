#pragma once
// Argument checks of the kernels of both backends (ops/host, ops/cuda): a view must be dense
// row-major, have a given shape or length; a loom::error names the function, the argument and
// what it got. Only views' shapes are read, so device views are checked the same way.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <sstream>
#include <string>

namespace loom::ops::detail {

/// "[2, 3]": extents as text for error messages (std::array has no operator<< that
/// LOOM_CHECK's message builder can find).
template <std::size_t R>
inline std::string str(const extents<R>& e) {
  std::ostringstream os;
  os << e;
  return os.str();
}

/// Throws unless the view is dense row-major; `what` names the argument.
template <class V>
inline void require_contiguous(const V& v, const char* fn, const char* what) {
  LOOM_CHECK(v.is_contiguous(), fn, ": ", what, " must be contiguous (shape ", str(v.shape()), ", strides ",
             str(v.strides()), ")");
}

template <class V, std::size_t R>
inline void require_shape(const V& v, const extents<R>& want, const char* fn, const char* what) {
  LOOM_CHECK(v.shape() == want, fn, ": ", what, " has shape ", str(v.shape()), ", expected ", str(want));
}

template <class V>
inline void require_length(const V& v, index_t n, const char* fn) {
  require_contiguous(v, fn, "argument");
  LOOM_CHECK(v.numel() == n, fn, ": arguments differ in length: ", v.numel(), " vs ", n);
}
template <class... V>
inline void require_same_length(const char* fn, index_t n, const V&... v) {
  (require_length(v, n, fn), ...);
}

/// The dimensions of attention's q [batch, seq, heads, head_dim] and k, v [batch, seq,
/// kv_heads, head_dim]; group: query heads per kv head.
struct attention_dims {
  index_t b, s, h, kvh, hd, group;
};
template <class Q, class K, class V, class O>
inline attention_dims check_attention(const Q& q, const K& k, const V& v, const O& o, const char* fn) {
  const attention_dims d{q.extent(0), q.extent(1), q.extent(2), k.extent(2), q.extent(3), 1};
  require_contiguous(q, fn, "q"), require_contiguous(k, fn, "k"), require_contiguous(v, fn, "v");
  require_contiguous(o, fn, "out");
  LOOM_CHECK(d.kvh > 0 && d.h % d.kvh == 0, fn, ": heads (", d.h, ") must be a multiple of kv_heads (", d.kvh, ")");
  require_shape(k, extents<4>{d.b, d.s, d.kvh, d.hd}, fn, "k");
  require_shape(v, extents<4>{d.b, d.s, d.kvh, d.hd}, fn, "v");
  require_shape(o, q.shape(), fn, "out");
  return {d.b, d.s, d.h, d.kvh, d.hd, d.h / d.kvh};
}

}  // namespace loom::ops::detail
