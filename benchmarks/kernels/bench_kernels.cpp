// loom-bench-kernels: the host kernels one at a time, as Google Benchmark programs, on the
// shapes of the training-step benchmark's models (bench_train_step.py: tiny 1.8M, small 8.3M
// and medium 31.6M parameters, 1,024 tokens a step; GQA in tiny and medium).
//
//   BM_gemm/<kernel>/<model>/<layer>/<product>: every distinct GEMM of the model's linear
//     layers (forward x W^T, input gradient dy W, weight gradient dy^T x, for q/o, k/v,
//     w1/w3, w2 and the output layer) through ops::gemm on each sgemm kernel the CPU runs
//     (avx512, avx2, blas; the others are skipped by name), with caches flushed before every
//     call as in a step, where operands come from the previous kernel.
//   BM_decode/<kernel>/<packed|unpacked>/<layer>: y = x W^T for one decoded token (m = 1) on
//     the stories15M shapes (dim 288, hidden 768, vocab 32000), W packed once
//     (ops::packed_weight) or copied by every ops::gemm call.
//   BM_attention_{forward,backward}/<model>, BM_rmsnorm_{forward,backward}/<model>,
//   BM_swiglu_{forward,backward}/<model>, BM_rope/<model>, BM_cross_entropy/<model>: the
//     other kernels of a step on the same shapes (GEMMs inside attention on the kernel
//     LOOM_SGEMM names, or the best the CPU has).
//   BM_adamw/<model>: optim::adamw_update over a flat buffer of the model's parameter count.
//
// Counters: GFLOP/s (GEMMs and attention, 2 flops a multiply-add), GB/s (elementwise and row
// kernels: bytes read + written once). Threads: loom's pool (LOOM_NUM_THREADS, else
// OPENBLAS_NUM_THREADS, else the cores). Usual flags apply (--benchmark_filter=avx2,
// --benchmark_repetitions=5, --benchmark_format=json).
#include <loom/core/random.hpp>
#include <loom/ops/host/activation.hpp>
#include <loom/ops/host/attention.hpp>
#include <loom/ops/host/cross_entropy.hpp>
#include <loom/ops/host/gemm.hpp>
#include <loom/ops/host/norm.hpp>
#include <loom/ops/host/packed_weight.hpp>
#include <loom/ops/host/rope.hpp>
#include <loom/optim/adamw.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <span>
#include <utility>
#include <string>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
namespace ops = loom::ops;

struct model_shape {
  const char* name;
  index_t dim, heads, kv_heads, hidden, vocab, seq, batch;
  index_t tokens() const { return seq * batch; }
  index_t head_dim() const { return dim / heads; }
};
// The three models of bench_train_step.py (SIZES there).
const model_shape models[] = {{"tiny", 128, 4, 2, 352, 4096, 128, 8},
                              {"small", 288, 6, 6, 768, 4096, 256, 4},
                              {"medium", 512, 8, 4, 1376, 8192, 256, 4}};

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::vector<float> v(n);
  loom::counter_rng(seed).fill_normal(std::span<float>(v), 0, 0.f, scale);
  return v;
}

std::vector<float> zeros(index_t n) { return std::vector<float>(static_cast<std::size_t>(n)); }

/// Evicts the last-level cache between timed calls, outside the timing.
void flush_caches(benchmark::State& state) {
  static std::vector<float> junk(std::size_t(64) << 20 >> 2, 1.f);
  state.PauseTiming();
  for (float& f : junk) f += 1.f;
  benchmark::DoNotOptimize(junk.data());
  state.ResumeTiming();
}

