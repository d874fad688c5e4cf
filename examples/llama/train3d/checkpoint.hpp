#pragma once
// Sharded checkpoints of the mesh trainer: every rank writes the training state it owns, no
// rank gathers the model, and a checkpoint resumes on any mesh and ZeRO stage.
//
// What a rank writes: for each model chunk, its ZeRO engine's slice of the fp32 master
// weights and Adam moments (engine::for_each_state_slice: the ranks' slices partition the
// state, at every stage), cut into pieces along the model's own tensors: a piece is a run of
// one full tensor (canonical copies only: no tensor-parallel replica, no tied copy), named
//   <kind>/<tensor>/<first element in the full tensor, row-major>    kind: master, exp_avg, exp_avg_sq
// in one safetensors file per rank (rank-00003.safetensors; ordinary tools open it). The
// parameters themselves are not written: the engine recomputes them from the master (a cast,
// exactly what every step does). Rank 0 writes manifest.json: the format, the step (the
// optimizer steps taken, which is also the data cursor and the lr schedule's position), the
// mesh and stage it was saved at, every tensor's name and full shape, the loss scaler's state.
//
// Loading reads the manifest and each file's header, then each rank reads only the byte
// ranges of the pieces that overlap what it owns now (read_safetensors_range): never the whole
// model, whatever mesh saved it.
//
// Crash safety: a checkpoint is written into <root>/step-<N>.partial, every file fsynced,
// then renamed to <root>/step-<N> and <root>/latest rewritten (a temporary file renamed over
// it). A crash at any point leaves the previous step's checkpoint and a `latest` naming it.

#include "train3d.hpp"

#include <loom/io/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace llama3d {

namespace detail {

inline constexpr const char* checkpoint_format = "loom-sharded-checkpoint-1";
inline const char* const state_kinds[3] = {"master", "exp_avg", "exp_avg_sq"};

// A run of a full tensor held at flat offset `flat` of a chunk's buffer.
struct piece {
  std::string tensor;
  std::size_t full = 0, flat = 0, count = 0;
};

// fn(tensor, full element, flat element, count) for every row segment of `shards` that
// overlaps flat [lo, hi), merged where consecutive in both.
template <class Fn>
void for_each_piece(const tp::shard_list& shards, std::size_t lo, std::size_t hi, Fn&& fn) {
  piece run;
  auto flush = [&] {
    if (run.count) fn(run);
    run = {};
  };
  for (const auto& d : shards)
    for (index_t r = 0; r < d.rows; ++r) {
      const std::size_t a = d.local_offset + static_cast<std::size_t>(r * d.cols), b = a + static_cast<std::size_t>(d.cols);
      const std::size_t x = std::max(a, lo), y = std::min(b, hi);
      if (x >= y) continue;
      const std::size_t full = static_cast<std::size_t>((d.row0 + r) * d.full_cols + d.col0) + (x - a);
      if (run.count && run.tensor == d.name && run.full + run.count == full && run.flat + run.count == x) {
        run.count += y - x;
      } else {
        flush();
        run = {d.name, full, x, y - x};
      }
    }
  flush();
}

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  LOOM_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  LOOM_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed");
}

// Test hook: LOOM_CHECKPOINT_CRASH=<point> kills this process (SIGKILL) at that point of a
// save, so a test can show that no crash leaves `latest` naming an incomplete checkpoint.
inline void crash_point(const char* point) {
  const char* e = std::getenv("LOOM_CHECKPOINT_CRASH");
  if (e && std::strcmp(e, point) == 0) std::raise(SIGKILL);
}

inline std::string rank_file(int r) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", r);
  return name;
}

inline nlohmann::json scaler_json(const loom::amp::any_loss_scaler& s) {
  if (const auto* d = std::get_if<loom::amp::dynamic_loss_scaler>(&s)) {
    const auto& st = d->state();
    return {{"kind", "dynamic"}, {"scale", st.scale}, {"iteration", st.iteration},
            {"last_overflow_iteration", st.last_overflow_iteration}, {"hysteresis_left", st.hysteresis_left},
            {"skipped_steps", st.skipped_steps}};
  }
  return {{"kind", "static"}, {"scale", loom::amp::scale_of(s)}};
}

}  // namespace detail

