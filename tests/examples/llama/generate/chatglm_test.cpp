// ChatGLM2/3 as a configuration of the one decoder, against an independent PyTorch
// transcription of ChatGLM's modeling semantics (chatglm_reference.py, float64): it writes a
// small random ChatGLM3-shaped model as HF folders (F32 in two shards with
// model.safetensors.index.json; BF16 in one file), the logits, loss and every gradient of a
// batch, and a greedy continuation. loom reads the folder (llama_loader.hpp) and must give
// the same logits, loss and gradients (max |loom - torch| <= 1e-4 max |torch| per tensor),
// the same greedy tokens from the paged engine, the same results at tp = 2 as at tp = 1
// (1e-5), and write the model back (export_hf) so that PyTorch reads identical tensors.
// Bad folders are refused with errors naming the file and the tensor or key.
#include <doctest/doctest.h>

#include "llama_engine.hpp"
#include "llama_loader.hpp"

#include <llama/model/llama.hpp>
#include <llama/model3d/llama3d.hpp>

#include <loom/checkpoint/sharded.hpp>
#include <loom/comm/self_comm.hpp>
#include <loom/comm/thread_comm.hpp>

#include <support/error_of.hpp>
#include <support/rel_err.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using loom::index_t;
using loom::test::error_of;

namespace {

/// The reference's folder, made once per test run.
struct reference {
  fs::path dir;
  nlohmann::json expected;
  loom::io::tensor_map ref;  // logits, grad/<HF name>

  static const reference& get() {
    static const reference r = [] {
      reference x;
      x.dir = fs::temp_directory_path() / ("loom_chatglm_" + std::to_string(::getpid()));
      fs::remove_all(x.dir);
      fs::create_directories(x.dir);
      const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_CHATGLM_REFERENCE + " make " + x.dir.string();
      REQUIRE(std::system(cmd.c_str()) == 0);
      std::ifstream f(x.dir / "expected.json");
      x.expected = nlohmann::json::parse(f);
      x.ref = loom::io::read_safetensors((x.dir / "ref.safetensors").string());
      return x;
    }();
    return r;
  }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  std::vector<std::int32_t> ints(const char* key) const { return expected[key].get<std::vector<std::int32_t>>(); }
};

/// max |a - b| / max |b|
double rel_err(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  return loom::test::rel_err(a.data(), b.data(), b.size());
}

/// A copy of the reference's F32 folder to spoil.
fs::path copy_of_hf(const reference& r, const std::string& name) {
  const fs::path to = r.dir / name;
  fs::remove_all(to);
  fs::copy(r.dir / "hf", to, fs::copy_options::recursive);
  return to;
}
void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(dir / "config.json") >> j;
  edit(j);
  std::ofstream(dir / "config.json") << j.dump();
}

/// A state of one chunk for checkpoint::save: the flat buffer as the fp32 master, no moments.
struct flat_state {
  std::span<float> master;
  std::vector<float> zeros = std::vector<float>(master.size(), 0.f);
  void for_each_state_slice(const loom::checkpoint::state_visitor& v) { v(0, master, zeros, zeros); }
};

}  // namespace

TEST_CASE("a HF ChatGLM3 folder (index.json shards) gives PyTorch's logits, loss and gradients") {
  const auto& r = reference::get();
  const llama::flat_weights w = llama::load_checkpoint(r.path("hf"));
  const llama::config& c = w.cfg;
  CHECK(c.model_type == "chatglm");
  CHECK(c.dim == 256);
  CHECK(c.n_heads == 8);
  CHECK(c.n_kv_heads == 2);
  CHECK(c.hidden_dim == 512);
  CHECK(c.vocab == 1000);
  CHECK(c.rotary_dim() == 16);
  CHECK(c.rope_theta == 15000.0);
  CHECK(c.qkv_bias);
  CHECK(!c.tied_output);

  llama::model<float> m(c);
  REQUIRE(m.params().size() == w.params.size());
  std::copy(w.params.begin(), w.params.end(), m.params().begin());
  const index_t b = r.expected["batch"].get<index_t>(), s = r.expected["seq"].get<index_t>();
  const auto tokens = r.ints("tokens"), targets = r.ints("targets");
  const float loss = m.forward(loom::make_view(tokens.data(), b, s), loom::make_view(targets.data(), b, s));
  m.zero_grad();
  m.backward();

  const double want_loss = r.expected["loss"].get<double>();
  CHECK(std::abs(loss - want_loss) <= 1e-4 * std::abs(want_loss));
  const auto& ref_logits = r.ref.at("logits").data;
  CHECK(rel_err({m.logits().data(), ref_logits.size()}, ref_logits.span()) <= 1e-4);
  for (const auto& e : m.layout().entries()) {
    const std::string hf = llama::detail::chatglm_name(e.name);
    INFO("gradient of ", e.name, " (", hf, ")");
    CHECK(rel_err(std::span<const float>(m.grads()).subspan(e.offset, e.numel), r.ref.at("grad/" + hf).data.span()) <= 1e-4);
  }
}

