// loom-bench-train-step: times forward + backward of the reference LLaMA on one rank, and
// sgemm on the same threads (the practical peak of this machine for this work).
//
//   loom-bench-train-step --dim 288 --layers 6 --heads 6 --kv-heads 6 --hidden 768
//       --vocab 32000 --seq 256 --batch 4 --steps 3 [--checkpoint]
//   loom-bench-train-step --sgemm 1024          (GFLOP/s of an n x n x n sgemm, see bench_sgemm)
//   loom-bench-train-step --dim 128 ... --kernels       (whole steps on each sgemm kernel the
//       CPU runs, round-robin; the GEMMs alone: loom-bench-kernels)
//
// Prints one JSON object per run. Threads: OPENBLAS_NUM_THREADS (loom's pool and OpenBLAS
// both take it). bench_train_step.py runs both beside PyTorch.
#include <llama/model/llama.hpp>
#include <loom/ops/host/gemm.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: loom-bench-train-step [--dim N --layers N --heads N --kv-heads N --hidden N --vocab N "
               "--seq N --batch N --steps N --checkpoint --kernels] | [--sgemm N]\n",
               why);
}

// The practical peak: an n x n x n sgemm, best of 5, both as one OpenBLAS call on its own
// threads and through ops::gemm (split over loom's pool, on the kernel LOOM_SGEMM names or
// the best the CPU has); the larger is the peak.
int bench_sgemm(long n) {
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  auto av = loom::make_view(a.data(), n, n), bv = loom::make_view(b.data(), n, n), cv = loom::make_view(c.data(), n, n);
  auto best_gflops = [&](auto&& call) {
    call();  // warm-up
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = clock_type::now();
      call();
      best = std::min(best, seconds_since(t0));
    }
    return 2.0 * n * n * n / best / 1e9;
  };
  const int ni = static_cast<int>(n);
  const double openblas = best_gflops([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.f, a.data(), ni, b.data(), ni, 0.f, c.data(), ni);
  });
  const double loom_gemm = best_gflops([&] { loom::ops::gemm(loom::host{}, av, bv, cv); });
  std::printf("{\"sgemm_n\": %ld, \"sgemm_gflops\": %.2f, \"openblas_gflops\": %.2f, \"loom_gemm_gflops\": %.2f, "
              "\"loom_sgemm_kernel\": \"%s\"}\n",
              n, std::max(openblas, loom_gemm), openblas, loom_gemm, loom::ops::name(loom::ops::host_sgemm_kernel()));
  return 0;
}

// --kernels: the same step with float GEMMs on each kernel the CPU runs (avx512, avx2, blas),
// round-robin step by step (the machine's drift hits all alike); best and median of each,
// and the median of the paired ratios (BLAS step time / the kernel's, adjacent steps).
template <class Step>
int compare_kernels(Step& step, long steps, double flops) {
  using loom::ops::host_sgemm;
  std::vector<host_sgemm> ks;
  for (const host_sgemm k : loom::ops::all_host_sgemm)
    if (loom::ops::host_sgemm_supported(k)) ks.push_back(k);
  std::vector<std::vector<double>> t(ks.size()), ratio(ks.size());
  for (long s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < ks.size(); ++i) {
      loom::ops::set_host_sgemm(ks[i]);
      const auto t0 = clock_type::now();
      step();
      t[i].push_back(seconds_since(t0));
    }
    for (std::size_t i = 0; i < ks.size(); ++i) ratio[i].push_back(t.back().back() / t[i].back());  // blas is last
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto best = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  for (std::size_t i = 0; i < ks.size(); ++i)
    std::printf("{\"impl\": \"loom\", \"sgemm\": \"%s\", \"steps\": %ld, \"gflops\": %.2f, \"median_s\": %.5f, "
                "\"median_speedup_over_blas\": %.3f}\n",
                loom::ops::name(ks[i]), steps, flops / best(t[i]) / 1e9, median(t[i]), median(ratio[i]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  llama::config c{};
  long batch = 4, steps = 3, sgemm = 0;
  bool checkpoint = false, kernels = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return usage("loom-bench-train-step: LLaMA training-step throughput"), 0;
    if (a == "--checkpoint") {
      checkpoint = true;
      continue;
    }
    if (a == "--kernels") {
      kernels = true;
      continue;
    }
    if (i + 1 >= argc) return usage(("missing value after " + a).c_str()), 2;
    char* end = nullptr;
    const long v = std::strtol(argv[++i], &end, 10);
    if (*end != '\0' || v <= 0) return usage(("bad value '" + std::string(argv[i]) + "' for " + a).c_str()), 2;
    if (a == "--dim") c.dim = v;
    else if (a == "--layers") c.n_layers = v;
    else if (a == "--heads") c.n_heads = v;
    else if (a == "--kv-heads") c.n_kv_heads = v;
    else if (a == "--hidden") c.hidden_dim = v;
    else if (a == "--vocab") c.vocab = v;
    else if (a == "--seq") c.seq_len = v;
    else if (a == "--batch") batch = v;
    else if (a == "--steps") steps = v;
    else if (a == "--sgemm") sgemm = v;
    else return usage(("unknown option " + a).c_str()), 2;
  }
  if (sgemm) return bench_sgemm(sgemm);
  try {
    llama::model<float> m(c);
    m.init(1);
    m.set_checkpointing(checkpoint);
    const long n = batch * c.seq_len;
    std::vector<std::int32_t> tokens(n), targets(n);
    const loom::counter_rng rng(5);
    for (long i = 0; i < n; ++i) tokens[i] = rng.bits(2 * i) % c.vocab, targets[i] = rng.bits(2 * i + 1) % c.vocab;
    auto tok = loom::make_view(tokens.data(), batch, c.seq_len), tgt = loom::make_view(targets.data(), batch, c.seq_len);
    auto step = [&] {
      m.zero_grad();
      const float loss = m.forward(tok, tgt);
      m.backward();
      return loss;
    };
    step();  // warm-up: plans activations, sizes the workspace
    if (kernels) return compare_kernels(step, steps, m.flops_per_token(c.seq_len) * double(n));
    double best = 1e30;
    float loss = 0;
    for (long s = 0; s < steps; ++s) {
      const auto t0 = clock_type::now();
      loss = step();
      best = std::min(best, seconds_since(t0));
    }
    const double flops = m.flops_per_token(c.seq_len) * double(n);
    std::printf(
        "{\"impl\": \"loom\", \"params\": %zu, \"tokens\": %ld, \"step_s\": %.5f, \"tokens_per_s\": %.1f, "
        "\"gflops\": %.2f, \"loss\": %.5f, \"sgemm\": \"%s\"}\n",
        m.parameter_count(), n, best, double(n) / best, flops / best / 1e9, double(loss),
        loom::ops::name(loom::ops::host_sgemm_kernel()));
  } catch (const loom::error& e) {
    std::fprintf(stderr, "loom-bench-train-step: %s\n", e.what());
    return 1;
  }
  return 0;
}
