// Parity of loom's LLaMA with an independent PyTorch implementation (llama_reference.py):
// same weights and tokens in, logits, loss and every parameter's gradient out, compared per
// tensor (max |loom - torch| <= 1e-4 * max |torch|), fp32, for a GQA model with an untied
// output and for a tied model, with both rotary conventions.
#include <doctest/doctest.h>
#include <llama/model/llama.hpp>

#include <support/rel_err.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using loom::index_t;

namespace {

template <class E>
void write_bin(const fs::path& p, std::span<const E> v) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size_bytes()));
}
std::vector<float> read_floats(const fs::path& p, std::size_t n) {
  std::vector<float> v(n);
  std::ifstream f(p, std::ios::binary);
  REQUIRE(f.good());
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  REQUIRE(f.gcount() == static_cast<std::streamsize>(n * sizeof(float)));
  return v;
}
using loom::test::rel_err;

void check_parity(const llama::config& cfg, index_t batch, index_t seq, bool checkpoint) {
  llama::model<float> m(cfg);
  m.init(1234);
  m.set_checkpointing(checkpoint);
  const index_t n = batch * seq;
  std::vector<std::int32_t> tokens(n), targets(n);
  const loom::counter_rng rng(99);
  for (index_t i = 0; i < n; ++i) {
    tokens[i] = static_cast<std::int32_t>(rng.bits(2 * i) % cfg.vocab);
    targets[i] = (i % 7 == 3) ? -100 : static_cast<std::int32_t>(rng.bits(2 * i + 1) % cfg.vocab);
  }
  const float loss = m.forward(loom::make_view(tokens.data(), batch, seq),
                               loom::make_view(targets.data(), batch, seq));
  m.zero_grad();
  m.backward();

  const fs::path dir = fs::temp_directory_path() / ("loom_llama_parity_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream c(dir / "config.txt");
    c << "dim " << cfg.dim << "\nn_layers " << cfg.n_layers << "\nn_heads " << cfg.n_heads << "\nn_kv_heads "
      << cfg.n_kv_heads << "\nvocab " << cfg.vocab << "\nbatch " << batch << "\nseq " << seq << "\nnorm_eps "
      << cfg.norm_eps << "\nrope_theta " << cfg.rope_theta << "\nrope "
      << (cfg.rope == loom::ops::rope_style::interleaved ? "interleaved" : "half_split") << "\n";
    std::ofstream l(dir / "layout.txt");
    for (const auto& e : m.layout().entries()) {
      l << e.name << ' ' << e.offset << ' ' << e.numel;
      for (auto s : e.shape) l << ' ' << s;
      l << '\n';
    }
  }
  write_bin(dir / "params.bin", std::span<const float>(m.params()));
  write_bin(dir / "tokens.bin", std::span<const std::int32_t>(tokens));
  write_bin(dir / "targets.bin", std::span<const std::int32_t>(targets));
  const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_LLAMA_REFERENCE + " " + dir.string();
  REQUIRE(std::system(cmd.c_str()) == 0);

  const auto ref_logits = read_floats(dir / "ref_logits.bin", static_cast<std::size_t>(n * cfg.vocab));
  const auto ref_grads = read_floats(dir / "ref_grads.bin", m.grads().size());
  double ref_loss = 0;
  std::ifstream(dir / "ref_loss.txt") >> ref_loss;
  fs::remove_all(dir);

  CHECK(std::abs(loss - ref_loss) <= 1e-4 * std::abs(ref_loss));
  CHECK(rel_err(m.logits().data(), ref_logits.data(), ref_logits.size()) <= 1e-4);
  for (const auto& e : m.layout().entries()) {
    INFO("gradient of ", e.name);
    const double err = rel_err(m.grads().data() + e.offset, ref_grads.data() + e.offset, e.numel);
    CHECK(err <= 1e-4);
  }
}

}  // namespace

TEST_CASE("parity with PyTorch: GQA, untied output, interleaved rotary") {
  llama::config c{.dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .hidden_dim = 96, .vocab = 67,
                  .seq_len = 16};
  check_parity(c, 2, 16, false);
}

TEST_CASE("parity with PyTorch: tied output, multi-head, half-split rotary, checkpointing") {
  llama::config c{.dim = 48, .n_layers = 2, .n_heads = 3, .n_kv_heads = 3, .hidden_dim = 80, .vocab = 53,
                  .seq_len = 12, .tied_output = true, .rope = loom::ops::rope_style::half_split};
  check_parity(c, 3, 12, true);
}

TEST_CASE("parity with PyTorch: multi-query, shorter sequence than seq_len") {
  llama::config c{.dim = 32, .n_layers = 1, .n_heads = 4, .n_kv_heads = 1, .hidden_dim = 64, .vocab = 41,
                  .seq_len = 20, .rope_theta = 500000.0};
  check_parity(c, 2, 9, false);
}
