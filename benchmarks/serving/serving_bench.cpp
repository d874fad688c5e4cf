// loom-bench-serving: continuous batching vs static batching at equal KV memory, KV memory
// waste, and single-stream decode speed, on the paged-KV LLaMA engine (random weights: speed
// does not depend on their values).
//
// Workload: N requests arriving together; prompt lengths uniform; output lengths long-tailed as
// in chat traffic: a share of long answers (uniform in --long MIN MAX), the rest short
// (uniform in --output MIN MAX). Seeded.
// Both systems get the same KV memory (kv_tokens slots) and run the same model code:
//  - continuous: the loom scheduler (paged blocks, token budget, chunked prefill, decode first,
//    each request stops at its own length and frees its blocks at once);
//  - static: fixed batches in arrival order; a batch is padded to its longest prompt and runs
//    until its longest output is done (finished rows keep computing, as in a padded batch), the
//    next batch waits for the whole batch; each row reserves the workload's worst-case length
//    (prompt + output limits), so the batch size is kv_tokens / worst case.
// Throughput counts useful generated tokens only. KV waste = 1 - (tokens held) / (slots
// allocated), averaged over engine steps, weighted by slots allocated.
#include "llama_engine.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <string>
#include <vector>

using namespace llama;
using clock_type = std::chrono::steady_clock;

namespace {

struct options {
  int requests = 96;
  int min_prompt = 8, max_prompt = 192;
  int min_output = 8, max_output = 64;
  int min_long = 256, max_long = 448;
  int long_percent = 25;
  int kv_tokens = 6144;
  int block_size = 16;
  int budget = 512;
  int decode_tokens = 256;
  int watermark = -1;  // blocks kept free at admission; -1: 2% of the pool
  std::uint64_t seed = 1;
};

const char* usage =
    "usage: loom-bench-serving [--requests N] [--prompt MIN MAX] [--output MIN MAX] [--long MIN MAX]\n"
    "                          [--long-percent P] [--kv-tokens N] [--watermark N]\n"
    "                          [--block-size N] [--budget N] [--decode-tokens N] [--seed S] [--quick]\n";

int worst_case(const options& o) { return o.max_prompt + std::max(o.max_output, o.long_percent > 0 ? o.max_long : 0); }

// Thread CPU time: the engine is single-threaded, and CPU time is what a busy shared machine
// does not distort.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct workload_item {
  std::vector<loom::kv::token_id> prompt;
  int output = 0;
};

struct result {
  double seconds = 0, cpu = 0;
  std::int64_t useful = 0, computed = 0, steps = 0, preemptions = 0;
  double waste = 0;
};

config bench_model() {
  config c;
  c.dim = 128, c.hidden_dim = 344, c.n_layers = 4, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 512;
  c.seq_len = 1024;
  c.tied_output = false;
  return c;
}

// Runs `reqs` on an engine with `blocks` KV blocks; all requests queued at once.
template <class Engine>
void run_all(Engine& eng, std::vector<loom::kv::request> reqs, result& r, double& held, double& alloc_slots) {
  for (auto& q : reqs) eng.add(std::move(q));
  auto& a = eng.allocator();
  while (eng.has_work()) {
    for (const auto& e : eng.step()) (void)e;
    const std::int64_t slots = static_cast<std::int64_t>(a.num_blocks() - a.num_free()) * a.block_size();
    held += static_cast<double>(eng.scheduler().kv_tokens_in_use());
    alloc_slots += static_cast<double>(slots);
    eng.scheduler().take_finished();
  }
  r.steps = eng.steps();
  r.computed = eng.tokens_computed();
  r.preemptions = eng.scheduler().num_preemptions();
}

result continuous(const flat_weights& w, const std::vector<workload_item>& wl, const options& o) {
  engine_config ec;
  ec.block_size = o.block_size;
  ec.num_blocks = o.kv_tokens / o.block_size;
  ec.scheduler.max_num_batched_tokens = o.budget;
  ec.scheduler.max_num_seqs = 256;
  ec.scheduler.enable_prefix_caching = false;  // no shared prefixes in this workload
  ec.scheduler.watermark_blocks = o.watermark >= 0 ? o.watermark : ec.num_blocks / 50;
  llama_engine<float> eng(w, ec);
  std::vector<loom::kv::request> reqs;
  result r;
  for (std::size_t i = 0; i < wl.size(); ++i) {
    loom::kv::request q;
    q.id = i;
    q.prompt = wl[i].prompt;
    q.max_new_tokens = wl[i].output;
    reqs.push_back(q);
    r.useful += wl[i].output;
  }
  double held = 0, slots = 0;
  const auto t0 = clock_type::now();
  const double c0 = cpu_seconds();
  run_all(eng, reqs, r, held, slots);
  r.cpu = cpu_seconds() - c0;
  r.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  r.waste = slots > 0 ? 1.0 - held / slots : 0.0;
  return r;
}

