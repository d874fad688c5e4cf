// llama-serve: HTTP server (ChatGLM api.py protocol + OpenAI-compatible completions and chat
// completions with SSE streaming) over the paged-KV LLaMA engine. Ctrl-C stops it.
// With --tp N (and --pp P) the model is split over N x P thread ranks (tensor groups of N in P
// pipeline stages), or under `mpirun -np N*P` over its processes: rank 0 (the main thread of
// process 0) runs the server, whose engine leads; the other ranks run its plans (follow())
// until it stops. Each rank reads only its slice of the checkpoint. A failed rank ends the
// program with its error (the group's collectives throw, the server reports its engine
// broken; under mpirun the failed process aborts the job), never a hang.
#include "llama_cli.hpp"
#include "llama_engine.hpp"

#include <loom/serve/http_server.hpp>

#include <loom/serve/chat_setup.hpp>

#include <tokenizer_file.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <optional>
#include <pthread.h>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {
const char* usage =
    "usage: llama-serve (--checkpoint PATH | --random) [--tokenizer tokenizer.bin|.model]\n"
    "                   [--template chatglm2|chatglm3|llama2|none] [--host H] [--port P]\n"
    "                   [--blocks N] [--block-size N] [--budget N] [--max-seqs N] [--model-name NAME]\n"
    "                   [--api-key KEY] [--max-body-bytes N] [--max-tokens N] [--max-concurrent N]\n"
    "                   [--request-timeout S] [--read-timeout S] [--http-threads N] [--lora [NAME=]DIR ...]\n"
    "                   [--tp N] [--pp N] [--micro-batches M] [--max-memory-per-rank BYTES]\n"
    "  POST /                       ChatGLM api.py: {prompt, history, max_length, top_p, temperature}\n"
    "  POST /v1/completions         OpenAI completions (\"stream\": true for server-sent events)\n"
    "  POST /v1/chat/completions    OpenAI chat completions (\"stream\": true for server-sent events)\n"
    "  --tokenizer: llama2.c's tokenizer.bin or a SentencePiece tokenizer.model. Without it, text is\n"
    "  byte-encoded (id = 3 + byte).\n"
    "  --template T           the chat template conversations (api.py history, OpenAI messages) are rendered\n"
    "                         with, and whose stop tokens end an answer. Default: from the model: chatglm ->\n"
    "                         chatglm3 if the tokenizer's folder declares <|observation|>, else chatglm2; llama\n"
    "                         with a tokenizer.model -> llama2; otherwise none (plain text, stops on eos)\n"
    "  --api-key KEY          requests need 'Authorization: Bearer KEY' (401 otherwise; GET /health is open)\n"
    "  --max-body-bytes N     larger request bodies are refused with 413 before they are read (8 MiB)\n"
    "  --max-tokens N         most new tokens one request may ask for (4096)\n"
    "  --max-concurrent N     requests admitted at once; more get 503 (64)\n"
    "  --request-timeout S    a request still generating after S seconds is cancelled (600)\n"
    "  --read-timeout S       a request's line, headers and body must arrive within S seconds (10)\n"
    "  --http-threads N       connections served at once, > --max-concurrent (128 or 2 x --max-concurrent)\n"
    "  --lora [NAME=]DIR      serve the PEFT LoRA adapter in DIR (adapter_config.json, adapter_model.safetensors)\n"
    "                         over the base, as model NAME (default: DIR's folder name); repeatable. A request\n"
    "                         picks it with \"model\": NAME (the base: --model-name or no field); adapters of\n"
    "                         different requests share one batch\n"
    "  --tp N                 split the model over N tensor-parallel thread ranks (N divides heads, kv-heads,\n"
    "                         hidden, vocab); requests, streaming and cancellation are as on one rank\n"
    "  --pp N                 and its layers over N pipeline stages of --tp ranks each (N <= layers)\n"
    "  --micro-batches M      a step's sequences flow through the stages as M micro-batches (default: --pp)\n"
    "                         Under mpirun -np N (or --hostfile) the ranks are its processes: --tp x --pp must\n"
    "                         be N (--tp defaults to N / pp)\n"
    "  --max-memory-per-rank BYTES  refuse, before loading, a model whose rank needs more (e.g. 512M, 2G; the\n"
    "                         figures and the smallest tp that fits are printed at start-up)\n";

