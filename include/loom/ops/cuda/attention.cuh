#pragma once
// Causal (and prefix-LM) attention with grouped-query heads on a CUDA device, forward and
// backward, under the host's names (ops/host/attention.hpp) with the cuda tag and a stream.
// Same layouts: q, out [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim];
// query head h reads kv head h / (heads / kv_heads); the mask is ops/math/attention.hpp's,
// the host's.
//
// The algorithm is FlashAttention-2's, in fp32 on the CUDA cores: no [seq, seq] matrix is
// stored. Forward keeps, per query row, the running maximum, sum and output of the online
// softmax over tiles of keys staged in shared memory and saves the row's log-sum-exp (lse,
// [batch, heads, seq]) for backward, which recomputes each probability as e^(s - lse):
//   delta_t = <dO_t, O_t>                       (equal to the host's <dP_t, P_t>)
//   dS = P (dP - delta) scale,  dQ += dS K       (a block per query tile, over key tiles)
//   dV += P^T dO,  dK += dS^T Q                  (a block per key tile of one kv head, over
//                                                  its query heads and the query tiles that
//                                                  see it)
// Where the host multiplies whole tiles with GEMMs, these kernels give each lane one key (or
// query) of a 32-wide tile: a lane makes its score with a dot product over shared memory, the
// tile's maximum and sum are warp reductions, and the tile enters the row's state through
// ops::math::online_softmax_merge (the step the paged decode kernel and its host test use).
// Every sum runs in a fixed order (keys, query heads and queries ascending; no atomics), so a
// result is the same on every run; it differs from the host's only by the order of additions.
//
// Limits: fp32 operands, head_dim <= 256. Tensor-core tiles (bf16 mma) are the next step for
// speed; this version is the reference the GPU trainer can run and test against the host.
// The kernels and their launch code also compile with g++ for the emulator (tests/ops/cuda/
// emulation.hpp: a CUDA thread a fiber), so the CPU CI checks them against the host's attention.

#include <loom/core/device.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/attention.hpp>
#include <loom/ops/math/exp.hpp>
#include <loom/ops/math/softmax.hpp>

#include <cmath>
#include <cstddef>
#include <type_traits>

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/error.hpp>
#include <loom/ops/checks.hpp>

#include <cuda_runtime.h>