/// Writes the trainer's state to <root>/step-<steps()> (see the file comment). Collective
/// over the world; returns the checkpoint's directory.
template <class P, class T, class C>
std::string save_checkpoint(trainer<P, T, C>& t, const std::string& root) {
  namespace fs = std::filesystem;
  auto& world = t.mesh().world();
  const int rank = world.rank();
  const std::string final_dir = root + "/step-" + std::to_string(t.steps()), partial = final_dir + ".partial";
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot create directory '", root, "': ", ec.message());
    fs::remove_all(partial, ec);  // a crashed save's leftovers
    fs::create_directories(partial, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot create directory '", partial, "': ", ec.message());
  }
  world.barrier();
  loom::io::tensor_map pieces;
  for (int c = 0; c < t.chunks(); ++c) {
    const auto& md = t.model(c);
    tp::shard_list canon;
    for (const auto& s : md.shards())
      if (s.replica == 0) canon.push_back(s);
    t.engine(c).for_each_state_slice([&](std::size_t lo, std::span<float> m0, std::span<float> m1, std::span<float> m2) {
      const std::span<float> state[3] = {m0, m1, m2};
      detail::for_each_piece(canon, lo, lo + m0.size(), [&](const detail::piece& p) {
        for (int k = 0; k < 3; ++k) {
          loom::io::named_tensor nt;
          nt.shape = {static_cast<std::int64_t>(p.count)};
          nt.data = loom::buffer<float>(p.count);
          std::copy_n(state[k].begin() + static_cast<std::ptrdiff_t>(p.flat - lo), p.count, nt.data.begin());
          pieces.emplace(std::string(detail::state_kinds[k]) + "/" + p.tensor + "/" + std::to_string(p.full), std::move(nt));
        }
      });
    });
  }
  const std::string file = partial + "/" + detail::rank_file(rank);
  loom::io::write_safetensors(file, pieces, "F32", {{"format", detail::checkpoint_format}, {"rank", std::to_string(rank)}});
  detail::fsync_path(file, false);
  world.barrier();
  detail::crash_point("rank-files");
  if (rank == 0) {
    const auto& o = t.options();
    nlohmann::json tensors = nlohmann::json::object();
    const auto layout = full_layout(t.model().cfg());
    for (const auto& e : layout.entries()) tensors[e.name] = e.shape;
    const nlohmann::json manifest = {{"format", detail::checkpoint_format},
                                     {"step", t.steps()},
                                     {"world", world.size()},
                                     {"mesh", {{"dp", o.mesh.dp}, {"tp", o.mesh.tp}, {"pp", o.mesh.pp}}},
                                     {"zero_stage", o.zero_stage},
                                     {"files", world.size()},
                                     {"tensors", tensors},
                                     {"loss_scaler", detail::scaler_json(t.loss_scaler())}};
    {
      std::ofstream f(partial + "/manifest.json");
      f << manifest.dump(1) << "\n";
      LOOM_CHECK(f.good(), "checkpoint: writing '", partial, "/manifest.json' failed");
    }
    detail::fsync_path(partial + "/manifest.json", false);
    detail::fsync_path(partial, true);
    detail::crash_point("manifest");
    std::error_code ec;
    fs::remove_all(final_dir, ec);
    fs::rename(partial, final_dir, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot rename '", partial, "' to '", final_dir, "': ", ec.message());
    detail::crash_point("renamed");
    {
      std::ofstream f(root + "/latest.tmp");
      f << "step-" << t.steps() << "\n";
      LOOM_CHECK(f.good(), "checkpoint: writing '", root, "/latest.tmp' failed");
    }
    detail::fsync_path(root + "/latest.tmp", false);
    detail::crash_point("latest-tmp");
    fs::rename(root + "/latest.tmp", root + "/latest", ec);
    LOOM_CHECK(!ec, "checkpoint: cannot update '", root, "/latest': ", ec.message());
    detail::fsync_path(root, true);
  }
  world.barrier();
  return final_dir;
}

/// The checkpoint directory `path` names: a checkpoint itself (it holds manifest.json), or a
/// root whose `latest` file names one.
inline std::string resolve_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::exists(path + "/manifest.json")) return path;
  std::ifstream f(path + "/latest");
  LOOM_CHECK(f.good(), "checkpoint: '", path, "' holds neither manifest.json nor a 'latest' file");
  std::string name;
  f >> name;
  LOOM_CHECK(!name.empty() && name.find('/') == std::string::npos && name.find("..") == std::string::npos,
             "checkpoint: '", path, "/latest' names no checkpoint directory ('", name.substr(0, 64), "')");
  LOOM_CHECK(fs::exists(path + "/" + name + "/manifest.json"), "checkpoint: '", path, "/latest' names '", name,
             "', which holds no manifest.json");
  return path + "/" + name;
}

