// loom::checkpoint over a fake engine: rank r of n owns an even slice of a chunk's flat buffer
// and its three state vectors. Every saved value is a closed form of (kind, tensor, element of
// the full tensor), so the oracle for a load on another split, another rank count and other
// shard rectangles is that formula itself.
#include <loom/checkpoint/sharded.hpp>
#include <loom/comm/thread_comm.hpp>

#include <support/error_of.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <vector>

using loom::test::error_of;

namespace {

using loom::nn::tp::shard_desc;
using loom::nn::tp::shard_list;

// The full model: A [6 x 4], b [5], C [3 x 8].
const loom::checkpoint::tensor_shapes model = {{"A", {6, 4}}, {"b", {5}}, {"C", {3, 8}}};

float value(int kind, const std::string& tensor, std::size_t full) {
  return static_cast<float>(kind * 1000 + (tensor == "A" ? 0 : tensor == "b" ? 100 : 200)) + 0.5f * static_cast<float>(full);
}

// One rank's slice [lo, hi) of a flat buffer of n elements, with its state.
struct fake_engine {
  std::size_t lo = 0;
  std::vector<float> m[3];
  fake_engine(std::size_t n, int rank, int ranks) {
    lo = n * static_cast<std::size_t>(rank) / static_cast<std::size_t>(ranks);
    const std::size_t hi = n * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(ranks);
    for (auto& v : m) v.assign(hi - lo, -1.f);
  }
  void for_each_state_slice(const loom::checkpoint::state_visitor& fn) { fn(lo, m[0], m[1], m[2]); }
};

std::size_t numel(const shard_list& s) {
  std::size_t n = 0;
  for (const auto& d : s) n += static_cast<std::size_t>(d.rows * d.cols);
  return n;
}

// Fills the engine's slices from the closed form (the state a run would have).
void fill(fake_engine& e, const shard_list& shards) {
  for (const auto& d : shards)
    for (loom::index_t r = 0; r < d.rows; ++r)
      for (loom::index_t c = 0; c < d.cols; ++c) {
        const std::size_t flat = d.local_offset + static_cast<std::size_t>(r * d.cols + c);
        if (flat < e.lo || flat >= e.lo + e.m[0].size()) continue;
        const std::size_t full = static_cast<std::size_t>((d.row0 + r) * d.full_cols + d.col0 + c);
        for (int k = 0; k < 3; ++k) e.m[k][flat - e.lo] = value(k, d.name, full);
      }
}

// Two "tensor-parallel" layouts of the whole model over chunks: `cols` splits A and C by
// columns into two chunks (b replicated: chunk 1 holds a copy with replica 1); `rows` holds
// everything in one chunk, A split by rows into two slots.
std::vector<shard_list> split_by_columns() {
  shard_list c0 = {{"A", 0, 6, 2, 6, 4, 0, 0, 0}, {"b", 12, 5, 1, 5, 1, 0, 0, 0}, {"C", 17, 3, 4, 3, 8, 0, 0, 0}};
  shard_list c1 = {{"C", 0, 3, 4, 3, 8, 0, 4, 0}, {"A", 12, 6, 2, 6, 4, 0, 2, 0}, {"b", 24, 5, 1, 5, 1, 0, 0, 1}};
  return {c0, c1};
}
std::vector<shard_list> one_chunk() {
  return {{{"b", 0, 5, 1, 5, 1, 0, 0, 0}, {"A", 5, 4, 4, 6, 4, 2, 0, 0}, {"A", 21, 2, 4, 6, 4, 0, 0, 0},
           {"C", 29, 3, 8, 3, 8, 0, 0, 0}}};
}

// save (fill = true) or load on `ranks` thread ranks; returns each rank's engines
std::vector<std::vector<fake_engine>> run(const std::vector<shard_list>& layout, int ranks, const std::string& root, std::int64_t step,
                                          bool save, int keep_last = 0) {
  std::vector<std::vector<fake_engine>> out(static_cast<std::size_t>(ranks));
  loom::comm::run_ranks(ranks, [&](loom::comm::thread_comm& world) {
    auto& engines = out[static_cast<std::size_t>(world.rank())];
    for (const auto& s : layout) engines.emplace_back(numel(s), world.rank(), ranks);
    std::vector<loom::checkpoint::chunk<fake_engine>> chunks;
    for (std::size_t c = 0; c < layout.size(); ++c) chunks.push_back({&layout[c], &engines[c]});
    if (save) {
      for (std::size_t c = 0; c < layout.size(); ++c) fill(engines[c], layout[c]);
      loom::checkpoint::save(world, root, step, std::span(std::as_const(chunks)), model, {{"note", "test"}}, {keep_last});
    } else {
      const loom::checkpoint::reader ck(root);
      ck.check_model(model);
      loom::checkpoint::load(ck, std::span(std::as_const(chunks)));
    }
  });
  return out;
}

}  // namespace

