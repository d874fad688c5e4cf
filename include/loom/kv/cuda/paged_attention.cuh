#pragma once
// Paged attention on a CUDA device: the append of new keys/values to the paged pool, batch
// prefill and batch decode over it, under the host's names (kv/paged_attention.hpp) with the
// cuda tag, the block table as device arrays (paged_kv_csr_device) and a stream.
//
// Decode, as FlashInfer does it for long contexts (split-KV): the keys of a sequence are cut
// into `splits` ranges; a block of `decode_warps` warps takes one range of one sequence for up
// to 4 query heads that share a key/value head (GQA), so each key and value row is read from
// memory once for all of them. The block copies tiles of rows into shared memory with
// cp.async, several tiles in flight, so that the memory stays busy without registers holding
// the loads. A row is spread over a group of lanes in 16-byte vectors (16 lanes for 128 bf16
// elements: two rows a warp). A score is a shuffle reduction over the lane group, folded in
// one key at a time by the online-softmax step in base 2 (the query carries scale * log2(e),
// so e^(s - m) is one exp2 instead of a multi-instruction exp: with two multiply-adds a
// loaded element per head, every other instruction a key and head costs counts). At the end
// the states go back to natural units and are merged with the host's
// ops::math::online_softmax_merge: the lane groups' with shuffles, the warps' in warp order
// inside the block, then the ranges' in range order by a second kernel. No atomics, so the
// result is the same on every run; it differs from the host's one-pass result by the order
// of additions and exp2's rounding (the tests' tolerance says how much).
// A head_dim that is not a multiple of 16 bytes, fp32 rows of more than 128 elements or a pool
// not 16-byte aligned take a register kernel (rows loaded into registers, element by element
// where needed) and one head a block.
//
// Prefill (ragged query runs, decode rows among them) runs the training forward's tiles
// (ops/cuda/attention.cuh) over keys gathered from the pages. Every kernel here, launch code
// included, also compiles with g++ for the emulator (tests/ops/cuda/emulation.hpp), where the
// CPU CI checks it against the host.
//
// Why splits: one (sequence, head) per block leaves most of a large GPU idle at small batch
// and long context, the case decode is bandwidth-bound in; the split count grows with the
// longest sequence so that each range holds at least decode_min_keys keys.

#include <loom/core/device.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/ops/cuda/attention.cuh>
#include <loom/ops/cuda/launch.hpp>
#include <loom/ops/math/load.hpp>
#include <loom/ops/math/softmax.hpp>

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/error.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/paged_attention.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <span>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace loom::kv {

namespace kernels {

inline constexpr int decode_warps = 4;
inline constexpr int max_head_dim = 256;
inline constexpr std::int64_t decode_min_keys = 256;   // keys per split at least
inline constexpr std::int64_t decode_max_splits = 64;

/// Key ranges a sequence is cut into, from the longest sequence of the batch.
inline std::int64_t decode_splits(std::int64_t max_kv_len) {
  return std::clamp<std::int64_t>(max_kv_len / decode_min_keys, 1, decode_max_splits);
}

__device__ inline std::int64_t kv_len_of(const std::int32_t* indptr, const std::int32_t* last_page_len, std::int32_t b,
                                         std::int32_t bs) {
  const std::int32_t pages = indptr[b + 1] - indptr[b];
  return pages == 0 ? 0 : static_cast<std::int64_t>(pages - 1) * bs + last_page_len[b];
}

template <class T>
__global__ void append_paged_kv(const float* __restrict__ k, const float* __restrict__ v,
                                const std::int32_t* __restrict__ batch_indices, const std::int64_t* __restrict__ positions,
                                T* __restrict__ cache, const std::int32_t* __restrict__ indptr,
                                const std::int32_t* __restrict__ indices, std::int64_t n, std::int64_t hk, std::int64_t dim,
                                std::int32_t bs) {
  const std::int64_t row = hk * dim, token_stride = row, kv_half = bs * row, block_stride = 2 * kv_half;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n * row;
       e += static_cast<std::int64_t>(blockDim.x) * gridDim.x) {
    const std::int64_t i = e / row, hd = e % row, p = positions[i];
    const std::int32_t page = indices[indptr[batch_indices[i]] + p / bs];
    T* slot = cache + page * block_stride + (p % bs) * token_stride + hd;
    slot[0] = T(k[e]);
    slot[kv_half] = T(v[e]);
  }
}

/// A lane's slice of a key or value row: V elements, 16 bytes for the fast path (one vector
/// load), one element where head_dim is not a multiple of 16 bytes.
template <class T, int V>
struct alignas(sizeof(T) * V) decode_vec {
  T e[V];
};

template <class T, int V>
__device__ LOOM_FORCE_INLINE decode_vec<T, V> load_vec(const T* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const decode_vec<T, V>*>(p);
#else
  decode_vec<T, V> r;
  for (int i = 0; i < V; ++i) r.e[i] = p[i];
  return r;
#endif
}

/// A 16-byte copy from global to shared memory that the thread does not wait for
/// (cp.async, sm_80 and later; a plain copy elsewhere and under the emulator), the commit of
/// the copies issued so far as one group, and the wait until at most N groups are pending.
__device__ LOOM_FORCE_INLINE void async_copy16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem));
#else
  std::memcpy(smem, gmem, 16);
#endif
}
__device__ LOOM_FORCE_INLINE void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ LOOM_FORCE_INLINE void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

