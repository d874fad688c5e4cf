// llama-serve: HTTP server (ChatGLM api.py protocol + OpenAI-compatible completions and chat
// completions with SSE streaming) over the paged-KV LLaMA engine. Ctrl-C stops it.
#include "llama_cli.hpp"
#include "llama_server.hpp"

#include <csignal>
#include <cstdio>
#include <optional>
#include <pthread.h>
#include <string>

namespace {
const char* usage =
    "usage: llama-serve (--checkpoint PATH | --random) [--tokenizer tokenizer.bin] [--host H] [--port P]\n"
    "                   [--blocks N] [--block-size N] [--budget N] [--max-seqs N] [--model-name NAME]\n"
    "  POST /                       ChatGLM api.py: {prompt, history, max_length, top_p, temperature}\n"
    "  POST /v1/completions         OpenAI completions (\"stream\": true for server-sent events)\n"
    "  POST /v1/chat/completions    OpenAI chat completions (\"stream\": true for server-sent events)\n"
    "  Without --tokenizer, text is byte-encoded (id = 3 + byte).\n";
}

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  int port = 8000;
  llama::model_args model;
  llama::engine_config ec;
  ec.num_blocks = 1024;
  ec.scheduler.max_num_seqs = 64;
  llama::server_options opt;
  using examples::cli::number;
  auto on = [&](const std::string& a, const auto& next) {
    if (model.parse(a, next, ec)) return true;
    if (a == "--host") host = next();
    else if (a == "--port") port = number<int>(a, next());
    else if (a == "--max-seqs") ec.scheduler.max_num_seqs = number<int>(a, next());
    else if (a == "--model-name") opt.model_name = next();
    else return false;
    return true;
  };
  const auto check = [&] { model.validate(); };
  if (const auto rc = examples::cli::command_line(argc, argv, "llama-serve", usage, on, check)) return *rc;
  try {
    llama::llama_config rc;
    rc.vocab_size = 259;  // byte-level ids for --random
    rc.shared_classifier = false;
    const llama::llama_weights w = model.load(rc);
    std::optional<loom::io::llama2c_tokenizer> tok;
    if (!model.tokenizer.empty()) tok.emplace(model.tokenizer, w.config.vocab_size);
    // Signals go to the main thread only, which waits for them and stops the server.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    llama::llama_server server(w, ec, tok ? llama::text_codec(&*tok) : llama::text_codec(), opt);
    const int p = server.start(host, port);
    std::printf("llama-serve: listening on http://%s:%d (model dim=%d layers=%d vocab=%d, KV pool %d blocks of %d)\n",
                host.c_str(), p, w.config.dim, w.config.n_layers, w.config.vocab_size, ec.num_blocks, ec.block_size);
    std::fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    std::printf("llama-serve: signal %d, stopping after %lld requests\n", sig,
                static_cast<long long>(server.requests_served()));
    server.stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-serve: %s\n", e.what());
    return 1;
  }
  return 0;
}
