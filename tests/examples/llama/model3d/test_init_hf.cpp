// llama3d::init_from_hf (examples/llama/train3d/init_hf.hpp): Hugging Face folders into the
// mesh trainer. Oracles, all independent of loom's range reader:
//  - hf_init_reference.py writes the folders (ChatGLM3-shaped: F32 shards + index, BF16 one
//    file; HF-named LLaMA with GQA: F32 shards + index, F16 one file) and, for each, the
//    tensors the trainer must hold under the model's names (q/k un-permuted by Python for an
//    interleaved-rotary trainer), read here by the whole-file reader. After init on (1,1,1),
//    (4,1,1) ZeRO-3, (2,2,1) ZeRO-3 and (2,1,2) ZeRO-1 the consolidated master equals them
//    bit for bit, and a forward pass (evaluate) gives the single-rank model's loss on them.
//  - bytes read: every rank reads at most the bytes of the state slices it owns; on 4 ranks
//    at ZeRO-3 the ranks' reads add up to the tensor bytes exactly (each element read once).
//  - fine-tuning on chat records (loss on responses only) from the ChatGLM folder: (4,1,1)
//    ZeRO-3 and (2,2,1) ZeRO-3 give the (1,1,1) run's losses (1e-5), and the loss falls; the
//    checkpoint exported as an HF folder (llama::export_hf) gives, in the PyTorch
//    transcription, loom's logits (1e-4).
//  - bad folders: a config disagreeing with the trainer's, an unknown model_type, a missing
//    shard, a missing tensor, a misshapen tensor, each named with its file.
#include "hf_write.hpp"
#include "train3d_suite.hpp"

#include <llama/generate/llama_loader.hpp>
#include <llama/model/llama.hpp>
#include <llama/train3d/checkpoint.hpp>
#include <llama/train3d/init_hf.hpp>

#include <loom/data/batches.hpp>

#include <support/error_of.hpp>
#include <support/rel_err.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using loom::comm::any_comm;
using loom::index_t;
using loom::test::error_of;
using loom::test::rel_err;
using namespace train3d_suite;

namespace {

/// The reference's folders, made once per test run.
struct reference {
  fs::path dir;
  static const reference& get() {
    static const reference r = [] {
      reference x;
      x.dir = fs::temp_directory_path() / ("loom_init_hf_" + std::to_string(::getpid()));
      fs::remove_all(x.dir);
      fs::create_directories(x.dir);
      const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_INIT_HF_REFERENCE + " make " + x.dir.string();
      REQUIRE(std::system(cmd.c_str()) == 0);
      return x;
    }();
    return r;
  }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

/// What a run of init_from_hf gave: the consolidated master, the loss of one forward pass,
/// and per rank the bytes it read and the state elements it owns.
struct init_result {
  std::vector<float> master;
  double loss = 0;
  std::vector<llama3d::hf_read_stats> stats;
  std::vector<std::size_t> owned;
};

void batch_of(const llama::config& cfg, const llama3d::train_options& o, std::int64_t step, int g, std::span<std::int32_t> tok,
              std::span<std::int32_t> tgt) {
  llama3d::counting_batch(3, step, g, o.micro_batch_size, o.seq, cfg.vocab, tok, tgt);
}

template <class P>
init_result init_on(loom::comm::mesh_shape mesh, int zero, const llama::config& cfg, const std::string& folder) {
  const auto o = options(mesh, zero, "1f1b", 4 / mesh.dp);
  init_result out;
  out.stats.resize(static_cast<std::size_t>(mesh.size()));
  out.owned.resize(static_cast<std::size_t>(mesh.size()));
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<P, float, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    const auto r = static_cast<std::size_t>(world.rank());
    llama3d::init_from_hf(t, folder, out.stats[r]);
    for (int c = 0; c < t.chunks(); ++c)
      t.engine(c).for_each_state_slice([&](std::size_t, std::span<float> m, std::span<float>, std::span<float>) { out.owned[r] += m.size(); });
    const double loss = t.evaluate([&](std::int64_t s, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      batch_of(cfg, o, s, g, tok, tgt);
    });
    auto master = t.consolidated_master();
    if (world.rank() == 0) out.master = std::move(master), out.loss = loss;
  });
  return out;
}