/// The running states of HB query heads over this lane's slice of head_dim (lane i of a group
/// of `lanes` holds elements [(n lanes + i) V, + V) for n < NV), and the fold of one key into
/// them: a score is a shuffle reduction over the lane group, then the online-softmax step in
/// base 2 (q carries scale * log2(e), so e^(s - m) is one exp2).
template <int V, int NV, int HB>
struct decode_state {
  float q[HB][NV][V], acc[HB][NV][V], m[HB], l[HB];

  /// From q's rows qr [HB][dim].
  __device__ decode_state(const float* qr, float scale, int lanes, int lane_in, std::int32_t dim) {
    const float scale_log2 = scale * 1.4426950408889634f;
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      m[hb] = -INFINITY, l[hb] = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int e = (n * lanes + lane_in) * V;
#pragma unroll
        for (int v = 0; v < V; ++v) q[hb][n][v] = e < dim ? qr[hb * dim + e + v] * scale_log2 : 0.f, acc[hb][n][v] = 0.f;
      }
    }
  }

  /// Key and value slices k, v (zeros past head_dim); ok: the key is in range (uniform over
  /// the lane group; every lane of the warp calls, for the shuffles).
  template <class T>
  __device__ LOOM_FORCE_INLINE void fold(const decode_vec<T, V> (&k)[NV], const decode_vec<T, V> (&v)[NV], bool ok,
                                         int lanes) {
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      float d = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int i = 0; i < V; ++i) d += q[hb][n][i] * ops::load<float>(k[n].e[i]);
      for (int o = lanes / 2; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (!ok) continue;
      if (d > m[hb]) {  // a new maximum rescales what was accumulated
        const float c = exp2f(m[hb] - d);
        l[hb] *= c;
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
          for (int i = 0; i < V; ++i) acc[hb][n][i] *= c;
        m[hb] = d;
      }
      const float p = exp2f(d - m[hb]);
      l[hb] += p;
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[hb][n][i] += p * ops::load<float>(v[n].e[i]);
    }
  }

  /// Merges the block's states (back in natural units, by the host's online_softmax_merge):
  /// the lane groups' with shuffles, the warps' in warp order through `smem` (decode_warps *
  /// HB * (head_dim + 2) floats); warp 0 then writes the heads' outputs (one split) or their
  /// states for merge_splits. Every thread of the block calls.
  __device__ void finish(float* smem, int lanes, int lane_in, std::int32_t dim, std::int64_t row0, std::int64_t splits,
                         std::int64_t split, float* out, float* ws_acc, float* ws_m, float* ws_l) {
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const bool leader = lane < lanes;
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      m[hb] *= 0.6931471805599453f;
      for (int o = lanes; o < 32; o *= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m[hb], o), l2 = __shfl_xor_sync(0xffffffffu, l[hb], o);
        float a2[NV][V];
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
          for (int i = 0; i < V; ++i) a2[n][i] = __shfl_xor_sync(0xffffffffu, acc[hb][n][i], o);
        float c1, c2;
        ops::math::online_softmax_merge(m[hb], l[hb], m2, l2, c1, c2);
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
          for (int i = 0; i < V; ++i) acc[hb][n][i] = acc[hb][n][i] * c1 + a2[n][i] * c2;
      }
    }
    float* sm = smem;                         // [decode_warps][HB]
    float* sl = sm + decode_warps * HB;       // [decode_warps][HB]
    float* sacc = sl + decode_warps * HB;     // [decode_warps][HB][dim]
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      if (lane == 0) sm[warp * HB + hb] = m[hb], sl[warp * HB + hb] = l[hb];
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int e = (n * lanes + lane_in) * V;
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (leader && e < dim) sacc[(warp * HB + hb) * dim + e + i] = acc[hb][n][i];
      }
    }
    __syncthreads();
    if (warp != 0 || !leader) return;
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      for (int w = 1; w < decode_warps; ++w) {
        float c1, c2;
        ops::math::online_softmax_merge(m[hb], l[hb], sm[w * HB + hb], sl[w * HB + hb], c1, c2);
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int e = (n * lanes + lane_in) * V;
#pragma unroll
          for (int i = 0; i < V; ++i)
            if (e < dim) acc[hb][n][i] = acc[hb][n][i] * c1 + sacc[(w * HB + hb) * dim + e + i] * c2;
        }
      }
      const std::int64_t row = row0 + hb, state = row * splits + split;
      const float inv = l[hb] > 0.f ? 1.f / l[hb] : 0.f;
      if (splits > 1 && lane == 0) ws_m[state] = m[hb], ws_l[state] = l[hb];
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int e = (n * lanes + lane_in) * V;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (e >= dim) continue;
          if (splits == 1) out[row * dim + e + i] = acc[hb][n][i] * inv;
          else ws_acc[state * dim + e + i] = acc[hb][n][i];
        }
      }
    }
  }
};

/// Shared memory decode_state::finish needs.
inline std::size_t decode_finish_bytes(int heads, std::int64_t dim) {
  return static_cast<std::size_t>(decode_warps) * static_cast<std::size_t>(heads) * static_cast<std::size_t>(dim + 2) *
         sizeof(float);
}

/// Where a sequence's key rows of one key/value head are (its value rows: kv_half further).
template <class T>
struct decode_rows {
  const T* cache;
  const std::int32_t* pages;
  std::int32_t bs;
  std::int64_t head_offset, token_stride, kv_half;

  __device__ LOOM_FORCE_INLINE const T* key(std::int64_t j) const {
    const auto jj = static_cast<std::int32_t>(j);
    return cache + pages[jj / bs] * 2 * kv_half + (jj % bs) * token_stride + head_offset;
  }
};

