#pragma once
// The engine tests' workload: n requests of different prompt and output lengths, half of them
// behind a shared 40-token system prompt (prefix-cache hits), the last two exactly two full
// 16-token blocks of it (wholly cached), prompts up to 90 tokens (longer than a small token
// budget: chunked prefill) and up to 32 new tokens each.
#include "llama_loader.hpp"

#include <loom/core/random.hpp>
#include <loom/kv/scheduler.hpp>

#include <vector>

namespace llama_generate_test {

inline std::vector<loom::kv::request> make_requests(const llama::config& c, int n) {
  using loom::kv::token_id;
  loom::counter_rng rng(77);
  std::uint64_t k = 0;
  auto rnd = [&](int m) { return static_cast<int>(rng.bits(k++) % static_cast<std::uint32_t>(m)); };
  std::vector<token_id> system_prompt;  // shared by half of the requests: prefix-cache hits
  for (int i = 0; i < 40; ++i) system_prompt.push_back(rnd(static_cast<int>(c.vocab)));
  std::vector<loom::kv::request> reqs;
  for (int i = 0; i < n; ++i) {
    loom::kv::request r;
    r.id = static_cast<std::uint64_t>(i);
    if (i % 2 == 0) r.prompt = system_prompt;
    for (int j = 0, m = 1 + rnd(50); j < m; ++j) r.prompt.push_back(rnd(static_cast<int>(c.vocab)));
    r.max_new_tokens = 1 + rnd(32);
    // Two prompts that are exactly two full blocks of the shared prefix: wholly cached.
    if (i >= n - 2) r.prompt.assign(system_prompt.begin(), system_prompt.begin() + 32);
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace llama_generate_test
