#pragma once
// Paged attention on a CUDA device: the append of new keys/values to the paged pool, batch
// prefill and batch decode over it, under the host's names (kv/paged_attention.hpp) with the
// cuda tag, the block table as device arrays (paged_kv_csr_device) and a stream.
//
// Decode, as FlashInfer does it for long contexts (split-KV): the keys of a sequence are cut
// into `splits` ranges; a block of `decode_warps` warps takes one (sequence, head, range), each
// warp every decode_warps-th key of it. A warp holds the query and its accumulator spread over
// its lanes (head_dim / 32 elements each), makes each score with a shuffle reduction and folds
// it in with the online-softmax step the host runs (ops::math::online_softmax_push). The
// warps' states are merged in warp order inside the block, then the ranges' states in range
// order by a second kernel (ops::math::online_softmax_merge, tested on the host against one
// pass): no atomics, so the result is the same on every run. It differs from the host's
// one-pass result only by the order of additions (the tests' tolerance says how much).
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
#include <span>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace loom::kv {

namespace kernels {

inline constexpr int decode_warps = 4;
inline constexpr int max_dim_per_lane = 8;             // head_dim <= 256
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

/// One block per (split, head, sequence); see the file comment.
template <class T>
__global__ void __launch_bounds__(decode_warps * 32)
    decode_split(const float* __restrict__ q, const T* __restrict__ cache, const std::int32_t* __restrict__ indptr,
                 const std::int32_t* __restrict__ indices, const std::int32_t* __restrict__ last_page_len,
                 std::int32_t bs, std::int64_t hk, std::int32_t dim, float scale, std::int64_t splits,
                 float* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_m, float* __restrict__ ws_l) {
  const std::int64_t split = blockIdx.x, h = blockIdx.y, nh = gridDim.y;
  const std::int32_t b = static_cast<std::int32_t>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t kv_len = kv_len_of(indptr, last_page_len, b, bs);
  const std::int64_t per = (kv_len + splits - 1) / splits, j0 = std::min(kv_len, split * per),
                     j1 = std::min(kv_len, j0 + per);
  const std::int64_t kvh = h / (nh / hk), token_stride = hk * dim, kv_half = bs * token_stride,
                     block_stride = 2 * kv_half;
  const float* qr = q + (static_cast<std::int64_t>(b) * nh + h) * dim;
  float qv[max_dim_per_lane], acc[max_dim_per_lane];
  for (int i = 0; i < max_dim_per_lane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < dim ? qr[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const std::int32_t* pages = indices + indptr[b];
  for (std::int64_t j = j0 + warp; j < j1; j += decode_warps) {
    const T* key = cache + pages[j / bs] * block_stride + (j % bs) * token_stride + kvh * dim;
    float part = 0.f;
    for (int i = 0; i < max_dim_per_lane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) part += qv[i] * ops::load<float>(key[d]);
    }
    part = ops::kernels::warp_sum(part);
    float p, c;
    if (ops::math::online_softmax_push(part * scale, m, l, p, c))
      for (int i = 0; i < max_dim_per_lane; ++i) acc[i] *= c;
    const T* value = key + kv_half;
    for (int i = 0; i < max_dim_per_lane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) acc[i] += p * ops::load<float>(value[d]);
    }
  }
  // the warps' states, merged in warp order by warp 0
  __shared__ float sm[decode_warps], sl[decode_warps], sacc[decode_warps][max_dim_per_lane * 32];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
  for (int i = 0; i < max_dim_per_lane; ++i) sacc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  for (int w = 1; w < decode_warps; ++w) {
    float c1, c2;
    ops::math::online_softmax_merge(m, l, sm[w], sl[w], c1, c2);
    for (int i = 0; i < max_dim_per_lane; ++i) acc[i] = acc[i] * c1 + sacc[w][lane + 32 * i] * c2;
  }
  if (splits == 1) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int i = 0; i < max_dim_per_lane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) out[(static_cast<std::int64_t>(b) * nh + h) * dim + d] = acc[i] * inv;
    }
    return;
  }
  const std::int64_t state = (static_cast<std::int64_t>(b) * nh + h) * splits + split;
  if (lane == 0) ws_m[state] = m, ws_l[state] = l;
  for (int i = 0; i < max_dim_per_lane; ++i) {
    const int d = lane + 32 * i;
    if (d < dim) ws_acc[state * dim + d] = acc[i];
  }
}

/// One block per (head, row): the splits' states of a decode row (a sequence) or of a prefill
/// query row, merged in split order, normalised. Row bh = blockIdx.y * gridDim.x + blockIdx.x.
__global__ void merge_splits(const float* __restrict__ ws_acc, const float* __restrict__ ws_m, const float* __restrict__ ws_l,
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
  LOOM_CHECK(dim > 0 && dim <= 32 * kernels::max_dim_per_lane, fn, ": head_dim=", dim, " outside the supported [1, ",
             32 * kernels::max_dim_per_lane, "]");
  LOOM_CHECK(nh <= 65535 && csr.batch <= 65535, fn, ": num_heads=", nh, " and batch=", csr.batch,
             " must each be at most 65535 (grid dimensions)");
  if (csr.batch == 0) return;
  const float scale = params.sm_scale > 0.f ? params.sm_scale : 1.f / std::sqrt(static_cast<float>(dim));
  const std::int64_t splits = kernels::decode_splits(csr.max_kv_len());
  if (splits > 1) ws.reserve(static_cast<std::int64_t>(csr.batch) * nh * splits, dim);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(nh), static_cast<unsigned>(csr.batch));
  LOOM_LAUNCH(kernels::decode_split, grid, kernels::decode_warps * 32, 0, stream)(
      q.data(), cache.data(), csr.indptr.data(), csr.indices.data(), csr.last_page_len.data(), csr.block_size,
      cache.extent(3), static_cast<std::int32_t>(dim), scale, splits, out.data(), ws.acc.data(), ws.m.data(), ws.l.data());
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