/// A saved checkpoint opened for reading: its manifest and every rank file's header, and
/// reads of any range of any tensor's state, touching only the bytes of the pieces that
/// overlap it.
class checkpoint_reader {
 public:
  explicit checkpoint_reader(const std::string& path) : dir_(resolve_checkpoint(path)), what_("checkpoint '" + dir_ + "'") {
    {
      // one entry per tensor: a few hundred bytes each; a larger file is not a manifest
      const std::vector<char> text = loom::io::detail::read_file_bytes(dir_ + "/manifest.json");
      LOOM_CHECK(text.size() <= (std::size_t{64} << 20), what_, ": manifest.json has ", text.size(), " bytes (limit 64 MiB)");
      manifest_ = loom::data::parse_json_input(std::string_view(text.data(), text.size()), what_ + ": manifest.json");
    }
    LOOM_CHECK(manifest_.is_object() && manifest_.value("format", "") == detail::checkpoint_format, what_,
               ": manifest.json is not a ", detail::checkpoint_format, " manifest");
    LOOM_CHECK(manifest_.contains("tensors") && manifest_["tensors"].is_object(), what_, ": manifest.json lists no tensors");
    for (auto& [name, shape] : manifest_["tensors"].items()) {
      std::vector<std::int64_t> v;
      LOOM_CHECK(shape.is_array(), what_, ": tensor '", name, "' has no shape");
      for (std::size_t i = 0; i < shape.size(); ++i)
        v.push_back(loom::data::json_integer(shape[i], what_ + ": shape of '" + name + "'", 1, INT64_MAX));
      shapes_[name] = std::move(v);
    }
    step_ = loom::data::json_integer(manifest_["step"], what_ + ": step", 0, INT64_MAX);
    const auto files = loom::data::json_integer(manifest_["files"], what_ + ": files", 1, 1 << 20);
    for (std::int64_t r = 0; r < files; ++r) {
      index_.push_back(loom::io::read_safetensors_index(dir_ + "/" + detail::rank_file(static_cast<int>(r))));
      for (const auto& [key, e] : index_.back().tensors) {
        if (key.rfind("master/", 0) != 0) continue;
        const std::size_t slash = key.rfind('/');
        LOOM_CHECK(slash > 7 && slash + 1 < key.size() && key.size() - slash - 1 <= 18 &&
                       key.find_first_not_of("0123456789", slash + 1) == std::string::npos,
                   what_, ": file ", r, " has a tensor named '", key.substr(0, 80), "'");  // <= 18 digits: no overflow
        where_[key.substr(7, slash - 7)].push_back(
            {static_cast<std::size_t>(std::stoull(key.substr(slash + 1))), static_cast<std::size_t>(e.count), index_.size() - 1});
      }
    }
    for (auto& [name, v] : where_) std::sort(v.begin(), v.end(), [](const located& a, const located& b) { return a.full < b.full; });
  }

  const std::string& dir() const noexcept { return dir_; }
  const nlohmann::json& manifest() const noexcept { return manifest_; }
  std::int64_t step() const noexcept { return step_; }
  /// Every tensor's name and full shape.
  const std::map<std::string, std::vector<std::int64_t>>& shapes() const noexcept { return shapes_; }

  /// Elements [first, first + out.size()) of tensor `name` (row-major in its full shape) of
  /// state `kind` (0 master, 1 exp_avg, 2 exp_avg_sq); every element must be in a piece.
  void read(int kind, const std::string& name, std::size_t first, std::span<float> out) const {
    const auto it = where_.find(name);
    LOOM_CHECK(it != where_.end(), what_, ": no piece of tensor '", name, "'");
    std::size_t got = 0;
    for (const located& l : it->second) {
      const std::size_t a = std::max(l.full, first), b = std::min(l.full + l.count, first + out.size());
      if (a >= b) continue;
      const std::string key = std::string(detail::state_kinds[kind]) + "/" + name + "/" + std::to_string(l.full);
      loom::io::read_safetensors_range(index_[l.file], key, a - l.full, out.subspan(a - first, b - a));
      got += b - a;
    }
    LOOM_CHECK(got == out.size(), what_, ": tensor '", name, "' elements [", first, ", ", first + out.size(),
               ") are covered by ", got, " elements of its pieces");
  }