result static_batching(const flat_weights& w, const std::vector<workload_item>& wl, const options& o) {
  const int worst = worst_case(o);
  const int batch = std::max(1, o.kv_tokens / worst);
  result r;
  double held = 0, slots = 0;
  const auto t0 = clock_type::now();
  const double c0 = cpu_seconds();
  for (std::size_t b0 = 0; b0 < wl.size(); b0 += static_cast<std::size_t>(batch)) {
    const std::size_t b1 = std::min(wl.size(), b0 + static_cast<std::size_t>(batch));
    std::size_t longest_prompt = 0;
    int longest_output = 0;
    for (std::size_t i = b0; i < b1; ++i) {
      longest_prompt = std::max(longest_prompt, wl[i].prompt.size());
      longest_output = std::max(longest_output, wl[i].output);
    }
    engine_config ec;
    ec.block_size = o.block_size;
    ec.num_blocks = o.kv_tokens / o.block_size;
    ec.scheduler.max_num_batched_tokens = static_cast<std::int32_t>(batch * longest_prompt);  // one padded prefill
    ec.scheduler.max_num_seqs = batch;
    ec.scheduler.enable_prefix_caching = false;
    llama_engine<float> eng(w, ec);
    std::vector<loom::kv::request> reqs;
    for (std::size_t i = b0; i < b1; ++i) {
      loom::kv::request q;
      q.id = i;
      q.prompt.assign(longest_prompt - wl[i].prompt.size(), 0);  // left padding
      q.prompt.insert(q.prompt.end(), wl[i].prompt.begin(), wl[i].prompt.end());
      q.max_new_tokens = longest_output;  // rows run until the longest is done
      reqs.push_back(q);
      r.useful += wl[i].output;
    }
    result part;
    double h = 0, s = 0;
    run_all(eng, reqs, part, h, s);
    r.steps += part.steps;
    r.computed += part.computed;
    // Static reserves `worst` slots per row for the whole batch; rows hold their real tokens.
    for (std::int64_t k = 0; k < part.steps; ++k) slots += static_cast<double>(batch) * worst;
    for (std::size_t i = b0; i < b1; ++i) {
      // real tokens of row i over the batch's decode steps: prompt, then one more per step up to its length
      const double p = static_cast<double>(wl[i].prompt.size());
      for (int k = 0; k < part.steps; ++k) held += p + std::min(k, wl[i].output);
    }
  }
  r.cpu = cpu_seconds() - c0;
  r.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  r.waste = slots > 0 ? 1.0 - held / slots : 0.0;
  return r;
}