/// Elements of `master` (full_layout(cfg)) that differ from the tensors of `meta_file`.
std::size_t differing(const std::vector<float>& master, const llama::config& cfg, const std::string& meta_file) {
  const auto want = loom::io::read_safetensors(meta_file);
  const auto layout = llama3d::full_layout(cfg);
  REQUIRE(master.size() == layout.size());
  REQUIRE(want.size() == layout.entries().size());
  std::size_t bad = 0;
  for (const auto& e : layout.entries()) {
    const auto& t = want.at(e.name).data;
    REQUIRE(t.size() == e.numel);
    for (std::size_t i = 0; i < e.numel; ++i) bad += master[e.offset + i] != t[i];
  }
  return bad;
}

/// The single-rank model's loss on the evaluate() batch with the tensors of `meta_file`.
double loss_of(const llama::config& cfg, const std::string& meta_file) {
  const auto want = loom::io::read_safetensors(meta_file);
  llama::model<double, double> m(cfg);
  for (const auto& e : m.layout().entries())
    std::copy(want.at(e.name).data.begin(), want.at(e.name).data.end(), m.params().begin() + static_cast<std::ptrdiff_t>(e.offset));
  const auto o = options({1, 1, 1}, 0, "1f1b", 4);
  std::vector<std::int32_t> tok(static_cast<std::size_t>(o.micro_batch_size * o.seq)), tgt(tok.size());
  double sum = 0;
  for (int g = 0; g < 4; ++g) {
    batch_of(cfg, o, 0, g, tok, tgt);
    sum += m.forward(loom::make_view(static_cast<const std::int32_t*>(tok.data()), o.micro_batch_size, o.seq),
                     loom::make_view(static_cast<const std::int32_t*>(tgt.data()), o.micro_batch_size, o.seq));
  }
  return sum / 4;
}

const loom::comm::mesh_shape meshes[] = {{1, 1, 1}, {4, 1, 1}, {2, 2, 1}, {2, 1, 2}};
int stage_for(loom::comm::mesh_shape m) { return m.size() == 1 ? 0 : m.pp > 1 ? 1 : 3; }

}  // namespace

TEST_CASE("init_from_hf: a ChatGLM3 folder (F32 shards, BF16 file) fills every mesh's master with the file's tensors") {
  const auto& r = reference::get();
  const llama::config cfg = llama::config_from_hf(r.path("glm"));
  CHECK(cfg.model_type == "chatglm");
  CHECK(cfg.n_kv_heads == 2);
  const double want_loss = loss_of(cfg, r.path("glm_meta.safetensors"));
  for (auto mesh : meshes) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    CAPTURE(mesh.pp);
    const auto got = init_on<float>(mesh, stage_for(mesh), cfg, r.path("glm"));
    CHECK(differing(got.master, cfg, r.path("glm_meta.safetensors")) == 0);
    CHECK(std::abs(got.loss - want_loss) <= 1e-5 * want_loss);
  }
  // BF16 on disk, bfloat16 parameters (the weights are bfloat16 values: nothing is rounded)
  const auto bf = init_on<loom::bfloat16>({2, 2, 1}, 3, cfg, r.path("glm_bf16"));
  CHECK(differing(bf.master, cfg, r.path("glm_meta.safetensors")) == 0);
  CHECK(std::abs(bf.loss - want_loss) <= 1e-5 * want_loss);
}

TEST_CASE("init_from_hf: an HF LLaMA with GQA (F32 shards, F16 file) into interleaved and half-split trainers") {
  const auto& r = reference::get();
  const llama::config half = llama::config_from_hf(r.path("llama"));
  CHECK(half.rope == loom::ops::rope_style::half_split);
  CHECK(half.n_heads == 8);
  CHECK(half.n_kv_heads == 2);
  CHECK(!half.tied_output);
  llama::config inter = half;  // Meta's convention: q/k rows un-permuted on the way in
  inter.rope = loom::ops::rope_style::interleaved;
  // the same model either way: the same loss
  const double want_loss = loss_of(inter, r.path("llama_meta_interleaved.safetensors"));
  CHECK(std::abs(loss_of(half, r.path("llama_meta_half.safetensors")) - want_loss) <= 1e-9 * want_loss);
  for (auto mesh : meshes) {
    CAPTURE(mesh.dp);
    CAPTURE(mesh.tp);
    CAPTURE(mesh.pp);
    const auto got = init_on<float>(mesh, stage_for(mesh), inter, r.path("llama"));
    CHECK(differing(got.master, inter, r.path("llama_meta_interleaved.safetensors")) == 0);
    CHECK(std::abs(got.loss - want_loss) <= 1e-5 * want_loss);
  }
  const auto h = init_on<loom::half>({4, 1, 1}, 3, half, r.path("llama_f16"));
  CHECK(differing(h.master, half, r.path("llama_meta_half.safetensors")) == 0);
  CHECK(std::abs(h.loss - want_loss) <= 1e-5 * want_loss);
  const auto i16 = init_on<float>({2, 1, 2}, 2, inter, r.path("llama_f16"));
  CHECK(differing(i16.master, inter, r.path("llama_meta_interleaved.safetensors")) == 0);
}