namespace loom::ops {

namespace kernels {

inline constexpr int attention_warps = 4;
inline constexpr int attention_tile_keys = 32;       // keys (backward dK/dV: queries) of a shared tile: one a lane
inline constexpr int attention_rows_per_warp = 8;    // forward and dQ: query rows a warp carries
inline constexpr int attention_kv_rows_per_warp = 4;  // dK/dV: key rows a warp carries (two accumulators each)
inline constexpr int attention_max_head_dim = 256;

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float dot_row(const float* __restrict__ a, const float* __restrict__ b, int dim) {
  float s = 0.f;
  for (int d = 0; d < dim; ++d) s += a[d] * b[d];
  return s;
}

/// dst[r * ld + d] = src[(t0 + r) * row_stride + d] for r < n, d < dim, by the whole block.
__device__ inline void load_rows(float* __restrict__ dst, int ld, const float* __restrict__ src, index_t row_stride,
                                 index_t t0, int n, int dim) {
  for (int e = static_cast<int>(threadIdx.x); e < n * dim; e += static_cast<int>(blockDim.x)) {
    const int r = e / dim, d = e % dim;
    dst[r * ld + d] = src[(t0 + r) * row_stride + d];
  }
}

/// Shared-memory row stride of a tile read a row per lane: odd, so the 32 lanes' rows fall
/// into 32 different banks.
__host__ __device__ inline int attention_ld(int dim) { return dim % 2 ? dim : dim + 1; }

/// One tile of keys into one query row's online-softmax state (running max m, sum l and
/// output acc, lane-strided: element lane + 32 e), by the row's warp: lane j scores key t0 + j
/// of the staged tile (ks, vs: [nk][ld]) when it is below `vis` (the row's visible keys), the
/// tile's maximum and sum are warp reductions, and the tile merges into the state with
/// ops::math::online_softmax_merge. The training forward and paged prefill share it.
template <int DPL>
__device__ inline void online_softmax_tile(const float* qrow, const float* ks, const float* vs, int ld, int nk, index_t t0,
                                           index_t vis, int dim, float scale, int lane, float& m, float& l,
                                           float (&acc)[DPL]) {
  const bool valid = lane < nk && t0 + lane < vis;
  const float sc = valid ? dot_row(qrow, ks + lane * ld, dim) * scale : -INFINITY;
  const float mx = warp_max(sc);  // the caller passes tiles with a visible key: finite
  const float p = valid ? ops::exp(sc - mx) : 0.f;
  const float ls = warp_sum(p);
  float part[DPL] = {};
  for (int j = 0; j < nk; ++j) {
    const float pj = __shfl_sync(0xffffffffu, p, j);
    const float* vr = vs + j * ld;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (lane + 32 * e < dim) part[e] += pj * vr[lane + 32 * e];
  }
  float c1, c2;
  math::online_softmax_merge(m, l, mx, ls, c1, c2);
#pragma unroll
  for (int e = 0; e < DPL; ++e) acc[e] = acc[e] * c1 + part[e] * c2;
}

/// The online-softmax state of the RPW query rows a warp carries (running max, sum and
/// lane-strided output each), for the training forward and paged prefill.
template <int RPW, int DPL>
struct online_softmax_rows {
  float m[RPW], l[RPW], acc[RPW][DPL];
  __device__ online_softmax_rows() {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      m[i] = -INFINITY, l[i] = 0.f;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[i][e] = 0.f;
    }
  }
  /// Row i's output, acc / l (zeros for a row that saw no key), into orow [dim].
  __device__ void write(int i, float* orow, int dim, int lane) const {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (lane + 32 * e < dim) orow[lane + 32 * e] = acc[i][e] * inv;
  }
};

/// Forward's and dQ's block: one query tile of one head of one batch entry; warp w carries
/// rows r0 + w + attention_warps i (i < RPW), so causal rows of every length go to every warp.
template <int RPW>
struct query_tile {
  static constexpr index_t rows = attention_warps * RPW;
  index_t b, hh, g, r0, r1;
  int warp, lane, ld;
  float *ks, *vs, *qs;  // dynamic shared memory: K and V tiles [attention_tile_keys][ld], q's rows [rows][dim] (then the caller's)
  __device__ query_tile(index_t s, index_t h, index_t kvh, int dim)
      : b(blockIdx.z), hh(blockIdx.y), g(blockIdx.y / (h / kvh)), r0(static_cast<index_t>(blockIdx.x) * rows),
        r1(r0 + rows < s ? r0 + rows : s), warp(static_cast<int>(threadIdx.x) / 32), lane(static_cast<int>(threadIdx.x) % 32),
        ld(attention_ld(dim)) {
    LOOM_DYNAMIC_SHARED_FLOATS(smem);
    ks = smem, vs = smem + attention_tile_keys * ld, qs = vs + attention_tile_keys * ld;
  }
  __device__ index_t row(int i) const { return r0 + warp + attention_warps * i; }
  /// The tile's rows of a [batch, seq, heads, dim] tensor into dst [rows][dim].
  __device__ void load(float* dst, const float* src, index_t s, index_t h, int dim) const {
    load_rows(dst, dim, src + (b * s * h + hh) * dim, h * dim, r0, static_cast<int>(r1 - r0), dim);
  }
  /// For each tile of keys the tile's last row sees (at most attention_tile_keys, staged in
  /// ks, vs), and each of the warp's rows r that sees any of them:
  /// fn(i, r, visible keys of r, t0, keys in the tile).
  template <class F>
  __device__ void over_key_tiles(const float* k, const float* v, index_t s, index_t kvh, int dim, attention_mask mask,
                                 F&& fn) const {
    const float* kb = k + (b * s * kvh + g) * dim;
    const float* vb = v + (b * s * kvh + g) * dim;
    const index_t kmax = mask.visible(r1 - 1, s);
    for (index_t t0 = 0; t0 < kmax; t0 += attention_tile_keys) {
      const int nk = static_cast<int>(kmax - t0 < attention_tile_keys ? kmax - t0 : attention_tile_keys);
      __syncthreads();  // the previous tile is consumed (and the caller's rows are staged)
      load_rows(ks, ld, kb, kvh * dim, t0, nk, dim);
      load_rows(vs, ld, vb, kvh * dim, t0, nk, dim);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const index_t r = row(i), vis = r < r1 ? mask.visible(r, s) : 0;
        if (t0 < vis) fn(i, r, vis, t0, nk);  // warp-uniform
      }
    }
  }
};