// --lora's value: "NAME=DIR", or "DIR" named by its folder.
std::pair<std::string, std::string> lora_flag(const std::string& v) {
  const std::size_t eq = v.find('=');
  if (eq != std::string::npos) {
    LOOM_CHECK(eq > 0 && eq + 1 < v.size(), "flag --lora: '", v, "' is not NAME=DIR or DIR");
    return {v.substr(0, eq), v.substr(eq + 1)};
  }
  LOOM_CHECK(!v.empty(), "flag --lora needs a PEFT folder, got ''");
  std::filesystem::path p(v);
  if (p.filename().empty()) p = p.parent_path();  // "dir/"
  return {p.filename().string(), v};
}

// The value of an integer flag, which must lie in [lo, hi]; a loom::error naming the flag otherwise.
template <class T>
T in_range(const std::string& flag, const std::string& v, long long lo, long long hi) {
  const auto x = examples::cli::number<long long>(flag, v);
  LOOM_CHECK(x >= lo && x <= hi, "flag ", flag, " must be in [", lo, ", ", hi, "], got ", x);
  return static_cast<T>(x);
}
}

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  int port = 8000;
  llama::model_args model;
  llama::engine_config ec;
  ec.num_blocks = 1024;
  ec.scheduler.max_num_seqs = 64;
  loom::serve::server_options opt;
  opt.model_name = "loom-llama";
  bool threads_given = false;
  std::string template_flag;
  std::vector<std::pair<std::string, std::string>> loras;  // (name, folder)
  using examples::cli::number;
  auto on = [&](const std::string& a, const auto& next) {
    if (model.parse(a, next, ec)) return true;
    if (a == "--host") host = next();
    else if (a == "--port") port = in_range<int>(a, next(), 1, 65535);
    else if (a == "--max-seqs") ec.scheduler.max_num_seqs = number<int>(a, next());
    else if (a == "--model-name") opt.model_name = next();
    else if (a == "--template") template_flag = next();
    else if (a == "--lora") loras.push_back(lora_flag(next()));
    else if (a == "--api-key") opt.api_key = next();
    else if (a == "--max-body-bytes") opt.max_body_bytes = in_range<std::size_t>(a, next(), 1, 1ll << 40);
    else if (a == "--max-tokens") opt.max_tokens_limit = in_range<std::int32_t>(a, next(), 1, INT32_MAX);
    else if (a == "--max-concurrent") opt.max_in_flight = in_range<std::int32_t>(a, next(), 1, 1 << 16);
    else if (a == "--request-timeout") opt.request_timeout = std::chrono::seconds(in_range<int>(a, next(), 1, 7 * 24 * 3600));
    else if (a == "--read-timeout") opt.http.read_timeout = std::chrono::seconds(in_range<int>(a, next(), 1, 3600));
    else if (a == "--http-threads") opt.http.threads = in_range<std::int32_t>(a, next(), 2, 1 << 16), threads_given = true;
    else return false;
    return true;
  };
  const auto check = [&] {
    model.validate();
    if (!template_flag.empty()) (void)loom::serve::parse_template_flag(template_flag);
    if (!threads_given) opt.http.threads = std::max(opt.http.threads, 2 * opt.max_in_flight);
    LOOM_CHECK(opt.http.threads > opt.max_in_flight, "flag --http-threads (", opt.http.threads,
               ") must exceed --max-concurrent (", opt.max_in_flight, "): threads must be left to read and refuse requests");
    LOOM_CHECK(loras.empty() || model.tp * model.pp == 1,
               "flag --lora needs --tp 1 --pp 1 (adapters over a split model are not supported yet), got ", model.ranks());
    for (std::size_t i = 0; i < loras.size(); ++i) {
      LOOM_CHECK(loras[i].first != opt.model_name, "flag --lora: adapter name '", loras[i].first,
                 "' is the base model's name (--model-name)");
      for (std::size_t k = 0; k < i; ++k)
        LOOM_CHECK(loras[k].first != loras[i].first, "flag --lora: two adapters are called '", loras[i].first, "'");
    }
  };
  if (const auto rc = examples::cli::command_line(argc, argv, "llama-serve", usage, on, check)) return *rc;
  try {
    model.use_mpi_world();
    // Under mpirun rank 0 prints and serves; the others' output would repeat it.
    if (examples::mpi_launch_rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;
    llama::config rc;
    rc.dim = 64, rc.hidden_dim = 172, rc.n_layers = 2, rc.n_heads = 4, rc.n_kv_heads = 4, rc.seq_len = 256;
    // --random: byte-level ids 3..258 and one unused id, so that tp 2 and 4 divide the
    // vocabulary (untied: a random tied classifier only repeats its input)
    rc.vocab = 260;
    // The memory plan before any tensor is read: a model that does not fit is refused unread.
    const llama::config cfg = model.config_before_loading(rc);
    model.plan_memory<llama::llama_engine<float, loom::comm::any_comm>>("llama-serve", cfg, ec);
    const std::optional<llama::flat_weights> random_weights = model.random ? std::optional(model.load(rc)) : std::nullopt;
    const loom::serve::chat_setup chat = loom::serve::choose_chat_template(template_flag, cfg.model_type, model.tokenizer, model.checkpoint);
    std::optional<loom::data::any_tokenizer> tok;
    if (!model.tokenizer.empty()) tok.emplace(examples::open_tokenizer(model.tokenizer, chat.specials, cfg.vocab));
    const loom::serve::text_codec codec = tok ? loom::serve::text_codec(&*tok, chat.templ) : loom::serve::text_codec();
    // Signals go to rank 0's thread (the main thread) only, which waits for them and stops the
    // server; blocked before the ranks' threads start, which inherit the mask.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::vector<llama::served_adapter> adapters;
    for (const auto& [name, dir] : loras) {
      adapters.push_back(llama::served_adapter::from_peft(name, dir, cfg));
      const auto& lc = adapters.back().config();
      std::string targets;
      for (const auto& m : lc.target_modules) targets += (targets.empty() ? "" : ",") + m;
      std::printf("llama-serve: LoRA adapter '%s' from %s (r=%d, lora_alpha=%g%s, %s)\n", name.c_str(), dir.c_str(),
                  static_cast<int>(lc.r), lc.lora_alpha, lc.use_rslora ? ", rsLoRA" : "", targets.c_str());
    }
    llama::run_tensor_group("llama-serve", model, [&](auto& comm, const std::atomic<bool>& peer_failed) {
      using C = std::remove_cvref_t<decltype(comm)>;
      using engine = llama::llama_engine<float, C>;
      loom::host_memory_resource weights("rank " + std::to_string(comm.rank()) + " weights");
      loom::comm::mesh<C> mesh(comm, {1, model.tp, model.pp});
      std::optional<llama::checkpoint_reader> reader;  // open while the engine reads its slice
      const llama::flat_weights* random = random_weights ? &*random_weights : nullptr;
      if (comm.rank() != 0) {
        engine eng(cfg, mesh, model.slice(reader, random), ec, weights);
        reader.reset();
        return eng.follow();
      }
      loom::serve::http_server<engine> server(codec, opt, cfg, mesh, model.slice(reader, random), ec, weights, std::move(adapters));
      reader.reset();
      const int p = server.start(host, port);
      std::printf("llama-serve: listening on http://%s:%d (model dim=%d layers=%d vocab=%d, KV pool %d blocks of %d, tp %d, pp %d)\n",
                  host.c_str(), p, static_cast<int>(cfg.dim), static_cast<int>(cfg.n_layers), static_cast<int>(cfg.vocab),
                  ec.num_blocks, ec.block_size, model.tp, model.pp);
      std::printf("llama-serve: chat template %s (%s); answers stop on token ids", loom::serve::template_name(chat.templ).c_str(),
                  chat.why.c_str());
      for (const auto id : codec.stop_tokens()) std::printf(" %d", static_cast<int>(id));
      std::printf("\n");
      std::fflush(stdout);
      // A signal, or a failed rank: another rank's error (the group is aborted; run_ranks
      // reports that rank's), or the engine's group broken under a step.
      const timespec poll{0, 100'000'000};
      int sig = -1;
      while (sig < 0) {
        sig = sigtimedwait(&set, nullptr, &poll);
        if (sig >= 0) break;
        const std::string failure = server.failure();
        if (peer_failed || !failure.empty()) {
          server.stop();
          throw loom::error(failure.empty() ? std::string("another rank failed") : "the tensor group failed: " + failure);
        }
      }
      std::printf("llama-serve: signal %d, stopping after %lld requests\n", sig, static_cast<long long>(server.requests_served()));
      server.stop();
      server.engine().stop_followers();
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-serve: %s\n", e.what());
    return 1;
  }
  return 0;
}
