// loom-bench-train-step: times forward + backward of the reference LLaMA on one rank, and
// sgemm on the same threads (the practical peak of this machine for this work).
//
//   loom-bench-train-step --dim 288 --layers 6 --heads 6 --kv-heads 6 --hidden 768
//       --vocab 32000 --seq 256 --batch 4 --steps 3 [--checkpoint]
//   loom-bench-train-step --sgemm 1024          (GFLOP/s of an n x n x n sgemm, see bench_sgemm)
//   loom-bench-train-step --dim 128 ... --gemm-shapes   (the model's linear-layer GEMMs on
//       loom's sgemm kernel and on BLAS, see bench_gemm_shapes)
//   loom-bench-train-step --dim 128 ... --kernels       (whole steps on each kernel, alternating)
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
#include <functional>
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
               "--seq N --batch N --steps N --checkpoint --kernels --gemm-shapes] | [--sgemm N]\n",
               why);
}

// The practical peak: an n x n x n sgemm, best of 5, both as one OpenBLAS call on its own
// threads and through ops::gemm (split over loom's pool; loom's kernel where the CPU has
// AVX-512F); the larger is the peak.
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
  std::printf("{\"sgemm_n\": %ld, \"sgemm_gflops\": %.2f, \"openblas_gflops\": %.2f, \"loom_gemm_gflops\": %.2f}\n", n,
              std::max(openblas, loom_gemm), openblas, loom_gemm);
  return 0;
}

// --kernels: the same step with float GEMMs on loom's kernel and on BLAS, alternating step by
// step (the machine's drift hits both alike); best and median of each, and the median of the
// paired ratios (BLAS step time / loom step time of adjacent steps).
template <class Step>
int compare_kernels(Step& step, long steps, double flops) {
  using loom::ops::host_sgemm;
  if (!loom::ops::detail::sgemm_avx512_supported()) {
    std::fprintf(stderr, "loom-bench-train-step: --kernels needs a CPU with AVX-512F (loom's sgemm kernel)\n");
    return 1;
  }
  std::vector<double> t_loom, t_blas, ratio;
  for (long s = 0; s < steps; ++s) {
    for (host_sgemm k : {host_sgemm::loom, host_sgemm::blas}) {
      loom::ops::set_host_sgemm(k);
      const auto t0 = clock_type::now();
      step();
      (k == host_sgemm::loom ? t_loom : t_blas).push_back(seconds_since(t0));
    }
    ratio.push_back(t_blas.back() / t_loom.back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto best = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  std::printf(
      "{\"impl\": \"loom\", \"steps\": %ld, \"loom_sgemm_gflops\": %.2f, \"blas_sgemm_gflops\": %.2f, "
      "\"loom_sgemm_median_s\": %.5f, \"blas_sgemm_median_s\": %.5f, \"median_speedup\": %.3f}\n",
      steps, flops / best(t_loom) / 1e9, flops / best(t_blas) / 1e9, median(t_loom), median(t_blas), median(ratio));
  return 0;
}

// --gemm-shapes: every distinct GEMM of the model's linear layers (forward x W^T, input
// gradient dy W, weight gradient dy^T x, for q, k/v, o, w1/w3, w2 and the output layer) on
// the batch's tokens, through ops::gemm with each float kernel in turn, with caches flushed
// before every call (as in a step, where operands come from the previous kernel); best of 10.
int bench_gemm_shapes(const llama::config& c, long tokens) {
  using loom::ops::host_sgemm;
  if (!loom::ops::detail::sgemm_avx512_supported()) {
    std::fprintf(stderr, "loom-bench-train-step: --gemm-shapes needs a CPU with AVX-512F (loom's sgemm kernel)\n");
    return 1;
  }
  const long hd = c.dim / c.n_heads;
  const struct {
    const char* name;
    long out, in;
  } layers[] = {{"q/o", c.dim, c.dim}, {"k/v", c.n_kv_heads * hd, c.dim}, {"w1/w3", c.hidden_dim, c.dim},
                {"w2", c.dim, c.hidden_dim}, {"output", c.vocab, c.dim}};
  std::vector<float> flush(std::size_t(64) << 20 >> 2, 1.f);
  for (const auto& l : layers) {
    std::vector<float> x(tokens * l.in, 0.5f), w(l.out * l.in, 0.25f), y(tokens * l.out, 0.125f), dx(tokens * l.in),
        dw(l.out * l.in);
    auto xv = loom::make_view(x.data(), tokens, l.in), wv = loom::make_view(w.data(), l.out, l.in),
         yv = loom::make_view(y.data(), tokens, l.out);
    const struct {
      const char* what;
      std::function<void()> call;
    } products[] = {
        {"forward x W^T", [&] { loom::ops::gemm(loom::host{}, xv, wv.transpose(0, 1), yv); }},
        {"dx = dy W", [&] { loom::ops::gemm(loom::host{}, loom::tensor_view<const float, loom::host, 2>(yv), wv, loom::make_view(dx.data(), tokens, l.in)); }},
        {"dW = dy^T x", [&] { loom::ops::gemm(loom::host{}, yv.transpose(0, 1), xv, loom::make_view(dw.data(), l.out, l.in)); }}};
    for (const auto& p : products) {
      double best[2] = {1e30, 1e30};
      for (int r = 0; r < 10; ++r)
        for (int k = 0; k < 2; ++k) {
          loom::ops::set_host_sgemm(k == 0 ? host_sgemm::loom : host_sgemm::blas);
          for (float& f : flush) f += 1.f;
          const auto t0 = clock_type::now();
          p.call();
          best[k] = std::min(best[k], seconds_since(t0));
        }
      const double flops = 2.0 * double(tokens) * double(l.in) * double(l.out);
      std::printf("{\"layer\": \"%s\", \"product\": \"%s\", \"out\": %ld, \"in\": %ld, \"tokens\": %ld, "
                  "\"loom_sgemm_gflops\": %.2f, \"blas_sgemm_gflops\": %.2f, \"speedup\": %.3f}\n",
                  l.name, p.what, l.out, l.in, tokens, flops / best[0] / 1e9, flops / best[1] / 1e9, best[1] / best[0]);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  llama::config c{};
  long batch = 4, steps = 3, sgemm = 0;
  bool checkpoint = false, kernels = false, gemm_shapes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return usage("loom-bench-train-step: LLaMA training-step throughput"), 0;
    if (a == "--checkpoint") {
      checkpoint = true;
      continue;
    }
    if (a == "--kernels" || a == "--gemm-shapes") {
      (a == "--kernels" ? kernels : gemm_shapes) = true;
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
  if (gemm_shapes) return bench_gemm_shapes(c, batch * c.seq_len);
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
        "\"gflops\": %.2f, \"loss\": %.5f}\n",
        m.parameter_count(), n, best, double(n) / best, flops / best / 1e9, double(loss));
  } catch (const loom::error& e) {
    std::fprintf(stderr, "loom-bench-train-step: %s\n", e.what());
    return 1;
  }
  return 0;
}
