#pragma once
// Causal scaled-dot-product attention with grouped-query heads, forward and backward.
//
// Layout: q, out [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim];
// query head h reads kv head h / (heads / kv_heads) (consecutive query heads share a kv
// head, as Meta's repeat_kv does): kv_heads == heads is multi-head, 1 is multi-query.
// Every product is a GEMM on strided views of one (batch, head), made transposed: S^T =
// scale K Q^T, P^T = softmax down its columns under the mask, O = (P^T)^T V; backward dP^T =
// V dO^T, dV += P^T dO, dS^T = P^T (dP^T - colsum(dP^T P^T)) scale, dQ += (dS^T)^T K, dK +=
// dS^T Q. Query rows go in tiles of `attention_tile`; a tile multiplies only the keys its
// last row may see (the causal upper triangle is skipped tile by tile, and those
// probabilities are stored as 0). The probabilities, P^T [batch, heads, seq (keys), seq
// (queries)], are saved by forward for backward (fine for the sequence lengths trained on
// the CPU).
//
// Threads: the (batch, kv head) pairs are split over host_pool(); one pair's query heads run
// in order on one thread, so dK/dV of a kv head shared by several query heads are summed in
// the same order as on one thread (results do not depend on the thread count). While the
// pool runs, OpenBLAS is held to one thread per call (blas_single_thread_scope).
//
// Mask: causal, with an optional prefix-LM part (`prefix` > 0): the first `prefix`
// positions attend to each other in both directions, later ones causally to everything
// before them (ops/math/attention.hpp, shared with the CUDA kernels).

#include <loom/core/thread_pool.hpp>
#include <loom/ops/host/common.hpp>
#include <loom/ops/host/gemm.hpp>
#include <loom/ops/host/softmax.hpp>
#include <loom/ops/math/attention.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::ops {

/// Query rows per GEMM tile: a tile of rows [r0, r1) multiplies only the keys it may see, so
/// a causal mask skips about half of the seq x seq products (tuning value).
inline constexpr index_t attention_tile = 64;

namespace detail {
/// [seq, head_dim] view of (batch bi, head hi) inside a [batch, seq, heads, head_dim] tensor.
template <class E>
inline tensor_view<E, host, 2> head_view(E* base, index_t bi, index_t hi, index_t s, index_t heads, index_t hd) {
  return {base + (bi * s * heads + hi) * hd, extents<2>{s, hd}, extents<2>{heads * hd, 1}};
}
template <class Q, class K, class V, class O>
struct head_set {
  tensor_view<Q, host, 2> q;
  tensor_view<K, host, 2> k;
  tensor_view<V, host, 2> v;
  tensor_view<O, host, 2> o;
};
/// The [seq, head_dim] views of query head hi, its kv head, and output head hi.
template <class Q, class K, class V, class O>
inline head_set<Q, K, V, O> head_views(const tensor_view<Q, host, 4>& q, const tensor_view<K, host, 4>& k,
                                       const tensor_view<V, host, 4>& v, const tensor_view<O, host, 4>& o, index_t bi,
                                       index_t hi, const attention_dims& d) {
  const index_t g = hi / d.group;
  return {head_view(q.data(), bi, hi, d.s, d.h, d.hd), head_view(k.data(), bi, g, d.s, d.kvh, d.hd),
          head_view(v.data(), bi, g, d.s, d.kvh, d.hd), head_view(o.data(), bi, hi, d.s, d.h, d.hd)};
}
}  // namespace detail

