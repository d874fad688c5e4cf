#pragma once
// The AVX-512 half of loom's sgemm kernel (x86-64 with AVX-512F): a 12 x 32 tile of C in 24
// zmm accumulators, B copied into 32-column panels (a 16 x 16 register transpose when B is a
// transposed weight). The blocked loop around it, and the rule by which every kernel
// computes each element of C (so this one and the AVX2 one give the same bits), are in
// sgemm.hpp.
//
// Tiling (measured on one Genoa core, best of NC 128-512 and 12 or 14 rows): 12 x 32 tiles,
// N blocks of 512 columns (a 512 x 512 B copy is 1 MiB, the L2 of that core). A row-major A
// whose rows are a multiple of 4 KiB apart is read 8 rows a tile (8 ways of L1; measured on
// the output layer's input gradient, 1024 x 128 x 4096: 20% faster than copying 12 rows first,
// and as fast as 12-row tiles over rows padded out of the alias).

#include <loom/core/cpu.hpp>
#include <loom/ops/host/sgemm.hpp>

namespace loom::ops::detail {

#if LOOM_HAS_SGEMM_X86
#define LOOM_TARGET_AVX512 __attribute__((target("avx512f")))
#if defined(__CUDACC__)  // nvcc's front end does not know GCC's unroll pragma (the host compiler does)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif
// GCC 12 warns inside its own intrinsics (_mm512_undefined_ps as the unused merge source of
// the unpack intrinsics) once they are inlined here.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

struct sgemm_avx512 {
  static constexpr const char* name = "avx512";
  static constexpr int mr = 12, mr_aliased = 8, nr = 32, tr = 16;
  static constexpr index_t nc = 512;
  // Its 12-float reads use most of each line of a 4 KiB-strided transposed A; copying the
  // tile first was slower (docs/benchmarks.md).
  static constexpr bool pack_aliased_at = false;

  static bool supported() noexcept { return cpu::has_avx512f(); }

  /// Lane masks of a panel of `width` (<= 32) columns.
  static void masks(int width, __mmask16& m0, __mmask16& m1) noexcept {
    m0 = static_cast<__mmask16>(width >= 16 ? 0xFFFFu : (1u << width) - 1u);
    m1 = static_cast<__mmask16>(width >= 32 ? 0xFFFFu : width <= 16 ? 0u : (1u << (width - 16)) - 1u);
  }

  template <int MR, bool AT>
  LOOM_TARGET_AVX512 __attribute__((noinline)) static void micro(const float* a, index_t lda, const float* bp,
                                                                  index_t kc, float* c, index_t ldc, float alpha,
                                                                  float beta, int width) {
    __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    if constexpr (AT) {
      for (index_t k = 0; k < kc; ++k) {
        const __m512 b0 = _mm512_load_ps(bp + k * 32), b1 = _mm512_load_ps(bp + k * 32 + 16);
        const float* ak = a + k * lda;
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m512 av = _mm512_set1_ps(ak[r]);
          acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
          acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
        }
      }
    } else {
      const float* ar[MR];
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) ar[r] = a + r * lda;
      for (index_t k = 0; k < kc; ++k) {
        const __m512 b0 = _mm512_load_ps(bp + k * 32), b1 = _mm512_load_ps(bp + k * 32 + 16);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m512 av = _mm512_set1_ps(ar[r][k]);
          acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
          acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
        }
      }
    }
    __mmask16 m0, m1;
    masks(width, m0, m1);
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      float* cr = c + r * ldc;
      if (beta == 0.f) {
        _mm512_mask_storeu_ps(cr, m0, _mm512_mul_ps(va, acc0[r]));
        _mm512_mask_storeu_ps(cr + 16, m1, _mm512_mul_ps(va, acc1[r]));
      } else {
        _mm512_mask_storeu_ps(cr, m0, _mm512_fmadd_ps(va, acc0[r], _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(m0, cr))));
        _mm512_mask_storeu_ps(cr + 16, m1,
                              _mm512_fmadd_ps(va, acc1[r], _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16))));
      }
    }
  }

  /// dst[c * ldd + r] = src[r * ld + c] for r, c < 16: a 16 x 16 transpose in registers.
  LOOM_TARGET_AVX512 static void transpose(const float* src, index_t ld, float* dst, index_t ldd) {
    __m512 r[16], t[16];
  #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  #pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
  #pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {  // r[4g + q], 128-bit lane L: rows 4g..4g+3 of column 4L + q
      const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]), t2 = _mm512_castps_pd(t[i + 2]),
                    t3 = _mm512_castps_pd(t[i + 3]);
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
  #pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {  // t[q]: lanes (rows 0-3, col q), (0-3, 8+q), (4-7, q), (4-7, 8+q); and so on
      t[q] = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88);
      t[4 + q] = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xdd);
      t[8 + q] = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88);
      t[12 + q] = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xdd);
    }
  #pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {  // whole columns q, 8 + q, 4 + q, 12 + q
      _mm512_storeu_ps(dst + q * ldd, _mm512_shuffle_f32x4(t[q], t[8 + q], 0x88));
      _mm512_storeu_ps(dst + (8 + q) * ldd, _mm512_shuffle_f32x4(t[q], t[8 + q], 0xdd));
      _mm512_storeu_ps(dst + (4 + q) * ldd, _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0x88));
      _mm512_storeu_ps(dst + (12 + q) * ldd, _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0xdd));
    }
  }

  /// Row-major B[k0 : k0 + kc, j0 : j0 + nc] into 32-column panels [nc / 32][kc][32], zeros past nc.
  LOOM_TARGET_AVX512 static void pack_b(const float* b, index_t ldb, index_t k0, index_t kc, index_t j0, index_t nc,
                                        float* dst) {
    for (index_t p = 0; p * 32 < nc; ++p, dst += kc * 32) {
      const index_t width = std::min<index_t>(32, nc - p * 32), jb = j0 + p * 32;
      // B(k, j) = b[k * ldb + j]: rows of 32 contiguous floats
      __mmask16 m0, m1;
      masks(static_cast<int>(width), m0, m1);
      for (index_t kk = 0; kk < kc; ++kk) {
        const float* src = b + (k0 + kk) * ldb + jb;
        _mm512_store_ps(dst + kk * 32, _mm512_maskz_loadu_ps(m0, src));
        _mm512_store_ps(dst + kk * 32 + 16, _mm512_maskz_loadu_ps(m1, src + 16));
      }
    }
  }
};
static_assert(sgemm_isa<sgemm_avx512>);

#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#if defined(__CUDACC__)
#pragma nv_diagnostic pop
#endif
#undef LOOM_TARGET_AVX512
#endif  // LOOM_HAS_SGEMM_X86

}  // namespace loom::ops::detail