/// The block's (split, `heads` query heads of one key/value head, sequence), its first query
/// row and key range, for both decode kernels (and the benchmark's read of the same rows).
struct decode_block {
  std::int64_t split, nh, h0, kvh, row0, j0, j1;
  std::int32_t b;

  __device__ decode_block(const std::int32_t* indptr, const std::int32_t* last_page_len, std::int32_t bs, std::int64_t hk,
                          std::int64_t splits, int heads) {
    split = blockIdx.x, nh = static_cast<std::int64_t>(gridDim.y) * heads, h0 = blockIdx.y * std::int64_t{heads};
    b = static_cast<std::int32_t>(blockIdx.z);
    kvh = h0 / (nh / hk), row0 = b * nh + h0;
    const std::int64_t kv_len = kv_len_of(indptr, last_page_len, b, bs), per = (kv_len + splits - 1) / splits;
    j0 = std::min(kv_len, split * per), j1 = std::min(kv_len, j0 + per);
  }

  /// The block's rows in a pool [blocks, 2, bs, hk, dim].
  template <class T>
  __device__ decode_rows<T> rows(const T* cache, const std::int32_t* indices, const std::int32_t* indptr, std::int32_t bs,
                                 std::int64_t hk, std::int32_t dim) const {
    const std::int64_t token_stride = hk * dim;
    return {cache, indices + indptr[b], bs, kvh * dim, token_stride, bs * token_stride};
  }
};

/// One block per (split, query head, sequence); see the file comment. This one loads each lane
/// group's U rows into registers, then folds them in: for head_dims that are not a multiple of
/// 16 bytes (V = 1, NV = 8), fp32 rows of more than 128 elements (NV = 2) and unaligned pools.
template <class T, int V, int NV>
__global__ void __launch_bounds__(decode_warps * 32)
    decode_split(const float* __restrict__ q, const T* __restrict__ cache, const std::int32_t* __restrict__ indptr,
                 const std::int32_t* __restrict__ indices, const std::int32_t* __restrict__ last_page_len,
                 std::int32_t bs, std::int64_t hk, std::int32_t dim, int lanes, float scale, std::int64_t splits,
                 float* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_m, float* __restrict__ ws_l) {
  constexpr int U = 4;
  const decode_block blk(indptr, last_page_len, bs, hk, splits, 1);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int sub = lane / lanes, lane_in = lane % lanes, subs = 32 / lanes;
  decode_state<V, NV, 1> st(q + blk.row0 * dim, scale, lanes, lane_in, dim);
  const auto rows = blk.rows(cache, indices, indptr, bs, hk, dim);
  // each round the block takes decode_warps * U * subs consecutive keys; a lane group U of them
  const std::int64_t round = std::int64_t{decode_warps} * U * subs;
  for (std::int64_t r = blk.j0; r < blk.j1; r += round) {  // uniform over the block
    const std::int64_t base = r + warp * U * subs + sub;
    decode_vec<T, V> kb[U][NV], vb[U][NV];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::int64_t j = base + u * subs;
      ok[u] = j < blk.j1;
      const T* key = ok[u] ? rows.key(j) : nullptr;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int e = (n * lanes + lane_in) * V;
        if (ok[u] && e < dim) {
          kb[u][n] = load_vec<T, V>(key + e);
          vb[u][n] = load_vec<T, V>(key + rows.kv_half + e);
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) kb[u][n].e[i] = T(0.f), vb[u][n].e[i] = T(0.f);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) st.fold(kb[u], vb[u], ok[u], lanes);
  }
  __shared__ float finish_smem[decode_warps * (max_head_dim + 2)];
  st.finish(finish_smem, lanes, lane_in, dim, blk.row0, splits, blk.split, out, ws_acc, ws_m, ws_l);
}

inline constexpr int decode_stages = 3;
inline constexpr int decode_stage_bytes = 16384;  // key and value rows; 3 stages: 48 KiB, no opt-in

/// Keys a stage of decode_split_staged holds for a head_dim and element size.
LOOM_HOST_DEVICE inline int decode_tile_keys(std::int64_t dim, std::size_t elem) {
  return static_cast<int>(decode_stage_bytes / (2 * static_cast<std::int64_t>(elem) * dim));
}