void BM_gemm(benchmark::State& state, ops::host_sgemm kernel, model_shape m, index_t out, index_t in, int product) {
  const index_t t = m.tokens();
  auto x = random_floats(std::size_t(t * in), 1), w = random_floats(std::size_t(out * in), 2),
       y = random_floats(std::size_t(t * out), 3), dx = zeros(t * in), dw = zeros(out * in);
  auto xv = make_view(x.data(), t, in), wv = make_view(w.data(), out, in), yv = make_view(y.data(), t, out);
  const ops::host_sgemm old = ops::host_sgemm_kernel();
  ops::set_host_sgemm(kernel);
  for (auto _ : state) {
    flush_caches(state);
    if (product == 0) ops::gemm(host{}, loom::tensor_view<const float, host, 2>(xv), wv.transpose(0, 1), yv);
    if (product == 1) ops::gemm(host{}, loom::tensor_view<const float, host, 2>(yv), wv, make_view(dx.data(), t, in));
    if (product == 2) ops::gemm(host{}, yv.transpose(0, 1), xv, make_view(dw.data(), out, in));
  }
  ops::set_host_sgemm(old);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(t) * double(in) * double(out),
                                                 benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void set_bytes(benchmark::State& state, double bytes) {
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void BM_decode(benchmark::State& state, ops::host_sgemm kernel, bool packed, index_t out, index_t in) {
  auto w = random_floats(std::size_t(out * in), 16), x = random_floats(std::size_t(in), 17);
  auto y = zeros(out);
  const auto wv = make_view(static_cast<const float*>(w.data()), out, in);
  const ops::packed_weight pw(wv, kernel);
  const ops::host_sgemm old = ops::host_sgemm_kernel();
  ops::set_host_sgemm(kernel);
  for (auto _ : state) {
    if (packed) ops::gemm(host{}, make_view(static_cast<const float*>(x.data()), 1, in), pw, make_view(y.data(), 1, out));
    else ops::gemm(host{}, make_view(static_cast<const float*>(x.data()), 1, in), wv.transpose(0, 1), make_view(y.data(), 1, out));
    benchmark::DoNotOptimize(y.data());
  }
  ops::set_host_sgemm(old);
  set_bytes(state, double(out * in) * 4);  // the weight streamed once
}

void BM_attention(benchmark::State& state, model_shape m, bool backward) {
  const index_t b = m.batch, s = m.seq, h = m.heads, kvh = m.kv_heads, hd = m.head_dim();
  auto q = random_floats(std::size_t(b * s * h * hd), 4), k = random_floats(std::size_t(b * s * kvh * hd), 5),
       v = random_floats(std::size_t(b * s * kvh * hd), 6), dout = random_floats(q.size(), 7);
  std::vector<float> o(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  auto probs = zeros(b * h * s * s), scratch = zeros(s * s);
  auto fwd = [&] {
    ops::attention_forward(host{}, make_view(q.data(), b, s, h, hd), make_view(k.data(), b, s, kvh, hd),
                           make_view(v.data(), b, s, kvh, hd), make_view(o.data(), b, s, h, hd),
                           make_view(probs.data(), b, h, s, s));
  };
  fwd();
  for (auto _ : state) {
    if (!backward) {
      fwd();
    } else {
      ops::attention_backward(host{}, make_view(dout.data(), b, s, h, hd), make_view(q.data(), b, s, h, hd),
                              make_view(k.data(), b, s, kvh, hd), make_view(v.data(), b, s, kvh, hd),
                              make_view(probs.data(), b, h, s, s), make_view(dq.data(), b, s, h, hd),
                              make_view(dk.data(), b, s, kvh, hd), make_view(dv.data(), b, s, kvh, hd),
                              make_view(scratch.data(), s, s), {}, false);
    }
  }
  // causal: half of the [s, s] scores; QK^T and PV (forward), four such products (backward)
  const double flops = (backward ? 4.0 : 2.0) * 2.0 * double(b * h) * double(s) * double(s) / 2 * double(hd);
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}


void BM_rmsnorm(benchmark::State& state, model_shape m, bool backward) {
  const index_t n = m.tokens(), d = m.dim;
  auto x = random_floats(std::size_t(n * d), 8), w = random_floats(std::size_t(d), 9), dy = random_floats(x.size(), 10);
  std::vector<float> y(x.size()), dx(x.size());
  auto rstd = zeros(n), dw = zeros(d);
  auto fwd = [&] {
    ops::rmsnorm_forward(host{}, make_view(x.data(), n, d), make_view(w.data(), d), make_view(y.data(), n, d),
                         make_view(rstd.data(), n), 1e-5f);
  };
  fwd();
  for (auto _ : state) {
    if (!backward) {
      fwd();
    } else {
      ops::rmsnorm_backward(host{}, make_view(dy.data(), n, d), make_view(x.data(), n, d), make_view(w.data(), d),
                            make_view(rstd.data(), n), make_view(dx.data(), n, d), make_view(dw.data(), d));
    }
  }
  set_bytes(state, double(n * d) * 4 * (backward ? 3 : 2));
}

void BM_swiglu(benchmark::State& state, model_shape m, bool backward) {
  const index_t n = m.tokens() * m.hidden;
  auto a = random_floats(std::size_t(n), 11), b = random_floats(std::size_t(n), 12), dy = random_floats(std::size_t(n), 13);
  auto y = zeros(n), da = zeros(n), db = zeros(n);
  for (auto _ : state) {
    if (!backward)
      ops::swiglu_forward(host{}, make_view(a.data(), n), make_view(b.data(), n), make_view(y.data(), n));
    else
      ops::swiglu_backward(host{}, make_view(dy.data(), n), make_view(a.data(), n), make_view(b.data(), n),
                           make_view(da.data(), n), make_view(db.data(), n));
  }
  set_bytes(state, double(n) * 4 * (backward ? 5 : 3));
}

void BM_rope(benchmark::State& state, model_shape m) {
  const index_t b = m.batch, s = m.seq, h = m.heads, hd = m.head_dim();
  ops::rope_table<float> table(s, hd, 10000.0);
  auto x = random_floats(std::size_t(b * s * h * hd), 14);
  for (auto _ : state) ops::rope_forward(host{}, make_view(x.data(), b, s, h, hd), table, ops::rope_style::half_split);
  set_bytes(state, double(x.size()) * 4 * 2);
}

void BM_cross_entropy(benchmark::State& state, model_shape m) {
  const index_t n = m.tokens(), v = m.vocab;
  auto logits = random_floats(std::size_t(n * v), 15, 3.f);
  std::vector<float> lse = zeros(n), dl(logits.size());
  std::vector<std::int32_t> tgt(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) tgt[std::size_t(i)] = std::int32_t((i * 37) % v);
  for (auto _ : state) {
    const float loss = ops::cross_entropy_forward_backward(host{}, make_view(std::as_const(logits).data(), n, v),
                                                           make_view(tgt.data(), n), make_view(lse.data(), n),
                                                           make_view(dl.data(), n, v));
    benchmark::DoNotOptimize(loss);
  }
  set_bytes(state, double(n * v) * 4 * 2);
}

/// One AdamW step over the whole flat buffer: p, g, m, v read, p, m, v written.
void BM_adamw(benchmark::State& state, index_t n) {
  auto p = random_floats(std::size_t(n), 16), g = random_floats(std::size_t(n), 17);
  auto m = zeros(n), v = zeros(n);
  std::int64_t t = 0;
  for (auto _ : state)
    loom::optim::adamw_update(p, g, m, v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, ++t);
  set_bytes(state, double(n) * 4 * 7);
}

/// Registers every benchmark; kernels the CPU lacks are named on stdout as skipped.
void register_all() {
  const char* products[] = {"forward_xWT", "dx_dyW", "dW_dyTx"};
  for (const ops::host_sgemm k : ops::all_host_sgemm) {
    if (!ops::host_sgemm_supported(k)) {
      std::printf("skipped: BM_gemm/%s (this CPU lacks its instruction set)\n", ops::name(k));
      continue;
    }
    for (const model_shape& m : models) {
      const struct {
        const char* name;
        index_t out, in;
      } layers[] = {{"q_o", m.dim, m.dim},
                    {"k_v", m.kv_heads * m.head_dim(), m.dim},
                    {"w1_w3", m.hidden, m.dim},
                    {"w2", m.dim, m.hidden},
                    {"output", m.vocab, m.dim}};
      for (const auto& l : layers) {
        if (std::string(l.name) == "k_v" && m.kv_heads == m.heads) continue;  // same shapes as q_o
        for (int p = 0; p < 3; ++p)
          benchmark::RegisterBenchmark((std::string("BM_gemm/") + ops::name(k) + "/" + m.name + "/" + l.name + "/" + products[p]).c_str(),
                                       BM_gemm, k, m, l.out, l.in, p)
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
      }
    }
  }
  const struct {
    const char* name;
    index_t out, in;
  } decode_layers[] = {{"q_o_288x288", 288, 288}, {"w1_768x288", 768, 288}, {"w2_288x768", 288, 768}, {"output_32000x288", 32000, 288}};
  for (const ops::host_sgemm k : ops::all_host_sgemm) {
    if (!ops::host_sgemm_supported(k)) {
      std::printf("skipped: BM_decode/%s (this CPU lacks its instruction set)\n", ops::name(k));
      continue;
    }
    for (const bool packed : {true, false})
      for (const auto& l : decode_layers)
        benchmark::RegisterBenchmark((std::string("BM_decode/") + ops::name(k) + (packed ? "/packed/" : "/unpacked/") + l.name).c_str(),
                                     BM_decode, k, packed, l.out, l.in)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
  }
  for (const model_shape& m : models) {
    const std::string s = std::string("/") + m.name;
    benchmark::RegisterBenchmark(("BM_attention_forward" + s).c_str(), BM_attention, m, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_attention_backward" + s).c_str(), BM_attention, m, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_rmsnorm_forward" + s).c_str(), BM_rmsnorm, m, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_rmsnorm_backward" + s).c_str(), BM_rmsnorm, m, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_swiglu_forward" + s).c_str(), BM_swiglu, m, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_swiglu_backward" + s).c_str(), BM_swiglu, m, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_rope" + s).c_str(), BM_rope, m)->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark(("BM_cross_entropy" + s).c_str(), BM_cross_entropy, m)->Unit(benchmark::kMicrosecond)->UseRealTime();
  }
  const struct {
    const char* name;
    index_t params;
  } adamw_sizes[] = {{"tiny", 1'800'000}, {"small", 8'300'000}, {"medium", 31'600'000}};
  for (const auto& a : adamw_sizes)
    benchmark::RegisterBenchmark((std::string("BM_adamw/") + a.name).c_str(), BM_adamw, a.params)->Unit(benchmark::kMicrosecond)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  register_all();
  benchmark::AddCustomContext("sgemm_kernel_default", ops::name(ops::host_sgemm_kernel()));
  benchmark::AddCustomContext("pool_threads", std::to_string(loom::host_pool().size()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
