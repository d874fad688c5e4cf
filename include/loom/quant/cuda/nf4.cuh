#pragma once
// NF4 weights on a CUDA device: an nf4_matrix (quant/nf4.hpp) copied as it is stored (the
// packed codes, and the absmax values or, with double quantisation, their 8-bit codes, scales
// and offset) and dequantised by rows into fp32 or bf16 for a cuBLAS GEMM, the way QLoRA runs a
// frozen 4-bit base: the weight stays at ~0.5 byte a parameter on the device and a layer's
// tile is expanded just before its GEMM.
//
// Why the same bits as the host: each value is nf4_values[code] * absmax in one fp32 multiply,
// and a double-quantised absmax is quant/nf4.hpp's double_quant_absmax on both; the tables are the host's own arrays, copied
// to the device when the matrix is (so they are written once, in quant/nf4.hpp).

#include <loom/core/device.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/error.hpp>
#include <loom/quant/nf4.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace loom::quant {

namespace kernels {

/// Thread per code byte of rows [r0, r1): two values of one block.
template <class T>
__global__ void nf4_dequantize_rows(const std::uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                                    const std::uint8_t* __restrict__ absmax_codes, const float* __restrict__ absmax_scales,
                                    float offset, const float* __restrict__ nf4_table, const float* __restrict__ dynamic_table,
                                    index_t first_byte, index_t bytes, index_t block_size, index_t absmax_block_size,
                                    bool double_quant, T* __restrict__ out) {
  for (index_t j = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; j < bytes;
       j += static_cast<index_t>(blockDim.x) * gridDim.x) {
    const index_t byte = first_byte + j, block = 2 * byte / block_size;
    float s;
    if (double_quant) {
      s = double_quant_absmax(dynamic_table[absmax_codes[block]], absmax_scales[block / absmax_block_size], offset);
    } else {
      s = absmax[block];
    }
    const std::uint8_t q = codes[byte];
    out[2 * j] = T(nf4_table[q >> 4] * s);
    out[2 * j + 1] = T(nf4_table[q & 15] * s);
  }
}

}  // namespace kernels

/// An nf4_matrix's stored fields on the device, with the two look-up tables.
class nf4_matrix_device {
 public:
  /// Copies `m` (synchronously: the host matrix may go away afterwards).
  explicit nf4_matrix_device(const nf4_matrix& m, memory_resource& mr = default_resource<cuda>())
      : rows_(m.rows()), cols_(m.cols()), opt_(m.options()), offset_(m.absmax_offset()), codes_(m.codes().size(), mr),
        absmax_(m.absmax().size(), mr), absmax_codes_(m.absmax_codes().size(), mr), absmax_scales_(m.absmax_scales().size(), mr),
        tables_(nf4_values.size() + dynamic_map.size(), mr) {
    copy(codes_.data(), m.codes());
    copy(absmax_.data(), m.absmax());
    copy(absmax_codes_.data(), m.absmax_codes());
    copy(absmax_scales_.data(), m.absmax_scales());
    std::vector<float> tables(nf4_values.begin(), nf4_values.end());
    tables.insert(tables.end(), dynamic_map.begin(), dynamic_map.end());
    copy(tables_.data(), std::span<const float>(tables));
  }

  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  const nf4_options& options() const noexcept { return opt_; }
  /// Device bytes of the weight itself (as nf4_matrix::bytes; the 1 KiB of tables aside).
  std::size_t bytes() const noexcept {
    return codes_.bytes() + absmax_.bytes() + absmax_codes_.bytes() + absmax_scales_.bytes() +
           (opt_.double_quant ? sizeof(float) : 0);
  }

  const std::uint8_t* codes() const noexcept { return codes_.data(); }
  const float* absmax() const noexcept { return absmax_.data(); }
  const std::uint8_t* absmax_codes() const noexcept { return absmax_codes_.data(); }
  const float* absmax_scales() const noexcept { return absmax_scales_.data(); }
  float absmax_offset() const noexcept { return offset_; }
  const float* nf4_table() const noexcept { return tables_.data(); }                 // [16]
  const float* dynamic_table() const noexcept { return tables_.data() + nf4_values.size(); }  // [256]

 private:
  template <class T>
  static void copy(T* to, std::span<const T> from) {
    if (!from.empty()) LOOM_CUDA_CHECK(cudaMemcpy(to, from.data(), from.size_bytes(), cudaMemcpyHostToDevice));
  }

  index_t rows_, cols_;
  nf4_options opt_;
  float offset_;
  buffer<std::uint8_t, cuda> codes_;
  buffer<float, cuda> absmax_;
  buffer<std::uint8_t, cuda> absmax_codes_;
  buffer<float, cuda> absmax_scales_;
  buffer<float, cuda> tables_;
};

/// out = W[r0:r1, :] dequantised (fp32 values, stored as T: float or bfloat16); out is
/// [r1 - r0, cols], contiguous. Asynchronous on `stream`.
template <class T>
void nf4_dequantize_rows(const nf4_matrix_device& w, index_t r0, index_t r1, tensor_view<T, cuda, 2> out,
                         cudaStream_t stream = nullptr) {
  const char* fn = "quant::nf4_dequantize_rows(cuda)";
  LOOM_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.rows(), fn, ": rows [", r0, ", ", r1, ") outside [0, ", w.rows(), ")");
  LOOM_CHECK(out.extent(0) == r1 - r0 && out.extent(1) == w.cols() && out.is_contiguous(), fn,
             ": out must be a contiguous [", r1 - r0, ", ", w.cols(), "]");
  const index_t bytes = (r1 - r0) * w.cols() / 2;
  if (bytes == 0) return;
  const auto& o = w.options();
  LOOM_LAUNCH(kernels::nf4_dequantize_rows, ops::kernels::grid_for(bytes, ops::kernels::elementwise_block),
              ops::kernels::elementwise_block, 0, stream)(
      w.codes(), w.absmax(), w.absmax_codes(), w.absmax_scales(), w.absmax_offset(), w.nf4_table(), w.dynamic_table(),
      r0 * w.cols() / 2, bytes, o.block_size, o.double_quant ? o.absmax_block_size : 1, o.double_quant, out.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::quant
