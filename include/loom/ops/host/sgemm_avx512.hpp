#pragma once
// loom's own single-precision GEMM kernel for x86-64 CPUs with AVX-512 (one thread; ops::gemm
// splits over the pool and calls it per block of C, as it would call BLAS).
//
// Why: the GEMMs of a training step are skinny (K and N of 64-1376 beside M = 1,024 tokens),
// and BLAS packs both operands of every call into its own layout first. For K = 128 that
// packing is about a sixth of the GEMM time (`perf` on the tiny benchmark model: OpenBLAS's
// copy routines 15% of the whole step). This kernel does not pack A: its micro-kernel
// broadcasts A's elements straight from the caller's rows (row-major A: 12 row streams, or 8
// where rows are a multiple of 4 KiB apart, see sgemm_blocked; transposed A: 12 adjacent
// elements of one row); B is copied, into 32-column panels
// (B is the weight or the smaller operand: its copy is 1/M of the multiply-adds). Measured
// against OpenBLAS 0.3.21's Cooperlake kernel on one Genoa core: 0.93-1.24x on the three
// benchmark models' GEMMs (1.04-1.24x on all 15 of the 1.8M-param model), within 2% at
// n = 1,024; whole training steps 1.02-1.08x (docs/benchmarks.md, "Training step").
//
// Shape of the computation (GotoBLAS's loop order without the A packing):
//   for each K block of sgemm_kc: for each N block of sgemm_nc: copy B[kblock, nblock] into
//   32-wide panels; for each 12 rows of A: for each panel: C[12 x 32] (+)= A[12 x kc] Bp[kc x 32]
//   (sgemm_rows)
// with the 12 x 32 tile of C in 24 zmm accumulators. Every element of C is one sum over k in
// ascending order (K blocks in order), whatever part of C a call covers: results do not
// depend on how ops::gemm splits C over threads. beta == 0 never reads C (BLAS semantics).
//
// Compiled with GCC/Clang's target attribute, so the library needs no -mavx512f; used only
// where the CPU reports AVX-512F at run time (sgemm_avx512_supported()).

#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define LOOM_HAS_SGEMM_AVX512 1
#include <immintrin.h>
#else
#define LOOM_HAS_SGEMM_AVX512 0
#endif

