#pragma once
// Sharded checkpoints: every rank writes the training state it owns, no rank gathers the
// model, and a checkpoint resumes on any mesh and ZeRO stage.
//
// What a checkpoint holds is described by *chunks*: a flat parameter buffer (a pipeline
// stage's model chunk) with the shard list that says which rows of which full tensors it
// holds (nn::tp::shard_desc; replica > 0 marks a tensor-parallel or tied copy), and an
// engine whose `for_each_state_slice` hands out this rank's slices of the fp32 master weights
// and both Adam moments (zero::engine: the ranks' slices partition the state at every stage).
// A rank cuts its slices into *pieces* along the full tensors (canonical copies only), named
//   <kind>/<tensor>/<first element in the full tensor, row-major>    kind: master, exp_avg, exp_avg_sq
// in one safetensors file per rank (rank-00003.safetensors; ordinary tools open it). Rank 0
// writes manifest.json: the format, the step, the number of rank files, every tensor's full
// shape, and the caller's own fields (mesh, stage, loss scaler: see `meta`). The parameters
// themselves are not written: an engine recomputes them from the master.
//
// Loading reads the manifest and each file's header; each rank then reads only the byte
// ranges of the pieces that overlap what it owns now (io::read_safetensors_range): never the
// whole model, whatever mesh saved it. `load` takes its state from any `state_source`, so a
// model folder of another format (an HF folder) is distributed over the ranks the same way.
//
// Crash safety: a checkpoint is written into <root>/step-<N>.partial, every file fsynced,
// then renamed to <root>/step-<N>, and <root>/latest rewritten (a temporary file renamed over
// it). A crash at any point leaves the previous checkpoint and a `latest` naming it. Only
// after that are checkpoints older than the newest `keep_last` removed.

#include <loom/amp/loss_scaler.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/data/json_input.hpp>
#include <loom/io/safetensors.hpp>
#include <loom/nn/tp/shard.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <concepts>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace loom::checkpoint {

/// Every tensor's name and full shape.
using tensor_shapes = std::map<std::string, std::vector<std::int64_t>>;

/// fn(first, master, exp_avg, exp_avg_sq): this rank's slices of a chunk's state, `first`
/// being the flat offset of the slices in the chunk's buffer.
using state_visitor = std::function<void(std::size_t, std::span<float>, std::span<float>, std::span<float>)>;

/// One flat parameter buffer's state (see the file comment). E: anything with
/// `for_each_state_slice(state_visitor)` (zero::engine, zero::any_engine).
template <class E>
struct chunk {
  const nn::tp::shard_list* shards = nullptr;
  E* engine = nullptr;
};

struct save_options {
  int keep_last = 0;  ///< after a save, remove all but the newest `keep_last` checkpoints (0: keep all)
};

namespace detail {

inline constexpr const char* format = "loom-sharded-checkpoint-1";
inline const char* const state_kinds[3] = {"master", "exp_avg", "exp_avg_sq"};

// A run of a full tensor held at flat offset `flat` of a chunk's buffer.
struct piece {
  std::string tensor;
  std::size_t full = 0, flat = 0, count = 0;
};

// fn(piece) for every row segment of `shards` that overlaps flat [lo, hi), merged where
// consecutive in both the full tensor and the flat buffer.
template <class Fn>
void for_each_piece(const nn::tp::shard_list& shards, std::size_t lo, std::size_t hi, Fn&& fn) {
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

// Object `j`'s field `key` when it is a string, else "" (nlohmann's value() throws its own
// type_error for another type: a manifest is outside bytes, refused with loom::error).
inline std::string string_field(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

inline std::string rank_file(std::int64_t r) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(r));
  return name;
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.flush();
  LOOM_CHECK(f.good(), "checkpoint: writing '", path, "' failed");
}

// The step of a directory named step-<N> (no .partial), or -1.
inline std::int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return -1;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos) return -1;
  return static_cast<std::int64_t>(std::stoll(name.substr(5)));
}

