#pragma once
// loom's own single-precision GEMM kernels (one thread each; ops::gemm splits C over the pool
// and calls one per block of C, as it would call BLAS): one blocked loop, here, over a
// micro-kernel and a B-panel copy per instruction set, each in a file of its own:
//   sgemm_avx512.hpp  12 x 32 tiles of C in 24 zmm registers (x86-64 with AVX-512F)
//   sgemm_avx2.hpp     6 x 16 tiles of C in 12 ymm registers (x86-64 with AVX2 and FMA)
//
// Why our own: the GEMMs of a training step are skinny (K and N of 64-1376 beside M = 1,024
// tokens), and BLAS packs both operands of every call into its own layout first; for K = 128
// that packing is a sixth of the GEMM time. These kernels never pack A: the micro-kernel
// broadcasts A's elements straight from the caller's rows (row-major A: one stream per tile
// row; transposed A: adjacent elements of one row). Only B is copied, into panels as wide as
// the tile (B is the weight or the narrower operand: its copy is 1/M of the multiply-adds).
//
// Loop order (GotoBLAS's, without the A packing):
//   for each K block of sgemm_kc: for each N block of K::nc: copy B[kblock, nblock] into
//   K::nr-wide panels; for each K::mr rows of A: for each panel: C[mr x nr] (+)= A Bp
//
// Same bits everywhere: every element of C is computed as
//   acc = 0; for k in the K block, ascending: acc = fma(A(i, k), B(k, j), acc)
//   C = alpha * acc                          (first K block, beta == 0: C is not read)
//   C = fma(alpha, acc, beta' * C)           (beta' = beta in the first K block, else 1)
// one lane of one register, whichever kernel, tile, panel or part of C computes it. The K
// blocks are the same (sgemm_kc) in every kernel, so the AVX-512 and AVX2 kernels give the
// same bits as each other, on any thread count and any split of C: a training run is
// reproducible across the x86-64 machines of a cluster, not only on one of them. Only the
// tiling (mr, nr, nc) is per instruction set; it changes speed, never results.
//
// The micro-kernels and panel copies are compiled with GCC/Clang's target attribute, so the
// library needs no -mavx512f or -mavx2; each is used only where the CPU reports its
// features at run time (K::supported()). This file is the part every instruction set shares;
// the kernel files include it, and ops/host/gemm.hpp chooses among them.

#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define LOOM_HAS_SGEMM_X86 1
#include <immintrin.h>
#else
#define LOOM_HAS_SGEMM_X86 0
#endif

namespace loom::ops::detail {

/// Depth of a K block. The one tiling constant every kernel shares: it decides where partial
/// sums are rounded into C (measured best of 256-1024 on the AVX-512 kernel).
inline constexpr index_t sgemm_kc = 512;

/// This thread's scratch for the B copy, at least `floats` long and 64-byte aligned: one
/// buffer per thread for every kernel and layout.
inline float* sgemm_scratch(index_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<index_t>(buffer.size()) < floats + 16) buffer.resize(static_cast<std::size_t>(floats + 16));
  return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(buffer.data()) + 63) & ~std::uintptr_t(63));
}

/// Requires: K is one instruction set's half of an sgemm kernel:
/// - `K::mr`, `K::nr`: rows and columns of C in one micro-kernel tile; `K::mr_aliased`: the
///   rows of a tile when A's rows are a multiple of 4 KiB apart (see sgemm_blocked);
///   `K::pack_aliased_at`: whether a transposed A of such a stride is copied tile by tile;
///   `K::nc`: columns of one B copy;
/// - `K::supported()`: whether this CPU runs it;
/// - `K::micro<MR, AT>(a, lda, bp, kc, c, ldc, alpha, beta, width)`: C[MR x width] (+)= the
///   tile, by the rule in this file's header (A(r, k) = a[r lda + k], or a[k lda + r] when AT;
///   Bp: kc rows of nr floats; width <= nr columns of C written, no others touched);
/// - `K::pack_b(b, ldb, k0, kc, j0, nc, dst)`: row-major B[k0 : k0 + kc, j0 : j0 + nc] (B(k, j)
///   = b[k ldb + j]) into panels [nc / nr][kc][nr], zeros past nc;
/// - `K::transpose(src, ld, dst, ldd)`: dst[c ldd + r] = src[r ld + c] for r, c < K::tr (a
///   register transpose; nr a multiple of tr), for the panels of a transposed B.
template <class K>
concept sgemm_isa = requires(const float* src, float* dst, index_t i) {
  { K::mr } -> std::convertible_to<int>;
  { K::mr_aliased } -> std::convertible_to<int>;
  { K::pack_aliased_at } -> std::convertible_to<bool>;
  { K::nr } -> std::convertible_to<int>;
  { K::tr } -> std::convertible_to<int>;
  { K::nc } -> std::convertible_to<index_t>;
  { K::supported() } -> std::same_as<bool>;
  K::pack_b(src, i, i, i, i, i, dst);
  K::transpose(src, i, dst, i);
};

