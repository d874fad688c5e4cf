// loom-bench-gpu: the short GPU benchmark of scripts/gpu-check.sh. Each row times one of loom's
// CUDA kernels with CUDA events (median of --reps launches after warm-up launches) and states
// it against the device's peak, which the command line gives (defaults: an H200's dense bf16
// tensor peak and HBM3e bandwidth from its data sheet; pass your device's):
//   GEMM (cuBLAS through ops::gemm, fp32 accumulation) at a ~1B LLaMA's training shapes:
//     TFLOP/s and % of --peak-tflops (bf16) / --peak-tflops-fp32
//   paged decode attention (kv::batch_decode_with_paged_kv_cache, bf16 pool, GQA):
//     the keys and values read per launch / time, GB/s and % of --peak-gbs
//   paged prefill (kv::batch_prefill_with_paged_kv_cache, bf16 pool, GQA): whole prompts, and
//     a 256-token chunk over 32768 keys (split keys), model FLOP/s (causal) and % of
//     --peak-tflops-fp32
//   causal attention forward and backward (ops::attention_forward / _backward, fp32, GQA) at
//     that model's heads: model FLOP/s (causal half of the seq x seq products: forward 2,
//     backward 5 GEMM-equivalents) and % of --peak-tflops-fp32
//   NF4 dequantisation (quant::nf4_dequantize_rows into bf16): bytes read + written / time
//   embedding forward and RMSNorm forward: bytes moved / time
//   token sampling (kv::sample, 64 rows of a 32000-word vocabulary: greedy, and temperature
//     with top-p, which sorts each row): logits read / time (a latency of the decode step
//     more than a bandwidth figure: the sort is O(V log^2 V) a row)
// Without a device it says so and exits 0: it is a measurement, never a test.
//   the decoder's training step (llama3d::stage_model on the cuda tag, step.cu): model FLOP/s
//     and % of --peak-tflops (the step's MFU)
//   loom-bench-gpu [--quick] [--only gemm|decode|prefill|attention|nf4|rows|sampling|step] [--reps N] [--peak-tflops T] [--peak-tflops-fp32 T] [--peak-gbs G]

#include "bench_gpu.hpp"

#include <loom/core/buffer.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/memory.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/kv/block_table.hpp>
#include <loom/kv/cuda/paged_attention.cuh>
#include <loom/kv/cuda/sampler.cuh>
#include <loom/ops/cuda/attention.cuh>
#include <loom/ops/cuda/embedding.cuh>
#include <loom/ops/cuda/gemm.hpp>
#include <loom/ops/cuda/norm.cuh>
#include <loom/quant/cuda/nf4.cuh>
#include <loom/quant/nf4.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using namespace loom_bench_gpu;

double number_arg(int& i, int argc, char** argv) {
  const std::string name = argv[i];
  LOOM_CHECK(i + 1 < argc, "loom-bench-gpu: ", name, " needs a value");
  char* end = nullptr;
  const double v = std::strtod(argv[++i], &end);
  LOOM_CHECK(end && *end == '\0' && std::isfinite(v) && v > 0, "loom-bench-gpu: ", name, " must be a positive number, got '",
             std::string(argv[i]).substr(0, 64), "'");
  return v;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") o.quick = true;
    else if (a == "--only") {
      LOOM_CHECK(i + 1 < argc, "loom-bench-gpu: --only needs a value (gemm, decode, prefill, attention, nf4, rows, sampling, step)");
      o.only = argv[++i];
    }
    else if (a == "--reps") o.reps = static_cast<int>(std::min(number_arg(i, argc, argv), 10000.0));
    else if (a == "--peak-tflops") o.peak_tflops = number_arg(i, argc, argv);
    else if (a == "--peak-tflops-fp32") o.peak_tflops_fp32 = number_arg(i, argc, argv);
    else if (a == "--peak-gbs") o.peak_gbs = number_arg(i, argc, argv);
    else LOOM_CHECK(false, "loom-bench-gpu: unknown argument '", a.substr(0, 64), "' (--quick, --only, --reps, --peak-tflops, --peak-tflops-fp32, --peak-gbs)");
  }
  return o;
}

