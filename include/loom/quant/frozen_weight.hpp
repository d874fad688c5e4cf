#pragma once
// What a GEMM needs of a frozen weight it dequantises on the fly, and the bf16 one.
//
// Why a concept: the QLoRA base is NF4 (nf4.hpp) or kept in bf16, and the GEMMs that read it
// (quant/host/gemm.hpp) differ only in how a tile of W becomes fp32. Both formats hand out
// block-aligned tiles into a caller's buffer, so the GEMM bounds its scratch to one tile and
// never holds the whole matrix in fp32.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>

namespace loom::quant {

/// A frozen weight W [rows, cols] read by tiles.
/// Requires: rows() and cols(); tile_align(), the granularity of tile columns (NF4: its block
/// size); dequantize(r0, r1, c0, c1, out, ld) writing W[r0:r1, c0:c1] as fp32 into out with
/// row stride ld, for c0 and c1 multiples of tile_align() (or c1 == cols()); bytes() held.
template <class W>
concept frozen_weight = requires(const W& w, index_t i, float* out) {
  { w.rows() } -> std::convertible_to<index_t>;
  { w.cols() } -> std::convertible_to<index_t>;
  { w.tile_align() } -> std::convertible_to<index_t>;
  { w.bytes() } -> std::convertible_to<std::size_t>;
  w.dequantize(i, i, i, i, out, i);
};

/// A frozen weight stored in bfloat16 (2 bytes a parameter): the other QLoRA-style base, read
/// by the same GEMMs; each value widens to fp32 exactly.
class bf16_matrix {
 public:
  bf16_matrix() = default;
  /// Rounds w [rows, cols] (unit stride in dimension 1) to bfloat16, nearest even.
  explicit bf16_matrix(tensor_view<const float, host, 2> w, memory_resource& mr = default_resource<host>())
      : rows_(w.extent(0)), cols_(w.extent(1)) {
    LOOM_CHECK(rows_ > 0 && cols_ > 0, "quant::bf16_matrix: the weight has shape [", rows_, ", ", cols_,
               "]: rows and cols must be positive");
    LOOM_CHECK(w.stride(1) == 1 || cols_ == 1, "quant::bf16_matrix: w must have unit stride in dimension 1 (stride ",
               w.stride(1), ")");
    data_ = buffer<bfloat16>(static_cast<std::size_t>(rows_ * cols_), mr);
    for (index_t r = 0; r < rows_; ++r)
      for (index_t c = 0; c < cols_; ++c) {
        const float v = w.data()[r * w.stride(0) + c];
        LOOM_CHECK(std::isfinite(v), "quant::bf16_matrix: w[", r, ", ", c, "]=", v, " is not finite");
        data_.data()[r * cols_ + c] = bfloat16(v);
      }
  }

  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  static constexpr index_t tile_align() noexcept { return 1; }
  std::size_t bytes() const noexcept { return data_.bytes(); }
  const bfloat16* data() const noexcept { return data_.data(); }

  /// out[r - r0, c - c0] = float(W[r, c]) for the tile [r0, r1) x [c0, c1), row stride ld.
  void dequantize(index_t r0, index_t r1, index_t c0, index_t c1, float* out, index_t ld) const {
    LOOM_CHECK(0 <= r0 && r0 <= r1 && r1 <= rows_ && 0 <= c0 && c0 <= c1 && c1 <= cols_ && ld >= c1 - c0,
               "quant::bf16_matrix::dequantize: tile rows [", r0, ", ", r1, ") cols [", c0, ", ", c1, ") ld=", ld,
               " is not a tile of [", rows_, ", ", cols_, "]");
    for (index_t r = r0; r < r1; ++r) {
      const bfloat16* in = data_.data() + r * cols_ + c0;
      float* o = out + (r - r0) * ld;
      for (index_t c = 0; c < c1 - c0; ++c) o[c] = static_cast<float>(in[c]);
    }
  }

 private:
  index_t rows_ = 0, cols_ = 0;
  buffer<bfloat16> data_;
};

}  // namespace loom::quant