TEST_CASE("a checkpoint saved on one split loads on every other: every element equals the closed form") {
  namespace fs = std::filesystem;
  const std::string root = "checkpoint_sharded_test.ckpt";
  fs::remove_all(root);
  run(split_by_columns(), 3, root, 7, true);
  for (const auto& layout : {one_chunk(), split_by_columns()})
    for (int ranks : {1, 2, 5}) {
      CAPTURE(ranks);
      const auto engines = run(layout, ranks, root, 0, false);
      fake_engine want0(0, 0, 1);
      for (int r = 0; r < ranks; ++r)
        for (std::size_t c = 0; c < layout.size(); ++c) {
          fake_engine want(numel(layout[c]), r, ranks);
          fill(want, layout[c]);  // replicas included
          for (int k = 0; k < 3; ++k) CHECK(engines[std::size_t(r)][c].m[k] == want.m[k]);
        }
    }
  const loom::checkpoint::reader ck(root);
  CHECK(ck.step() == 7);
  CHECK(ck.manifest()["note"] == "test");
  CHECK(ck.shapes() == model);
  fs::remove_all(root);
}

TEST_CASE("keep_last keeps the newest checkpoints and latest names the last save") {
  namespace fs = std::filesystem;
  const std::string root = "checkpoint_keep_test.ckpt";
  fs::remove_all(root);
  for (int step : {1, 2, 3, 4}) run(one_chunk(), 2, root, step, true, 2);
  CHECK_FALSE(fs::exists(root + "/step-1"));
  CHECK_FALSE(fs::exists(root + "/step-2"));
  CHECK(fs::exists(root + "/step-3/manifest.json"));
  CHECK(fs::exists(root + "/step-4/manifest.json"));
  CHECK(loom::checkpoint::resolve(root) == root + "/step-4");
  run(one_chunk(), 2, root, 5, true);  // 0: keep all
  CHECK(fs::exists(root + "/step-3"));
  CHECK(error_of([&] { run(one_chunk(), 1, root, 6, true, -1); }).find("keep_last=-1") != std::string::npos);
  fs::remove_all(root);
}

TEST_CASE("consolidation streams one tensor at a time: under a memory limit below the model it writes the closed form, peak = the largest tensor") {
  namespace fs = std::filesystem;
  const std::string root = "checkpoint_consolidate_test.ckpt";
  fs::remove_all(root);
  run(split_by_columns(), 2, root, 3, true);
  loom::host_memory_resource mr("consolidate");
  mr.set_limit(2 * 24 * sizeof(float));  // twice the largest tensor: less than the model's 53 floats
  const std::size_t largest = loom::checkpoint::consolidate(root, root + "/model.safetensors", mr);
  CHECK(largest == 24);
  CHECK(mr.peak_bytes() == largest * sizeof(float));
  const auto tensors = loom::io::read_safetensors(root + "/model.safetensors");
  REQUIRE(tensors.size() == model.size());
  for (const auto& [name, shape] : model) {
    CAPTURE(name);
    const auto& t = tensors.at(name);
    CHECK(t.shape == shape);
    bool same = true;
    for (std::size_t i = 0; i < t.data.size(); ++i) same = same && t.data[i] == value(0, name, i);
    CHECK(same);
  }
  fs::remove_all(root);
}

TEST_CASE("another model, a missing rank file or a bad manifest is refused naming it") {
  namespace fs = std::filesystem;
  const std::string root = "checkpoint_bad_test.ckpt";
  fs::remove_all(root);
  run(one_chunk(), 2, root, 1, true);
  const loom::checkpoint::reader ck(root);
  auto other = model;
  other["C"] = {3, 9};
  CHECK(error_of([&] { ck.check_model(other); }).find("tensor 'C' has shape [3,8], this model's is [3,9]") != std::string::npos);
  other.erase("C");
  CHECK(error_of([&] { ck.check_model(other); }).find("holds 3 tensors, this model has 2") != std::string::npos);
  std::vector<float> out(30);
  CHECK(error_of([&] { ck.read(0, "A", 0, out); }).find("elements [0, 30) are covered by 24") != std::string::npos);
  fs::remove(root + "/step-1/rank-00001.safetensors");
  CHECK(error_of([&] { loom::checkpoint::reader{root}; }).find("rank-00001.safetensors") != std::string::npos);
  CHECK(error_of([&] { loom::checkpoint::resolve("no_such_dir"); }).find("neither manifest.json") != std::string::npos);
  std::ofstream(root + "/latest") << std::string(100000, 'x');  // a latest file that is no step name
  const std::string m = error_of([&] { loom::checkpoint::resolve(root); });
  CHECK(m.find("names no checkpoint directory") != std::string::npos);
  CHECK(m.size() < 400);
  fs::remove_all(root);
}