TEST_CASE("an HF LLaMA folder read on (2,2,1) ZeRO-3 and exported back is the same tensors, bit for bit, in PyTorch") {
  const auto& r = reference::get();
  const std::string in = r.path("llama");
  const llama::config cfg = llama::config_from_hf(in);
  const fs::path dir = r.dir / "llama_round_trip";
  fs::remove_all(dir);
  const auto o = options({2, 2, 1}, 3, "1f1b", 2);
  std::string ckpt;
  train3d_suite::run_ranks(4, [&](any_comm& world) {
    llama3d::trainer<float, float, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    llama3d::init_from_hf(t, in);
    const std::string saved = llama3d::save_checkpoint(t, (dir / "ckpt").string());
    if (world.rank() == 0) ckpt = saved;
  });
  const std::string out = (dir / "hf").string();
  llama::export_hf(ckpt, out, cfg);
  const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_INIT_HF_REFERENCE + " same " + in + " " + out;
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("init_from_hf into a LoRA run whose schedule unfreezes the base: the base engine holds the file's tensors, a frozen step keeps them (ZeRO-0, ZeRO-3)") {
  // The base of such a run is in an engine of its own, which refreshes the parameters from its
  // fp32 master after every step: the folder must reach that master, not the parameters alone.
  const auto& r = reference::get();
  const llama::config cfg = llama::config_from_hf(r.path("llama"));
  const auto want = loom::io::read_safetensors(r.path("llama_meta_half.safetensors"));  // Meta's names, HF's rows
  for (const auto& [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 1, 1}, 0}, std::pair{loom::comm::mesh_shape{2, 1, 1}, 3}}) {
    CAPTURE(mesh.dp);
    CAPTURE(zero);
    auto o = options(mesh, zero, "1f1b", 4 / mesh.dp);
    o.lora.emplace();
    o.lora->r = 2, o.lora->lora_alpha = 4;
    o.lora->target_modules = {"q_proj", "v_proj"};
    o.groups.groups.push_back({"lora", {"*.lora_?.weight"}, {}, {}, {}, {}});
    o.groups.phases = {{0.5, {"lora"}}, {1.0, {"lora", "base"}}};
    o.total_steps = 2;
    std::vector<std::size_t> differ;  // per base snapshot: elements unlike the file's
    train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
      llama3d::trainer<float, float, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
      REQUIRE(t.base_engine() != nullptr);
      llama3d::init_from_hf(t, r.path("llama"));
      std::vector<std::size_t> d;
      const auto count = [&] {
        const std::vector<float> base = t.base_params();  // collective over dp under ZeRO-3
        std::size_t bad = 0;
        for (const auto& sh : t.model().shards()) {  // tp = pp = 1: whole tensors
          const auto& w = want.at(sh.name).data;
          REQUIRE(w.size() == static_cast<std::size_t>(sh.rows * sh.cols));
          for (std::size_t i = 0; i < w.size(); ++i) bad += base[sh.local_offset + i] != w[i];
        }
        d.push_back(bad);
      };
      const auto step = [&] {
        t.step([&](std::int64_t s, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) { batch_of(cfg, o, s, g, tok, tgt); });
      };
      count();  // read in
      step();   // adapters only: the base frozen
      count();
      step();   // the base trains
      count();
      if (world.rank() == 0) differ = d;
    });
    REQUIRE(differ.size() == 3);
    CHECK(differ[0] == 0);
    CHECK(differ[1] == 0);
    CHECK(differ[2] > 0);
  }
}