 private:
  struct located {
    std::size_t full, count, file;
  };
  std::string dir_, what_;
  nlohmann::json manifest_;
  std::int64_t step_ = 0;
  std::map<std::string, std::vector<std::int64_t>> shapes_;
  std::vector<loom::io::safetensors_index> index_;
  std::map<std::string, std::vector<located>> where_;
};

/// Loads a checkpoint saved by save_checkpoint on any mesh and ZeRO stage into `t` (the same
/// model), so that the next step continues the saved run. Collective over the world.
template <class P, class T, class C>
void load_checkpoint(trainer<P, T, C>& t, const std::string& path) {
  const checkpoint_reader ck(path);
  const std::string what = "checkpoint '" + ck.dir() + "'";
  // the same model: every tensor, by name and full shape
  const auto layout = full_layout(t.model().cfg());
  LOOM_CHECK(ck.shapes().size() == layout.entries().size(), what, ": holds ", ck.shapes().size(), " tensors, this model has ",
             layout.entries().size());
  for (const auto& e : layout.entries()) {
    const auto it = ck.shapes().find(e.name);
    LOOM_CHECK(it != ck.shapes().end(), what, ": has no tensor '", e.name, "'");
    LOOM_CHECK(it->second == std::vector<std::int64_t>(e.shape.begin(), e.shape.end()), what, ": tensor '", e.name,
               "' has shape ", nlohmann::json(it->second).dump(), ", this model's is ", nlohmann::json(e.shape).dump());
  }
  // each rank fills its slices of every chunk, replicas included, from the pieces it overlaps
  for (int c = 0; c < t.chunks(); ++c) {
    const auto& md = t.model(c);
    t.engine(c).for_each_state_slice([&](std::size_t lo, std::span<float> m0, std::span<float> m1, std::span<float> m2) {
      const std::span<float> state[3] = {m0, m1, m2};
      detail::for_each_piece(md.shards(), lo, lo + m0.size(), [&](const detail::piece& need) {
        for (int k = 0; k < 3; ++k) ck.read(k, need.tensor, need.full, state[k].subspan(need.flat - lo, need.count));
      });
    });
  }
  // the loss scaler as it was
  const auto& sc = ck.manifest()["loss_scaler"];
  if (auto* d = std::get_if<loom::amp::dynamic_loss_scaler>(&t.loss_scaler())) {
    LOOM_CHECK(sc.is_object() && sc.value("kind", "") == "dynamic", what,
               ": was saved with a static loss scale; this run has a dynamic one");
    loom::amp::dynamic_loss_scaler_state st;
    const auto field = [&](const char* k) { return sc.contains(k) ? sc[k] : nlohmann::json(); };
    const std::string w = what + ": loss_scaler.";
    st.scale = loom::data::json_real<float>(field("scale"), w + "scale", 0.0, 1e38);
    st.iteration = loom::data::json_integer(field("iteration"), w + "iteration", 0, INT64_MAX);
    st.last_overflow_iteration = loom::data::json_integer(field("last_overflow_iteration"), w + "last_overflow_iteration", -1, INT64_MAX);
    st.hysteresis_left = static_cast<int>(loom::data::json_integer(field("hysteresis_left"), w + "hysteresis_left", 1, INT32_MAX));
    st.skipped_steps = loom::data::json_integer(field("skipped_steps"), w + "skipped_steps", 0, INT64_MAX);
    d->set_state(st);
  }
  t.restore(ck.step());
}

/// Streams checkpoint `path`'s fp32 master weights into one safetensors file of the whole
/// model (the single-rank names and shapes, what llama-generate and the serving engine load),
/// one tensor at a time: the memory it needs is about one tensor, whatever the model's size
/// (the tensor's buffer comes from `mr`; a range read adds one piece's bytes while it runs).
/// Returns the largest tensor's element count.
inline std::size_t consolidate_checkpoint(const std::string& path, const std::string& out_file,
                                          loom::memory_resource& mr = loom::default_resource<loom::host>()) {
  const checkpoint_reader ck(path);
  loom::io::safetensors_writer w(out_file, ck.shapes(), "F32", {{"format", "pt"}, {"loom.step", std::to_string(ck.step())}});
  std::size_t largest = 0;
  for (const auto& [name, shape] : ck.shapes()) {
    std::size_t n = 1;
    for (auto e : shape) n *= static_cast<std::size_t>(e);
    largest = std::max(largest, n);
    loom::buffer<float> t(n, mr);
    ck.read(0, name, 0, t.span());
    w.write(name, std::span<const float>(t.span()));
  }
  w.close();
  return largest;
}

}  // namespace llama3d