/// One block per (query tile, head, batch): the online softmax over the key tiles.
template <int DPL>
__global__ void __launch_bounds__(attention_warps * 32)
    attention_forward(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      float* __restrict__ out, float* __restrict__ lse, index_t s, index_t h, index_t kvh, int dim,
                      float scale, attention_mask mask) {
  constexpr int RPW = attention_rows_per_warp;
  const query_tile<RPW> t(s, h, kvh, dim);
  const int ld = t.ld, lane = t.lane;
  const float *ks = t.ks, *vs = t.vs, *qs = t.qs;
  t.load(t.qs, q, s, h, dim);
  online_softmax_rows<RPW, DPL> st;
  t.over_key_tiles(k, v, s, kvh, dim, mask, [&](int i, index_t r, index_t vis, index_t t0, int nk) {
    online_softmax_tile<DPL>(qs + (r - t.r0) * dim, ks, vs, ld, nk, t0, vis, dim, scale, lane, st.m[i], st.l[i], st.acc[i]);
  });
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const index_t r = t.row(i);
    if (r >= t.r1) continue;
    st.write(i, out + ((t.b * s + r) * h + t.hh) * dim, dim, lane);  // key 0 is visible to every row: l > 0
    if (lane == 0) lse[(t.b * h + t.hh) * s + r] = math::log_sum_exp(st.m[i], st.l[i]);
  }
}

/// delta[(b h + hh) s + t] = <dO, O> of query row (b, t, hh): a warp a row.
LOOM_KERNEL void attention_delta(const float* __restrict__ dout, const float* __restrict__ out, float* __restrict__ delta,
                                index_t rows, index_t s, index_t h, int dim) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const index_t warps = static_cast<index_t>(gridDim.x) * (blockDim.x / 32);
  for (index_t row = static_cast<index_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    float part = 0.f;
    for (int d = lane; d < dim; d += 32) part += dout[row * dim + d] * out[row * dim + d];
    part = warp_sum(part);
    const index_t hh = row % h, t = row / h % s, b = row / (h * s);
    if (lane == 0) delta[(b * h + hh) * s + t] = part;
  }
}

/// dQ: one block per (query tile, head, batch), over the key tiles its rows see.
template <int DPL>
__global__ void __launch_bounds__(attention_warps * 32)
    attention_backward_dq(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ delta,
                          float* __restrict__ dq, index_t s, index_t h, index_t kvh, int dim, float scale,
                          attention_mask mask, bool accumulate) {
  constexpr int RPW = attention_rows_per_warp;
  const query_tile<RPW> t(s, h, kvh, dim);
  float* dos = t.qs + t.rows * dim;  // dO's rows after q's
  const int ld = t.ld, lane = t.lane;
  const float *ks = t.ks, *vs = t.vs, *qs = t.qs;
  t.load(t.qs, q, s, h, dim);
  t.load(dos, dout, s, h, dim);
  float rl[RPW], rd[RPW], acc[RPW][DPL];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const index_t r = t.row(i), stat = (t.b * h + t.hh) * s + r;
    rl[i] = r < t.r1 ? lse[stat] : 0.f, rd[i] = r < t.r1 ? delta[stat] : 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[i][e] = 0.f;
  }
  t.over_key_tiles(k, v, s, kvh, dim, mask, [&](int i, index_t r, index_t vis, index_t t0, int nk) {
    float ds = 0.f;
    if (lane < nk && t0 + lane < vis) {
      const float p = ops::exp(dot_row(qs + (r - t.r0) * dim, ks + lane * ld, dim) * scale - rl[i]);
      const float dp = dot_row(dos + (r - t.r0) * dim, vs + lane * ld, dim);
      ds = math::softmax_backward(p, dp, rd[i]) * scale;
    }
    for (int j = 0; j < nk; ++j) {
      const float dsj = __shfl_sync(0xffffffffu, ds, j);
      const float* kr = ks + j * ld;
#pragma unroll
      for (int e = 0; e < DPL; ++e)
        if (lane + 32 * e < dim) acc[i][e] += dsj * kr[lane + 32 * e];
    }
  });
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const index_t r = t.row(i);
    if (r >= t.r1) continue;
    float* grow = dq + ((t.b * s + r) * h + t.hh) * dim;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (lane + 32 * e < dim) grow[lane + 32 * e] = (accumulate ? grow[lane + 32 * e] : 0.f) + acc[i][e];
  }
}