/// The fast path (head_dim a multiple of 16 bytes, a row in at most 32 lanes): the block copies
/// tiles of key and value rows into shared memory with cp.async, decode_stages tiles in
/// flight, so the bytes in flight are not bounded by registers (a register version must hold
/// its loads until it uses them, which caps the blocks an SM keeps); each lane group folds its
/// keys of the tile in from shared memory. Dynamic shared memory: decode_stages stages.
template <class T, int HB>
__global__ void __launch_bounds__(decode_warps * 32)
    decode_split_staged(const float* __restrict__ q, const T* __restrict__ cache, const std::int32_t* __restrict__ indptr,
                        const std::int32_t* __restrict__ indices, const std::int32_t* __restrict__ last_page_len,
                        std::int32_t bs, std::int64_t hk, std::int32_t dim, int lanes, float scale, std::int64_t splits,
                        float* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_m,
                        float* __restrict__ ws_l) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const decode_block blk(indptr, last_page_len, bs, hk, splits, HB);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int sub = lane / lanes, lane_in = lane % lanes, subs = 32 / lanes;
  const int tk = decode_tile_keys(dim, sizeof(T)), chunks = dim / V, tile_elems = tk * dim;
  LOOM_DYNAMIC_SHARED_FLOATS(smem);
  T* stages = reinterpret_cast<T*>(smem);  // [decode_stages][keys, values][tk][dim]
  const auto rows = blk.rows(cache, indices, indptr, bs, hk, dim);
  const auto load_tile = [&](std::int64_t jt, int stage) {  // keys [jt, jt + tk) of the range, then a commit
    T* ks = stages + static_cast<std::int64_t>(stage) * 2 * tile_elems;
    for (int i = static_cast<int>(threadIdx.x); i < tk * chunks; i += decode_warps * 32) {
      const int t = i / chunks, c = (i - t * chunks) * V;
      if (jt + t >= blk.j1) break;  // i grows with t
      const T* key = rows.key(jt + t) + c;
      async_copy16(ks + t * dim + c, key);
      async_copy16(ks + tile_elems + t * dim + c, key + rows.kv_half);
    }
    async_commit();
  };
  decode_state<V, 1, HB> st(q + blk.row0 * dim, scale, lanes, lane_in, dim);
  for (int s = 0; s < decode_stages - 1; ++s) load_tile(blk.j0 + std::int64_t{s} * tk, s);
  int stage = 0;
  for (std::int64_t jt = blk.j0; jt < blk.j1; jt += tk) {  // uniform over the block
    async_wait<decode_stages - 2>();  // this thread's copies of tile jt have landed ...
    __syncthreads();                  // ... everyone's, and every warp is done with the stage refilled next
    load_tile(jt + std::int64_t{decode_stages - 1} * tk, (stage + decode_stages - 1) % decode_stages);
    const T* ks = stages + static_cast<std::int64_t>(stage) * 2 * tile_elems;
    for (int t0 = warp * subs; t0 < tk; t0 += decode_warps * subs) {  // uniform over the warp
      const int t = t0 + sub;
      const bool ok = t < tk && jt + t < blk.j1;
      decode_vec<T, V> k[1], v[1];
      if (ok && lane_in < chunks) {
        k[0] = load_vec<T, V>(ks + t * dim + lane_in * V);
        v[0] = load_vec<T, V>(ks + tile_elems + t * dim + lane_in * V);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) k[0].e[i] = T(0.f), v[0].e[i] = T(0.f);
      }
      st.fold(k, v, ok, lanes);
    }
    stage = (stage + 1) % decode_stages;
  }
  async_wait<0>();
  __syncthreads();  // the stages become finish's scratch
  st.finish(smem, lanes, lane_in, dim, blk.row0, splits, blk.split, out, ws_acc, ws_m, ws_l);
}

/// Dynamic shared memory of decode_split_staged for a head_dim and element size.
inline std::size_t decode_staged_bytes(std::int64_t dim, std::size_t elem) {
  return static_cast<std::size_t>(decode_stages) * 2 * static_cast<std::size_t>(decode_tile_keys(dim, elem)) *
         static_cast<std::size_t>(dim) * elem;
}

/// Calls f(kernel, heads_per_block, lanes, dynamic_smem_bytes) with the decode kernel for a
/// pool element type, head_dim, GQA group (query heads per key/value head) and pool alignment:
/// the staged kernel when head_dim is a multiple of 16 bytes and the pool 16-byte aligned, up
/// to 4 heads of a group a block (the largest power of two dividing it: more would hold too
/// many registers); the register kernel with element loads and one head a block otherwise.
template <class T, class F>
void with_decode_kernel(std::int64_t dim, std::int64_t group, bool aligned16, F&& f) {
  constexpr int vf = static_cast<int>(16 / sizeof(T));
  const int c = static_cast<int>((dim + vf - 1) / vf);
  if (aligned16 && dim % vf == 0 && c <= 32) {
    const int lanes = static_cast<int>(std::bit_ceil(static_cast<unsigned>(c)));
    const int heads = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
    // the stages are finish's scratch too
    const std::size_t smem = std::max(decode_staged_bytes(dim, sizeof(T)), decode_finish_bytes(heads, dim));
    if (heads == 4) return f(decode_split_staged<T, 4>, 4, lanes, smem);
    if (heads == 2) return f(decode_split_staged<T, 2>, 2, lanes, smem);
    return f(decode_split_staged<T, 1>, 1, lanes, smem);
  }
  if constexpr (vf < 8) {  // 2-byte elements: c <= 32 for every head_dim <= 256
    if (aligned16 && dim % vf == 0) return f(decode_split<T, vf, 2>, 1, 32, std::size_t{0});  // c <= 64
  }
  return f(decode_split<T, 1, 8>, 1, static_cast<int>(std::bit_ceil(static_cast<unsigned>((dim + 7) / 8))), std::size_t{0});
}

/// One block per (head, row): the splits' states of a decode row (a sequence) or of a prefill
/// query row, merged in split order, normalised. Row bh = blockIdx.y * gridDim.x + blockIdx.x.
LOOM_KERNEL void merge_splits(const float* __restrict__ ws_acc, const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                             std::int64_t splits, std::int32_t dim, float* __restrict__ out) {
  const std::int64_t bh = static_cast<std::int64_t>(blockIdx.y) * gridDim.x + blockIdx.x, s0 = bh * splits;
  for (std::int32_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float m = ws_m[s0], l = ws_l[s0], acc = ws_acc[s0 * dim + d];
    for (std::int64_t s = 1; s < splits; ++s) {
      float c1, c2;
      ops::math::online_softmax_merge(m, l, ws_m[s0 + s], ws_l[s0 + s], c1, c2);
      acc = acc * c1 + ws_acc[(s0 + s) * dim + d] * c2;
    }
    out[bh * dim + d] = l > 0.f ? acc / l : 0.f;
  }
}

