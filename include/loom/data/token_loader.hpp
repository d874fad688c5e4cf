#pragma once
// Batches of (tokens, targets) from token shards: windows, per-epoch shuffling, rank sharding.
//
// A sample is a window of seq_len + 1 consecutive tokens of one shard: tokens = the first
// seq_len, targets = the last seq_len (next-token prediction). Windows do not overlap in
// their targets: window k of a shard starts at token k * seq_len, so a shard of n tokens
// holds (n - 1) / seq_len windows and a window never straddles two files.
//
// Order and rank assignment: data/sampler.hpp (per-epoch Philox shuffle, rank striding,
// dropped tail).
//
// State for resume is (epoch, batch index in the epoch): loader_state.

#include <loom/core/error.hpp>
#include <loom/data/batch.hpp>
#include <loom/data/sampler.hpp>
#include <loom/data/token_shard.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

struct loader_options {
  std::size_t seq_len = 256;
  std::size_t batch = 8;         ///< this rank's micro-batch size
  std::uint32_t vocab_size = 0;  ///< every token must be below it
  std::uint64_t seed = 1234;
  bool shuffle = true;
  int rank = 0;
  int world = 1;
};

class token_loader {
 public:
  token_loader(std::vector<token_shard> shards, loader_options o) : shards_(std::move(shards)), o_(o) {
    LOOM_CHECK(o.seq_len >= 1, "token_loader: seq_len must be >= 1, got seq_len=", o.seq_len);
    LOOM_CHECK(o.vocab_size >= 1 && o.vocab_size <= 2147483647u, "token_loader: vocab_size must be in [1, 2^31 - 1] (ids are int32), got vocab_size=",
               o.vocab_size);
    LOOM_CHECK(!shards_.empty(), "token_loader: empty dataset (no shard files given)");
    first_window_.push_back(0);
    for (const auto& s : shards_) {
      LOOM_CHECK(s.vocab_size() == 0 || s.vocab_size() <= o.vocab_size, "token_loader: shard path='", s.path(),
                 "' was written for vocab_size=", s.vocab_size(), " > the model's vocab_size=", o.vocab_size);
      first_window_.push_back(first_window_.back() + (s.size() > 0 ? (s.size() - 1) / o.seq_len : 0));
    }
    windows_ = first_window_.back();
    std::size_t tokens = 0;
    for (const auto& s : shards_) tokens += s.size();
    LOOM_CHECK(windows_ > 0, "token_loader: empty dataset: ", shards_.size(), " shard(s) with ", tokens,
               " tokens hold no window of seq_len+1=", o.seq_len + 1, " tokens");
    sampler_ = distributed_sampler(windows_, {o.batch, o.seed, o.shuffle, o.rank, o.world}, "token_loader");
  }

  std::size_t windows() const noexcept { return windows_; }
  std::size_t batches_per_epoch() const noexcept { return sampler_.batches_per_epoch(); }
  const loader_options& options() const noexcept { return o_; }
  loader_state state() const noexcept { return state_; }
  void set_state(loader_state s) {
    sampler_.check_state(s, "token_loader");
    state_ = s;
  }

  /// Fills `out` with the next batch and advances the state.
  void next(token_batch& out) {
    const std::size_t S = o_.seq_len, B = o_.batch;
    out.batch = B, out.seq_len = S;
    out.tokens.resize(B * S);
    out.targets.resize(B * S);
    window_.resize(S + 1);
    for (std::size_t b = 0; b < B; ++b) {
      const std::uint64_t w = sampler_.sample(state_, b);
      const std::size_t shard = static_cast<std::size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), w) -
                                                         first_window_.begin()) - 1;
      const std::size_t first = (w - first_window_[shard]) * S;
      shards_[shard].read(first, window_, o_.vocab_size);
      std::copy(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(S), out.tokens.begin() + static_cast<std::ptrdiff_t>(b * S));
      std::copy(window_.begin() + 1, window_.end(), out.targets.begin() + static_cast<std::ptrdiff_t>(b * S));
    }
    state_ = sampler_.advance(state_);
  }

 private:
  std::vector<token_shard> shards_;
  loader_options o_;
  std::vector<std::uint64_t> first_window_;  // prefix sums of windows per shard
  std::size_t windows_ = 0;
  distributed_sampler sampler_;
  loader_state state_;
  std::vector<std::int32_t> window_;
};

/// Opens every path as a shard (headerless files read with `headerless_width`).
inline std::vector<token_shard> open_shards(const std::vector<std::string>& paths,
                                            std::optional<token_width> headerless_width = std::nullopt) {
  std::vector<token_shard> s;
  s.reserve(paths.size());
  for (const auto& p : paths) s.emplace_back(p, headerless_width);
  return s;
}

}  // namespace loom::data
