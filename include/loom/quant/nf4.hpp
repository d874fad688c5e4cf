#pragma once
// NF4 weights as bitsandbytes stores them (QLoRA's 4-bit NormalFloat), on the host: blockwise
// quantisation with an fp32 absmax per block, two 4-bit codes a byte, and optional "double
// quantisation" of the absmax values with bitsandbytes' signed dynamic 8-bit map.
//
// Why a faithful transcription and not "nearest table entry": a model quantised here must give
// the codes bitsandbytes gives (so checkpoints and PEFT/QLoRA numbers carry over), and the two
// differ at the edges. bitsandbytes scales by the reciprocal (x * (1 / absmax), one rounding
// more than x / absmax), places values with a tree of fp32 thresholds (the midpoints of
// neighbouring table entries; a value exactly on one goes to the lower code), and quantises the
// absmax values with a 7-step binary search over the 8-bit map whose tie rule is its own. The
// per-element functions are LOOM_HOST_DEVICE so a CUDA backend reuses them.
//
// Edge cases follow bitsandbytes' arithmetic too: a block of zeros has absmax 0, so its values
// scale to 0 * inf = NaN, every threshold comparison fails and the code is 0 (-1.0); dequantised
// that is -1.0 * 0 = -0.0, never a NaN; a block whose absmax is subnormal (1 / absmax
// overflows) gets codes 0 and 15 alike, i.e. errors of at most twice that absmax. With double
// quantisation a block's absmax is only as exact as the second level's 8-bit step, so small
// blocks (zeros included) come back scaled by that step. Non-finite inputs are refused.
//
// Layout (PyTorch's [out, in] for a linear weight, flattened row-major): element i belongs to
// block i / block_size; byte i / 2 holds element 2j in its high nibble and 2j + 1 in its low
// one. Here a block never spans two rows (block_size must divide the row length), so any
// block-aligned tile of rows and columns dequantises without touching its neighbours.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <loom/core/buffer.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/thread_pool.hpp>
#include <loom/quant/frozen_weight.hpp>
#include <span>

#include <loom/core/cpu.hpp>

#if LOOM_CPU_X86
#include <immintrin.h>
#define LOOM_NF4_X86 1
#else
#define LOOM_NF4_X86 0
#endif