namespace loom::ops::detail {

/// Rows of C per micro-kernel call (12 x 2 zmm accumulators), K block, N block of the B copy
/// (512 x 512 floats = 1 MiB, one core's L2 on the development machine; measured best of
/// KC 256-1024, NC 128-512, rows 12 or 14).
inline constexpr int sgemm_mr = 12;
inline constexpr index_t sgemm_kc = 512, sgemm_nc = 512;

/// Whether this CPU runs the kernel (x86-64 with AVX-512F, built with GCC or Clang).
inline bool sgemm_avx512_supported() noexcept {
#if LOOM_HAS_SGEMM_AVX512
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if LOOM_HAS_SGEMM_AVX512
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

/// C[MR x 32] = alpha A[MR x kc] Bp[kc x 32] + beta C (beta == 0: C not read), columns as
/// masks m0 (0-15) and m1 (16-31). A(r, k) = a[r * lda + k], or a[k * lda + r] when AT.
template <int MR, bool AT>
LOOM_TARGET_AVX512 __attribute__((noinline)) void sgemm_micro(const float* a, index_t lda, const float* bp, index_t kc,
                                                               float* c, index_t ldc, float alpha, float beta,
                                                               __mmask16 m0, __mmask16 m1) {
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

/// sgemm_micro<rows, AT> for a run-time `rows` <= R (the last, shorter tile of a block).
template <bool AT, int R>
LOOM_TARGET_AVX512 void sgemm_micro_rows(int rows, const float* a, index_t lda, const float* bp, index_t kc, float* c,
                                         index_t ldc, float alpha, float beta, __mmask16 m0, __mmask16 m1) {
  if constexpr (R > 0) {
    if (rows == R) return sgemm_micro<R, AT>(a, lda, bp, kc, c, ldc, alpha, beta, m0, m1);
    sgemm_micro_rows<AT, R - 1>(rows, a, lda, bp, kc, c, ldc, alpha, beta, m0, m1);
  }
}

/// Lane masks of a panel of `width` (<= 32) columns.
inline void sgemm_masks(index_t width, __mmask16& m0, __mmask16& m1) noexcept {
  m0 = static_cast<__mmask16>(width >= 16 ? 0xFFFFu : (1u << width) - 1u);
  m1 = static_cast<__mmask16>(width >= 32 ? 0xFFFFu : width <= 16 ? 0u : (1u << (width - 16)) - 1u);
}

/// dst[c * ldd + r] = src[r * ld + c] for r, c < 16: a 16 x 16 transpose in registers.
LOOM_TARGET_AVX512 inline void sgemm_transpose16(const float* src, index_t ld, float* dst, index_t ldd) {
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

/// B[k0 : k0 + kc, j0 : j0 + nc] into panels [nc / 32][kc][32] (zeros past nc).
template <bool BT>
LOOM_TARGET_AVX512 void sgemm_pack_b(const float* b, index_t ldb, index_t k0, index_t kc, index_t j0, index_t nc,
                                     float* dst) {
  for (index_t p = 0; p * 32 < nc; ++p, dst += kc * 32) {
    const index_t width = std::min<index_t>(32, nc - p * 32), jb = j0 + p * 32;
    if constexpr (!BT) {  // B(k, j) = b[k * ldb + j]: rows of 32 contiguous floats
      __mmask16 m0, m1;
      sgemm_masks(width, m0, m1);
      for (index_t kk = 0; kk < kc; ++kk) {
        const float* src = b + (k0 + kk) * ldb + jb;
        _mm512_store_ps(dst + kk * 32, _mm512_maskz_loadu_ps(m0, src));
        _mm512_store_ps(dst + kk * 32 + 16, _mm512_maskz_loadu_ps(m1, src + 16));
      }
    } else {  // B(k, j) = b[j * ldb + k]: a transpose, 16 x 16 blocks where whole, else element by element
      for (index_t h = 0; h < 32; h += 16) {
        index_t kk = 0;
        if (width >= h + 16)
          for (; kk + 16 <= kc; kk += 16) sgemm_transpose16(b + (jb + h) * ldb + k0 + kk, ldb, dst + kk * 32 + h, 32);
        for (; kk < kc; ++kk)
          for (index_t j = h; j < h + 16; ++j) dst[kk * 32 + j] = j < width ? b[(jb + j) * ldb + k0 + kk] : 0.f;
      }
    }
  }
}

/// This thread's scratch for the B copy, at least `floats` long and 64-byte aligned: one
/// buffer per thread for all four layouts.
inline float* sgemm_scratch(index_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<index_t>(buffer.size()) < floats + 16) buffer.resize(static_cast<std::size_t>(floats + 16));
  return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(buffer.data()) + 63) & ~std::uintptr_t(63));
}

/// C[0:m, 0:nc] (+)= alpha A[0:m, 0:kc] Bp (the panels of one K and N block): MR-row tiles,
/// each over every 32-column panel of Bp (the last tile shorter where m % MR != 0).
template <int MR, bool AT>
LOOM_TARGET_AVX512 void sgemm_rows(index_t m, index_t nc, index_t kc, float alpha, const float* a, index_t lda,
                                   const float* bp, float beta, float* c, index_t ldc) {
  for (index_t i0 = 0; i0 < m; i0 += MR) {
    const int rows = static_cast<int>(std::min<index_t>(MR, m - i0));
    const float* ai = AT ? a + i0 : a + i0 * lda;
    for (index_t p = 0; p * 32 < nc; ++p) {
      __mmask16 m0, m1;
      sgemm_masks(std::min<index_t>(32, nc - p * 32), m0, m1);
      float* cp = c + i0 * ldc + p * 32;
      if (rows == MR)
        sgemm_micro<MR, AT>(ai, lda, bp + p * kc * 32, kc, cp, ldc, alpha, beta, m0, m1);
      else
        sgemm_micro_rows<AT, MR - 1>(rows, ai, lda, bp + p * kc * 32, kc, cp, ldc, alpha, beta, m0, m1);
    }
  }
}

template <bool AT, bool BT>
LOOM_TARGET_AVX512 void sgemm_blocked(index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
                                      const float* b, index_t ldb, float beta, float* c, index_t ldc) {
  // Rows of a row-major A a multiple of 4 KiB apart fall into the same L1 sets (8 ways): 12
  // of them would evict each other before each cache line's 16 floats are used. Such A (a
  // [tokens, vocab] gradient) is read 8 rows at a time (measured on the output layer's input
  // gradient, 1024 x 128 x 4096: 8-row tiles 20% faster than copying 12 rows first, and as
  // fast as 12-row tiles on rows padded out of the alias).
  const bool aliased_rows = !AT && lda % 1024 == 0;
  const index_t kmax = std::min(k, sgemm_kc);
  float* bp = sgemm_scratch(kmax * ((std::min(n, sgemm_nc) + 31) / 32 * 32));
  for (index_t k0 = 0; k0 < k; k0 += sgemm_kc) {
    const index_t kc = std::min(sgemm_kc, k - k0);
    const float beta_k = k0 == 0 ? beta : 1.f;  // later K blocks add to C
    const float* ak = AT ? a + k0 * lda : a + k0;
    for (index_t j0 = 0; j0 < n; j0 += sgemm_nc) {
      const index_t nc = std::min(sgemm_nc, n - j0);
      sgemm_pack_b<BT>(b, ldb, k0, kc, j0, nc, bp);
      if (aliased_rows)
        sgemm_rows<8, false>(m, nc, kc, alpha, ak, lda, bp, beta_k, c + j0, ldc);
      else
        sgemm_rows<sgemm_mr, AT>(m, nc, kc, alpha, ak, lda, bp, beta_k, c + j0, ldc);
    }
  }
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#if defined(__CUDACC__)
#pragma nv_diagnostic pop
#endif
#undef LOOM_TARGET_AVX512
#endif

/// C[m, n] = alpha op(A) op(B) + beta C, row-major as cblas_sgemm(CblasRowMajor, ...): A(i, k)
/// = a[i * lda + k], or a[k * lda + i] when a_trans; B(k, j) = b[k * ldb + j], or b[j * ldb + k]
/// when b_trans. Requires m, n, k > 0 and sgemm_avx512_supported().
inline void sgemm_avx512(bool a_trans, bool b_trans, index_t m, index_t n, index_t k, float alpha, const float* a,
                         index_t lda, const float* b, index_t ldb, float beta, float* c, index_t ldc) {
#if LOOM_HAS_SGEMM_AVX512
  if (a_trans) {
    if (b_trans) return sgemm_blocked<true, true>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return sgemm_blocked<true, false>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  if (b_trans) return sgemm_blocked<false, true>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  sgemm_blocked<false, false>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#else
  (void)a_trans, (void)b_trans, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb,
      (void)beta, (void)c, (void)ldc;
#endif
}

}  // namespace loom::ops::detail