TEST_CASE("a LoRA run exported merged (export_merged_hf) is an HF folder whose plain model gives the LoRA run's loss (fp32 base with a trained top layer on (2,2,1) ZeRO-3; NF4 base on (2,1,1) ZeRO-3)") {
  const auto& r = reference::get();
  const llama::config cfg = llama::config_from_hf(r.path("llama"));
  struct variant {
    loom::comm::mesh_shape mesh;
    llama3d::lora_base base;
    bool groups;
  };
  for (const variant v : {variant{{2, 2, 1}, llama3d::lora_base::fp32, true}, variant{{2, 1, 1}, llama3d::lora_base::nf4, false}}) {
    CAPTURE(v.mesh.tp);
    CAPTURE(llama3d::to_string(v.base));
    auto o = options(v.mesh, 3, "1f1b", 4 / v.mesh.dp);
    o.adamw.lr = 1e-2f;
    o.lora.emplace();
    o.lora->r = 4, o.lora->lora_alpha = 8;
    o.lora->target_modules = {"q_proj", "k_proj", "down_proj"};
    o.lora_base = v.base;
    if (v.groups) {
      o.groups.groups.push_back({"lora", {"*.lora_?.weight"}, {}, {}, {}, {}});
      o.groups.groups.push_back({"top", {}, -1, {}, {}, {}});
      o.groups.phases = {{0.34, {"lora"}}, {1.0, {"lora", "top"}}};
      o.total_steps = 3;
    }
    const fs::path out = r.dir / ("merged_" + std::string(llama3d::to_string(v.base)));
    fs::remove_all(out);
    const auto data = [&](std::int64_t s, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
      batch_of(cfg, o, s, g, tok, tgt);
    };
    double lora_loss = 0;
    train3d_suite::run_ranks(v.mesh.size(), [&](any_comm& world) {
      llama3d::trainer<float, float, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
      llama3d::init_from_hf(t, r.path("llama"));
      for (int s = 0; s < 3; ++s) t.step(data);
      const double l = t.evaluate(data, 50);
      const int files = llama3d::export_merged_hf(t, out.string());
      if (world.rank() == 0) {
        lora_loss = l;
        CHECK(files == 1);
      }
    });
    // the folder in a run without LoRA, and the base folder: the merged one gives the LoRA
    // run's loss, the base one does not (the adapters moved)
    const auto plain_loss = [&](const std::string& folder) {
      double loss = 0;
      const auto p = options({1, 1, 1}, 0, "1f1b", 4);
      train3d_suite::run_ranks(1, [&](any_comm& world) {
        llama3d::trainer<float, float, any_comm> t(world, llama::config_from_hf(folder), p, loom::default_resource<loom::host>());
        llama3d::init_from_hf(t, folder);
        loss = t.evaluate(data, 50);
      });
      return loss;
    };
    const double merged = plain_loss(out.string()), base = plain_loss(r.path("llama"));
    CHECK(std::abs(merged - lora_loss) <= 1e-5 * lora_loss);
    CHECK(std::abs(base - lora_loss) > 1e-4 * lora_loss);
  }
}

TEST_CASE("init_from_hf: each rank reads only the bytes of the slices it owns") {
  const auto& r = reference::get();
  for (const char* folder : {"glm", "glm_bf16", "llama"}) {
    CAPTURE(folder);
    const llama::config cfg = llama::config_from_hf(r.path(folder));
    const std::uint64_t es = std::string(folder) == "glm_bf16" ? 2 : 4;
    const std::pair<loom::comm::mesh_shape, int> runs[] = {{{4, 1, 1}, 3}, {{2, 2, 1}, 3}, {{4, 1, 1}, 0}};
    for (auto [mesh, zero] : runs) {
      CAPTURE(mesh.dp);
      CAPTURE(mesh.tp);
      CAPTURE(zero);
      const auto got = init_on<float>(mesh, zero, cfg, r.path(folder));
      const std::uint64_t data = got.stats[0].file_bytes - got.stats[0].header_bytes;  // the tensors' bytes
      std::uint64_t sum = 0;
      for (std::size_t k = 0; k < got.stats.size(); ++k) {
        const auto& s = got.stats[k];
        if (k == 0)  // the ranks' figures are alike; one line per run
          MESSAGE(std::string(folder), " mesh (", mesh.dp, ",", mesh.tp, ",", mesh.pp, ") ZeRO-", zero, " rank ", k, ": read ", s.data_bytes,
                " data bytes + ", s.header_bytes, " header bytes of ", s.file_bytes, " (owns ", got.owned[k], " elements)");
        // the rank's share: the state slices it owns (its engine's slices, padding included)
        CHECK(s.data_bytes <= got.owned[k] * es);
        sum += s.data_bytes;
      }
      if (mesh.tp == 1) {  // no tensor-parallel replicas: the slices partition the model, each element is read once
        CHECK(sum == data);
        for (const auto& s : got.stats) CHECK(s.data_bytes <= data / 4 + data / 100);  // a quarter, + ZeRO's padding
      } else {             // the norms are replicated over tp: read by both tp ranks
        CHECK(sum > data);
        CHECK(sum < data + data / 20);
      }
    }
  }
}