namespace loom::quant {

/// The 16 NF4 values (QLoRA, Appendix E; bitsandbytes' table), code c -> nf4_values[c].
inline constexpr std::array<float, 16> nf4_values = {-1.0f,
                                                     -0.6961928009986877f,
                                                     -0.5250730514526367f,
                                                     -0.39491748809814453f,
                                                     -0.28444138169288635f,
                                                     -0.18477343022823334f,
                                                     -0.09105003625154495f,
                                                     0.0f,
                                                     0.07958029955625534f,
                                                     0.16093020141124725f,
                                                     0.24611230194568634f,
                                                     0.33791524171829224f,
                                                     0.44070982933044434f,
                                                     0.5626170039176941f,
                                                     0.7229568362236023f,
                                                     1.0f};

/// The NF4 code of x (already divided by its block's absmax): bitsandbytes' decision tree over
/// the midpoints between neighbouring values, `>` at every node, so a value on a midpoint takes
/// the lower code and NaN takes code 0.
LOOM_HOST_DEVICE constexpr std::uint8_t nf4_code(float x) noexcept {
  if (x > 0.03979014977812767f) {
    if (x > 0.3893125355243683f) {
      if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 15 : 14;
      return x > 0.5016634166240692f ? 13 : 12;
    }
    if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 11 : 10;
    return x > 0.1202552504837513f ? 9 : 8;
  }
  if (x > -0.33967943489551544f) {
    if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 7 : 6;
    return x > -0.23460740596055984f ? 5 : 4;
  }
  if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 3 : 2;
  return x > -0.8480964004993439f ? 1 : 0;
}

namespace detail {
/// The positive half of the dynamic map below 1.0, ascending: bitsandbytes'
/// create_dynamic_map(signed=True, max_exponent_bits=7) builds, for i = 0..6, the midpoints of
/// torch.linspace(0.1, 1, 2^i + 1) scaled by 10^(i - 6), all in fp32. The values are stored
/// rather than recomputed because torch's fp32 linspace rounds by its vectorised CPU kernel (a
/// plain start + k * step differs from it in the last bit of several entries), and the map is
/// part of the format: the tests check this table against the map built by torch.
inline constexpr float dynamic_map_positive[127] = {
    0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f,
    0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f, 0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f,
    0x1.78d5p-11f,   0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f, 0x1.e353f8p-10f, 0x1.3b645ap-9f,
    0x1.851eb8p-9f,  0x1.ced914p-9f,  0x1.0c49bap-8f,  0x1.3126e8p-8f,  0x1.56041ap-8f,  0x1.7ae148p-8f,
    0x1.9fbe76p-8f,  0x1.c49ba6p-8f,  0x1.e978d4p-8f,  0x1.072b02p-7f,  0x1.19999ap-7f,  0x1.2c083p-7f,
    0x1.3e76c8p-7f,  0x1.75c29p-7f,   0x1.d1eb86p-7f,  0x1.170a3ep-6f,  0x1.451eb8p-6f,  0x1.733334p-6f,
    0x1.a147aep-6f,  0x1.cf5c26p-6f,  0x1.fd70a4p-6f,  0x1.15c28ep-5f,  0x1.2ccccep-5f,  0x1.43d70ap-5f,
    0x1.5ae146p-5f,  0x1.71eb86p-5f,  0x1.88f5c2p-5f,  0x1.ap-5f,       0x1.b70a3ep-5f,  0x1.ce147ap-5f,
    0x1.e51ebap-5f,  0x1.fc28f4p-5f,  0x1.09999ap-4f,  0x1.151ebap-4f,  0x1.20a3d6p-4f,  0x1.2c28f6p-4f,
    0x1.37ae14p-4f,  0x1.433334p-4f,  0x1.4eb85p-4f,   0x1.5a3d7p-4f,   0x1.65c29p-4f,   0x1.7147aep-4f,
    0x1.7ccccep-4f,  0x1.8851eap-4f,  0x1.93d70ap-4f,  0x1.b66668p-4f,  0x1.fp-4f,       0x1.14ccccp-3f,
    0x1.31999ap-3f,  0x1.4e6666p-3f,  0x1.6b3332p-3f,  0x1.88p-3f,      0x1.a4ccccp-3f,  0x1.c1999ap-3f,
    0x1.de6668p-3f,  0x1.fb3334p-3f,  0x1.0cp-2f,      0x1.1a6668p-2f,  0x1.28ccccp-2f,  0x1.373334p-2f,
    0x1.459998p-2f,  0x1.54p-2f,      0x1.626664p-2f,  0x1.70ccccp-2f,  0x1.7f3334p-2f,  0x1.8d9998p-2f,
    0x1.9cp-2f,      0x1.aa6664p-2f,  0x1.b8ccccp-2f,  0x1.c73334p-2f,  0x1.d59998p-2f,  0x1.e4p-2f,
    0x1.f26668p-2f,  0x1.006666p-1f,  0x1.07999ap-1f,  0x1.0eccccp-1f,  0x1.16p-1f,      0x1.1d3334p-1f,
    0x1.246668p-1f,  0x1.2b999ap-1f,  0x1.32ccccp-1f,  0x1.3ap-1f,      0x1.413334p-1f,  0x1.486666p-1f,
    0x1.4f999ap-1f,  0x1.56cccep-1f,  0x1.5ep-1f,      0x1.653334p-1f,  0x1.6c6668p-1f,  0x1.73999ap-1f,
    0x1.7acccep-1f,  0x1.82p-1f,      0x1.893334p-1f,  0x1.906666p-1f,  0x1.979998p-1f,  0x1.9eccccp-1f,
    0x1.a6p-1f,      0x1.ad3332p-1f,  0x1.b46666p-1f,  0x1.bb9998p-1f,  0x1.c2ccccp-1f,  0x1.cap-1f,
    0x1.d13334p-1f,  0x1.d86666p-1f,  0x1.df9998p-1f,  0x1.e6ccccp-1f,  0x1.eep-1f,      0x1.f53332p-1f,
    0x1.fc6666p-1f,
};
}  // namespace detail

/// bitsandbytes' signed dynamic 8-bit map, ascending: the negated positive values, 0, the
/// positive values, 1.0 (256 entries; code q -> dynamic_map[q]).
inline constexpr std::array<float, 256> dynamic_map = [] {
  std::array<float, 256> m{};
  for (int i = 0; i < 127; ++i) {
    m[static_cast<std::size_t>(126 - i)] = -detail::dynamic_map_positive[i];
    m[static_cast<std::size_t>(128 + i)] = detail::dynamic_map_positive[i];
  }
  m[127] = 0.0f;
  m[255] = 1.0f;
  return m;
}();

/// A double-quantised block's absmax, dynamic_map[code] * scale + offset, in bitsandbytes' two
/// fp32 roundings on every backend. The product is rounded on its own: on the device __fmul_rn,
/// since nvcc would otherwise widen it and fuse it with the sum into one double FMA (it does:
/// the GPU's dequantised weights then differ from the host's). The sum is taken in
/// double, which rounds to the fp32 sum exactly (53 >= 2 * 24 + 2 bits).
LOOM_HOST_DEVICE inline float double_quant_absmax(float code_value, float scale, float offset) noexcept {
#ifdef __CUDA_ARCH__
  const float d = __fmul_rn(code_value, scale);
#else
  const float d = code_value * scale;
#endif
  return static_cast<float>(static_cast<double>(d) + static_cast<double>(offset));
}

/// The 8-bit code of x (already scaled by its block's reciprocal absmax) in an ascending
/// 256-entry map: bitsandbytes' search, which halves a step from 64 down to 1 starting at 127,
/// then picks between the landing entry and the last entry passed on the side of x by their
/// fp32 midpoint. The entries compared need not be neighbours, and the bounds start at -1 and
/// 1 (the map's ends replace them only when the search reached an end): transcribed as is,
/// because that is what decides the codes.
LOOM_HOST_DEVICE constexpr std::uint8_t dynamic_code(const float* map, float x) noexcept {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float val = map[pivot];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= step;
    }
    val = map[pivot];
  }
  if (upper_pivot == 255) upper = map[255];
  if (lower_pivot == 0) lower = map[0];
  if (x > val) return static_cast<std::uint8_t>(x > (upper + val) * 0.5f ? upper_pivot : pivot);
  return static_cast<std::uint8_t>(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

/// max |x| over a block, as bitsandbytes reduces it (0 for a block of zeros).
inline float block_absmax(std::span<const float> x) noexcept {
  float m = 0.0f;
  for (const float v : x) m = std::fmax(m, std::fabs(v));
  return m;
}

/// 8-bit blockwise quantisation (bitsandbytes' quantize_blockwise with the dynamic map): for
/// each block of `block` values (the last may be shorter) absmax[b] = max |x| and
/// codes[i] = dynamic_code(x[i] * (1 / absmax[b])).
inline void quantize_blockwise_8bit(std::span<const float> x, std::size_t block, std::span<std::uint8_t> codes,
                                    std::span<float> absmax) {
  LOOM_CHECK(block > 0, "quant::quantize_blockwise_8bit: block=", block, " must be positive");
  LOOM_CHECK(codes.size() == x.size(), "quant::quantize_blockwise_8bit: codes.size()=", codes.size(), ", expected ",
             x.size());
  LOOM_CHECK(absmax.size() == (x.size() + block - 1) / block,
             "quant::quantize_blockwise_8bit: absmax.size()=", absmax.size(), ", expected ",
             (x.size() + block - 1) / block, " (", x.size(), " values in blocks of ", block, ")");
  for (std::size_t b = 0; b < absmax.size(); ++b) {
    const std::size_t i0 = b * block, n = std::min(block, x.size() - i0);
    absmax[b] = block_absmax(x.subspan(i0, n));
    const float inv = 1.0f / absmax[b];
    for (std::size_t i = i0; i < i0 + n; ++i) codes[i] = dynamic_code(dynamic_map.data(), x[i] * inv);
  }
}

/// The inverse: out[i] = dynamic_map[codes[i]] * absmax[i / block].
inline void dequantize_blockwise_8bit(std::span<const std::uint8_t> codes, std::span<const float> absmax,
                                      std::size_t block, std::span<float> out) {
  LOOM_CHECK(block > 0 && absmax.size() == (codes.size() + block - 1) / block && out.size() == codes.size(),
             "quant::dequantize_blockwise_8bit: codes.size()=", codes.size(), ", absmax.size()=", absmax.size(),
             ", block=", block, ", out.size()=", out.size(), " do not fit together");
  for (std::size_t i = 0; i < codes.size(); ++i) out[i] = dynamic_map[codes[i]] * absmax[i / block];
}

/// How an nf4_matrix is stored. QLoRA's recipe: block_size 64, double_quant on.
struct nf4_options {
  index_t block_size = 64;          // values per absmax; must be even and divide the row length
  bool double_quant = false;        // bitsandbytes' compress_statistics (its default: off)
  index_t absmax_block_size = 256;  // absmax values per second-level scale (double_quant only)
};

/// Bytes an nf4_matrix of [rows, cols] holds, in closed form: rows * cols / 2 bytes of codes
/// plus, per block of block_size values, a 4-byte absmax, or with double quantisation a 1-byte
/// code plus a 4-byte scale per absmax_block_size absmax codes and one 4-byte offset. Per
/// parameter at block 64: 0.5 + 4/64 = 0.5625 bytes, or 0.5 + 1/64 + 4/(64 * 256) (+ 4 per
/// matrix) ~ 0.5159 bytes with double quantisation.
constexpr std::size_t nf4_bytes(index_t rows, index_t cols, const nf4_options& o = {}) noexcept {
  const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  const std::size_t blocks = n / static_cast<std::size_t>(o.block_size);
  if (!o.double_quant) return n / 2 + blocks * sizeof(float);
  const auto b2 = static_cast<std::size_t>(o.absmax_block_size);
  return n / 2 + blocks + (blocks + b2 - 1) / b2 * sizeof(float) + sizeof(float);
}

namespace detail {
/// Instruction sets of the code-to-value expansion (dequantisation's inner loop).
enum class nf4_isa { scalar, avx2, avx512 };

/// out[2j] = lut[q[j] >> 4], out[2j + 1] = lut[q[j] & 15] for j < bytes; lut: a block's 16
/// scaled values. The vector versions look up 8 or 16 codes per instruction (vpermps) and
/// interleave the high and low nibbles' values; being look-ups, all give the same bits.
inline void nf4_expand_scalar(const std::uint8_t* q, index_t bytes, const float* lut, float* out) noexcept {
  for (index_t j = 0; j < bytes; ++j) {
    out[2 * j] = lut[q[j] >> 4];
    out[2 * j + 1] = lut[q[j] & 15];
  }
}
#if LOOM_NF4_X86
// GCC 12 warns inside its own intrinsics (the undefined merge source of the masked builtins)
// once they are inlined here.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx2"))) inline void nf4_expand_avx2(const std::uint8_t* q, index_t bytes, const float* lut,
                                                            float* out) noexcept {
  const __m256 lut0 = _mm256_loadu_ps(lut), lut1 = _mm256_loadu_ps(lut + 8);
  index_t j = 0;
  for (; j + 8 <= bytes; j += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
    const __m256i h = _mm256_srli_epi32(b, 4), l = _mm256_and_si256(b, _mm256_set1_epi32(15));
    // a code's bit 3 picks the half of the table: shifted to the sign bit for blendv
    const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut0, h), _mm256_permutevar8x32_ps(lut1, h),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(h, 28)));
    const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut0, l), _mm256_permutevar8x32_ps(lut1, l),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(l, 28)));
    const __m256 a = _mm256_unpacklo_ps(hi, lo), c = _mm256_unpackhi_ps(hi, lo);  // pairs 0,1 | 4,5 and 2,3 | 6,7
    _mm256_storeu_ps(out + 2 * j, _mm256_permute2f128_ps(a, c, 0x20));
    _mm256_storeu_ps(out + 2 * j + 8, _mm256_permute2f128_ps(a, c, 0x31));
  }
  nf4_expand_scalar(q + j, bytes - j, lut, out + 2 * j);
}
__attribute__((target("avx512f"))) inline void nf4_expand_avx512(const std::uint8_t* q, index_t bytes, const float* lut,
                                                                 float* out) noexcept {
  const __m512 table = _mm512_loadu_ps(lut);
  // output element 2k from the high nibbles' vector (index k), 2k + 1 from the low one's (16 + k)
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  index_t j = 0;
  for (; j + 16 <= bytes; j += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table);
    _mm512_storeu_ps(out + 2 * j, _mm512_permutex2var_ps(hi, first, lo));
    _mm512_storeu_ps(out + 2 * j + 16, _mm512_permutex2var_ps(hi, second, lo));
  }
  nf4_expand_scalar(q + j, bytes - j, lut, out + 2 * j);
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
/// The best expansion this CPU runs.
inline nf4_isa nf4_best_isa() noexcept {
#if LOOM_NF4_X86
  if (cpu::has_avx512f()) return nf4_isa::avx512;
  if (cpu::has_avx2_fma()) return nf4_isa::avx2;
#endif
  return nf4_isa::scalar;
}
inline void nf4_expand(nf4_isa isa, const std::uint8_t* q, index_t bytes, const float* lut, float* out) noexcept {
#if LOOM_NF4_X86
  if (isa == nf4_isa::avx512) return nf4_expand_avx512(q, bytes, lut, out);
  if (isa == nf4_isa::avx2) return nf4_expand_avx2(q, bytes, lut, out);
#endif
  (void)isa;
  nf4_expand_scalar(q, bytes, lut, out);
}
}  // namespace detail