TEST_CASE("the paged engine generates PyTorch's greedy tokens for the ChatGLM") {
  const auto& r = reference::get();
  for (const char* folder : {"hf", "hf/model-00001-of-00002.safetensors"}) {
    CAPTURE(folder);
    if (std::string(folder) != "hf") {  // one shard alone lacks half the tensors
      CHECK(error_of([&] { (void)llama::load_checkpoint(r.path(folder)); }).find("is missing from the checkpoint") !=
            std::string::npos);
      continue;
    }
    const llama::flat_weights w = llama::load_checkpoint(r.path(folder));
    llama::engine_config ec;
    ec.num_blocks = 16;
    ec.block_size = 4;
    llama::llama_engine<float> eng(w, ec);
    loom::kv::request q;
    q.id = 1;
    for (auto t : r.ints("prompt")) q.prompt.push_back(t);
    const auto want = r.ints("greedy");
    q.max_new_tokens = static_cast<std::int32_t>(want.size());
    const auto out = eng.generate({q});
    CHECK(std::vector<std::int32_t>(out.at(1).begin(), out.at(1).end()) == want);
  }
}

TEST_CASE("BF16 ChatGLM weights load rounded to bfloat16") {
  const auto& r = reference::get();
  const auto w32 = llama::load_checkpoint(r.path("hf")), w16 = llama::load_checkpoint(r.path("hf_bf16"));
  REQUIRE(w32.params.size() == w16.params.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < w32.params.size(); ++i) differ += w16.params[i] != static_cast<float>(loom::bfloat16(w32.params[i]));
  CHECK(differ == 0);
}

TEST_CASE("the ChatGLM at tp = 2 (thread ranks) equals tp = 1") {
  const auto& r = reference::get();
  const llama::flat_weights w = llama::load_checkpoint(r.path("hf"));
  const llama::config& c = w.cfg;
  const index_t b = r.expected["batch"].get<index_t>(), s = r.expected["seq"].get<index_t>(), n = b * s;
  const auto tokens = r.ints("tokens"), targets = r.ints("targets");
  llama::model<float> one(c);
  std::copy(w.params.begin(), w.params.end(), one.params().begin());
  const float loss1 = one.forward(loom::make_view(tokens.data(), b, s), loom::make_view(targets.data(), b, s));
  one.zero_grad();
  one.backward();

  std::vector<float> grads(w.params.size(), 0.f);  // the ranks' canonical shards, disjoint
  std::vector<double> logit_err(2, 0), loss_err(2, 0);
  loom::comm::run_ranks(2, [&](loom::comm::thread_comm& tp) {
    llama3d::stage_model<float, float, loom::comm::thread_comm> st(c, tp, 0, 1);
    loom::nn::tp::load_shards(st.shards(), w.params.span(), st.params(), [&](const std::string& nm) { return st.full_offset(nm); });
    const float loss = st.forward(0, loom::make_view(tokens.data(), b, s), loom::make_view(targets.data(), b, s));
    st.backward(0);
    st.store_grads(std::span<float>(grads));
    const auto l = st.logits(0);  // [n, vocab / 2]: this rank's vocabulary columns
    const index_t v0 = tp.rank() * (c.vocab / 2);
    double worst = 0, ref = 0;
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < l.extent(1); ++j) {
        const double want = one.logits().data()[i * c.vocab + v0 + j];
        worst = std::max(worst, std::abs(double(l(i, j)) - want));
        ref = std::max(ref, std::abs(want));
      }
    logit_err[static_cast<std::size_t>(tp.rank())] = worst / ref;
    loss_err[static_cast<std::size_t>(tp.rank())] = std::abs(double(loss) - double(loss1)) / std::abs(double(loss1));
  });
  for (int k = 0; k < 2; ++k) {
    CHECK(logit_err[static_cast<std::size_t>(k)] <= 1e-5);
    CHECK(loss_err[static_cast<std::size_t>(k)] <= 1e-5);
  }
  for (const auto& e : one.layout().entries()) {
    INFO("gradient of ", e.name);
    CHECK(rel_err(std::span<const float>(grads).subspan(e.offset, e.numel),
                  std::span<const float>(one.grads()).subspan(e.offset, e.numel)) <= 1e-5);
  }
}