// Removes all but the newest `keep` step-<N> directories under root (never `latest`'s).
inline void prune(const std::string& root, int keep, const std::string& latest) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::int64_t s = e.is_directory() ? step_of(e.path().filename().string()) : -1;
    if (s >= 0) steps.emplace_back(s, e.path());
  }
  std::sort(steps.begin(), steps.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) {
    if (steps[i].second.filename() == latest) continue;
    std::error_code ec;
    fs::remove_all(steps[i].second, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot remove old checkpoint '", steps[i].second.string(), "': ", ec.message());
  }
}

}  // namespace detail

/// Writes the state of `chunks` (every rank's own slices) to <root>/step-<step> (see the file
/// comment) and returns that directory. `tensors`: every tensor's full shape; `meta`: fields
/// added to the manifest (a JSON object; its keys must not be format, step, files, tensors).
/// Collective over `world`.
template <comm::communicator Comm, class E>
std::string save(Comm& world, const std::string& root, std::int64_t step, std::span<const chunk<E>> chunks,
                 const tensor_shapes& tensors, const nlohmann::json& meta = nlohmann::json::object(),
                 const save_options& opt = {}) {
  namespace fs = std::filesystem;
  LOOM_CHECK(step >= 0, "checkpoint::save: step must be >= 0, got step=", step);
  LOOM_CHECK(opt.keep_last >= 0, "checkpoint::save: keep_last must be >= 0, got keep_last=", opt.keep_last);
  LOOM_CHECK(meta.is_object(), "checkpoint::save: meta must be a JSON object");
  const int rank = world.rank();
  const std::string name = "step-" + std::to_string(step), final_dir = root + "/" + name, partial = final_dir + ".partial";
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot create directory '", root, "': ", ec.message());
    fs::remove_all(partial, ec);  // a crashed save's leftovers
    fs::create_directories(partial, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot create directory '", partial, "': ", ec.message());
  }
  world.barrier();
  io::tensor_map pieces;
  for (const chunk<E>& ch : chunks) {
    nn::tp::shard_list canon;
    for (const auto& s : *ch.shards)
      if (s.replica == 0) canon.push_back(s);
    ch.engine->for_each_state_slice([&](std::size_t lo, std::span<float> m0, std::span<float> m1, std::span<float> m2) {
      const std::span<float> state[3] = {m0, m1, m2};
      detail::for_each_piece(canon, lo, lo + m0.size(), [&](const detail::piece& p) {
        for (int k = 0; k < 3; ++k) {
          io::named_tensor nt;
          nt.shape = {static_cast<std::int64_t>(p.count)};
          nt.data = buffer<float>(p.count);
          std::copy_n(state[k].begin() + static_cast<std::ptrdiff_t>(p.flat - lo), p.count, nt.data.begin());
          pieces.emplace(std::string(detail::state_kinds[k]) + "/" + p.tensor + "/" + std::to_string(p.full), std::move(nt));
        }
      });
    });
  }
  const std::string file = partial + "/" + detail::rank_file(rank);
  io::write_safetensors(file, pieces, "F32", {{"format", detail::format}, {"rank", std::to_string(rank)}});
  detail::fsync_path(file, false);
  world.barrier();
  detail::crash_point("rank-files");
  if (rank == 0) {
    nlohmann::json manifest = meta;
    manifest["format"] = detail::format;
    manifest["step"] = step;
    manifest["files"] = world.size();
    manifest["tensors"] = tensors;
    detail::write_text(partial + "/manifest.json", manifest.dump(1) + "\n");
    detail::fsync_path(partial + "/manifest.json", false);
    detail::fsync_path(partial, true);
    detail::crash_point("manifest");
    std::error_code ec;
    fs::remove_all(final_dir, ec);
    fs::rename(partial, final_dir, ec);
    LOOM_CHECK(!ec, "checkpoint: cannot rename '", partial, "' to '", final_dir, "': ", ec.message());
    detail::crash_point("renamed");
    detail::write_text(root + "/latest.tmp", name + "\n");
    detail::fsync_path(root + "/latest.tmp", false);
    detail::crash_point("latest-tmp");
    fs::rename(root + "/latest.tmp", root + "/latest", ec);
    LOOM_CHECK(!ec, "checkpoint: cannot update '", root, "/latest': ", ec.message());
    detail::fsync_path(root, true);
    if (opt.keep_last > 0) detail::prune(root, opt.keep_last, name);
  }
  world.barrier();
  return final_dir;
}