namespace {
/// Fine-tuning from the ChatGLM folder on chat records: `steps` steps on `mesh` (4
/// micro-batches per step on every mesh); with `save`, a checkpoint of the end there.
run_result fine_tune(loom::comm::mesh_shape mesh, int zero, const std::string& folder, const std::string& chat, int n_steps,
                     const std::string& save = "") {
  const llama::config cfg = llama::config_from_hf(folder);
  auto o = options(mesh, zero, "1f1b", 4 / mesh.dp);
  o.seq = 32;  // half prompt, half response
  o.adamw.lr = 1e-3f;
  run_result out;
  train3d_suite::run_ranks(mesh.size(), [&](any_comm& world) {
    llama3d::trainer<double, double, any_comm> t(world, cfg, o, loom::default_resource<loom::host>());
    llama3d::init_from_hf(t, folder);
    auto loader = loom::data::make_batch_loader({chat}, cfg.vocab, o.seq, o.micro_batch_size, o.seed);
    loom::data::token_batch batch;
    run_result res;
    for (int s = 0; s < n_steps; ++s)
      res.losses.push_back(t.step([&](std::int64_t step, int g, std::span<std::int32_t> tok, std::span<std::int32_t> tgt) {
                              loom::data::global_micro_batch(loader, step, g, 4, batch);
                              std::copy(batch.tokens.begin(), batch.tokens.end(), tok.begin());
                              std::copy(batch.targets.begin(), batch.targets.end(), tgt.begin());
                            }).loss);
    if (!save.empty()) llama3d::save_checkpoint(t, save);
    res.master = t.consolidated_master();
    if (world.rank() == 0) out = res;
  });
  return out;
}
}  // namespace