/// dK, dV: one block per (key tile, kv head, batch); warp w carries keys c0 + w +
/// attention_warps i, and each lane one query of a shared tile of queries that see the tile's
/// first key, over the kv head's query heads in order.
template <int DPL>
__global__ void __launch_bounds__(attention_warps * 32)
    attention_backward_dkdv(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ delta,
                            float* __restrict__ dk, float* __restrict__ dv, index_t s, index_t h, index_t kvh, int dim,
                            float scale, attention_mask mask, bool accumulate) {
  constexpr int RPW = attention_kv_rows_per_warp, rows = attention_warps * RPW, tq = attention_tile_keys;
  LOOM_DYNAMIC_SHARED_FLOATS(smem);
  const int ld = attention_ld(dim);
  float* qs = smem;               // [tq][ld]
  float* dos = qs + tq * ld;      // [tq][ld]
  float* kst = dos + tq * ld;     // [rows][dim]
  float* vst = kst + rows * dim;  // [rows][dim]
  float* ls = vst + rows * dim;   // [tq]
  float* dl = ls + tq;            // [tq]
  const index_t b = blockIdx.z, g = blockIdx.y, c0 = static_cast<index_t>(blockIdx.x) * rows;
  const index_t c1 = c0 + rows < s ? c0 + rows : s, group = h / kvh;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  load_rows(kst, dim, k + (b * s * kvh + g) * dim, kvh * dim, c0, static_cast<int>(c1 - c0), dim);
  load_rows(vst, dim, v + (b * s * kvh + g) * dim, kvh * dim, c0, static_cast<int>(c1 - c0), dim);
  float ak[RPW][DPL], av[RPW][DPL];
#pragma unroll
  for (int i = 0; i < RPW; ++i)
#pragma unroll
    for (int e = 0; e < DPL; ++e) ak[i][e] = av[i][e] = 0.f;
  for (index_t hq = g * group; hq < (g + 1) * group; ++hq) {
    const float* qb = q + (b * s * h + hq) * dim;
    const float* ob = dout + (b * s * h + hq) * dim;
    for (index_t t0 = mask.first_seeing(c0); t0 < s; t0 += tq) {
      const int nq = static_cast<int>(s - t0 < tq ? s - t0 : tq);
      __syncthreads();
      load_rows(qs, ld, qb, h * dim, t0, nq, dim);
      load_rows(dos, ld, ob, h * dim, t0, nq, dim);
      for (int e = static_cast<int>(threadIdx.x); e < nq; e += static_cast<int>(blockDim.x))
        ls[e] = lse[(b * h + hq) * s + t0 + e], dl[e] = delta[(b * h + hq) * s + t0 + e];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const index_t c = c0 + warp + attention_warps * i;
        const bool valid = c < c1 && lane < nq && c < mask.visible(t0 + lane, s);
        if (!__any_sync(0xffffffffu, valid)) continue;
        float p = 0.f, ds = 0.f;
        if (valid) {
          p = ops::exp(dot_row(qs + lane * ld, kst + (c - c0) * dim, dim) * scale - ls[lane]);
          ds = math::softmax_backward(p, dot_row(dos + lane * ld, vst + (c - c0) * dim, dim), dl[lane]) * scale;
        }
        for (int j = 0; j < nq; ++j) {
          const float pj = __shfl_sync(0xffffffffu, p, j), dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
          for (int e = 0; e < DPL; ++e)
            if (lane + 32 * e < dim) {
              av[i][e] += pj * dos[j * ld + lane + 32 * e];
              ak[i][e] += dsj * qs[j * ld + lane + 32 * e];
            }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const index_t c = c0 + warp + attention_warps * i;
    if (c >= c1) continue;
    float* krow = dk + ((b * s + c) * kvh + g) * dim;
    float* vrow = dv + ((b * s + c) * kvh + g) * dim;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (lane + 32 * e < dim) {
        const int d = lane + 32 * e;
        krow[d] = (accumulate ? krow[d] : 0.f) + ak[i][e];
        vrow[d] = (accumulate ? vrow[d] : 0.f) + av[i][e];
      }
  }
}

/// Grid and dynamic shared memory of the three tile kernels: forward and dQ (a block per
/// query tile of a head), dK/dV (a block per key tile of a kv head).
struct attention_launch {
  unsigned x, y, z;
  std::size_t smem;
};
inline attention_launch attention_query_launch(index_t b, index_t s, index_t h, int dim, int staged_tensors) {
  constexpr index_t rows = attention_warps * attention_rows_per_warp;
  return {static_cast<unsigned>((s + rows - 1) / rows), static_cast<unsigned>(h), static_cast<unsigned>(b),
          sizeof(float) * static_cast<std::size_t>(2 * attention_tile_keys * attention_ld(dim) + staged_tensors * rows * dim)};
}
inline attention_launch attention_key_launch(index_t b, index_t s, index_t kvh, int dim) {
  constexpr index_t rows = attention_warps * attention_kv_rows_per_warp, tile = attention_tile_keys;
  return {static_cast<unsigned>((s + rows - 1) / rows), static_cast<unsigned>(kvh), static_cast<unsigned>(b),
          sizeof(float) * static_cast<std::size_t>(2 * tile * attention_ld(dim) + 2 * rows * dim + 2 * tile)};
}

/// f(std::integral_constant<int, DPL>) for the smallest of 1, 2, 4, 8 floats a lane that
/// hold head_dim (<= 256) spread over a warp's 32 lanes.
template <class F>
void with_dims_per_lane(index_t dim, F&& f) {
  if (dim <= 32) return f(std::integral_constant<int, 1>{});
  if (dim <= 64) return f(std::integral_constant<int, 2>{});
  if (dim <= 128) return f(std::integral_constant<int, 4>{});
  f(std::integral_constant<int, 8>{});
}


/// kernel over grid l with attention_warps * 32 threads, the opt-in to more than 48 KiB
/// of dynamic shared memory made first (a device with less fails here, with CUDA's message).
template <class... P, class... A>
void launch_attention(void (*kernel)(P...), attention_launch l, cudaStream_t stream, A... args) {
  if (l.smem > 48 * 1024)
    LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(l.smem)));
  LOOM_LAUNCH(kernel, dim3(l.x, l.y, l.z), attention_warps * 32, l.smem, stream)(args...);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kernels

/// Device scratch of attention_backward: delta, one float per query row and head.
struct attention_workspace {
  buffer<float, cuda> delta;
  explicit attention_workspace(memory_resource& r = default_resource<cuda>()) : delta(0, r), mr_(&r) {}
  void reserve(index_t rows) {
    if (static_cast<index_t>(delta.size()) < rows) delta = buffer<float, cuda>(static_cast<std::size_t>(rows), *mr_);
  }

 private:
  memory_resource* mr_;
};

namespace detail {
inline attention_dims check_attention_cuda(const tensor_view<const float, cuda, 4>& q, const tensor_view<const float, cuda, 4>& k,
                                           const tensor_view<const float, cuda, 4>& v, const tensor_view<const float, cuda, 4>& o,
                                           attention_mask mask, const char* fn) {
  const auto d = check_attention(q, k, v, o, fn);
  LOOM_CHECK(d.hd > 0 && d.hd <= kernels::attention_max_head_dim, fn, ": head_dim=", d.hd, " outside the supported [1, ",
             kernels::attention_max_head_dim, "]");
  LOOM_CHECK(d.h <= 65535 && d.b <= 65535, fn, ": heads=", d.h, " and batch=", d.b, " must each be at most 65535 (grid dimensions)");
  LOOM_CHECK(mask.prefix >= 0, fn, ": mask prefix must be >= 0, got prefix=", mask.prefix);
  return d;
}
}  // namespace detail

/// out = attention(q, k, v) under `mask`; lse [batch, heads, seq] receives each query row's
/// log-sum-exp of its scaled scores (what backward needs in place of the host's probs).
/// Asynchronous on `stream`.
inline void attention_forward(cuda, tensor_view<const float, cuda, 4> q, tensor_view<const float, cuda, 4> k,
                              tensor_view<const float, cuda, 4> v, tensor_view<float, cuda, 4> out,
                              tensor_view<float, cuda, 3> lse, attention_mask mask = {}, cudaStream_t stream = nullptr) {
  const char* fn = "ops::attention_forward(cuda)";
  const auto d = detail::check_attention_cuda(q, k, v, out, mask, fn);
  detail::require_shape(lse, extents<3>{d.b, d.h, d.s}, fn, "lse");
  detail::require_contiguous(lse, fn, "lse");
  if (d.b == 0 || d.s == 0 || d.h == 0) return;
  const float scale = 1.f / std::sqrt(static_cast<float>(d.hd));
  const int dim = static_cast<int>(d.hd);
  kernels::with_dims_per_lane(d.hd, [&](auto dpl) {
    kernels::launch_attention(kernels::attention_forward<decltype(dpl)::value>,
                              kernels::attention_query_launch(d.b, d.s, d.h, dim, 1), stream, q.data(), k.data(),
                              v.data(), out.data(), lse.data(), d.s, d.h, d.kvh, dim, scale, mask);
  });
}

/// dq, dk, dv += gradients of attention given dout, forward's out and lse (dq, dk, dv = ...
/// when !accumulate); mask as in forward; ws holds a float per query row and head.
/// Asynchronous on `stream` (ws must outlive the launches).
inline void attention_backward(cuda, tensor_view<const float, cuda, 4> dout, tensor_view<const float, cuda, 4> q,
                               tensor_view<const float, cuda, 4> k, tensor_view<const float, cuda, 4> v,
                               tensor_view<const float, cuda, 4> out, tensor_view<const float, cuda, 3> lse,
                               tensor_view<float, cuda, 4> dq, tensor_view<float, cuda, 4> dk, tensor_view<float, cuda, 4> dv,
                               attention_workspace& ws, attention_mask mask = {}, bool accumulate = true,
                               cudaStream_t stream = nullptr) {
  const char* fn = "ops::attention_backward(cuda)";
  const auto d = detail::check_attention_cuda(q, k, v, dout, mask, fn);
  detail::require_shape(out, q.shape(), fn, "out");
  detail::require_contiguous(out, fn, "out");
  detail::require_shape(lse, extents<3>{d.b, d.h, d.s}, fn, "lse");
  detail::require_contiguous(lse, fn, "lse");
  detail::require_shape(dq, q.shape(), fn, "dq");
  detail::require_shape(dk, k.shape(), fn, "dk");
  detail::require_shape(dv, v.shape(), fn, "dv");
  for (auto* g : {&dq, &dk, &dv}) detail::require_contiguous(*g, fn, "dq/dk/dv");
  if (d.b == 0 || d.s == 0 || d.h == 0) return;
  const float scale = 1.f / std::sqrt(static_cast<float>(d.hd));
  const index_t query_rows = d.b * d.s * d.h;
  ws.reserve(query_rows);
  LOOM_LAUNCH(kernels::attention_delta, kernels::grid_for(query_rows * 32, kernels::row_block),
              kernels::row_block, 0, stream)(
      dout.data(), out.data(), ws.delta.data(), query_rows, d.s, d.h, static_cast<int>(d.hd));
  LOOM_CUDA_CHECK(cudaGetLastError());
  const int dim = static_cast<int>(d.hd);
  kernels::with_dims_per_lane(d.hd, [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    kernels::launch_attention(kernels::attention_backward_dq<DPL>, kernels::attention_query_launch(d.b, d.s, d.h, dim, 2), stream, dout.data(), q.data(),
                              k.data(), v.data(), lse.data(), static_cast<const float*>(ws.delta.data()), dq.data(), d.s,
                              d.h, d.kvh, dim, scale, mask, accumulate);
    kernels::launch_attention(kernels::attention_backward_dkdv<DPL>, kernels::attention_key_launch(d.b, d.s, d.kvh, dim), stream, dout.data(), q.data(),
                              k.data(), v.data(), lse.data(), static_cast<const float*>(ws.delta.data()), dk.data(),
                              dv.data(), d.s, d.h, d.kvh, dim, scale, mask, accumulate);
  });
}

}  // namespace loom::ops