/// The checkpoint directory `path` names: a checkpoint itself (it holds manifest.json), or a
/// root whose `latest` file names one.
inline std::string resolve(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::exists(path + "/manifest.json")) return path;
  std::ifstream f(path + "/latest");
  LOOM_CHECK(f.good(), "checkpoint: '", path, "' holds neither manifest.json nor a 'latest' file");
  std::string name(256, '\0');  // "step-<N>\n": a longer file names no checkpoint of ours
  f.read(name.data(), static_cast<std::streamsize>(name.size()));
  name.resize(static_cast<std::size_t>(f.gcount()));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
  LOOM_CHECK(detail::step_of(name) >= 0,  // step-<N>: what save writes, never a path
             "checkpoint: '", path, "/latest' names no checkpoint directory ('", name.substr(0, 64), "')");
  LOOM_CHECK(fs::exists(path + "/" + name + "/manifest.json"), "checkpoint: '", path, "/latest' names '", name.substr(0, 64),
             "', which holds no manifest.json");
  return path + "/" + name;
}

/// A saved checkpoint opened for reading: its manifest and every rank file's header, and
/// reads of any range of any tensor's state, touching only the bytes of the pieces that
/// overlap it.
class reader {
 public:
  explicit reader(const std::string& path) : dir_(resolve(path)), what_("checkpoint '" + dir_ + "'") {
    {
      // one entry per tensor: a few hundred bytes each; a larger file is not a manifest
      const std::vector<char> text = io::detail::read_file_bytes(dir_ + "/manifest.json");
      LOOM_CHECK(text.size() <= (std::size_t{64} << 20), what_, ": manifest.json has ", text.size(), " bytes (limit 64 MiB)");
      manifest_ = data::parse_json_input(std::string_view(text.data(), text.size()), what_ + ": manifest.json");
    }
    LOOM_CHECK(manifest_.is_object() && detail::string_field(manifest_, "format") == detail::format, what_,
               ": manifest.json is not a ", detail::format, " manifest");
    LOOM_CHECK(manifest_.contains("tensors") && manifest_["tensors"].is_object(), what_, ": manifest.json lists no tensors");
    for (auto& [name, shape] : manifest_["tensors"].items()) {
      std::vector<std::int64_t> v;
      LOOM_CHECK(shape.is_array(), what_, ": tensor '", name.substr(0, 80), "' has no shape");
      std::int64_t numel = 1;  // every later size (a consolidation's buffer, a writer's offsets) is this product
      for (std::size_t i = 0; i < shape.size(); ++i) {
        v.push_back(data::json_integer(shape[i], what_ + ": shape of '" + name.substr(0, 80) + "'", 1, INT64_MAX));
        LOOM_CHECK(!__builtin_mul_overflow(numel, v.back(), &numel), what_, ": tensor '", name.substr(0, 80), "' has shape ",
                   data::quote_json(shape), ", more elements than int64 holds");
      }
      shapes_[name] = std::move(v);
    }
    const auto field = [&](const char* k) { return manifest_.contains(k) ? manifest_[k] : nlohmann::json(); };
    step_ = data::json_integer(field("step"), what_ + ": step", 0, INT64_MAX);
    const auto files = data::json_integer(field("files"), what_ + ": files", 1, 1 << 20);
    for (std::int64_t r = 0; r < files; ++r) {
      index_.push_back(io::read_safetensors_index(dir_ + "/" + detail::rank_file(r)));
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
    for (auto& [name, v] : where_) {
      std::sort(v.begin(), v.end(), [](const located& a, const located& b) { return a.full < b.full; });
      // read() finds a range's pieces by binary search, which holds only if none overlap (a save
      // writes each element once); two pieces claiming one element are a corrupt checkpoint
      for (std::size_t i = 1; i < v.size(); ++i)
        LOOM_CHECK(v[i - 1].full + v[i - 1].count <= v[i].full, what_, ": tensor '", name.substr(0, 80), "' has pieces at ",
                   v[i - 1].full, " (", v[i - 1].count, " elements) and ", v[i].full, " that overlap");
    }
  }

  const std::string& dir() const noexcept { return dir_; }
  const nlohmann::json& manifest() const noexcept { return manifest_; }
  std::int64_t step() const noexcept { return step_; }
  /// Every tensor's name and full shape.
  const tensor_shapes& shapes() const noexcept { return shapes_; }
  /// The element count of tensor `name` by its shape, refused when its master pieces hold
  /// fewer (they are bounded by the rank files' sizes, the manifest's shape is not): what a
  /// buffer for the whole tensor may be sized by.
  std::size_t numel(const std::string& name) const {
    const auto s = shapes_.find(name);
    LOOM_CHECK(s != shapes_.end(), what_, ": has no tensor '", name.substr(0, 80), "'");
    std::size_t n = 1, held = 0;
    for (auto e : s->second) n *= static_cast<std::size_t>(e);  // the constructor checked the product
    if (const auto it = where_.find(name); it != where_.end())
      for (const located& l : it->second) held += l.count;
    LOOM_CHECK(n <= held, what_, ": tensor '", name.substr(0, 80), "' has ", n, " elements by its shape, its pieces hold ", held);
    return n;
  }
  /// Refuses a checkpoint of another model: `want` must name the same tensors with the same
  /// full shapes (an error names the tensor count, or the tensor and both shapes).
  void check_model(const tensor_shapes& want) const {
    LOOM_CHECK(shapes_.size() == want.size(), what_, ": holds ", shapes_.size(), " tensors, this model has ", want.size());
    for (const auto& [name, shape] : want) {
      const auto it = shapes_.find(name);
      LOOM_CHECK(it != shapes_.end(), what_, ": has no tensor '", name, "'");
      LOOM_CHECK(it->second == shape, what_, ": tensor '", name, "' has shape ", nlohmann::json(it->second).dump(),
                 ", this model's is ", nlohmann::json(shape).dump());
    }
  }

  /// Elements [first, first + out.size()) of tensor `name` (row-major in its full shape) of
  /// state `kind` (0 master, 1 exp_avg, 2 exp_avg_sq); every element must be in a piece.
  void read(int kind, const std::string& name, std::size_t first, std::span<float> out) const {
    LOOM_CHECK(kind >= 0 && kind < 3, "checkpoint::reader::read: kind must be 0, 1 or 2, got kind=", kind);
    const auto it = where_.find(name);
    LOOM_CHECK(it != where_.end(), what_, ": no piece of tensor '", name.substr(0, 80), "'");
    std::size_t got = 0;
    // pieces are sorted by their first element and do not overlap: start at the last piece
    // that begins at or before `first` (a tensor cut into rows has thousands of pieces)
    const auto& v = it->second;
    auto l0 = std::upper_bound(v.begin(), v.end(), first, [](std::size_t x, const located& l) { return x < l.full; });
    if (l0 != v.begin()) --l0;
    for (auto l = l0; l != v.end() && l->full < first + out.size(); ++l) {
      const std::size_t a = std::max(l->full, first), b = std::min(l->full + l->count, first + out.size());
      if (a >= b) continue;
      const std::string key = std::string(detail::state_kinds[kind]) + "/" + name + "/" + std::to_string(l->full);
      io::read_safetensors_range(index_[l->file], key, a - l->full, out.subspan(a - first, b - a));
      got += b - a;
    }
    LOOM_CHECK(got == out.size(), what_, ": tensor '", name.substr(0, 80), "' elements [", first, ", ", first + out.size(),
               ") are covered by ", got, " elements of its pieces");
  }

 private:
  struct located {
    std::size_t full, count, file;
  };
  std::string dir_, what_;
  nlohmann::json manifest_;
  std::int64_t step_ = 0;
  tensor_shapes shapes_;
  std::vector<io::safetensors_index> index_;
  std::map<std::string, std::vector<located>> where_;
};

/// Where `load` takes the state from: anything that fills elements [first, first +
/// out.size()) of full tensor `name` (row-major) of state `kind` (0 master, 1 exp_avg, 2
/// exp_avg_sq), reading no more than those. A saved checkpoint (`reader`) is one; a model
/// folder of another format is another (llama3d::hf_source: a Hugging Face folder's weights
/// as the master, zero moments), so both go through the one slice distribution below.
template <class S>
concept state_source = requires(const S& s, int kind, const std::string& name, std::size_t first, std::span<float> out) {
  s.read(kind, name, first, out);
};

/// Fills every rank's slices of `chunks` (replicas included) from `src` (a checkpoint
/// `reader`, or any state_source), asking only for the pieces they overlap. The caller has
/// checked the model (reader::check_model).
template <state_source S, class E>
void load(const S& src, std::span<const chunk<E>> chunks) {
  for (const chunk<E>& ch : chunks)
    ch.engine->for_each_state_slice([&](std::size_t lo, std::span<float> m0, std::span<float> m1, std::span<float> m2) {
      const std::span<float> state[3] = {m0, m1, m2};
      detail::for_each_piece(*ch.shards, lo, lo + m0.size(), [&](const detail::piece& need) {
        for (int k = 0; k < 3; ++k) src.read(k, need.tensor, need.full, state[k].subspan(need.flat - lo, need.count));
      });
    });
}

/// The loss scaler's state as manifest fields.
inline nlohmann::json scaler_json(const amp::any_loss_scaler& s) {
  if (const auto* d = std::get_if<amp::dynamic_loss_scaler>(&s)) {
    const auto& st = d->state();
    return {{"kind", "dynamic"}, {"scale", st.scale}, {"iteration", st.iteration},
            {"last_overflow_iteration", st.last_overflow_iteration}, {"hysteresis_left", st.hysteresis_left},
            {"skipped_steps", st.skipped_steps}};
  }
  return {{"kind", "static"}, {"scale", amp::scale_of(s)}};
}

/// Restores a dynamic scaler's state from the manifest's `key` field (a static scaler has
/// none to restore); every field is range-checked by name.
inline void restore_scaler(const reader& ck, amp::any_loss_scaler& s, const char* key = "loss_scaler") {
  auto* d = std::get_if<amp::dynamic_loss_scaler>(&s);
  if (!d) return;
  const std::string what = "checkpoint '" + ck.dir() + "'";
  const auto& m = ck.manifest();
  const nlohmann::json sc = m.contains(key) ? m[key] : nlohmann::json();
  LOOM_CHECK(sc.is_object() && detail::string_field(sc, "kind") == "dynamic", what,
             ": was saved with a static loss scale; this run has a dynamic one");
  amp::dynamic_loss_scaler_state st;
  const auto field = [&](const char* k) { return sc.contains(k) ? sc[k] : nlohmann::json(); };
  const std::string w = what + ": " + key + ".";
  st.scale = data::json_real<float>(field("scale"), w + "scale", 0.0, 1e38);
  st.iteration = data::json_integer(field("iteration"), w + "iteration", 0, INT64_MAX);
  st.last_overflow_iteration = data::json_integer(field("last_overflow_iteration"), w + "last_overflow_iteration", -1, INT64_MAX);
  st.hysteresis_left = static_cast<int>(data::json_integer(field("hysteresis_left"), w + "hysteresis_left", 1, INT32_MAX));
  st.skipped_steps = data::json_integer(field("skipped_steps"), w + "skipped_steps", 0, INT64_MAX);
  d->set_state(st);
}

namespace detail {
// Writes the master weights of `shapes` (the file's names; `source`: file name -> checkpoint
// name, identity when absent) through `w`, one tensor at a time from `mr`. Returns the
// largest tensor's element count.
template <class Source>
std::size_t write_master(const Source& ck, io::safetensors_writer& w, const tensor_shapes& shapes,
                                const std::map<std::string, std::string>& source,
                                const std::function<void(const std::string&, std::span<float>)>& transform,
                                memory_resource& mr) {
  std::size_t largest = 0;
  for (const auto& [out_name, shape] : shapes) {
    const auto it = source.find(out_name);
    const std::string& name = it == source.end() ? out_name : it->second;
    const std::size_t n = ck.numel(name);
    largest = std::max(largest, n);
    buffer<float> t(n, mr);
    ck.read(0, name, 0, t.span());
    if (transform) transform(name, t.span());
    w.write(out_name, std::span<const float>(t.span()));
  }
  w.close();
  return largest;
}
}  // namespace detail

/// Streams checkpoint `path`'s fp32 master weights into one safetensors file of the whole
/// model (the checkpoint's tensor names and full shapes), one tensor at a time: the memory it
/// needs is about one tensor, whatever the model's size (the tensor's buffer comes from `mr`;
/// a range read adds one piece's bytes while it runs). Returns the largest tensor's element
/// count.
inline std::size_t consolidate(const std::string& path, const std::string& out_file,
                               memory_resource& mr = default_resource<host>()) {
  const reader ck(path);
  io::safetensors_writer w(out_file, ck.shapes(), "F32", {{"format", "pt"}, {"loom.step", std::to_string(ck.step())}});
  return detail::write_master(ck, w, ck.shapes(), {}, {}, mr);
}

/// How `export_folder` writes a model folder.
struct folder_options {
  std::uint64_t max_shard_bytes = std::uint64_t{5} << 30;  ///< a shard file holds at most this (one tensor may exceed it)
  std::string dtype = "F32";                               ///< "F32", "F16" or "BF16"
  /// The folder's name of a checkpoint tensor (empty: the same name).
  std::function<std::string(const std::string&)> rename;
  /// Rewrites a tensor in place before it is written (e.g. a row permutation the target
  /// format's convention needs); gets the checkpoint's name.
  std::function<void(const std::string&, std::span<float>)> transform;
  std::string config_json;  ///< written as config.json when not empty
};

/// Whole tensors held in memory as a source of weights for export_folder: each name's full
/// shape and its values (row-major), which must outlive the source. What a model consolidated
/// in memory is exported through (a LoRA run's base with its adapters merged).
class memory_source {
 public:
  /// Adds tensor `name` of `shape` with its values `data` (as many as the shape has elements).
  void add(const std::string& name, std::vector<std::int64_t> shape, std::span<const float> data) {
    std::size_t n = 1;
    for (auto e : shape) n *= static_cast<std::size_t>(e);
    LOOM_CHECK(n == data.size(), "checkpoint::memory_source: tensor '", name, "' has ", n, " elements by its shape, ",
               data.size(), " values");
    LOOM_CHECK(data_.emplace(name, data).second, "checkpoint::memory_source: tensor '", name, "' is added twice");
    shapes_[name] = std::move(shape);
  }
  const tensor_shapes& shapes() const noexcept { return shapes_; }
  std::size_t numel(const std::string& name) const { return at(name).size(); }
  /// Elements [first, first + out.size()) of tensor `name`; kind 0 only (weights, no moments).
  void read(int kind, const std::string& name, std::size_t first, std::span<float> out) const {
    LOOM_CHECK(kind == 0, "checkpoint::memory_source: holds weights only, asked for state kind ", kind);
    const auto d = at(name);
    LOOM_CHECK(first <= d.size() && out.size() <= d.size() - first, "checkpoint::memory_source: elements [", first, ", ",
               first + out.size(), ") of '", name, "' of ", d.size());
    std::copy_n(d.begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
  }

 private:
  std::span<const float> at(const std::string& name) const {
    const auto it = data_.find(name);
    LOOM_CHECK(it != data_.end(), "checkpoint::memory_source: no tensor '", name, "'");
    return it->second;
  }
  tensor_shapes shapes_;
  std::map<std::string, std::span<const float>> data_;
};

/// Streams checkpoint `path`'s fp32 master weights (the optimizer state is dropped) into a
/// Hugging Face-style folder, one tensor at a time: model.safetensors, or shards
/// model-0000k-of-0000n.safetensors cut at `max_shard_bytes` with model.safetensors.index.json
/// ({"metadata": {"total_size"}, "weight_map": {name: file}}), plus config.json. Memory: one
/// tensor (from `mr`) plus a range read's piece. Returns the number of shard files.
inline int export_folder(const std::string& path, const std::string& out_dir, const folder_options& opt = {},
                         memory_resource& mr = default_resource<host>());

/// The same from any source of whole weights: a `reader`, or a `memory_source` (anything with
/// shapes(), numel(name) and read(0, name, first, out)).
template <class Source>
  requires(!std::convertible_to<const Source&, std::string>)
int export_folder(const Source& ck, const std::string& out_dir, const folder_options& opt = {},
                  memory_resource& mr = default_resource<host>()) {
  namespace fs = std::filesystem;
  LOOM_CHECK(opt.max_shard_bytes > 0, "checkpoint::export_folder: max_shard_bytes must be > 0");
  const std::size_t es = io::detail::dtype_size(opt.dtype);
  LOOM_CHECK(es != 0, "checkpoint::export_folder: dtype must be F32, F16 or BF16, got dtype='", opt.dtype.substr(0, 16), "'");
  const auto name_of = [&](const std::string& n) { return opt.rename ? opt.rename(n) : n; };
  // shards in the folder's name order, cut greedily (what HF's own writers do)
  std::vector<tensor_shapes> shards(1);
  std::map<std::string, std::string> source;  // folder name -> checkpoint name
  std::uint64_t in_shard = 0, total = 0;
  for (const auto& [name, shape] : ck.shapes()) source[name_of(name)] = name;
  LOOM_CHECK(source.size() == ck.shapes().size(), "checkpoint::export_folder: two tensors are given the same name");
  for (const auto& [out_name, name] : source) {
    const std::uint64_t bytes = es * ck.numel(name);  // numel is bounded by the files: no overflow
    if (in_shard > 0 && in_shard + bytes > opt.max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back()[out_name] = ck.shapes().at(name);
    in_shard += bytes;
    total += bytes;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  LOOM_CHECK(!ec, "checkpoint::export_folder: cannot create directory '", out_dir, "': ", ec.message());
  const std::size_t n = shards.size();
  const auto file_name = [&](std::size_t k) {
    if (n == 1) return std::string("model.safetensors");
    char b[64];
    std::snprintf(b, sizeof b, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(b);
  };
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t k = 0; k < n; ++k) {
    io::safetensors_writer w(out_dir + "/" + file_name(k), shards[k], opt.dtype, {{"format", "pt"}});
    detail::write_master(ck, w, shards[k], source, opt.transform, mr);
    for (const auto& [out_name, shape] : shards[k]) weight_map[out_name] = file_name(k);
  }
  if (n > 1)
    detail::write_text(out_dir + "/model.safetensors.index.json",
                       nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n");
  if (!opt.config_json.empty()) detail::write_text(out_dir + "/config.json", opt.config_json);
  return static_cast<int>(n);
}

inline int export_folder(const std::string& path, const std::string& out_dir, const folder_options& opt, memory_resource& mr) {
  const reader ck(path);
  return export_folder(ck, out_dir, opt, mr);
}

}  // namespace loom::checkpoint