TEST_CASE("fine-tuning from a ChatGLM3 folder on chat records: every mesh equals one rank, the loss falls, the export gives loom's logits in PyTorch") {
  const auto& r = reference::get();
  const std::string chat = r.path("chat.jsonl");
  {
    std::ofstream f(chat);
    for (int i = 0; i < 16; ++i)
      f << R"({"prompt": "count from )" << i << R"(", "response": ")" << i + 1 << " " << i + 2 << " " << i + 3
        << R"(", "history": [["hi", "hello"]]})" << "\n";
  }
  const int n = 6;
  const run_result one = fine_tune({1, 1, 1}, 0, r.path("glm"), chat, n);
  for (double l : one.losses) MESSAGE("loss ", l);
  CHECK(one.losses.back() < one.losses.front());
  compare(fine_tune({4, 1, 1}, 3, r.path("glm"), chat, n), one);
  const std::string root = r.path("ckpt");
  const run_result mesh = fine_tune({2, 2, 1}, 3, r.path("glm"), chat, n, root);
  compare(mesh, one);

  // the export, read by the PyTorch transcription, against loom's logits of the trained master
  const llama::config cfg = llama::config_from_hf(r.path("glm"));
  const std::string out = r.path("tuned_hf");
  CHECK(llama::export_hf(root, out, cfg) >= 1);
  llama::model<float> m(cfg);
  std::copy(mesh.master.begin(), mesh.master.end(), m.params().begin());
  const index_t b = 2, s = 12;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(b * s));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 1000);
  m.forward(loom::make_view(static_cast<const std::int32_t*>(tokens.data()), b, s));
  loom::io::tensor_map logits;
  logits["logits"].shape = {b * s, cfg.vocab};
  logits["logits"].data = loom::buffer<float>(static_cast<std::size_t>(b * s * cfg.vocab));
  std::copy_n(m.logits().data(), b * s * cfg.vocab, logits["logits"].data.begin());
  loom::io::write_safetensors(r.path("loom_logits.safetensors"), logits);
  std::ofstream(r.path("tokens.json")) << nlohmann::json{{"batch", b}, {"seq", s}, {"tokens", tokens}}.dump();
  const std::string cmd = std::string(LOOM_TORCH_PYTHON) + " " + LOOM_INIT_HF_REFERENCE + " logits " + out + " " +
                          r.path("tokens.json") + " " + r.path("loom_logits.safetensors");
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("init_from_hf: a tied LLaMA (no lm_head) on two pipeline stages fills both copies of the embedding") {
  const auto& r = reference::get();
  auto cfg = llama::config_from_hf(r.path("llama"));
  cfg.tied_output = true;
  const auto w = llama::flat_weights::random(cfg, 21);
  write_hf_llama(r.path("tied"), w);
  CHECK(llama::config_from_hf(r.path("tied")).tied_output);
  const auto o = options({1, 1, 1}, 0, "1f1b", 4);
  llama::model<double, double> one(cfg);
  std::copy(w.params.begin(), w.params.end(), one.params().begin());
  std::vector<std::int32_t> tok(static_cast<std::size_t>(o.micro_batch_size * o.seq)), tgt(tok.size());
  double want = 0;
  for (int g = 0; g < 4; ++g) {
    batch_of(cfg, o, 0, g, tok, tgt);
    want += one.forward(loom::make_view(static_cast<const std::int32_t*>(tok.data()), o.micro_batch_size, o.seq),
                        loom::make_view(static_cast<const std::int32_t*>(tgt.data()), o.micro_batch_size, o.seq)) / 4;
  }
  for (auto [mesh, zero] : {std::pair{loom::comm::mesh_shape{1, 1, 2}, 0}, std::pair{loom::comm::mesh_shape{2, 1, 2}, 3}}) {
    CAPTURE(mesh.dp);
    CAPTURE(zero);
    const auto got = init_on<float>(mesh, zero, cfg, r.path("tied"));
    REQUIRE(got.master.size() == w.params.size());
    CHECK(std::equal(got.master.begin(), got.master.end(), w.params.begin()));
    CHECK(std::abs(got.loss - want) <= 1e-5 * want);  // the last stage's copy is the embedding too
  }
}