template <class T>
void bench_gemm(const options& o, const loom::ops::cublas_handle& h, index_t m, index_t k, index_t n, const char* name,
                double peak) {
  auto a = filled<T>(std::size_t(m * k), 0.01f), b = filled<T>(std::size_t(k * n), 0.01f);
  auto c = filled<T>(std::size_t(m * n), 0.f);
  const loom::tensor_view<const T, loom::cuda, 2> av(a.data(), loom::extents<2>{m, k}), bv(b.data(), loom::extents<2>{k, n});
  const loom::tensor_view<T, loom::cuda, 2> cv(c.data(), loom::extents<2>{m, n});
  const double ms = median_ms(o.reps, [&] { loom::ops::gemm(loom::cuda{}, h, av, bv, cv); });
  row(std::string("GEMM ") + name, std::to_string(m) + " x " + std::to_string(k) + " x " + std::to_string(n), ms,
      2.0 * double(m) * double(k) * double(n) / (ms * 1e-3) / 1e12, "TFLOP/s", peak);
}

/// The paged-attention benchmarks' pool: `batch` sequences of `len` tokens in 16-token pages
/// of a bf16 pool with 8 kv heads of 128, each sequence's pages interleaved with the others'.
struct interleaved_pool {
  static constexpr std::int64_t heads = 32, kv_heads = 8, dim = 128;
  static constexpr std::int32_t block_size = 16;
  loom::kv::paged_kv_csr_device csr;
  loom::buffer<loom::bfloat16, loom::cuda> cache;
  loom::tensor_view<loom::bfloat16, loom::cuda, 5> view;

  interleaved_pool(std::int32_t batch, std::int64_t len) : cache(0) {
    const std::int64_t pages = (len + block_size - 1) / block_size;
    const auto num_blocks = static_cast<std::int32_t>(pages * batch);
    loom::kv::paged_kv_csr host;
    host.block_size = block_size;
    host.clear();
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int64_t p = 0; p < pages; ++p) host.indices.push_back(static_cast<std::int32_t>(p * batch + b));
      host.indptr.push_back(static_cast<std::int32_t>(host.indices.size()));
      host.last_page_len.push_back(static_cast<std::int32_t>(len - (pages - 1) * block_size));
    }
    csr.upload(host);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());  // `host` goes out of scope
    cache = filled<loom::bfloat16>(std::size_t(num_blocks) * 2 * std::size_t(block_size * kv_heads * dim), 0.01f);
    view = {cache.data(), loom::extents<5>{num_blocks, 2, block_size, kv_heads, dim}};
  }
};