/// An NF4 matrix in bytes it does not own (a frozen_weight): either an nf4_matrix's own fields
/// (nf4_matrix::view) or its packed form (nf4_matrix::pack): the fields bitsandbytes stores one
/// after the other -- codes [rows * cols / 2], then the fp32 absmax [blocks], or with double
/// quantisation the absmax codes [blocks], their fp32 scales and the fp32 offset --
/// nf4_bytes(rows, cols, options) bytes in all. Why a packed form: a base partitioned over
/// data-parallel ranks (ZeRO-3) moves a matrix as one run of bytes, one all-gather, and is read
/// where it landed. The fp32 fields are read with memcpy, so the bytes need no alignment.
class nf4_view {
 public:
  nf4_view() = default;
  /// Over the fields of an nf4_matrix (absmax and scales as the bytes of their floats).
  nf4_view(index_t rows, index_t cols, const nf4_options& o, const std::uint8_t* codes, const std::uint8_t* absmax,
           const std::uint8_t* absmax_codes, const std::uint8_t* absmax_scales, float offset) noexcept
      : rows_(rows), cols_(cols), opt_(o), codes_(codes), absmax_(absmax), absmax_codes_(absmax_codes),
        absmax_scales_(absmax_scales), offset_(offset) {}
  /// Over a packed matrix [rows, cols] of format o (nf4_bytes(rows, cols, o) bytes; a loom::error
  /// names a size or shape that does not fit).
  nf4_view(index_t rows, index_t cols, const nf4_options& o, std::span<const std::uint8_t> packed)
      : rows_(rows), cols_(cols), opt_(o) {
    LOOM_CHECK(rows > 0 && cols > 0 && o.block_size > 0 && o.block_size % 2 == 0 && cols % o.block_size == 0 &&
                   (!o.double_quant || o.absmax_block_size > 0),
               "quant::nf4_view: [", rows, ", ", cols, "] in blocks of block_size=", o.block_size,
               " is not an NF4 matrix (positive shape, an even block that divides the row length)");
    LOOM_CHECK(packed.size() == nf4_bytes(rows, cols, o), "quant::nf4_view: ", packed.size(), " packed bytes, an NF4 [",
               rows, ", ", cols, "] with block_size=", o.block_size, " double_quant=", o.double_quant, " holds ",
               nf4_bytes(rows, cols, o));
    const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
    const std::size_t blocks = n / static_cast<std::size_t>(o.block_size);
    codes_ = packed.data();
    if (!o.double_quant) {
      absmax_ = codes_ + n / 2;
      return;
    }
    absmax_codes_ = codes_ + n / 2;
    absmax_scales_ = absmax_codes_ + blocks;
    std::memcpy(&offset_, packed.data() + packed.size() - sizeof(float), sizeof(float));
  }

  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  const nf4_options& options() const noexcept { return opt_; }
  index_t tile_align() const noexcept { return opt_.block_size; }
  std::size_t bytes() const noexcept { return nf4_bytes(rows_, cols_, opt_); }

