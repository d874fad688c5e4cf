// llama-generate: paged-KV generation for a batch of prompts from a llama2.c or HF safetensors
// checkpoint (or a random model, for trying the engine without files), on --tp x --pp thread
// ranks (tensor groups of --tp in --pp pipeline stages) or on the processes of `mpirun -np N`
// (the mesh is then the MPI world): rank 0 schedules, samples and prints; the others run its
// plans (llama_engine's follow()). Each rank reads only its slice of the checkpoint's files.
#include "llama_cli.hpp"

#include <tokenizer_file.hpp>

#include <loom/comm/fault_inject.hpp>
#include <loom/comm/timed.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <type_traits>
#include <string>
#include <vector>

namespace {

const char* usage =
    "usage: llama-generate (--checkpoint PATH | --random) [--tokenizer tokenizer.bin|tokenizer.model] [--prompt TEXT]...\n"
    "                      [--prompt-file FILE] [--max-new N] [--temperature T] [--top-k K] [--top-p P]\n"
    "                      [--repetition-penalty R] [--seed S] [--blocks N] [--block-size N] [--budget N]\n"
    "                      [--tp N] [--pp N] [--micro-batches M] [--max-memory-per-rank BYTES]\n"
    "  PATH: a llama2.c .bin (legacy or version 1), a .safetensors file, or an HF folder (config.json +\n"
    "  *.safetensors). --tokenizer: llama2.c's tokenizer.bin, or a SentencePiece tokenizer.model (LLaMA's); a prompt\n"
    "  is then bos + its ids and generation stops on the tokenizer's eos. Without it, a prompt is a list of token\n"
    "  ids (\"1 345 22\").\n"
    "  --prompt-file: one prompt per line. All prompts run together in one continuous batch.\n"
    "  --tp N: split the model over N tensor-parallel thread ranks (N must divide heads, kv-heads, hidden, vocab).\n"
    "  --pp N: and its layers over N pipeline stages of --tp ranks each (N <= layers); each step's sequences flow\n"
    "  through the stages as --micro-batches M micro-batches (default: N).\n"
    "  Under mpirun -np N (or --hostfile) the ranks are its processes: --tp x --pp must be N (--tp defaults to N / pp).\n"
    "  --max-memory-per-rank BYTES (e.g. 512M, 2G): refuse, before loading, a model whose rank would need more\n"
    "  (weights + KV pool + workspace, printed at start-up with the smallest tp that fits).\n";

std::vector<loom::kv::token_id> parse_ids(const std::string& s) {
  std::istringstream in(s);
  std::vector<loom::kv::token_id> ids;
  long long v;
  while (in >> v) ids.push_back(static_cast<loom::kv::token_id>(v));
  LOOM_CHECK(in.eof(), "prompt '", s, "' is not a list of token ids (give --tokenizer for text prompts)");
  return ids;
}

llama::config random_config() {
  llama::config c;
  c.vocab = 256;
  c.dim = 64, c.hidden_dim = 172, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4;  // tied_output = false: a random tied classifier only repeats its input
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  llama::model_args model;
  std::vector<std::string> prompts;
  loom::kv::sampling_params sp;
  int max_new = 64;
  llama::engine_config ec;
  using examples::cli::number;
  auto on = [&](const std::string& a, const auto& next) {
    if (model.parse(a, next, ec)) return true;
    if (a == "--prompt") prompts.push_back(next());
    else if (a == "--prompt-file") {
      const std::string path = next();
      std::ifstream f(path);
      LOOM_CHECK(f.good(), "cannot open the prompt file '", path, "'");
      for (std::string line; std::getline(f, line);)
        if (!line.empty()) prompts.push_back(line);
    } else if (a == "--max-new") max_new = number<int>(a, next());
    else if (a == "--temperature") sp.temperature = number<float>(a, next());
    else if (a == "--top-k") sp.top_k = number<int>(a, next());
    else if (a == "--top-p") sp.top_p = number<float>(a, next());
    else if (a == "--repetition-penalty") sp.repetition_penalty = number<float>(a, next());
    else if (a == "--seed") sp.seed = number<std::uint64_t>(a, next());
    else return false;
    return true;
  };
  const auto check = [&] { model.validate(); };
  if (const auto rc = examples::cli::command_line(argc, argv, "llama-generate", usage, on, check)) return *rc;
  try {
    model.use_mpi_world();
    // Under mpirun rank 0 prints; the others' output would repeat it.
    if (examples::mpi_launch_rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;
    ec.scheduler.max_num_seqs = static_cast<std::int32_t>(std::max<std::size_t>(prompts.size(), 1));
    // The memory plan before any tensor is read: a model that does not fit is refused unread.
    const llama::config c = model.config_before_loading(random_config());
    model.plan_memory<llama::llama_engine<float, loom::comm::any_comm>>("llama-generate", c, ec);
    const std::optional<llama::flat_weights> random_weights = model.random ? std::optional(model.load(random_config())) : std::nullopt;
    std::optional<loom::data::any_tokenizer> tok;
    if (!model.tokenizer.empty()) tok.emplace(examples::open_tokenizer(model.tokenizer, "none", c.vocab));
    if (prompts.empty()) prompts.push_back(tok ? "Once upon a time" : "1");
    std::printf("model: dim=%lld hidden=%lld layers=%lld heads=%lld kv_heads=%lld vocab=%lld seq_len=%lld\n",
                static_cast<long long>(c.dim), static_cast<long long>(c.hidden_dim), static_cast<long long>(c.n_layers),
                static_cast<long long>(c.n_heads), static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.vocab),
                static_cast<long long>(c.seq_len));
    std::vector<loom::kv::request> reqs;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      loom::kv::request r;
      r.id = i;
      if (tok) {
        r.prompt = {tok->bos_id()};
        const auto ids = tok->encode(prompts[i]);
        r.prompt.insert(r.prompt.end(), ids.begin(), ids.end());
      } else {
        r.prompt = parse_ids(prompts[i]);
      }
      r.max_new_tokens = std::min<int>(max_new, static_cast<int>(c.seq_len) - static_cast<int>(r.prompt.size()));
      r.sampling = sp;
      r.sampling.seed = sp.seed + i;
      if (tok) r.stop_tokens = {tok->eos_id()};
      reqs.push_back(std::move(r));
    }
    llama::run_tensor_group("llama-generate", model, [&](auto& comm, const std::atomic<bool>&) {
      // The engine's collectives and transfers go through a timed communicator: rank 0 reports
      // the share of its generation time spent in them (waiting for peers included).
      using C = loom::comm::timed<std::remove_cvref_t<decltype(comm)>>;
      using engine = llama::llama_engine<float, C>;
      loom::host_memory_resource weights("rank " + std::to_string(comm.rank()) + " weights");
      C timed(comm.split(0, comm.rank()));
      loom::comm::mesh<C> mesh(timed, {1, model.tp, model.pp});
      std::optional<llama::checkpoint_reader> reader;  // open while the engine reads its slice
      engine eng(c, mesh, model.slice(reader, random_weights ? &*random_weights : nullptr), ec, weights);
      reader.reset();
      if (loom::comm::inject_fault(comm.rank(), 0)) return;  // the tests' failed rank (LOOM_FAULT_INJECT=<rank>:0:<kind>)
      if (comm.rank() != 0) return eng.follow();
      std::printf("rank 0 of %d holds weights %zu + KV pool %zu + workspace %zu bytes\n", comm.size(), weights.current_bytes(),
                  eng.kv_bytes(), eng.workspace_bytes());
      timed.clock().reset();
      const auto t0 = std::chrono::steady_clock::now();
      auto out = eng.generate(reqs);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double comm_s = timed.clock().seconds();
      const std::uint64_t comm_calls = timed.clock().calls();
      eng.stop_followers();
      std::size_t generated = 0;
      for (auto& r : reqs) {
        const auto& o = out[r.id];
        generated += o.size();
        std::printf("[%zu] %s", static_cast<std::size_t>(r.id), tok ? prompts[r.id].c_str() : "");
        if (tok) {
          std::string text;  // piece by piece, each after the one before it (a leading space stays)
          for (std::size_t k = 0; k < o.size(); ++k) text += tok->decode_piece(k ? o[k - 1] : r.prompt.back(), o[k]);
          std::printf("%s\n", text.c_str());
        } else {
          for (auto t : o) std::printf(" %d", t);
          std::printf("\n");
        }
      }
      std::printf("%zu prompts, %zu tokens generated in %.3f s (%.1f tokens/s), %lld engine steps, KV pool %.1f MiB per rank, tp %d, pp %d\n",
                  prompts.size(), generated, s, generated / s, static_cast<long long>(eng.steps()), eng.kv_bytes() / 1048576.0,
                  model.tp, model.pp);
      std::printf("rank 0: %.3f ms per engine step; in communication %.3f s of %.3f s (%.1f%%, %llu calls); %lld preemptions\n",
                  1e3 * s / static_cast<double>(std::max<std::int64_t>(eng.steps(), 1)), comm_s, s, 100.0 * comm_s / s,
                  static_cast<unsigned long long>(comm_calls), static_cast<long long>(eng.scheduler().num_preemptions()));
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-generate: %s\n", e.what());
    return 1;
  }
  return 0;
}