namespace detail {
/// Query t (local index r of a tile starting at r0) does not see key j when
/// mask.visible(r0 + r, seq) <= j; visible() never decreases with t, so for each key the
/// queries of a tile that do not see it are a prefix of the tile. fn(j, c): key j is hidden
/// from the first c queries of the tile, for j in [0, vis).
template <class F>
inline void for_hidden_prefix(attention_mask mask, index_t seq, index_t r0, index_t rt, index_t vis, F&& fn) {
  index_t c = 0;
  for (index_t j = 0; j < vis; ++j) {
    while (c < rt && mask.visible(r0 + c, seq) <= j) ++c;
    fn(j, c);
  }
}

/// Softmax down each column of pt [vis, rt] (row stride ld): column r holds query r's scores
/// over keys 0..vis, entries hidden by the mask excluded and set to 0. Every loop runs along a
/// row, across the tile's queries, so it vectorises without a reduction: no row's maximum or
/// sum is folded from vector lanes, and each column is summed in key order (the same bits on
/// any vector width and thread count). Hidden entries are first set to a score whose exp is
/// ops::exp's floor (~1e-38 for float, 0 for double), far below half an ulp of a column sum
/// (>= 1), then to 0.
template <compute_type T>
inline void softmax_columns(T* pt, index_t ld, index_t vis, index_t rt, attention_mask mask, index_t seq, index_t r0) {
  T mx[attention_tile], sum[attention_tile];
  for_hidden_prefix(mask, seq, r0, rt, vis, [&](index_t j, index_t c) { std::fill_n(pt + j * ld, c, T(-1e30)); });
  std::copy_n(pt, rt, mx);  // key 0 is visible to every query
  for (index_t j = 1; j < vis; ++j) {
    const T* row = pt + j * ld;
    LOOM_SIMD
    for (index_t r = 0; r < rt; ++r) mx[r] = max_simd(mx[r], row[r]);
  }
  std::fill_n(sum, rt, T(0));
  for (index_t j = 0; j < vis; ++j) {
    T* row = pt + j * ld;
    LOOM_SIMD
    for (index_t r = 0; r < rt; ++r) {
      row[r] = ops::exp(row[r] - mx[r]);
      sum[r] += row[r];
    }
  }
  for (index_t r = 0; r < rt; ++r) sum[r] = T(1) / sum[r];
  for (index_t j = 0; j < vis; ++j) {
    T* row = pt + j * ld;
    LOOM_SIMD
    for (index_t r = 0; r < rt; ++r) row[r] *= sum[r];
  }
  for_hidden_prefix(mask, seq, r0, rt, vis, [&](index_t j, index_t c) { std::fill_n(pt + j * ld, c, T(0)); });
}
}  // namespace detail

/// out = attention(q, k, v); probs [batch, heads, seq, seq] receives the softmax, transposed:
/// probs(b, h, j, t) is query t's probability of key j (saved for backward; masked entries 0).
/// Why transposed: each query tile's scores are made as K Q^T, so the softmax runs along
/// rows across queries (detail::softmax_columns) instead of one short row per query, whose
/// maximum and sum folds cost more than their exps at the tiles' widths.
template <compute_type T>
inline void attention_forward(host, in_view<T, 4> q, in_view<T, 4> k, in_view<T, 4> v, tensor_view<T, host, 4> out,
                              tensor_view<T, host, 4> probs, attention_mask mask = {}) {
  const char* fn = "ops::attention_forward";
  const auto d = detail::check_attention(q, k, v, out, fn);
  detail::require_shape(probs, extents<4>{d.b, d.h, d.s, d.s}, fn, "probs");
  detail::require_contiguous(probs, fn, "probs");
  LOOM_CHECK(mask.prefix >= 0, fn, ": mask prefix must be >= 0, got prefix=", mask.prefix);
  const T scale = T(1) / std::sqrt(T(d.hd));
  auto& pool = host_pool();
  const index_t pairs = d.b * d.kvh;
  const blas_single_thread_scope one_blas_thread(pool.parts(pairs) > 1);
  pool.parallel_for(pairs, 1, [&](int, index_t p0, index_t p1) {
    for (index_t pair = p0; pair < p1; ++pair)
      for (index_t hi = pair % d.kvh * d.group; hi < (pair % d.kvh + 1) * d.group; ++hi) {
        const index_t bi = pair / d.kvh;
        const auto hv = detail::head_views(q, k, v, out, bi, hi, d);
        T* pp = probs.data() + (bi * d.h + hi) * d.s * d.s;
        for (index_t r0 = 0; r0 < d.s; r0 += attention_tile) {  // query rows [r0, r1) see keys [0, vis)
          const index_t r1 = std::min(d.s, r0 + attention_tile), rt = r1 - r0, vis = mask.visible(r1 - 1, d.s);
          tensor_view<T, host, 2> pt(pp + r0, extents<2>{vis, rt}, extents<2>{d.s, 1});  // P^T of the tile
          gemm(host{}, hv.k.slice(0, 0, vis), hv.q.slice(0, r0, r1).transpose(0, 1), pt, scale, T(0));
          detail::softmax_columns(pt.data(), d.s, vis, rt, mask, d.s, r0);
          for (index_t j = vis; j < d.s; ++j) std::fill_n(pp + j * d.s + r0, rt, T(0));
          gemm(host{}, tensor_view<const T, host, 2>(pt).transpose(0, 1), hv.v.slice(0, 0, vis), hv.o.slice(0, r0, r1));
        }
      }
  });
}