  /// The absmax of block b as dequantisation uses it: stored, or with double quantisation
  /// dynamic_map[code] * scale + offset (double_quant_absmax).
  float block_absmax_of(std::size_t b) const noexcept {
    if (!opt_.double_quant) return load(absmax_, b);
    return double_quant_absmax(dynamic_map[absmax_codes_[b]], load(absmax_scales_, b / static_cast<std::size_t>(opt_.absmax_block_size)),
                               offset_);
  }

  /// out[r - r0, c - c0] = W[r, c] for r in [r0, r1), c in [c0, c1), row stride ld; c0 and c1
  /// multiples of block_size (block-aligned tiles, so every block is read whole). Each value is
  /// nf4_values[code] * absmax in fp32, bitsandbytes' dequantisation.
  void dequantize(index_t r0, index_t r1, index_t c0, index_t c1, float* out, index_t ld) const {
    const index_t bs = opt_.block_size;
    LOOM_CHECK(0 <= r0 && r0 <= r1 && r1 <= rows_ && 0 <= c0 && c0 <= c1 && c1 <= cols_ && c0 % bs == 0 &&
                   c1 % bs == 0 && ld >= c1 - c0,
               "quant::nf4_matrix::dequantize: tile rows [", r0, ", ", r1, ") cols [", c0, ", ", c1, ") ld=", ld,
               " is not a block-aligned tile of [", rows_, ", ", cols_, "] with block_size=", bs);
    static const detail::nf4_isa isa = detail::nf4_best_isa();
    for (index_t r = r0; r < r1; ++r) {
      float* o = out + (r - r0) * ld;
      for (index_t c = c0; c < c1; c += bs, o += bs) {
        const index_t i = r * cols_ + c;
        // the block's 16 scaled values once, then one look-up per code
        const float s = block_absmax_of(static_cast<std::size_t>(i / bs));
        float scaled[16];
        for (int k = 0; k < 16; ++k) scaled[k] = nf4_values[static_cast<std::size_t>(k)] * s;
        detail::nf4_expand(isa, codes_ + i / 2, bs / 2, scaled, o);
      }
    }
  }