TEST_CASE("export_folder: HF-style shards cut at a size, an index naming every tensor, renamed and transformed") {
  namespace fs = std::filesystem;
  const std::string root = "checkpoint_export_test.ckpt", out = "checkpoint_export_test.hf";
  fs::remove_all(root);
  fs::remove_all(out);
  run(split_by_columns(), 2, root, 3, true);
  loom::checkpoint::folder_options o;
  o.max_shard_bytes = 100;  // A (96 B) and C (96 B) alone, b (20 B) beside one of them
  o.rename = [](const std::string& n) { return "model." + n; };
  o.transform = [](const std::string& n, std::span<float> t) {
    if (n == "b") std::reverse(t.begin(), t.end());
  };
  o.config_json = "{\"model_type\": \"test\"}\n";
  loom::host_memory_resource mr("export");
  CHECK(loom::checkpoint::export_folder(root, out, o, mr) == 3);
  CHECK(mr.peak_bytes() == 24 * sizeof(float));
  std::ifstream ij(out + "/model.safetensors.index.json");
  const auto index = nlohmann::json::parse(ij);
  CHECK(index["metadata"]["total_size"] == (24 + 5 + 24) * 4);
  REQUIRE(index["weight_map"].size() == 3);
  loom::io::tensor_map all;
  for (int k = 1; k <= 3; ++k) {
    const std::string f = "model-0000" + std::to_string(k) + "-of-00003.safetensors";
    auto m = loom::io::read_safetensors(out + "/" + f);
    std::uint64_t bytes = 0;
    for (const auto& [name, t] : m) {
      CHECK(index["weight_map"][name] == f);
      bytes += t.data.size() * 4;
    }
    CHECK(bytes <= 100 + 0u);
    for (auto& [name, t] : m) all.emplace(name, std::move(t));
  }
  REQUIRE(all.size() == 3);
  for (const auto& [name, shape] : model) {
    CAPTURE(name);
    const auto& t = all.at("model." + name);
    CHECK(t.shape == shape);
    bool same = true;
    for (std::size_t i = 0; i < t.data.size(); ++i)
      same = same && t.data[i] == value(0, name, name == "b" ? t.data.size() - 1 - i : i);
    CHECK(same);
  }
  std::ifstream cj(out + "/config.json");
  CHECK(nlohmann::json::parse(cj)["model_type"] == "test");
  // one shard: model.safetensors, no index; bf16 halves the bytes
  fs::remove_all(out);
  o = {};
  o.dtype = "BF16";
  CHECK(loom::checkpoint::export_folder(root, out, o) == 1);
  CHECK(fs::exists(out + "/model.safetensors"));
  CHECK_FALSE(fs::exists(out + "/model.safetensors.index.json"));
  CHECK(loom::io::read_safetensors(out + "/model.safetensors").at("C").data[4] == value(0, "C", 4));  // 202: exact in bf16
  o.dtype = "F64";
  CHECK(error_of([&] { loom::checkpoint::export_folder(root, out, o); }).find("dtype='F64'") != std::string::npos);
  // the same tensors from memory (checkpoint::memory_source) give the same file, byte for byte
  {
    o.dtype = "F32";
    fs::remove_all(out);
    REQUIRE(loom::checkpoint::export_folder(root, out, o) == 1);
    const loom::checkpoint::reader ck(root);
    std::map<std::string, std::vector<float>> held;
    loom::checkpoint::memory_source src;
    for (const auto& [name, shape] : ck.shapes()) {
      auto& v = held[name];
      v.resize(ck.numel(name));
      ck.read(0, name, 0, std::span<float>(v));
      src.add(name, shape, std::span<const float>(v));
    }
    const std::string mem_out = out + "-memory";
    fs::remove_all(mem_out);
    REQUIRE(loom::checkpoint::export_folder(src, mem_out, o) == 1);
    const auto bytes = [](const std::string& f) {
      std::ifstream in(f, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    CHECK(bytes(out + "/model.safetensors") == bytes(mem_out + "/model.safetensors"));
    CHECK(bytes(out + "/model.safetensors").size() > 0);
    // bad input: a value count unlike the shape, a tensor twice, a moment asked for
    std::vector<float> three(3);
    CHECK(error_of([&] { src.add("x", {2, 2}, std::span<const float>(three)); }).find("'x' has 4 elements by its shape, 3 values") !=
          std::string::npos);
    const auto& first = *ck.shapes().begin();
    CHECK(error_of([&] { src.add(first.first, first.second, std::span<const float>(held[first.first])); }).find("added twice") !=
          std::string::npos);
    std::vector<float> one(1);
    CHECK(error_of([&] { src.read(1, first.first, 0, std::span<float>(one)); }).find("state kind 1") != std::string::npos);
    fs::remove_all(mem_out);
  }
  fs::remove_all(root);
  fs::remove_all(out);
}