/// dq, dk, dv += gradients of attention given dout and forward's (transposed) probs (dq, dk,
/// dv = ... when !accumulate: each part zeroes its heads' slices just before adding into
/// them, no pass over the whole buffers first); scratch: [seq, seq] workspace of the calling
/// thread (pool threads use a thread-local one of the same size); mask as in forward.
template <compute_type T>
inline void attention_backward(host, in_view<T, 4> dout, in_view<T, 4> q, in_view<T, 4> k, in_view<T, 4> v,
                               in_view<T, 4> probs, tensor_view<T, host, 4> dq, tensor_view<T, host, 4> dk,
                               tensor_view<T, host, 4> dv, tensor_view<T, host, 2> scratch, attention_mask mask = {},
                               bool accumulate = true) {
  const char* fn = "ops::attention_backward";
  const auto d = detail::check_attention(q, k, v, dout, fn);
  detail::require_shape(probs, extents<4>{d.b, d.h, d.s, d.s}, fn, "probs");
  detail::require_contiguous(probs, fn, "probs");
  detail::require_shape(dq, q.shape(), fn, "dq");
  detail::require_shape(dk, k.shape(), fn, "dk");
  detail::require_shape(dv, v.shape(), fn, "dv");
  for (auto* g : {&dq, &dk, &dv}) detail::require_contiguous(*g, fn, "dq/dk/dv");
  detail::require_shape(scratch, extents<2>{d.s, d.s}, fn, "scratch");
  detail::require_contiguous(scratch, fn, "scratch");
  const T scale = T(1) / std::sqrt(T(d.hd));
  auto& pool = host_pool();
  const index_t pairs = d.b * d.kvh;
  const blas_single_thread_scope one_blas_thread(pool.parts(pairs) > 1);
  pool.parallel_for(pairs, 1, [&](int part, index_t p0, index_t p1) {
    thread_local std::vector<T> own;
    T* sc = scratch.data();
    if (part > 0) {
      own.resize(static_cast<std::size_t>(d.s * d.s));
      sc = own.data();
    }
    for (index_t pair = p0; pair < p1; ++pair)
      for (index_t hi = pair % d.kvh * d.group; hi < (pair % d.kvh + 1) * d.group; ++hi) {
        const index_t bi = pair / d.kvh;
        const auto hv = detail::head_views(q, k, v, dout, bi, hi, d);
        const auto gv = detail::head_views(dq, dk, dv, dout, bi, hi, d);
        if (!accumulate) {  // this head's dq rows, and the kv head's dk, dv rows with its first head
          for (index_t t = 0; t < d.s; ++t) {
            std::fill_n(&gv.q(t, 0), d.hd, T(0));
            if (hi % d.group == 0) std::fill_n(&gv.k(t, 0), d.hd, T(0)), std::fill_n(&gv.v(t, 0), d.hd, T(0));
          }
        }
        const T* pp = probs.data() + (bi * d.h + hi) * d.s * d.s;
        for (index_t r0 = 0; r0 < d.s; r0 += attention_tile) {
          const index_t r1 = std::min(d.s, r0 + attention_tile), rt = r1 - r0, vis = mask.visible(r1 - 1, d.s);
          tensor_view<const T, host, 2> pt(pp + r0, extents<2>{vis, rt}, extents<2>{d.s, 1});  // P^T
          tensor_view<T, host, 2> dst(sc, extents<2>{vis, rt}, extents<2>{d.s, 1});             // dP^T, then dS^T
          const auto dor = hv.o.slice(0, r0, r1);
          gemm(host{}, hv.v.slice(0, 0, vis), dor.transpose(0, 1), dst);        // dP^T = V dO^T
          gemm(host{}, pt, dor, gv.v.slice(0, 0, vis), T(1), T(1));              // dV += P^T dO
          T dot[attention_tile] = {};                                             // <dP, P> of each query
          for (index_t j = 0; j < vis; ++j) {
            const T* pr = &pt(j, 0);
            const T* dr = &dst(j, 0);
            LOOM_SIMD
            for (index_t r = 0; r < rt; ++r) dot[r] += pr[r] * dr[r];
          }
          for (index_t j = 0; j < vis; ++j) {  // dS = P (dP - <dP, P>) scale
            const T* pr = &pt(j, 0);
            T* dr = &dst(j, 0);
            LOOM_SIMD
            for (index_t r = 0; r < rt; ++r) dr[r] = math::softmax_backward(pr[r], dr[r], dot[r]) * scale;
          }
          const tensor_view<const T, host, 2> dsc = dst;
          gemm(host{}, dsc.transpose(0, 1), hv.k.slice(0, 0, vis), gv.q.slice(0, r0, r1), T(1), T(1));  // dQ += dS K
          gemm(host{}, dsc, hv.q.slice(0, r0, r1), gv.k.slice(0, 0, vis), T(1), T(1));                  // dK += dS^T Q
        }
      }
  });
}

}  // namespace loom::ops
