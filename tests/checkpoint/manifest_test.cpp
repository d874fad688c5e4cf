// Hostile manifests and rank files of a sharded checkpoint, written by hand (no engine): a
// shape whose element count overflows is refused naming the tensor, consolidation sizes no
// buffer beyond what the rank files hold (fuzz/checkpoint_manifest.cpp found both: a shape of
// 2^40 elements was allocated, a product that wraps wrote a file whose header lies), and
// overlapping pieces, which the reader's binary search cannot serve, are refused.
#include <loom/checkpoint/sharded.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

// A two-rank checkpoint of "a" [2, 3] (elements 0-2 in rank 0, 3-5 in rank 1) and "b" [4], whose
// values are their element numbers (b: 10 + element); the manifest's tensors are `tensors`.
// With `overlap`, rank 0 also holds elements 2-3 of "b", which rank 1 holds too.
struct scratch_checkpoint {
  std::string dir = (fs::temp_directory_path() / ("loom_ckpt_manifest_" + std::to_string(::getpid()))).string();
  explicit scratch_checkpoint(const std::string& tensors, bool overlap = false) {
    fs::create_directories(dir);
    auto piece = [](std::size_t n, float first) {
      loom::io::named_tensor t;
      t.shape = {static_cast<std::int64_t>(n)};
      t.data = loom::buffer<float>(n);
      for (std::size_t i = 0; i < n; ++i) t.data[i] = first + static_cast<float>(i);
      return t;
    };
    loom::io::tensor_map r0, r1;
    for (const std::string k : {"master", "exp_avg", "exp_avg_sq"}) {
      r0.emplace(k + "/a/0", piece(3, 0.f));
      r1.emplace(k + "/a/3", piece(3, 3.f));
      r1.emplace(k + "/b/0", piece(4, 10.f));
      if (overlap) r0.emplace(k + "/b/2", piece(2, 12.f));
    }
    loom::io::write_safetensors(dir + "/" + loom::checkpoint::detail::rank_file(0), r0);
    loom::io::write_safetensors(dir + "/" + loom::checkpoint::detail::rank_file(1), r1);
    std::ofstream(dir + "/manifest.json") << R"({"format": "loom-sharded-checkpoint-1", "step": 3, "files": 2, "tensors": )"
                                          << tensors << "}";
  }
  ~scratch_checkpoint() { fs::remove_all(dir); }
};

}  // namespace

TEST_CASE("a manifest whose true shapes match the pieces consolidates to the pieces' values") {
  scratch_checkpoint ck(R"({"a": [2, 3], "b": [4]})");
  loom::host_memory_resource mr("consolidate");
  CHECK(loom::checkpoint::consolidate(ck.dir, ck.dir + "/out.safetensors", mr) == 6);
  const auto m = loom::io::read_safetensors(ck.dir + "/out.safetensors");
  REQUIRE(m.size() == 2);
  CHECK(m.at("a").shape == std::vector<std::int64_t>{2, 3});
  for (std::size_t i = 0; i < 6; ++i) CHECK(m.at("a").data[i] == static_cast<float>(i));
  for (std::size_t i = 0; i < 4; ++i) CHECK(m.at("b").data[i] == 10.f + static_cast<float>(i));
}

TEST_CASE("a manifest shape whose element count overflows int64 is refused naming the tensor") {
  scratch_checkpoint ck(R"({"a": [4294967296, 4294967296], "b": [4]})");  // 2^64 elements: wraps to 0
  CHECK_THROWS_WITH_AS(loom::checkpoint::reader{ck.dir}, doctest::Contains("tensor 'a' has shape [4294967296, 4294967296], more elements than int64 holds"),
                       loom::error);
}

TEST_CASE("consolidation sizes no buffer beyond what the rank files hold") {
  scratch_checkpoint ck(R"({"a": [2, 3], "b": [1099511627776]})");  // 2^40 elements, the pieces hold 4
  loom::host_memory_resource mr("consolidate");
  CHECK_THROWS_WITH_AS(loom::checkpoint::consolidate(ck.dir, ck.dir + "/out.safetensors", mr),
                       doctest::Contains("tensor 'b' has 1099511627776 elements by its shape, its pieces hold 4"), loom::error);
  CHECK(mr.peak_bytes() <= 6 * sizeof(float));  // a's buffer only
}

TEST_CASE("pieces that overlap are refused naming the tensor and both pieces") {
  scratch_checkpoint ck(R"({"a": [2, 3], "b": [4]})", true);
  CHECK_THROWS_WITH_AS(loom::checkpoint::reader{ck.dir}, doctest::Contains("tensor 'b' has pieces at 0 (4 elements) and 2 that overlap"),
                       loom::error);
}

TEST_CASE("a format or loss-scaler kind that is not a string is refused by loom::error, not a JSON type error") {
  {
    scratch_checkpoint ck(R"({"a": [2, 3]})");
    std::ofstream(ck.dir + "/manifest.json") << R"({"format": {"dp": 2}, "tensors": {"a": [2, 3]}})";  // found by the fuzzer
    CHECK_THROWS_WITH_AS(loom::checkpoint::reader{ck.dir}, doctest::Contains("is not a loom-sharded-checkpoint-1 manifest"), loom::error);
  }
  scratch_checkpoint ck(R"({"a": [2, 3], "b": [4]}, "loss_scaler": {"kind": 7, "scale": 1})");
  const loom::checkpoint::reader r(ck.dir);
  loom::amp::any_loss_scaler s = loom::amp::dynamic_loss_scaler{};
  CHECK_THROWS_WITH_AS(loom::checkpoint::restore_scaler(r, s), doctest::Contains("was saved with a static loss scale"), loom::error);
}