 private:
  static float load(const std::uint8_t* floats, std::size_t i) noexcept {
    float v;
    std::memcpy(&v, floats + i * sizeof(float), sizeof(float));
    return v;
  }
  index_t rows_ = 0, cols_ = 0;
  nf4_options opt_{};
  const std::uint8_t* codes_ = nullptr;
  const std::uint8_t* absmax_ = nullptr;  // fp32 values, as bytes
  const std::uint8_t* absmax_codes_ = nullptr;
  const std::uint8_t* absmax_scales_ = nullptr;  // fp32 values, as bytes
  float offset_ = 0.0f;
};
static_assert(frozen_weight<nf4_view>);

/// A weight matrix W [rows, cols] in NF4 (a frozen_weight, frozen_weight.hpp). Built from fp32 (made once: "plan, then
/// run"), read by dequantising block-aligned tiles (dequantize) or reading the stored fields, which are bitsandbytes'
/// own: codes (QuantState's packed weight), absmax or, with double quantisation, absmax_codes + absmax_offset +
/// absmax_scales (QuantState.absmax, .offset, .state2.absmax).
class nf4_matrix {
 public:
  nf4_matrix() = default;
  /// Quantises w [rows, cols] (unit stride in dimension 1). A loom::error names a shape the
  /// format cannot hold (no rows or columns, a block size that is odd or does not divide the
  /// row length) and a value that is not finite.
  explicit nf4_matrix(tensor_view<const float, host, 2> w, const nf4_options& o = {},
                      memory_resource& mr = default_resource<host>())
      : rows_(w.extent(0)), cols_(w.extent(1)), opt_(o) {
    LOOM_CHECK(rows_ > 0 && cols_ > 0, "quant::nf4_matrix: the weight has shape [", rows_, ", ", cols_,
               "]: rows and cols must be positive");
    LOOM_CHECK(o.block_size > 0 && o.block_size % 2 == 0, "quant::nf4_matrix: block_size=", o.block_size,
               " must be positive and even (two codes a byte)");
    LOOM_CHECK(cols_ % o.block_size == 0, "quant::nf4_matrix: block_size=", o.block_size,
               " does not divide the row length cols=", cols_, " (a block must not span two rows)");
    LOOM_CHECK(!o.double_quant || o.absmax_block_size > 0, "quant::nf4_matrix: absmax_block_size=", o.absmax_block_size,
               " must be positive");
    LOOM_CHECK(w.stride(1) == 1 || cols_ == 1, "quant::nf4_matrix: w must have unit stride in dimension 1 (stride ",
               w.stride(1), ")");
    const auto n = static_cast<std::size_t>(rows_ * cols_), bs = static_cast<std::size_t>(o.block_size);
    const std::size_t blocks = n / bs;
    codes_ = buffer<std::uint8_t>(n / 2, mr);
    buffer<float> absmax(blocks, mr);
    // rows in parallel (blocks never span rows, so the parts write disjoint codes and absmax)
    host_pool().parallel_for(rows_, std::max<index_t>(1, (index_t(1) << 16) / cols_), [&](int, index_t r0, index_t r1) {
      for (index_t r = r0; r < r1; ++r) {
        const float* row = w.data() + r * w.stride(0);
        for (index_t c = 0; c < cols_; ++c)
          LOOM_CHECK(std::isfinite(row[c]), "quant::nf4_matrix: w[", r, ", ", c, "]=", row[c], " is not finite");
        for (index_t c0 = 0; c0 < cols_; c0 += o.block_size) {
          const std::size_t b = static_cast<std::size_t>(r * cols_ + c0) / bs;
          absmax[b] = block_absmax({row + c0, bs});
          const float inv = 1.0f / absmax[b];
          std::uint8_t* out = codes_.data() + (r * cols_ + c0) / 2;
          for (index_t j = 0; j < o.block_size / 2; ++j)
            out[j] =
                static_cast<std::uint8_t>(nf4_code(row[c0 + 2 * j] * inv) << 4 | nf4_code(row[c0 + 2 * j + 1] * inv));
        }
      }
    });
    if (!o.double_quant) {
      absmax_ = std::move(absmax);
      return;
    }
    // bitsandbytes: offset = mean(absmax); the differences quantised in blocks of 256. Its mean
    // is torch's fp32 reduction, whose order depends on device and build; here the sum runs in
    // double in block order and is rounded once, a definition the tests can state.
    double sum = 0;
    for (std::size_t b = 0; b < blocks; ++b) sum += absmax[b];
    offset_ = static_cast<float>(sum / static_cast<double>(blocks));
    for (std::size_t b = 0; b < blocks; ++b) absmax[b] -= offset_;
    const auto b2 = static_cast<std::size_t>(o.absmax_block_size);
    absmax_codes_ = buffer<std::uint8_t>(blocks, mr);
    absmax_scales_ = buffer<float>((blocks + b2 - 1) / b2, mr);
    quantize_blockwise_8bit({absmax.data(), blocks}, b2, {absmax_codes_.data(), blocks},
                            {absmax_scales_.data(), absmax_scales_.size()});
  }

  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  const nf4_options& options() const noexcept { return opt_; }
  /// Tiles are whole blocks wide (frozen_weight).
  index_t tile_align() const noexcept { return opt_.block_size; }
  /// [rows * cols / 2] packed codes, element 2j in the high nibble of byte j.
  std::span<const std::uint8_t> codes() const noexcept { return {codes_.data(), codes_.size()}; }
  /// [rows * cols / block_size] fp32 absmax (empty with double quantisation).
  std::span<const float> absmax() const noexcept { return {absmax_.data(), absmax_.size()}; }
  /// Double quantisation: the 8-bit codes of absmax - offset, their offset and their scales.
  std::span<const std::uint8_t> absmax_codes() const noexcept { return {absmax_codes_.data(), absmax_codes_.size()}; }
  float absmax_offset() const noexcept { return offset_; }
  std::span<const float> absmax_scales() const noexcept { return {absmax_scales_.data(), absmax_scales_.size()}; }

