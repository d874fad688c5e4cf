#pragma once
// The AVX2 half of loom's sgemm kernel (x86-64 with AVX2 and FMA: Intel since Haswell, AMD
// since Zen 1; most client CPUs and AMD servers before Zen 4 have no AVX-512). The blocked
// loop around it, and the rule by which every kernel computes each element of C (so this
// one and the AVX-512 one give the same bits), are in sgemm.hpp.
//
// Tile: 6 x 16 floats of C in 12 ymm accumulators, plus two for the B panel's row and one
// for the broadcast A element: 15 of the 16 ymm registers, 12 FMAs for 2 loads and 6
// broadcasts per k (BLIS's Haswell shape). B is copied into 16-column panels (an 8 x 8
// register transpose when B is a transposed weight). Six rows fit the 8 ways of L1, so A
// rows 4 KiB apart need no shorter tile.

#include <loom/core/cpu.hpp>
#include <loom/ops/host/sgemm.hpp>

namespace loom::ops::detail {

#if LOOM_HAS_SGEMM_X86
#define LOOM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#if defined(__CUDACC__)  // nvcc's front end does not know GCC's unroll pragma (the host compiler does)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

struct sgemm_avx2 {
  static constexpr const char* name = "avx2";
  static constexpr int mr = 6, mr_aliased = 6, nr = 16, tr = 8;
  static constexpr index_t nc = 512;
  // A transposed A 4 KiB-strided (dW of the output layer) is copied tile by tile: reading its
  // 6 floats a line straight from 512 rows in one L1 set ran at 0.7x OpenBLAS; the copy made
  // it 1.27x faster (docs/benchmarks.md).
  static constexpr bool pack_aliased_at = true;

  static bool supported() noexcept { return cpu::has_avx2_fma(); }

  /// Lane masks (all ones where written) of the two 8-column halves of a `width` (<= 16) panel.
  LOOM_TARGET_AVX2 static void masks(int width, __m256i& m0, __m256i& m1) noexcept {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lane);
    m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(width - 8), lane);
  }

  template <int MR, bool AT>
  LOOM_TARGET_AVX2 __attribute__((noinline)) static void micro(const float* a, index_t lda, const float* bp, index_t kc,
                                                                float* c, index_t ldc, float alpha, float beta,
                                                                int width) {
    __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    if constexpr (AT) {
      for (index_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_load_ps(bp + k * 16), b1 = _mm256_load_ps(bp + k * 16 + 8);
        const float* ak = a + k * lda;
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 av = _mm256_broadcast_ss(ak + r);
          acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
          acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
        }
      }
    } else {
      const float* ar[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) ar[r] = a + r * lda;
      for (index_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_load_ps(bp + k * 16), b1 = _mm256_load_ps(bp + k * 16 + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 av = _mm256_broadcast_ss(ar[r] + k);
          acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
          acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
        }
      }
    }
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    if (width == 16) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        float* cr = c + r * ldc;
        if (beta == 0.f) {
          _mm256_storeu_ps(cr, _mm256_mul_ps(va, acc0[r]));
          _mm256_storeu_ps(cr + 8, _mm256_mul_ps(va, acc1[r]));
        } else {
          _mm256_storeu_ps(cr, _mm256_fmadd_ps(va, acc0[r], _mm256_mul_ps(vb, _mm256_loadu_ps(cr))));
          _mm256_storeu_ps(cr + 8, _mm256_fmadd_ps(va, acc1[r], _mm256_mul_ps(vb, _mm256_loadu_ps(cr + 8))));
        }
      }
      return;
    }
    __m256i m0, m1;  // a panel's last columns: masked loads and stores never touch the others
    masks(width, m0, m1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      float* cr = c + r * ldc;
      if (beta == 0.f) {
        _mm256_maskstore_ps(cr, m0, _mm256_mul_ps(va, acc0[r]));
        _mm256_maskstore_ps(cr + 8, m1, _mm256_mul_ps(va, acc1[r]));
      } else {
        _mm256_maskstore_ps(cr, m0, _mm256_fmadd_ps(va, acc0[r], _mm256_mul_ps(vb, _mm256_maskload_ps(cr, m0))));
        _mm256_maskstore_ps(cr + 8, m1,
                            _mm256_fmadd_ps(va, acc1[r], _mm256_mul_ps(vb, _mm256_maskload_ps(cr + 8, m1))));
      }
    }
  }

  /// dst[c * ldd + r] = src[r * ld + c] for r, c < 8: an 8 x 8 transpose in registers.
  LOOM_TARGET_AVX2 static void transpose(const float* src, index_t ld, float* dst, index_t ldd) {
    __m256 r[8], t[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 8; i += 4) {  // r[i + q], 128-bit lane L: rows i..i+3 of column 4L + q
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {  // whole columns q and 4 + q: rows 0-3 from r[q], rows 4-7 from r[4 + q]
      _mm256_storeu_ps(dst + q * ldd, _mm256_permute2f128_ps(r[q], r[4 + q], 0x20));
      _mm256_storeu_ps(dst + (4 + q) * ldd, _mm256_permute2f128_ps(r[q], r[4 + q], 0x31));
    }
  }

  /// Row-major B[k0 : k0 + kc, j0 : j0 + nc] into 16-column panels [nc / 16][kc][16], zeros past nc.
  LOOM_TARGET_AVX2 static void pack_b(const float* b, index_t ldb, index_t k0, index_t kc, index_t j0, index_t nc,
                                      float* dst) {
    for (index_t p = 0; p * 16 < nc; ++p, dst += kc * 16) {
      const index_t width = std::min<index_t>(16, nc - p * 16), jb = j0 + p * 16;
      // B(k, j) = b[k * ldb + j]: rows of 16 contiguous floats
      if (width == 16) {
        for (index_t kk = 0; kk < kc; ++kk) {
          const float* src = b + (k0 + kk) * ldb + jb;
          _mm256_store_ps(dst + kk * 16, _mm256_loadu_ps(src));
          _mm256_store_ps(dst + kk * 16 + 8, _mm256_loadu_ps(src + 8));
        }
      } else {
        __m256i m0, m1;
        masks(static_cast<int>(width), m0, m1);
        for (index_t kk = 0; kk < kc; ++kk) {
          const float* src = b + (k0 + kk) * ldb + jb;
          _mm256_store_ps(dst + kk * 16, _mm256_maskload_ps(src, m0));
          _mm256_store_ps(dst + kk * 16 + 8, _mm256_maskload_ps(src + 8, m1));
        }
      }
    }
  }
};
static_assert(sgemm_isa<sgemm_avx2>);

#if defined(__CUDACC__)
#pragma nv_diagnostic pop
#endif
#undef LOOM_TARGET_AVX2
#endif  // LOOM_HAS_SGEMM_X86

}  // namespace loom::ops::detail