/// Ragged prefill: one block per (query tile, key range, head, sequence) of attention_warps
/// warps, the training forward's tiles (ops/cuda/attention.cuh: a warp carries rows r0 + w +
/// attention_warps i, a lane scores one key of a 32-key tile staged in shared memory,
/// online_softmax_tile folds the tile in); the keys come from the sequence's pages. Query i of
/// a sequence of q_len queries and kv_len keys sits at position kv_len - q_len + i. Blocks past
/// a sequence's last tile return at once. blockIdx.x = tile * splits + split: with one split
/// the block writes its rows' outputs; with several, split s takes keys [s split_keys,
/// (s + 1) split_keys) and writes its rows' online-softmax states (m, l, unnormalised acc;
/// a range past a row's visible keys leaves the empty state) for merge_splits.
template <class T, int DPL>
__global__ void __launch_bounds__(ops::kernels::attention_warps * 32)
    prefill_tiles(const float* __restrict__ q, const std::int32_t* __restrict__ qo_indptr, const T* __restrict__ cache,
                  const std::int32_t* __restrict__ indptr, const std::int32_t* __restrict__ indices,
                  const std::int32_t* __restrict__ last_page_len, std::int32_t bs, std::int64_t hk, std::int32_t dim,
                  float scale, bool causal, float* __restrict__ out, std::int64_t splits, std::int64_t split_keys,
                  float* __restrict__ ws_acc, float* __restrict__ ws_m, float* __restrict__ ws_l) {
  namespace ok = ops::kernels;
  constexpr int RPW = ok::attention_rows_per_warp, rows = ok::attention_warps * RPW, tk = ok::attention_tile_keys;
  const std::int32_t b = static_cast<std::int32_t>(blockIdx.z);
  const std::int64_t h = blockIdx.y, nh = gridDim.y, q0 = qo_indptr[b], q_len = qo_indptr[b + 1] - q0;
  const std::int64_t split = static_cast<std::int64_t>(blockIdx.x) % splits;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) / splits * rows;
  if (r0 >= q_len) return;  // the whole block, before any barrier
  const std::int64_t r1 = r0 + rows < q_len ? r0 + rows : q_len, kv_len = kv_len_of(indptr, last_page_len, b, bs);
  const std::int64_t kvh = h / (nh / hk), token_stride = hk * dim, kv_half = bs * token_stride, block_stride = 2 * kv_half;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32, ld = ok::attention_ld(dim);
  LOOM_DYNAMIC_SHARED_FLOATS(smem);
  float* ks = smem;           // [tk][ld]
  float* vs = ks + tk * ld;   // [tk][ld]
  float* qs = vs + tk * ld;   // [rows][dim]
  ok::load_rows(qs, dim, q + (q0 * nh + h) * dim, nh * dim, r0, static_cast<int>(r1 - r0), dim);
  auto visible = [&](std::int64_t i) { return causal ? kv_len - q_len + i + 1 : kv_len; };
  const std::int32_t* pages = indices + indptr[b];
  ok::online_softmax_rows<RPW, DPL> st;
  const std::int64_t k_first = split * split_keys, k_last = visible(r1 - 1);
  const std::int64_t kmax = splits == 1 || k_first + split_keys > k_last ? k_last : k_first + split_keys;
  for (std::int64_t t0 = k_first; t0 < kmax; t0 += tk) {
    const int nk = static_cast<int>(kmax - t0 < tk ? kmax - t0 : tk);
    __syncthreads();  // the previous tile is consumed (and the query rows are staged)
    for (int e = static_cast<int>(threadIdx.x); e < nk * dim; e += static_cast<int>(blockDim.x)) {
      const std::int64_t j = t0 + e / dim;
      const T* key = cache + pages[j / bs] * block_stride + (j % bs) * token_stride + kvh * dim + e % dim;
      ks[(e / dim) * ld + e % dim] = ops::load<float>(key[0]);
      vs[(e / dim) * ld + e % dim] = ops::load<float>(key[kv_half]);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const std::int64_t r = r0 + warp + ok::attention_warps * i, vis = r < r1 ? visible(r) : 0;
      if (t0 < vis)  // warp-uniform
        ok::online_softmax_tile<DPL>(qs + (r - r0) * dim, ks, vs, ld, nk, t0, vis, dim, scale, lane, st.m[i], st.l[i],
                                     st.acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const std::int64_t r = r0 + warp + ok::attention_warps * i;
    if (r >= r1) continue;
    if (splits == 1) {
      st.write(i, out + ((q0 + r) * nh + h) * dim, dim, lane);  // a row without a visible key: zeros, as on the host
      continue;
    }
    const std::int64_t state = ((q0 + r) * nh + h) * splits + split;
    if (lane == 0) ws_m[state] = st.m[i], ws_l[state] = st.l[i];
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (lane + 32 * e < dim) ws_acc[state * dim + lane + 32 * e] = st.acc[i][e];
  }
}

inline constexpr std::int64_t prefill_min_keys = 1024;        // keys per split at least
inline constexpr std::int64_t prefill_max_splits = 32;
inline constexpr std::int64_t prefill_enough_blocks = 1024;   // several waves on any current GPU

/// Key ranges each query tile's keys are cut into: only when the grid would be small (a
/// chunk of a long prompt, a few long sequences) and the keys many; at most what fills
/// prefill_enough_blocks. One when the merge's grid could not hold the query rows.
inline std::int64_t prefill_splits(std::int64_t blocks, std::int64_t max_kv_len, std::int64_t total_q) {
  if (blocks <= 0 || blocks >= prefill_enough_blocks || total_q > 65535) return 1;
  const std::int64_t fill = (prefill_enough_blocks + blocks - 1) / blocks;
  return std::clamp<std::int64_t>(max_kv_len / prefill_min_keys, 1, std::min(prefill_max_splits, fill));
}
/// Keys a split takes: the longest sequence's keys over the splits, whole tiles.
inline std::int64_t prefill_split_keys(std::int64_t max_kv_len, std::int64_t splits) {
  constexpr std::int64_t tk = ops::kernels::attention_tile_keys;
  return ((max_kv_len + splits - 1) / splits + tk - 1) / tk * tk;
}

/// Grid and dynamic shared memory of prefill_tiles for the longest query run of the batch,
/// each query tile's keys cut into `splits` ranges.
inline ops::kernels::attention_launch prefill_launch(std::int32_t batch, std::int64_t heads, std::int64_t max_q_len,
                                                     std::int32_t dim, std::int64_t splits = 1) {
  auto l = ops::kernels::attention_query_launch(1, max_q_len, heads, dim, 1);
  l.x *= static_cast<unsigned>(splits);
  l.z = static_cast<unsigned>(batch);
  return l;
}

}  // namespace kernels

