// Sharded-checkpoint manifests (include/loom/checkpoint/sharded.hpp): the input is the
// manifest.json of a scratch checkpoint folder whose two rank files are real and fixed, so the
// fuzzer works on the manifest against files the reader accepts. It runs what a resume and a
// consolidation do with a manifest: checkpoint::reader (format, step, files, every tensor's
// shape, then the rank files' headers), the loss scaler's state into a dynamic scaler, reads
// of each listed tensor's state, and checkpoint::consolidate, which sizes its buffer from the
// manifest's shape.
//
// The rank files hold, as a two-rank save cuts them, every state kind of tensor "a" [2, 3]
// (elements 0-2 in rank 0, 3-5 in rank 1) and "b" [4] (all in rank 1); "c" has no piece. The
// seeds (scripts/make_fuzz_corpus.py) name these tensors with their true shapes and others.
#include "fuzz_input.hpp"

#include <loom/checkpoint/sharded.hpp>

#include <cstdint>
#include <filesystem>
#include <vector>

namespace {

// The scratch checkpoint: rank files written once per process, manifest.json per input.
const std::string& checkpoint_dir() {
  return loom_fuzz::scratch_dir(".ckpt", [](const std::string& d) {
    auto piece = [](std::vector<std::int64_t> shape, float first) {
      loom::io::named_tensor t;
      const std::size_t n = static_cast<std::size_t>(shape[0]);
      t.shape = std::move(shape);
      t.data = loom::buffer<float>(n);
      for (std::size_t i = 0; i < n; ++i) t.data[i] = first + static_cast<float>(i);
      return t;
    };
    loom::io::tensor_map r0, r1;
    for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
      const std::string k = kind;
      r0.emplace(k + "/a/0", piece({3}, 0.f));
      r1.emplace(k + "/a/3", piece({3}, 3.f));
      r1.emplace(k + "/b/0", piece({4}, 10.f));
    }
    loom::io::write_safetensors(d + "/" + loom::checkpoint::detail::rank_file(0), r0);
    loom::io::write_safetensors(d + "/" + loom::checkpoint::detail::rank_file(1), r1);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& dir = checkpoint_dir();
  loom_fuzz::write_file(dir + "/manifest.json", data, size);
  loom_fuzz::call([&] {
    const loom::checkpoint::reader ck(dir);
    loom::amp::any_loss_scaler scaler = loom::amp::dynamic_loss_scaler{};  // what a resume with fp16 restores
    loom_fuzz::call([&] { loom::checkpoint::restore_scaler(ck, scaler); });
    for (const auto& entry : ck.shapes()) {
      const std::string& name = entry.first;
      // every state kind of the tensor's first elements (a piece-less tensor is refused by name)
      std::vector<float> out(6);
      for (int kind = 0; kind < 3; ++kind)
        for (std::size_t n : {1, 4, 6}) loom_fuzz::call([&] { ck.read(kind, name, 0, std::span(out).first(n)); });
    }
  });
  loom_fuzz::call([&] { (void)loom::checkpoint::consolidate(dir, dir + "/consolidated.safetensors"); });
  return 0;
}
