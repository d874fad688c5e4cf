// loom-bench-quant: a linear layer's two GEMMs over a frozen weight W [out, in] kept as NF4
// (with and without double quantisation) or bf16 and dequantised by tiles
// (quant::dequant_gemm_forward / _backward), against ops::gemm over the same W in fp32.
//
//   BM_linear/<fp32|nf4|nf4_dq|bf16>/<forward|backward>/m:<rows>/out:<out>/in:<in>
//   BM_quantize/<nf4|nf4_dq|bf16>/out:<out>/in:<in>: making the stored weight from fp32 (once
//     per model load).
//
// Counters: GFLOP/s (2 flops a multiply-add of the product), weight_bytes (what W occupies in
// that format) and bytes_per_param. Threads: loom's pool (LOOM_NUM_THREADS, else
// OPENBLAS_NUM_THREADS, else the cores). Usual flags apply (--benchmark_filter=nf4,
// --benchmark_repetitions=5, --benchmark_format=json).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <loom/ops/host/gemm.hpp>
#include <loom/quant/host/gemm.hpp>
#include <loom/quant/nf4.hpp>
#include <string>
#include <vector>

namespace {

using loom::host;
using loom::index_t;
using loom::make_view;
namespace quant = loom::quant;

enum class format { fp32, nf4, nf4_dq, bf16 };
const char* format_name(format f) {
  switch (f) {
    case format::fp32:
      return "fp32";
    case format::nf4:
      return "nf4";
    case format::nf4_dq:
      return "nf4_dq";
    case format::bf16:
      return "bf16";
  }
  return "?";
}

std::vector<float> bench_values(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i % 100003) + 0.1f);
  return v;
}

void BM_linear(benchmark::State& state, format f, bool backward, index_t m, index_t out, index_t in) {
  const auto w = bench_values(static_cast<std::size_t>(out * in), 0.02f);
  const auto x = bench_values(static_cast<std::size_t>(m * std::max(in, out)), 1.f);
  std::vector<float> y(static_cast<std::size_t>(m * std::max(in, out)));
  const auto wv = make_view(w.data(), out, in);
  const auto xin = make_view(x.data(), m, backward ? out : in);
  const auto yout = make_view(y.data(), m, backward ? in : out);
  std::size_t bytes = w.size() * sizeof(float);
  auto run = [&](const auto& q) {
    bytes = q.bytes();
    for (auto _ : state) {
      if (backward)
        quant::dequant_gemm_backward(host{}, xin, q, yout);
      else
        quant::dequant_gemm_forward(host{}, xin, q, yout);
      benchmark::ClobberMemory();
    }
  };
  switch (f) {
    case format::fp32:
      for (auto _ : state) {
        if (backward)
          loom::ops::gemm(host{}, xin, loom::tensor_view<const float, host, 2>(wv), yout);
        else
          loom::ops::gemm(host{}, xin, loom::tensor_view<const float, host, 2>(wv).transpose(0, 1), yout);
        benchmark::ClobberMemory();
      }
      break;
    case format::nf4:
      run(quant::nf4_matrix(wv));
      break;
    case format::nf4_dq:
      run(quant::nf4_matrix(wv, {.double_quant = true}));
      break;
    case format::bf16:
      run(quant::bf16_matrix(wv));
      break;
  }
  const double flops = 2.0 * double(m) * double(out) * double(in);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_bytes"] = double(bytes);
  state.counters["bytes_per_param"] = double(bytes) / (double(out) * double(in));
}

void BM_quantize(benchmark::State& state, format f, index_t out, index_t in) {
  const auto w = bench_values(static_cast<std::size_t>(out * in), 0.02f);
  const auto wv = make_view(w.data(), out, in);
  for (auto _ : state) {
    if (f == format::bf16)
      benchmark::DoNotOptimize(quant::bf16_matrix(wv).bytes());
    else
      benchmark::DoNotOptimize(quant::nf4_matrix(wv, {.double_quant = f == format::nf4_dq}).bytes());
  }
  state.counters["params/s"] =
      benchmark::Counter(double(out) * double(in), benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  for (const format f : {format::nf4, format::nf4_dq, format::bf16})
    benchmark::RegisterBenchmark((std::string("BM_quantize/") + format_name(f) + "/out:4096/in:4096").c_str(),
                                 BM_quantize, f, index_t(4096), index_t(4096))
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (const index_t m : {16, 512})
    for (const bool backward : {false, true})
      for (const format f : {format::fp32, format::nf4, format::nf4_dq, format::bf16}) {
        const std::string name = std::string("BM_linear/") + format_name(f) + (backward ? "/backward" : "/forward") +
                                 "/m:" + std::to_string(m) + "/out:4096/in:4096";
        benchmark::RegisterBenchmark(name.c_str(), BM_linear, f, backward, m, index_t(4096), index_t(4096))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  register_all();
  benchmark::AddCustomContext("sgemm_kernel_default", loom::ops::name(loom::ops::host_sgemm_kernel()));
  benchmark::AddCustomContext("pool_threads", std::to_string(loom::host_pool().size()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