TEST_CASE("init_from_hf refuses bad folders, naming the file and the key or tensor") {
  const auto& r = reference::get();
  const llama::config cfg = llama::config_from_hf(r.path("glm"));
  const auto spoil = [&](const std::string& name, const std::string& from = "glm_bf16") {
    const fs::path to = r.dir / name;
    fs::remove_all(to);
    fs::copy(r.dir / from, to, fs::copy_options::recursive);
    return to;
  };
  const auto edit_config = [](const fs::path& dir, auto edit) {
    nlohmann::json j;
    std::ifstream(dir / "config.json") >> j;
    edit(j);
    std::ofstream(dir / "config.json") << j.dump();
  };
  // one file of the model's tensors, rewritten with `change` applied
  const auto rewrite = [&](const fs::path& dir, auto change) {
    auto t = loom::io::read_safetensors((dir / "model.safetensors").string());
    change(t);
    loom::io::write_safetensors((dir / "model.safetensors").string(), t, "BF16");
  };
  const fs::path wrong_shape = spoil("wrong_shape"), missing_tensor = spoil("missing_tensor"), bad_type = spoil("bad_type");
  const fs::path bad_arch = spoil("bad_arch");
  const fs::path missing_shard = spoil("missing_shard", "glm"), other_model = spoil("other_model");
  rewrite(wrong_shape, [](loom::io::tensor_map& t) { t.at("transformer.encoder.layers.1.self_attention.dense.weight").shape = {128, 512}; });
  rewrite(missing_tensor, [](loom::io::tensor_map& t) { t.erase("transformer.encoder.layers.0.mlp.dense_4h_to_h.weight"); });
  edit_config(bad_type, [](nlohmann::json& j) { j["model_type"] = "gpt2"; });
  edit_config(bad_arch, [](nlohmann::json& j) { j.erase("model_type"), j["architectures"] = {"GPT2LMHeadModel"}; });
  fs::remove(missing_shard / "model-00002-of-00002.safetensors");
  edit_config(other_model, [](nlohmann::json& j) { j["ffn_hidden_size"] = 768; });

  train3d_suite::run_ranks(2, [&](any_comm& world) {
    llama3d::trainer<float, float, any_comm> t(world, cfg, options({2, 1, 1}, 3, "1f1b", 2), loom::default_resource<loom::host>());
    const auto err = [&](const fs::path& p) { return error_of([&] { llama3d::init_from_hf(t, p.string()); }); };
    const std::string shape = err(wrong_shape);
    CHECK(shape.find("'transformer.encoder.layers.1.self_attention.dense.weight'") != std::string::npos);
    CHECK(shape.find((wrong_shape / "model.safetensors").string()) != std::string::npos);
    CHECK(shape.find("[128,512]") != std::string::npos);
    CHECK(shape.find("[256,256]") != std::string::npos);
    const std::string missing = err(missing_tensor);
    CHECK(missing.find("'transformer.encoder.layers.0.mlp.dense_4h_to_h.weight' is missing") != std::string::npos);
    CHECK(missing.find(missing_tensor.string()) != std::string::npos);
    const std::string type = err(bad_type);
    CHECK(type.find((bad_type / "config.json").string()) != std::string::npos);
    CHECK(type.find("model_type \"gpt2\"") != std::string::npos);
    const std::string arch = err(bad_arch);
    CHECK(arch.find((bad_arch / "config.json").string()) != std::string::npos);
    CHECK(arch.find("GPT2LMHeadModel") != std::string::npos);
    const std::string shard = err(missing_shard);
    CHECK(shard.find("shard '" + (missing_shard / "model-00002-of-00002.safetensors").string() + "'") != std::string::npos);
    CHECK(shard.find("is missing") != std::string::npos);
    const std::string other = err(other_model);
    CHECK(other.find((other_model / "config.json").string()) != std::string::npos);
    CHECK(other.find("\"ffn_hidden_size\" is 768, the trainer's model has 512") != std::string::npos);
    // a LLaMA folder into a ChatGLM trainer: the model_type is named
    CHECK(err(r.dir / "llama").find("model_type is \"llama\", the trainer's model is \"chatglm\"") != std::string::npos);
    // after the refusals, the same trainer still initialises from the good folder
    llama3d::init_from_hf(t, r.path("glm_bf16"));
  });
}

TEST_CASE("an HF LLaMA with GQA initialised through the trainer gives PyTorch's logits, loss and gradients") {
  const auto& r = reference::get();
  const llama::config cfg = llama::config_from_hf(r.path("llama"));  // half-split: HF's rows as they are
  const auto got = init_on<float>({2, 2, 1}, 3, cfg, r.path("llama"));
  nlohmann::json expected;
  std::ifstream(r.path("llama_expected.json")) >> expected;
  const auto ref = loom::io::read_safetensors(r.path("llama_ref.safetensors"));
  llama::model<double, double> m(cfg);
  std::copy(got.master.begin(), got.master.end(), m.params().begin());
  const index_t b = expected["batch"].get<index_t>(), s = expected["seq"].get<index_t>();
  const auto tokens = expected["tokens"].get<std::vector<std::int32_t>>(), targets = expected["targets"].get<std::vector<std::int32_t>>();
  const double loss = m.forward(loom::make_view(tokens.data(), b, s), loom::make_view(targets.data(), b, s));
  m.zero_grad();
  m.backward();
  CHECK(std::abs(loss - expected["loss"].get<double>()) <= 1e-4 * expected["loss"].get<double>());
  const auto& logits = ref.at("logits").data;
  CHECK(rel_err(m.logits().data(), logits.data(), logits.size()) <= 1e-4);
  for (const auto& e : m.layout().entries()) {
    const std::string hf = llama::detail::hf_name(e.name);
    INFO("gradient of ", e.name, " (", hf, ")");
    const auto& want = ref.at("grad/" + hf).data;
    REQUIRE(want.size() == e.numel);
    CHECK(rel_err(m.grads().data() + e.offset, want.data(), e.numel) <= 1e-4);
  }
}