double single_stream(const config& c, int tokens, std::uint64_t seed) {
  const flat_weights w = flat_weights::random(c, seed);
  engine_config ec;
  ec.num_blocks = (tokens + 64) / 16 + 1;
  llama_engine<float> eng(w, ec);
  loom::kv::request q;
  q.prompt.assign(16, 1);
  q.max_new_tokens = tokens;
  eng.add(q);
  eng.step();  // prefill (not timed)
  const double c0 = cpu_seconds();
  std::int64_t n = 0;
  while (eng.has_work()) n += static_cast<std::int64_t>(eng.step().size());
  return static_cast<double>(n) / (cpu_seconds() - c0);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> int {
        LOOM_CHECK(i + 1 < argc, "option ", a, " needs a value");
        return std::stoi(argv[++i]);
      };
      if (a == "--help" || a == "-h") {
        std::fputs(usage, stdout);
        return 0;
      } else if (a == "--requests") o.requests = next();
      else if (a == "--prompt") o.min_prompt = next(), o.max_prompt = next();
      else if (a == "--output") o.min_output = next(), o.max_output = next();
      else if (a == "--long") o.min_long = next(), o.max_long = next();
      else if (a == "--long-percent") o.long_percent = next();
      else if (a == "--watermark") o.watermark = next();
      else if (a == "--kv-tokens") o.kv_tokens = next();
      else if (a == "--block-size") o.block_size = next();
      else if (a == "--budget") o.budget = next();
      else if (a == "--decode-tokens") o.decode_tokens = next();
      else if (a == "--seed") o.seed = static_cast<std::uint64_t>(next());
      else if (a == "--quick")
        o.requests = 32, o.max_prompt = 96, o.max_output = 32, o.min_long = 128, o.max_long = 192, o.kv_tokens = 2048,
        o.decode_tokens = 64;
      else LOOM_THROW("unknown argument '", a, "'");
    }
    LOOM_CHECK(o.min_prompt > 0 && o.min_prompt <= o.max_prompt && o.min_output > 0 && o.min_output <= o.max_output,
               "bad length ranges");
    LOOM_CHECK(o.min_long > 0 && o.min_long <= o.max_long && o.long_percent >= 0 && o.long_percent <= 100,
               "bad long-output range or share");
    LOOM_CHECK(o.kv_tokens >= worst_case(o), "--kv-tokens must hold one worst-case request (", worst_case(o), ")");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-serving: %s\n%s", e.what(), usage);
    return 2;
  }
  const config c = bench_model();
  const flat_weights w = flat_weights::random(c, o.seed);
  loom::counter_rng rng(o.seed);
  std::uint64_t k = 0;
  auto uni = [&](int lo, int hi) { return lo + static_cast<int>(rng.bits(k++) % static_cast<std::uint32_t>(hi - lo + 1)); };
  std::vector<workload_item> wl(static_cast<std::size_t>(o.requests));
  for (auto& it : wl) {
    for (int j = 0, n = uni(o.min_prompt, o.max_prompt); j < n; ++j) it.prompt.push_back(uni(3, static_cast<int>(c.vocab) - 1));
    it.output = uni(0, 99) < o.long_percent ? uni(o.min_long, o.max_long) : uni(o.min_output, o.max_output);
  }
  std::printf("model: dim=%d hidden=%d layers=%d heads=%d kv_heads=%d vocab=%d (random weights, fp32, 1 thread)\n",
              int(c.dim), int(c.hidden_dim), int(c.n_layers), int(c.n_heads), int(c.n_kv_heads), int(c.vocab));
  std::printf("workload: %d requests, prompt %d..%d tokens, output %d..%d tokens (%d%% of requests: %d..%d); KV memory "
              "%d token slots (%.1f MiB), block size %d, step budget %d\n\n",
              o.requests, o.min_prompt, o.max_prompt, o.min_output, o.max_output, o.long_percent, o.min_long, o.max_long,
              o.kv_tokens,
              o.kv_tokens * 2.0 * c.n_layers * c.n_kv_heads * c.head_dim() * 4 / 1048576.0, o.block_size, o.budget);
  std::int64_t prompt_tokens = 0, output_tokens = 0;
  for (auto& it : wl) prompt_tokens += static_cast<std::int64_t>(it.prompt.size()), output_tokens += it.output;
  std::printf("useful work: %lld prompt + %lld output tokens\n\n", static_cast<long long>(prompt_tokens),
              static_cast<long long>(output_tokens));
  const result s = static_batching(w, wl, o);
  const result r = continuous(w, wl, o);
  std::printf("| batching | batch size | CPU s | wall s | useful tokens / CPU s | tokens computed | steps | KV waste | "
              "preemptions |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| static (pad to longest, wait for batch) | %d | %.2f | %.2f | %.0f | %lld | %lld | %.1f%% | - |\n",
              std::max(1, o.kv_tokens / worst_case(o)), s.cpu, s.seconds, s.useful / s.cpu,
              static_cast<long long>(s.computed), static_cast<long long>(s.steps), 100 * s.waste);
  std::printf("| continuous (loom scheduler, paged KV) | up to 256 | %.2f | %.2f | %.0f | %lld | %lld | %.1f%% | %lld |\n",
              r.cpu, r.seconds, r.useful / r.cpu, static_cast<long long>(r.computed), static_cast<long long>(r.steps),
              100 * r.waste, static_cast<long long>(r.preemptions));
  std::printf("\ncontinuous / static throughput: %.2fx (CPU time), %.2fx (wall time)\n\n",
              (r.useful / r.cpu) / (s.useful / s.cpu), (r.useful / r.seconds) / (s.useful / s.seconds));
  config stories = c;  // the size of llama2.c's stories15M
  stories.dim = 288, stories.hidden_dim = 768, stories.n_layers = 6, stories.n_heads = 6, stories.n_kv_heads = 6;
  stories.vocab = 32000, stories.seq_len = 1024;
  std::printf("| single-stream decode (1 thread) | tokens / CPU s |\n|---|---|\n");
  std::printf("| bench model (above) | %.0f |\n", single_stream(c, o.decode_tokens, o.seed));
  std::printf("| stories15M size (dim 288, 6 layers, vocab 32000) | %.0f |\n", single_stream(stories, o.decode_tokens, o.seed));
  return 0;
}