/// A transposed B (B(k, j) = b[j ldb + k]) from B[k0 : k0 + kc, j0 : j0 + nc] into K's panels
/// [nc / nr][kc][nr]: K::tr x K::tr register transposes where the block is whole, the rest
/// element by element, zeros past nc (columns past B's end are never read).
template <sgemm_isa K>
inline void sgemm_pack_bt(const float* b, index_t ldb, index_t k0, index_t kc, index_t j0, index_t nc, float* dst) {
  constexpr index_t nr = K::nr, tr = K::tr;
  for (index_t p = 0; p * nr < nc; ++p, dst += kc * nr) {
    const index_t width = std::min<index_t>(nr, nc - p * nr), jb = j0 + p * nr;
    for (index_t h = 0; h < nr; h += tr) {
      index_t kk = 0;
      if (width >= h + tr)
        for (; kk + tr <= kc; kk += tr) K::transpose(b + (jb + h) * ldb + k0 + kk, ldb, dst + kk * nr + h, nr);
      for (; kk < kc; ++kk) {
        index_t j = h;
        for (; j < std::min(h + tr, width); ++j) dst[kk * nr + j] = b[(jb + j) * ldb + k0 + kk];
        for (; j < h + tr; ++j) dst[kk * nr + j] = 0.f;
      }
    }
  }
}

/// K::micro<rows, AT> for a run-time `rows` <= R (the last, shorter tile of a block).
template <sgemm_isa K, int R, bool AT>
inline void sgemm_micro_rows(int rows, const float* a, index_t lda, const float* bp, index_t kc, float* c, index_t ldc,
                             float alpha, float beta, int width) {
  if constexpr (R > 0) {
    if (rows == R) return K::template micro<R, AT>(a, lda, bp, kc, c, ldc, alpha, beta, width);
    sgemm_micro_rows<K, R - 1, AT>(rows, a, lda, bp, kc, c, ldc, alpha, beta, width);
  }
}

/// C[0:m, 0:nc] (+)= alpha A[0:m, 0:kc] Bp (the panels of one K and N block): MR-row tiles,
/// each over every panel of Bp (the last tile shorter where m % MR != 0). apack, when given
/// (a transposed A whose rows are a multiple of 4 KiB apart), receives each tile's A as
/// [kc][MR] first, and the micro-kernel reads it from there.
template <sgemm_isa K, int MR, bool AT>
inline void sgemm_rows(index_t m, index_t nc, index_t kc, float alpha, const float* a, index_t lda, const float* bp,
                       float beta, float* c, index_t ldc, float* apack) {
  for (index_t i0 = 0; i0 < m; i0 += MR) {
    const int rows = static_cast<int>(std::min<index_t>(MR, m - i0));
    const float* ai = AT ? a + i0 : a + i0 * lda;
    index_t la = lda;
    if (AT && apack) {  // the same values in the same order: the bits do not change
      for (index_t k = 0; k < kc; ++k)
        for (int r = 0; r < rows; ++r) apack[k * MR + r] = ai[k * lda + r];
      ai = apack, la = MR;
    }
    for (index_t p = 0; p * K::nr < nc; ++p) {
      const int width = static_cast<int>(std::min<index_t>(K::nr, nc - p * K::nr));
      const float* panel = bp + p * kc * K::nr;
      float* cp = c + i0 * ldc + p * K::nr;
      if (rows == MR)
        K::template micro<MR, AT>(ai, la, panel, kc, cp, ldc, alpha, beta, width);
      else
        sgemm_micro_rows<K, MR - 1, AT>(rows, ai, la, panel, kc, cp, ldc, alpha, beta, width);
    }
  }
}

template <sgemm_isa K, bool AT, bool BT>
inline void sgemm_blocked(index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda, const float* b,
                          index_t ldb, float beta, float* c, index_t ldc) {
  // Rows of a row-major A a multiple of 4 KiB apart fall into the same L1 sets (8 ways): a
  // tile of more rows than ways would evict its own lines before each line's 16 floats are
  // used. Such A (a [tokens, vocab] gradient) is read K::mr_aliased rows a tile. A transposed
  // A of such a stride (dW = dlogits^T x) walks k down one set, each step using only a
  // tile's width of a line: where K::pack_aliased_at says so, its tile is copied once per K
  // block into a contiguous [kc][mr] block (reused across every panel of the N block).
  const bool aliased_rows = lda % 1024 == 0;
  const bool pack_a = AT && aliased_rows && K::pack_aliased_at;
  const index_t kmax = std::min(k, sgemm_kc);
  const index_t b_floats = kmax * ((std::min(n, K::nc) + K::nr - 1) / K::nr * K::nr);
  float* bp = sgemm_scratch(b_floats + (pack_a ? kmax * K::mr + 16 : 0));
  float* apack = pack_a ? bp + (b_floats + 15) / 16 * 16 : nullptr;
  for (index_t k0 = 0; k0 < k; k0 += sgemm_kc) {
    const index_t kc = std::min(sgemm_kc, k - k0);
    const float beta_k = k0 == 0 ? beta : 1.f;  // later K blocks add to C
    const float* ak = AT ? a + k0 * lda : a + k0;
    for (index_t j0 = 0; j0 < n; j0 += K::nc) {
      const index_t nc = std::min(K::nc, n - j0);
      if constexpr (BT)
        sgemm_pack_bt<K>(b, ldb, k0, kc, j0, nc, bp);
      else
        K::pack_b(b, ldb, k0, kc, j0, nc, bp);
      if (!AT && aliased_rows)
        sgemm_rows<K, K::mr_aliased, false>(m, nc, kc, alpha, ak, lda, bp, beta_k, c + j0, ldc, nullptr);
      else
        sgemm_rows<K, K::mr, AT>(m, nc, kc, alpha, ak, lda, bp, beta_k, c + j0, ldc, apack);
    }
  }
}