/// A paged_kv_csr's arrays on the device (what the kernels read), uploaded on a stream.
struct paged_kv_csr_device {
  buffer<std::int32_t, cuda> indptr, indices, last_page_len;
  std::int32_t batch = 0, block_size = 16;
  std::vector<std::int64_t> kv_lens;  ///< each sequence's keys (host copy: the argument checks, the split-KV grid)

  /// The longest sequence (0 for an empty batch).
  std::int64_t max_kv_len() const noexcept {
    return kv_lens.empty() ? 0 : *std::max_element(kv_lens.begin(), kv_lens.end());
  }

  explicit paged_kv_csr_device(memory_resource& r = default_resource<cuda>())
      : indptr(0, r), indices(0, r), last_page_len(0, r), mr_(&r) {}

  /// Copies `csr` to the device (growing the buffers when needed); asynchronous on `stream`,
  /// `csr` must stay alive until the stream has passed this point.
  void upload(const paged_kv_csr& csr, cudaStream_t stream = nullptr) {
    LOOM_CHECK(static_cast<std::int32_t>(csr.indptr.size()) == csr.batch() + 1, "paged_kv_csr_device::upload: indptr has ",
               csr.indptr.size(), " entries for a batch of ", csr.batch());
    batch = csr.batch(), block_size = csr.block_size;
    kv_lens.resize(static_cast<std::size_t>(batch));
    for (std::int32_t b = 0; b < batch; ++b) kv_lens[std::size_t(b)] = csr.kv_len(b);
    copy(indptr, csr.indptr, stream), copy(indices, csr.indices, stream), copy(last_page_len, csr.last_page_len, stream);
  }

 private:
  memory_resource* mr_;
  void copy(buffer<std::int32_t, cuda>& to, const std::vector<std::int32_t>& from, cudaStream_t stream) {
    if (to.size() < from.size()) to = buffer<std::int32_t, cuda>(from.size(), *mr_);
    if (!from.empty())
      LOOM_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), from.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
  }
};

/// Device scratch of batch decode's split-KV partial states.
struct decode_workspace {
  buffer<float, cuda> acc, m, l;  // [batch * heads * splits * head_dim], [.. * splits] twice
  explicit decode_workspace(memory_resource& r = default_resource<cuda>()) : acc(0, r), m(0, r), l(0, r), mr_(&r) {}
  void reserve(std::int64_t states, std::int64_t head_dim) {
    const auto s = static_cast<std::size_t>(states), a = static_cast<std::size_t>(states * head_dim);
    if (acc.size() < a) acc = buffer<float, cuda>(a, *mr_);
    if (m.size() < s) m = buffer<float, cuda>(s, *mr_), l = buffer<float, cuda>(s, *mr_);
  }

 private:
  memory_resource* mr_;
};

namespace detail {
template <class T>
void check_device_cache(const char* fn, const tensor_view<T, cuda, 5>& cache, std::int64_t num_heads, std::int64_t head_dim,
                        const paged_kv_csr_device& csr) {
  LOOM_CHECK(cache.extent(1) == 2, fn, ": cache dimension 1 must be 2 (keys, values), got ", cache.extent(1));
  LOOM_CHECK(cache.extent(2) == csr.block_size, fn, ": cache block_size=", cache.extent(2), " differs from csr.block_size=",
             csr.block_size);
  LOOM_CHECK(cache.extent(4) == head_dim, fn, ": cache head_dim=", cache.extent(4), " differs from query head_dim=", head_dim);
  LOOM_CHECK(cache.extent(3) > 0 && num_heads % cache.extent(3) == 0, fn, ": num_heads (", num_heads,
             ") must be a multiple of num_kv_heads (", cache.extent(3), ")");
  LOOM_CHECK(cache.is_contiguous(), fn, ": the cache view must be contiguous");
}
}  // namespace detail