/// The decode kernel's reads without its arithmetic: block (split, key/value head, sequence)
/// reads the key and value rows of its key range, 16 bytes a thread at a time, and folds the
/// bits so that no load is optimised away. Its rate is what the pool's layout and the decode
/// grid allow, the ceiling for paged decode on the device.
__global__ void read_pool(const loom::bfloat16* __restrict__ cache, const std::int32_t* __restrict__ indptr,
                          const std::int32_t* __restrict__ indices, const std::int32_t* __restrict__ last_page_len,
                          std::int32_t bs, std::int64_t hk, std::int32_t dim, std::int64_t splits, unsigned* sink) {
  const loom::kv::kernels::decode_block blk(indptr, last_page_len, bs, hk, splits, 1);  // gridDim.y = hk: one head each
  const auto rows = blk.rows(cache, indices, indptr, bs, hk, dim);
  const std::int32_t chunks = dim / 8;  // 16 bytes of bf16
  unsigned acc = 0;
#pragma unroll 4
  for (std::int64_t i = blk.j0 * chunks + threadIdx.x; i < blk.j1 * chunks; i += blockDim.x) {
    const loom::bfloat16* key = rows.key(i / chunks) + (i % chunks) * 8;
    const uint4 k = *reinterpret_cast<const uint4*>(key), v = *reinterpret_cast<const uint4*>(key + rows.kv_half);
    acc ^= k.x ^ k.y ^ k.z ^ k.w ^ v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // practically never; keeps the loads
}

void bench_decode(const options& o, std::int32_t batch, std::int64_t kv_len) {
  namespace kv = loom::kv;
  using P = interleaved_pool;
  P pool(batch, kv_len);
  auto q = filled<float>(std::size_t(batch * P::heads * P::dim), 0.1f), out = filled<float>(q.size(), 0.f);
  kv::decode_workspace ws;
  const loom::tensor_view<const float, loom::cuda, 3> qv(q.data(), loom::extents<3>{batch, P::heads, P::dim});
  const loom::tensor_view<float, loom::cuda, 3> ov(out.data(), loom::extents<3>{batch, P::heads, P::dim});
  const double ms = median_ms(o.reps, [&] { kv::batch_decode_with_paged_kv_cache(loom::cuda{}, qv, pool.view, pool.csr, ov, ws); });
  const double bytes = double(batch) * double(kv_len) * double(P::kv_heads * P::dim) * 2.0 * sizeof(loom::bfloat16);
  const std::string shape = "batch " + std::to_string(batch) + ", kv_len " + std::to_string(kv_len);
  row("paged decode (bf16 pool, 32 q / 8 kv heads, head_dim 128)", shape, ms, bytes / (ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
  // the same rows read with no arithmetic, then the pool copied whole (read + write, contiguous)
  const std::int64_t splits = kv::kernels::decode_splits(kv_len);
  loom::buffer<unsigned, loom::cuda> sink(1);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(P::kv_heads), static_cast<unsigned>(batch));
  const double read_ms = median_ms(o.reps, [&] {
    read_pool<<<grid, 128>>>(pool.cache.data(), pool.csr.indptr.data(), pool.csr.indices.data(),
                             pool.csr.last_page_len.data(), P::block_size, P::kv_heads, static_cast<std::int32_t>(P::dim),
                             splits, sink.data());
    LOOM_CUDA_CHECK(cudaGetLastError());
  });
  row("  its rows read, no arithmetic (the layout's ceiling)", shape, read_ms, bytes / (read_ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
  if (batch == 64) {
    const std::size_t pool_bytes = pool.cache.size() * sizeof(loom::bfloat16);
    loom::buffer<loom::bfloat16, loom::cuda> copy(pool.cache.size());
    const double copy_ms = median_ms(o.reps, [&] {
      LOOM_CUDA_CHECK(cudaMemcpyAsync(copy.data(), pool.cache.data(), pool_bytes, cudaMemcpyDeviceToDevice));
    });
    row("  the pool copied (read + write, contiguous)", std::to_string(pool_bytes >> 20) + " MiB", copy_ms,
        2.0 * double(pool_bytes) / (copy_ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
  }
}

void bench_attention(const options& o, index_t batch, index_t seq) {
  const index_t h = 32, kvh = 4, hd = 64;
  auto q = filled<float>(std::size_t(batch * seq * h * hd), 0.01f), k = filled<float>(std::size_t(batch * seq * kvh * hd), 0.01f);
  auto v = filled<float>(k.size(), 0.01f), out = filled<float>(q.size(), 0.f), dout = filled<float>(q.size(), 0.01f);
  auto lse = filled<float>(std::size_t(batch * h * seq), 0.f), dq = filled<float>(q.size(), 0.f);
  auto dk = filled<float>(k.size(), 0.f), dv = filled<float>(k.size(), 0.f);
  using in4 = loom::tensor_view<const float, loom::cuda, 4>;
  using out4 = loom::tensor_view<float, loom::cuda, 4>;
  const loom::extents<4> qe{batch, seq, h, hd}, ke{batch, seq, kvh, hd};
  const loom::extents<3> le{batch, h, seq};
  loom::ops::attention_workspace ws;
  const std::string shape = "batch " + std::to_string(batch) + ", seq " + std::to_string(seq) + ", 32 q / 4 kv heads of 64";
  const double pairs = double(batch) * double(h) * double(seq) * double(seq) / 2 * double(hd);  // causal
  double ms = median_ms(o.reps, [&] {
    loom::ops::attention_forward(loom::cuda{}, in4(q.data(), qe), in4(k.data(), ke), in4(v.data(), ke), out4(out.data(), qe),
                                 loom::tensor_view<float, loom::cuda, 3>(lse.data(), le));
  });
  row("attention forward (fp32, causal)", shape, ms, 4 * pairs / (ms * 1e-3) / 1e12, "TFLOP/s", o.peak_tflops_fp32);
  ms = median_ms(o.reps, [&] {
    loom::ops::attention_backward(loom::cuda{}, in4(dout.data(), qe), in4(q.data(), qe), in4(k.data(), ke), in4(v.data(), ke),
                                  in4(out.data(), qe), loom::tensor_view<const float, loom::cuda, 3>(lse.data(), le),
                                  out4(dq.data(), qe), out4(dk.data(), ke), out4(dv.data(), ke), ws, {}, false);
  });
  row("attention backward (fp32, causal)", shape, ms, 10 * pairs / (ms * 1e-3) / 1e12, "TFLOP/s", o.peak_tflops_fp32);
}

/// Batch entries of `len` keys each whose last `q_len` tokens are the queries (q_len = len:
/// whole prompts; less: a chunk of a long prompt, where the keys are split across blocks).
void bench_prefill(const options& o, std::int32_t batch, std::int64_t len, std::int64_t q_len) {
  namespace kv = loom::kv;
  using P = interleaved_pool;
  P pool(batch, len);
  std::vector<std::int32_t> qo_indptr{0};
  for (std::int32_t b = 0; b < batch; ++b) qo_indptr.push_back(static_cast<std::int32_t>((b + 1) * q_len));
  kv::prefill_workspace ws;
  auto q = filled<float>(std::size_t(batch * q_len * P::heads * P::dim), 0.1f), out = filled<float>(q.size(), 0.f);
  const loom::tensor_view<const float, loom::cuda, 3> qv(q.data(), loom::extents<3>{batch * q_len, P::heads, P::dim});
  const loom::tensor_view<float, loom::cuda, 3> ov(out.data(), loom::extents<3>{batch * q_len, P::heads, P::dim});
  const double ms =
      median_ms(o.reps, [&] { kv::batch_prefill_with_paged_kv_cache(loom::cuda{}, qv, qo_indptr, pool.view, pool.csr, ov, ws); });
  // causal: query i of the chunk sees len - q_len + i + 1 keys
  const double pairs = double(q_len) * double(len - q_len) + double(q_len) * double(q_len + 1) / 2;
  const double flops = 4.0 * double(batch) * double(P::heads) * pairs * double(P::dim);
  row("paged prefill (bf16 pool, 32 q / 8 kv heads, head_dim 128)",
      "batch " + std::to_string(batch) + ", " + std::to_string(q_len) + " queries over " + std::to_string(len) + " keys", ms,
      flops / (ms * 1e-3) / 1e12, "TFLOP/s", o.peak_tflops_fp32);
}

void bench_nf4(const options& o, index_t rows, index_t cols) {
  std::vector<float> w(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float((i * 2654435761u) % 1000) * 1e-4f - 0.05f;
  const loom::quant::nf4_matrix m(loom::make_view(static_cast<const float*>(w.data()), rows, cols));
  const loom::quant::nf4_matrix_device dm(m);
  auto out = filled<loom::bfloat16>(w.size(), 0.f);
  const loom::tensor_view<loom::bfloat16, loom::cuda, 2> ov(out.data(), loom::extents<2>{rows, cols});
  const double ms = median_ms(o.reps, [&] { loom::quant::nf4_dequantize_rows(dm, 0, rows, ov); });
  const double bytes = double(dm.bytes()) + double(w.size()) * sizeof(loom::bfloat16);
  row("NF4 -> bf16 rows (double-quantised absmax)", std::to_string(rows) + " x " + std::to_string(cols), ms,
      bytes / (ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
}

void bench_rows(const options& o, index_t n, index_t d, index_t vocab) {
  std::vector<std::int32_t> tok(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) tok[std::size_t(i)] = static_cast<std::int32_t>((i * 7919) % vocab);
  loom::buffer<std::int32_t, loom::cuda> gtok(tok.size());
  LOOM_CUDA_CHECK(cudaMemcpy(gtok.data(), tok.data(), tok.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  auto table = filled<float>(std::size_t(vocab * d), 0.01f), x = filled<float>(std::size_t(n * d), 0.f);
  auto w = filled<float>(std::size_t(d), 1.f), y = filled<float>(std::size_t(n * d), 0.f), rstd = filled<float>(std::size_t(n), 0.f);
  loom::ops::embedding_workspace ews;
  const loom::tensor_view<std::int32_t, loom::cuda, 1> tv(gtok.data(), loom::extents<1>{n});
  const loom::tensor_view<const float, loom::cuda, 2> tab(table.data(), loom::extents<2>{vocab, d});
  const loom::tensor_view<float, loom::cuda, 2> xv(x.data(), loom::extents<2>{n, d}), yv(y.data(), loom::extents<2>{n, d});
  const std::string shape = std::to_string(n) + " x " + std::to_string(d);
  const double bytes = 2.0 * double(n * d) * sizeof(float);  // a row read, a row written
  double ms = median_ms(o.reps, [&] { loom::ops::embedding_forward(loom::cuda{}, tv, tab, xv, ews); });
  row("embedding forward (fp32; waits for its id check)", shape, ms, bytes / (ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
  ms = median_ms(o.reps, [&] {
    loom::ops::rmsnorm_forward(loom::cuda{}, loom::tensor_view<const float, loom::cuda, 2>(xv), 
                               loom::tensor_view<const float, loom::cuda, 1>(w.data(), loom::extents<1>{d}), yv,
                               loom::tensor_view<float, loom::cuda, 1>(rstd.data(), loom::extents<1>{n}), 1e-5f);
  });
  row("RMSNorm forward (fp32)", shape, ms, bytes / (ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
}

void bench_sampling(const options& o, std::int32_t batch, index_t vocab) {
  namespace kv = loom::kv;
  auto logits = filled<float>(std::size_t(batch * vocab), 8.f);
  loom::buffer<kv::token_id, loom::cuda> out(static_cast<std::size_t>(batch));
  const loom::tensor_view<float, loom::cuda, 2> lv(logits.data(), loom::extents<2>{batch, vocab});
  const loom::tensor_view<kv::token_id, loom::cuda, 1> ov(out.data(), loom::extents<1>{batch});
  const std::vector<std::span<const kv::token_id>> histories(static_cast<std::size_t>(batch));
  const std::vector<std::int64_t> positions(static_cast<std::size_t>(batch), 100);
  kv::sampling_workspace ws;
  const std::string shape = std::to_string(batch) + " x " + std::to_string(vocab);
  const double bytes = double(batch * vocab) * sizeof(float);
  for (const auto& [what, p] : {std::pair<const char*, kv::sampling_params>{"token sampling (greedy)", {}},
                                {"token sampling (temperature 0.8, top-p 0.9)", {.temperature = 0.8f, .top_p = 0.9f}}}) {
    const std::vector<kv::sampling_params> params(static_cast<std::size_t>(batch), p);
    const double ms = median_ms(o.reps, [&] { kv::sample(loom::cuda{}, lv, params, histories, positions, ov, ws); });
    row(what, shape, ms, bytes / (ms * 1e-3) / 1e9, "GB/s", o.peak_gbs);
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("loom-bench-gpu: no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (%d SMs, %.0f GiB); peaks assumed: %.0f TFLOP/s bf16, %.0f TFLOP/s fp32, %.0f GB/s\n\n", prop.name,
              prop.multiProcessorCount, double(prop.totalGlobalMem) / double(1 << 30), o.peak_tflops, o.peak_tflops_fp32,
              o.peak_gbs);
  std::printf("| kernel | shape | median ms | rate | %% of peak |\n|---|---|---:|---:|---:|\n");
  const index_t tokens = o.quick ? 2048 : 8192;
  loom::ops::cublas_handle h;
  // a ~1B LLaMA (hidden 2048, MLP 5632, vocab 32000): the attention projections, the MLP, the head
  const auto want = [&](const char* name) { return o.only.empty() || o.only == name; };
  if (want("gemm")) {
    bench_gemm<loom::bfloat16>(o, h, tokens, 2048, 2048, "bf16", o.peak_tflops);
    bench_gemm<loom::bfloat16>(o, h, tokens, 2048, 5632, "bf16", o.peak_tflops);
    bench_gemm<loom::bfloat16>(o, h, tokens, 5632, 2048, "bf16", o.peak_tflops);
    bench_gemm<loom::bfloat16>(o, h, tokens, 2048, 32000, "bf16", o.peak_tflops);
    bench_gemm<float>(o, h, tokens, 2048, 2048, "fp32", o.peak_tflops_fp32);
  }
  if (want("decode"))
    for (auto [batch, len] : {std::pair<std::int32_t, std::int64_t>{1, 32768}, {16, 4096}, {64, 4096}})
      if (!o.quick || batch == 16) bench_decode(o, batch, len);
  if (want("prefill")) {
    bench_prefill(o, o.quick ? 1 : 4, 2048, 2048);
    bench_prefill(o, 1, 32768, 256);  // a chunk of a long prompt: split keys
  }
  if (want("attention")) bench_attention(o, tokens / 2048, 2048);
  if (want("nf4")) bench_nf4(o, 4096, o.quick ? 4096 : 11008);
  if (want("rows")) bench_rows(o, tokens, 2048, 32000);
  if (want("sampling")) bench_sampling(o, 64, 32000);
  if (want("step")) bench_step(o);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
