#pragma once
// GEMMs over a frozen weight that is stored compressed (NF4, bf16) and dequantised on the fly,
// on the host: the forward y = x W^T and the input gradient dx = dy W of a linear layer whose
// weight W [out, in] does not train (QLoRA's base: there is no dW).
//
// Why tiles: the point of a 4-bit base is not to hold it in fp32. Each pool part dequantises
// one tile of W (tile_rows x tile_cols, block-aligned) into a scratch buffer of its own and
// multiplies it with ops::gemm (loom's sgemm kernel or BLAS), so the fp32 copy is one tile per
// thread, reused call after call, whatever the matrix size.
// - forward: parts take disjoint row tiles of W, i.e. disjoint column ranges of y, and walk
//   the columns of W (in) accumulating into their slice of y;
// - backward: parts take disjoint column tiles of W, i.e. column ranges of dx, and walk the
//   rows of W (out) accumulating dy[:, rows] W[rows, cols] into their slice of dx.
// Every output element is written by one part, summing over W's other dimension in tiles that
// do not depend on the thread count, so on loom's sgemm kernels (whose results do not depend
// on how C is split) the bits are the same on any thread count. Each tile is dequantised once per call: with m
// rows of activations it feeds m multiply-adds per weight, so the decode case (m of a few
// tokens) costs about the dequantisation and the training case about the GEMM.

#include <algorithm>
#include <loom/ops/host/gemm.hpp>
#include <loom/quant/frozen_weight.hpp>
#include <vector>

namespace loom::quant {

/// Tile of W dequantised at once (per pool part); 0 picks the default, a 1 MiB fp32 tile:
/// forward 64 rows x 4096 columns (deep along the summed dimension, W's columns); backward,
/// where the sum runs over W's rows, as many rows as x has (64 to 512) and the columns that
/// fill the tile: a deep sum when there are many rows to amortise it over, wide calls when few.
/// Columns are rounded down to the weight's tile_align() (at least one block), and tiles
/// shrink so every pool thread gets one.
struct dequant_gemm_options {
  index_t tile_rows = 0;
  index_t tile_cols = 0;
};

namespace detail {
inline constexpr index_t default_tile_floats = index_t(1) << 18;  // 1 MiB
/// One part's fp32 tile: a thread's buffer kept between calls (grown, never shrunk, to the
/// largest tile it was asked for), so a steady loop allocates nothing.
inline float* dequant_scratch(index_t floats) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<std::size_t>(floats)) scratch.resize(static_cast<std::size_t>(floats));
  return scratch.data();
}
inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
/// The tile extent along a dimension of n: at most `want`, a multiple of `align` unless it
/// covers n, and small enough that `parts` parts each get one.
inline index_t tile_extent(index_t n, index_t want, index_t align, int parts) {
  const index_t share = ceil_div(ceil_div(n, parts), align) * align;
  const index_t t = std::max(align, std::min(want, share) / align * align);
  return std::min(t, n);
}
template <class W>
inline void check_tiles(const W& w, const dequant_gemm_options& o, const char* fn) {
  LOOM_CHECK(o.tile_rows >= 0 && o.tile_cols >= 0, fn, ": tile_rows=", o.tile_rows, " and tile_cols=", o.tile_cols,
             " must be positive (or 0: the default)");
  LOOM_CHECK(w.tile_align() > 0 && w.cols() % w.tile_align() == 0, fn, ": the weight's tile_align()=", w.tile_align(),
             " does not divide its cols=", w.cols());
}
/// Calls f(r0, r1, c0, c1, tile) for every tr x tc tile of W, `tile` the view of W[r0:r1, c0:c1]
/// dequantised into the calling part's scratch. Parts take disjoint tiles along dimension
/// `split` of W (0: rows, 1: columns) and walk the other dimension in ascending order.
template <class W, class F>
inline void for_each_dequantized_tile(const W& w, index_t tr, index_t tc, int split, F&& f) {
  const index_t rows = w.rows(), cols = w.cols();
  const index_t n_split = split == 0 ? ceil_div(rows, tr) : ceil_div(cols, tc),
                n_walk = split == 0 ? ceil_div(cols, tc) : ceil_div(rows, tr);
  host_pool().parallel_for(n_split, 1, [&](int, index_t t0, index_t t1) {
    float* s = dequant_scratch(tr * tc);
    for (index_t t = t0; t < t1; ++t)
      for (index_t u = 0; u < n_walk; ++u) {
        const index_t r0 = (split == 0 ? t : u) * tr, c0 = (split == 0 ? u : t) * tc;
        const index_t r1 = std::min(rows, r0 + tr), c1 = std::min(cols, c0 + tc);
        w.dequantize(r0, r1, c0, c1, s, c1 - c0);
        f(r0, r1, c0, c1, make_view(static_cast<const float*>(s), r1 - r0, c1 - c0));
      }
  });
}
}  // namespace detail