TEST_CASE("a ChatGLM written back by loom reads in PyTorch as the same tensors") {
  const auto& r = reference::get();
  llama::flat_weights w = llama::load_checkpoint(r.path("hf"));
  // a sharded checkpoint of the loaded model (what training saves), then the HF folder
  loom::comm::self_comm self;
  const llama3d::stage_layers<float> layers(w.cfg, {}, llama3d::split_layers(w.cfg.n_layers, 1, 0), true, true);
  flat_state state{w.params.span()};
  const loom::checkpoint::chunk<flat_state> chunks[] = {{&layers.shards, &state}};
  loom::checkpoint::tensor_shapes shapes;
  for (const auto& e : layers.layout.entries()) shapes[e.name] = std::vector<std::int64_t>(e.shape.begin(), e.shape.end());
  const std::string ckpt = loom::checkpoint::save(self, r.path("ckpt"), 0, std::span<const loom::checkpoint::chunk<flat_state>>(chunks), shapes);
  const std::string out = r.path("written");
  const int files = llama::export_hf(ckpt, out, w.cfg, 1 << 20);  // 1 MiB shards: index.json too
  CHECK(files > 1);
  CHECK(fs::exists(fs::path(out) / "model.safetensors.index.json"));
  const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_CHATGLM_REFERENCE + " check " + r.dir.string() + " " + out;
  CHECK(std::system(cmd.c_str()) == 0);
  const llama::flat_weights back = llama::load_checkpoint(out);  // and loom reads it back
  CHECK(back.cfg.rope_theta == w.cfg.rope_theta);
  CHECK(std::equal(back.params.begin(), back.params.end(), w.params.begin(), w.params.end()));
}

TEST_CASE("bad ChatGLM folders are refused naming the file and the tensor or key") {
  const auto& r = reference::get();
  {  // a shape config.json does not give
    const auto d = copy_of_hf(r, "bad_shape");
    edit_config(d, [](nlohmann::json& j) { j["ffn_hidden_size"] = 384; });
    const auto e = error_of([&] { (void)llama::load_checkpoint(d.string()); });
    CHECK(e.find("tensor 'transformer.encoder.layers.0.mlp.dense_h_to_4h.weight' in '") != std::string::npos);
    CHECK(e.find("model-0000") != std::string::npos);
    CHECK(e.find("has shape [1024,256], its config gives [768,256]") != std::string::npos);
  }
  {  // a shard the index names is missing
    const auto d = copy_of_hf(r, "bad_shard");
    fs::remove(d / "model-00002-of-00002.safetensors");
    const auto e = error_of([&] { (void)llama::load_checkpoint(d.string()); });
    CHECK(e.find("shard '" + (d / "model-00002-of-00002.safetensors").string() + "' (tensor '") != std::string::npos);
    CHECK(e.find("is missing") != std::string::npos);
  }
  {  // an architecture loom does not read
    const auto d = copy_of_hf(r, "bad_arch");
    edit_config(d, [](nlohmann::json& j) { j["model_type"] = "mistral"; });
    const auto e = error_of([&] { (void)llama::load_checkpoint(d.string()); });
    CHECK(e.find((d / "config.json").string()) != std::string::npos);
    CHECK(e.find("model_type \"mistral\" is not an architecture loom reads") != std::string::npos);
  }
  {  // ChatGLM-6B v1
    const auto d = copy_of_hf(r, "v1");
    edit_config(d, [](nlohmann::json& j) {
      j.erase("padded_vocab_size");
      j["position_encoding_2d"] = true;
    });
    const auto e = error_of([&] { (void)llama::load_checkpoint(d.string()); });
    CHECK(e.find("ChatGLM-6B v1") != std::string::npos);
    CHECK(e.find("2D positions") != std::string::npos);
  }
  {  // a ChatGLM variant the decoder does not run
    const auto d = copy_of_hf(r, "post_norm");
    edit_config(d, [](nlohmann::json& j) { j["apply_residual_connection_post_layernorm"] = true; });
    CHECK(error_of([&] { (void)llama::load_checkpoint(d.string()); }).find("\"apply_residual_connection_post_layernorm\" = true is not supported") !=
          std::string::npos);
  }
  {  // a ChatGLM's fused layout cannot be written as a LLaMA
    llama::config c = llama::config::chatglm();
    c.model_type = "llama";
    CHECK(error_of([&] { llama::export_hf("nowhere", r.path("none"), c); }).find("fused_qkv=1") != std::string::npos);
  }
}

TEST_CASE("the ChatGLM reference's folder is removed") {  // last: the cases above share it
  fs::remove_all(reference::get().dir);
}