  /// Bytes held (codes, absmax or their codes + scales + offset): nf4_bytes(rows, cols, options).
  std::size_t bytes() const noexcept {
    return codes_.bytes() + absmax_.bytes() + absmax_codes_.bytes() + absmax_scales_.bytes() +
           (opt_.double_quant ? sizeof(float) : 0);
  }

  /// The fields as an nf4_view (valid while this matrix lives).
  nf4_view view() const noexcept {
    return {rows_, cols_, opt_, codes_.data(), reinterpret_cast<const std::uint8_t*>(absmax_.data()), absmax_codes_.data(),
            reinterpret_cast<const std::uint8_t*>(absmax_scales_.data()), offset_};
  }
  /// Writes the packed form (nf4_view) into out, nf4_bytes(rows, cols, options) bytes.
  void pack(std::span<std::uint8_t> out) const {
    LOOM_CHECK(out.size() == bytes(), "quant::nf4_matrix::pack: ", out.size(), " bytes given, the packed matrix has ", bytes());
    std::uint8_t* o = out.data();
    const auto put = [&o](const void* p, std::size_t n) {
      if (n) std::memcpy(o, p, n);
      o += n;
    };
    put(codes_.data(), codes_.bytes());
    put(absmax_.data(), absmax_.bytes());
    put(absmax_codes_.data(), absmax_codes_.bytes());
    put(absmax_scales_.data(), absmax_scales_.bytes());
    if (opt_.double_quant) put(&offset_, sizeof(float));
  }

  /// The absmax of block b as dequantisation uses it (nf4_view::block_absmax_of).
  float block_absmax_of(std::size_t b) const noexcept { return view().block_absmax_of(b); }
  /// out[r - r0, c - c0] = W[r, c] on a block-aligned tile (nf4_view::dequantize).
  void dequantize(index_t r0, index_t r1, index_t c0, index_t c1, float* out, index_t ld) const {
    view().dequantize(r0, r1, c0, c1, out, ld);
  }

 private:
  index_t rows_ = 0, cols_ = 0;
  nf4_options opt_{};
  buffer<std::uint8_t> codes_;
  buffer<float> absmax_;
  buffer<std::uint8_t> absmax_codes_;
  buffer<float> absmax_scales_;
  float offset_ = 0.0f;
};
static_assert(frozen_weight<nf4_matrix>);

}  // namespace loom::quant