/// Where K::pack_b / sgemm_pack_bt put B's panels when B is packed once for many products
/// (ops::packed_weight): block (kb, jb), the K block kb and N block jb, holds
/// [ceil(nc / nr)][kc][nr] floats at offset(kb, jb), blocks in kb-major order.
template <sgemm_isa K>
struct sgemm_packed_layout {
  index_t n = 0, k = 0;
  index_t k_blocks() const noexcept { return (k + sgemm_kc - 1) / sgemm_kc; }
  index_t n_blocks() const noexcept { return (n + K::nc - 1) / K::nc; }
  index_t panels() const noexcept { return (n + K::nr - 1) / K::nr; }
  index_t kc(index_t kb) const noexcept { return std::min(sgemm_kc, k - kb * sgemm_kc); }
  index_t nc(index_t jb) const noexcept { return std::min(K::nc, n - jb * K::nc); }
  /// Floats of all of K block kb: every N block's panels.
  index_t k_block_floats(index_t kb) const noexcept { return kc(kb) * panels() * K::nr; }
  index_t offset(index_t kb, index_t jb) const noexcept {
    return kb * sgemm_kc * panels() * K::nr + kc(kb) * jb * K::nc;  // earlier K blocks are all full
  }
  index_t floats() const noexcept { return k > 0 ? offset(k_blocks() - 1, 0) + k_block_floats(k_blocks() - 1) : 0; }
};

/// Packs B^T (w [n, k] row-major: y = x w^T) into sgemm_packed_layout<K>.
template <sgemm_isa K>
inline void sgemm_pack_weight(const float* w, index_t ldw, index_t n, index_t k, float* dst) {
  const sgemm_packed_layout<K> L{n, k};
  for (index_t kb = 0; kb < L.k_blocks(); ++kb)
    for (index_t jb = 0; jb < L.n_blocks(); ++jb)
      sgemm_pack_bt<K>(w, ldw, kb * sgemm_kc, L.kc(kb), jb * K::nc, L.nc(jb), dst + L.offset(kb, jb));
}

/// C[0:m, panels [p0, p1)] = alpha A B + beta C with B packed by sgemm_pack_weight (A
/// row-major, lda apart): the same micro-kernel calls, K blocks and rule as sgemm(), so the
/// same bits, without copying B.
template <sgemm_isa K>
inline void sgemm_prepacked(index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
                            const float* packed, index_t p0, index_t p1, float beta, float* c, index_t ldc) {
  const sgemm_packed_layout<K> L{n, k};
  const bool aliased_rows = lda % 1024 == 0;
  const index_t per_block = K::nc / K::nr;  // panels of a full N block
  for (index_t kb = 0; kb < L.k_blocks(); ++kb) {
    const index_t kc = L.kc(kb);
    const float beta_k = kb == 0 ? beta : 1.f;
    for (index_t jb = p0 / per_block; jb * per_block < p1; ++jb) {
      const index_t q0 = std::max(p0, jb * per_block), q1 = std::min(p1, (jb + 1) * per_block);
      const index_t j0 = q0 * K::nr, nc = std::min(n, q1 * K::nr) - j0;
      const float* bp = packed + L.offset(kb, jb) + (q0 - jb * per_block) * kc * K::nr;
      if (aliased_rows)
        sgemm_rows<K, K::mr_aliased, false>(m, nc, kc, alpha, a + kb * sgemm_kc, lda, bp, beta_k, c + j0, ldc, nullptr);
      else
        sgemm_rows<K, K::mr, false>(m, nc, kc, alpha, a + kb * sgemm_kc, lda, bp, beta_k, c + j0, ldc, nullptr);
    }
  }
}

/// C[m, n] = alpha op(A) op(B) + beta C on kernel K, row-major as cblas_sgemm(CblasRowMajor,
/// ...): A(i, k) = a[i * lda + k], or a[k * lda + i] when a_trans; B(k, j) = b[k * ldb + j],
/// or b[j * ldb + k] when b_trans. Requires m, n, k > 0 and K::supported().
template <sgemm_isa K>
inline void sgemm(bool a_trans, bool b_trans, index_t m, index_t n, index_t k, float alpha, const float* a,
                  index_t lda, const float* b, index_t ldb, float beta, float* c, index_t ldc) {
  if (a_trans) {
    if (b_trans) return sgemm_blocked<K, true, true>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return sgemm_blocked<K, true, false>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  if (b_trans) return sgemm_blocked<K, false, true>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  sgemm_blocked<K, false, false>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace loom::ops::detail