/// y [m, out] = x [m, in] W^T + beta y, W [out, in] frozen and dequantised by tiles. x needs
/// unit stride in one dimension and y unit stride in dimension 1 (as for ops::gemm).
template <frozen_weight W>
inline void dequant_gemm_forward(host h, tensor_view<const float, host, 2> x, const W& w, tensor_view<float, host, 2> y,
                                 float beta = 0.0f, const dequant_gemm_options& o = {}) {
  const index_t m = x.extent(0), in = w.cols(), out = w.rows();
  LOOM_CHECK(x.extent(1) == in, "quant::dequant_gemm_forward: x has shape ", x.shape(), " but the weight is [", out,
             ", ", in, "]");
  LOOM_CHECK(y.extent(0) == m && y.extent(1) == out, "quant::dequant_gemm_forward: y has shape ", y.shape(),
             ", expected [", m, ", ", out, "]");
  detail::check_tiles(w, o, "quant::dequant_gemm_forward");
  if (m == 0) return;
  const index_t tr = detail::tile_extent(out, o.tile_rows ? o.tile_rows : 64, 1, host_pool().size());
  const index_t tc =
      detail::tile_extent(in, o.tile_cols ? o.tile_cols : detail::default_tile_floats / 64, w.tile_align(), 1);
  detail::for_each_dequantized_tile(w, tr, tc, 0, [&](index_t r0, index_t r1, index_t c0, index_t c1, auto tile) {
    ops::gemm(h, x.slice(1, c0, c1), tile.transpose(0, 1), y.slice(1, r0, r1), 1.0f, c0 == 0 ? beta : 1.0f);
  });
}

/// dx [m, in] = dy [m, out] W + beta dx, W [out, in] frozen and dequantised by tiles (beta 1
/// adds to a gradient another path, e.g. a LoRA adapter, already wrote).
template <frozen_weight W>
inline void dequant_gemm_backward(host h, tensor_view<const float, host, 2> dy, const W& w,
                                  tensor_view<float, host, 2> dx, float beta = 0.0f,
                                  const dequant_gemm_options& o = {}) {
  const index_t m = dy.extent(0), in = w.cols(), out = w.rows();
  LOOM_CHECK(dy.extent(1) == out, "quant::dequant_gemm_backward: dy has shape ", dy.shape(), " but the weight is [",
             out, ", ", in, "]");
  LOOM_CHECK(dx.extent(0) == m && dx.extent(1) == in, "quant::dequant_gemm_backward: dx has shape ", dx.shape(),
             ", expected [", m, ", ", in, "]");
  detail::check_tiles(w, o, "quant::dequant_gemm_backward");
  if (m == 0) return;
  const index_t deep = std::clamp<index_t>((m + 63) / 64 * 64, 64, 512);
  const index_t tr = detail::tile_extent(out, o.tile_rows ? o.tile_rows : deep, 1, 1);
  const index_t tc = detail::tile_extent(in, o.tile_cols ? o.tile_cols : detail::default_tile_floats / deep,
                                         w.tile_align(), host_pool().size());
  detail::for_each_dequantized_tile(w, tr, tc, 1, [&](index_t r0, index_t r1, index_t c0, index_t c1, auto tile) {
    ops::gemm(h, dy.slice(1, r0, r1), tile, dx.slice(1, c0, c1), 1.0f, r0 == 0 ? beta : 1.0f);
  });
}

}  // namespace loom::quant