/// The cuda tag's append_paged_kv_cache: token i's keys and values go to sequence
/// batch_indices[i] at positions[i] (device arrays, [n] each; blocks prepared and `csr` built
/// for the grown lengths, as on the host, which checks the same indices before it writes: here
/// they are trusted, coming from the scheduler that built csr). Asynchronous.
///   k, v: [n, num_kv_heads, head_dim]; cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
template <class T>
void append_paged_kv_cache(cuda, tensor_view<const float, cuda, 3> k, tensor_view<const float, cuda, 3> v,
                           const std::int32_t* batch_indices, const std::int64_t* positions, tensor_view<T, cuda, 5> cache,
                           const paged_kv_csr_device& csr, cudaStream_t stream = nullptr) {
  const char* fn = "append_paged_kv_cache(cuda)";
  const std::int64_t n = k.extent(0), hk = cache.extent(3), dim = cache.extent(4);
  LOOM_CHECK(v.shape() == k.shape(), fn, ": k shape ", detail::shape_str(k.shape()), " differs from v shape ",
             detail::shape_str(v.shape()));
  LOOM_CHECK(k.extent(1) == hk && k.extent(2) == dim, fn, ": k shape ", detail::shape_str(k.shape()),
             " does not match the cache's [*, ", hk, ", ", dim, "]");
  LOOM_CHECK(k.is_contiguous() && v.is_contiguous() && cache.is_contiguous(), fn, ": k, v and the cache must be contiguous");
  LOOM_CHECK(cache.extent(2) == csr.block_size, fn, ": cache block_size=", cache.extent(2), " differs from csr.block_size=",
             csr.block_size);
  if (n == 0) return;
  const std::int64_t elems = n * hk * dim;
  LOOM_LAUNCH(kernels::append_paged_kv, ops::kernels::grid_for(elems, ops::kernels::elementwise_block),
              ops::kernels::elementwise_block, 0, stream)(
      k.data(), v.data(), batch_indices, positions, cache.data(), csr.indptr.data(), csr.indices.data(), n, hk, dim,
      csr.block_size);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// The cuda tag's batch_decode_with_paged_kv_cache: one query token per sequence over all its
/// keys, split-KV. Asynchronous.  q, out: [batch, num_heads, head_dim] (head_dim <= 256)
template <class T>
void batch_decode_with_paged_kv_cache(cuda, tensor_view<const float, cuda, 3> q, tensor_view<T, cuda, 5> cache_in,
                                      const paged_kv_csr_device& csr, tensor_view<float, cuda, 3> out, decode_workspace& ws,
                                      attention_params params = {}, cudaStream_t stream = nullptr) {
  const char* fn = "batch_decode_with_paged_kv_cache(cuda)";
  const tensor_view<const std::remove_const_t<T>, cuda, 5> cache(cache_in);
  const std::int64_t nh = q.extent(1), dim = q.extent(2);
  detail::check_device_cache(fn, cache, nh, dim, csr);
  LOOM_CHECK(q.extent(0) == csr.batch, fn, ": q has ", q.extent(0), " rows for a batch of ", csr.batch);
  LOOM_CHECK(out.shape() == q.shape(), fn, ": out shape ", detail::shape_str(out.shape()), " differs from q shape ",
             detail::shape_str(q.shape()));
  LOOM_CHECK(q.is_contiguous() && out.is_contiguous(), fn, ": q and out must be contiguous");
  LOOM_CHECK(dim > 0 && dim <= kernels::max_head_dim, fn, ": head_dim=", dim, " outside the supported [1, ",
             kernels::max_head_dim, "]");
  LOOM_CHECK(nh <= 65535 && csr.batch <= 65535, fn, ": num_heads=", nh, " and batch=", csr.batch,
             " must each be at most 65535 (grid dimensions)");
  if (csr.batch == 0) return;
  const float scale = params.sm_scale > 0.f ? params.sm_scale : 1.f / std::sqrt(static_cast<float>(dim));
  const std::int64_t splits = kernels::decode_splits(csr.max_kv_len());
  if (splits > 1) ws.reserve(static_cast<std::int64_t>(csr.batch) * nh * splits, dim);
  const bool aligned16 = reinterpret_cast<std::uintptr_t>(cache.data()) % 16 == 0;
  kernels::with_decode_kernel<std::remove_const_t<T>>(dim, nh / cache.extent(3), aligned16,
                                                      [&](auto kernel, int heads, int lanes, std::size_t smem) {
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(nh / heads), static_cast<unsigned>(csr.batch));
    LOOM_LAUNCH(kernel, grid, kernels::decode_warps * 32, smem, stream)(
        q.data(), cache.data(), csr.indptr.data(), csr.indices.data(), csr.last_page_len.data(), csr.block_size,
        cache.extent(3), static_cast<std::int32_t>(dim), lanes, scale, splits, out.data(), ws.acc.data(), ws.m.data(),
        ws.l.data());
  });
  LOOM_CUDA_CHECK(cudaGetLastError());
  if (splits == 1) return;
  const dim3 merge_grid(static_cast<unsigned>(nh), static_cast<unsigned>(csr.batch));
  LOOM_LAUNCH(kernels::merge_splits, merge_grid, 128, 0, stream)(ws.acc.data(), ws.m.data(), ws.l.data(), splits,
                                                                 static_cast<std::int32_t>(dim), out.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

/// Device scratch of batch prefill: qo_indptr on the device and the longest query run, and the
/// split-KV ranges' states (decode_workspace's).
struct prefill_workspace {
  buffer<std::int32_t, cuda> qo_indptr;
  std::int64_t max_q_len = 0;
  decode_workspace states;
  explicit prefill_workspace(memory_resource& r = default_resource<cuda>()) : qo_indptr(0, r), states(r), mr_(&r) {}

  /// Copies qo_indptr (host) to the device; asynchronous on `stream` (the span must outlive it).
  void upload(std::span<const std::int32_t> host_indptr, cudaStream_t stream) {
    if (qo_indptr.size() < host_indptr.size()) qo_indptr = buffer<std::int32_t, cuda>(host_indptr.size(), *mr_);
    max_q_len = 0;
    for (std::size_t b = 0; b + 1 < host_indptr.size(); ++b)
      max_q_len = std::max<std::int64_t>(max_q_len, host_indptr[b + 1] - host_indptr[b]);
    if (!host_indptr.empty())
      LOOM_CUDA_CHECK(cudaMemcpyAsync(qo_indptr.data(), host_indptr.data(), host_indptr.size_bytes(), cudaMemcpyHostToDevice,
                                      stream));
  }

 private:
  memory_resource* mr_;
};

/// The cuda tag's batch_prefill_with_paged_kv_cache: sequence b's queries q[qo_indptr[b] :
/// qo_indptr[b + 1]] (qo_indptr on the host, as the scheduler has it; copied into ws) attend
/// over its csr keys, causally from position kv_len - q_len. Asynchronous; decode rows (one
/// query) run here too.  q, out: [total_q, num_heads, head_dim] (head_dim <= 256)
template <class T>
void batch_prefill_with_paged_kv_cache(cuda, tensor_view<const float, cuda, 3> q, std::span<const std::int32_t> qo_indptr,
                                       tensor_view<T, cuda, 5> cache_in, const paged_kv_csr_device& csr,
                                       tensor_view<float, cuda, 3> out, prefill_workspace& ws, attention_params params = {},
                                       cudaStream_t stream = nullptr) {
  const char* fn = "batch_prefill_with_paged_kv_cache(cuda)";
  const tensor_view<const std::remove_const_t<T>, cuda, 5> cache(cache_in);
  const std::int64_t nh = q.extent(1), dim = q.extent(2);
  detail::check_device_cache(fn, cache, nh, dim, csr);
  LOOM_CHECK(out.shape() == q.shape(), fn, ": out shape ", detail::shape_str(out.shape()), " differs from q shape ",
             detail::shape_str(q.shape()));
  LOOM_CHECK(q.is_contiguous() && out.is_contiguous(), fn, ": q and out must be contiguous");
  LOOM_CHECK(static_cast<std::int32_t>(qo_indptr.size()) == csr.batch + 1 && qo_indptr.back() == q.extent(0), fn,
             ": qo_indptr has ", qo_indptr.size(), " entries ending at ", qo_indptr.empty() ? -1 : qo_indptr.back(),
             " for a batch of ", csr.batch, " and ", q.extent(0), " query tokens");
  for (std::int32_t b = 0; b < csr.batch; ++b) {
    const std::int64_t q_len = qo_indptr[std::size_t(b) + 1] - qo_indptr[std::size_t(b)];
    LOOM_CHECK(q_len >= 0 && q_len <= csr.kv_lens[std::size_t(b)], fn, ": sequence ", b, " has q_len=", q_len,
               " outside [0, kv_len=", csr.kv_lens[std::size_t(b)], "]");
  }
  LOOM_CHECK(dim > 0 && dim <= ops::kernels::attention_max_head_dim, fn, ": head_dim=", dim, " outside the supported [1, ",
             ops::kernels::attention_max_head_dim, "]");
  LOOM_CHECK(nh <= 65535 && csr.batch <= 65535, fn, ": num_heads=", nh, " and batch=", csr.batch,
             " must each be at most 65535 (grid dimensions)");
  ws.upload(qo_indptr, stream);
  if (csr.batch == 0 || ws.max_q_len == 0) return;
  const float scale = params.sm_scale > 0.f ? params.sm_scale : 1.f / std::sqrt(static_cast<float>(dim));
  const auto one = kernels::prefill_launch(csr.batch, nh, ws.max_q_len, static_cast<std::int32_t>(dim));
  const std::int64_t total_q = q.extent(0), max_kv = csr.max_kv_len();
  const std::int64_t splits = kernels::prefill_splits(std::int64_t(one.x) * one.y * one.z, max_kv, total_q);
  const std::int64_t split_keys = kernels::prefill_split_keys(max_kv, splits);
  const auto shape = kernels::prefill_launch(csr.batch, nh, ws.max_q_len, static_cast<std::int32_t>(dim), splits);
  if (splits > 1) ws.states.reserve(total_q * nh * splits, dim);
  ops::kernels::with_dims_per_lane(dim, [&](auto dpl) {
    ops::kernels::launch_attention(kernels::prefill_tiles<std::remove_const_t<T>, decltype(dpl)::value>, shape, stream,
                                   q.data(), static_cast<const std::int32_t*>(ws.qo_indptr.data()), cache.data(),
                                   csr.indptr.data(), csr.indices.data(), csr.last_page_len.data(), csr.block_size,
                                   cache.extent(3), static_cast<std::int32_t>(dim), scale, params.causal, out.data(), splits,
                                   split_keys, ws.states.acc.data(), ws.states.m.data(), ws.states.l.data());
  });
  if (splits == 1) return;
  LOOM_LAUNCH(kernels::merge_splits, dim3(static_cast<unsigned>(nh), static_cast<unsigned>(total_q)), 128, 0, stream)
  (ws.states.acc.data(), ws.states.m.data(), ws.states.l.data(), splits, static_cast<std::int32_t>(dim), out.data());
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::kv
