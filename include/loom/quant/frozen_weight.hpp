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
#include <cstdint>
#include <cstring>
#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>
#include <span>

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

/// A bf16 matrix in bytes it does not own (a frozen_weight): rows * cols bfloat16 values, row
/// major, as bf16_matrix holds and packs them (2 bytes a parameter). Why: a base partitioned
/// over data-parallel ranks (ZeRO-3) moves a matrix as one run of bytes and reads it where it
/// landed; values are read with memcpy, so the bytes need no alignment.
class bf16_view {
 public:
  bf16_view() = default;
  /// Over packed [rows, cols] (2 rows cols bytes; a loom::error names a size that does not fit).
  bf16_view(index_t rows, index_t cols, std::span<const std::uint8_t> packed) : rows_(rows), cols_(cols), data_(packed.data()) {
    LOOM_CHECK(rows > 0 && cols > 0 && packed.size() == static_cast<std::size_t>(rows * cols) * sizeof(bfloat16),
               "quant::bf16_view: ", packed.size(), " packed bytes do not hold a bf16 [", rows, ", ", cols, "]");
  }

  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  static constexpr index_t tile_align() noexcept { return 1; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(rows_ * cols_) * sizeof(bfloat16); }

  /// out[r - r0, c - c0] = float(W[r, c]) for the tile [r0, r1) x [c0, c1), row stride ld.
  void dequantize(index_t r0, index_t r1, index_t c0, index_t c1, float* out, index_t ld) const {
    LOOM_CHECK(0 <= r0 && r0 <= r1 && r1 <= rows_ && 0 <= c0 && c0 <= c1 && c1 <= cols_ && ld >= c1 - c0,
               "quant::bf16_matrix::dequantize: tile rows [", r0, ", ", r1, ") cols [", c0, ", ", c1, ") ld=", ld,
               " is not a tile of [", rows_, ", ", cols_, "]");
    for (index_t r = r0; r < r1; ++r) {
      const std::uint8_t* in = data_ + static_cast<std::size_t>(r * cols_ + c0) * sizeof(bfloat16);
      float* o = out + (r - r0) * ld;
      for (index_t c = 0; c < c1 - c0; ++c) {
        std::uint16_t bits;
        std::memcpy(&bits, in + static_cast<std::size_t>(c) * sizeof(bfloat16), sizeof(bits));
        o[c] = static_cast<float>(bfloat16::from_bits(bits));
      }
    }
  }

 private:
  index_t rows_ = 0, cols_ = 0;
  const std::uint8_t* data_ = nullptr;
};
static_assert(frozen_weight<bf16_view>);

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

  /// The values as a bf16_view (valid while this matrix lives).
  bf16_view view() const { return {rows_, cols_, {reinterpret_cast<const std::uint8_t*>(data_.data()), bytes()}}; }
  /// Writes the packed form (bf16_view) into out, bytes() bytes.
  void pack(std::span<std::uint8_t> out) const {
    LOOM_CHECK(out.size() == bytes(), "quant::bf16_matrix::pack: ", out.size(), " bytes given, the packed matrix has ", bytes());
    std::memcpy(out.data(), data_.data(), bytes());
  }
  /// out[r - r0, c - c0] = float(W[r, c]) for the tile [r0, r1) x [c0, c1), row stride ld.
  void dequantize(index_t r0, index_t r1, index_t c0, index_t c1, float* out, index_t ld) const {
    view().dequantize(r0, r1, c0, c1, out, ld);
  }

 private:
  index_t rows_ = 0, cols_ = 0;
  buffer<bfloat16> data_;
};

}  // namespace loom::quant
