// llama-serve's request bodies (loom/serve/request.hpp): the body parsed as the
// server parses it, then read as one route, chosen by the input's size mod 3 (api.py's POST /,
// /v1/completions, /v1/chat/completions), under the server's default limits or tight ones
// (size / 3, odd), with the raw-byte codec the server uses without a tokenizer.
//
// The server answers every http_error with its status and anything else with 500, so here a
// refusal must be an http_error in 400-499 with a bounded message; any other exception escapes
// and is a finding. An accepted request must be one the engine can run: a prompt shorter than
// the context, 1 <= max_new tokens within the context, the KV blocks within the pool, and
// sampling parameters the sampler accepts.
#include <loom/serve/request.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  loom::serve::request_limits lim;  // the server's defaults (llama-serve's engine: context 2048, 256 blocks of 16)
  if ((size / 3) % 2) lim = {.context = 96, .block_size = 16, .num_blocks = 4, .max_tokens_limit = 40, .default_max_tokens = 8};
  const loom::serve::text_codec codec;
  static const bool verbose = std::getenv("LOOM_FUZZ_VERBOSE") != nullptr;
  try {
    const nlohmann::json j = loom::serve::request::parse_body(body);
    loom::serve::gen_params p;
    switch (size % 3) {
      case 0: p = loom::serve::parse_chatglm_request(j, codec, lim).params; break;
      case 1: p = loom::serve::parse_openai_request(j, false, codec, lim).params; break;
      default: p = loom::serve::parse_openai_request(j, true, codec, lim).params; break;
    }
    const auto n = static_cast<std::int64_t>(p.prompt.size());
    if (n < 1 || n >= lim.context) __builtin_trap();
    if (p.max_new < 1 || p.max_new > lim.max_tokens_limit || n + p.max_new > lim.context) __builtin_trap();
    if (loom::kv::block_table::blocks_for(n + p.max_new, lim.block_size) > lim.num_blocks) __builtin_trap();
    p.sampling.validate();  // a loom::error here escapes: the engine would refuse what the server accepted
    if (verbose) std::fprintf(stderr, "loom-fuzz: accepted: %zu prompt tokens, %d new\n", p.prompt.size(), p.max_new);
  } catch (const loom::serve::http_error& e) {
    if (verbose) std::fprintf(stderr, "loom-fuzz: refused (%d): %s\n", e.status, e.what());
    // a 4xx naming the field, whose text does not grow with the body (the server cuts at 1 KiB)
    if (e.status < 400 || e.status > 499 || std::strlen(e.what()) > 1024) __builtin_trap();
  }
  return 0;
}
