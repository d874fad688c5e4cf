#pragma once
// Batches of (tokens, targets) from token shards: windows, per-epoch shuffling, rank sharding.
//
// A sample is a window of seq_len + 1 consecutive tokens of one shard: tokens = the first
// seq_len, targets = the last seq_len (next-token prediction). Windows do not overlap in
// their targets: window k of a shard starts at token k * seq_len, so a shard of n tokens
// holds (n - 1) / seq_len windows and a window never straddles two files.
//
// Order: each epoch is a permutation of all windows (Fisher-Yates driven by the
// counter-based RNG with stream = epoch, so epoch e's order is a pure function of (seed, e)
// and needs no saved generator state). Ranks: position p of the permutation goes to rank
// p % world (DistributedSampler's striding). An epoch has floor(windows / (batch * world))
// batches per rank; the tail is dropped so every rank steps the same number of times.
// Consequence used by data-parallel tests: the union over ranks of their j-th batches of
// size b is exactly the j-th batch of size b * world of a one-rank run.
//
// State for resume is (epoch, batch index in the epoch): loader_state.

#include <loom/core/error.hpp>
#include <loom/core/random.hpp>
#include <loom/data/token_shard.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

/// Ignored targets (positions without loss), PyTorch's default ignore_index.
inline constexpr std::int32_t ignore_index = -100;

struct loader_options {
  std::size_t seq_len = 256;
  std::size_t batch = 8;         ///< this rank's micro-batch size
  std::uint32_t vocab_size = 0;  ///< every token must be below it
  std::uint64_t seed = 1234;
  bool shuffle = true;
  int rank = 0;
  int world = 1;
};

struct loader_state {
  std::int64_t epoch = 0;
  std::int64_t batch_in_epoch = 0;
};

/// One batch: tokens and targets, both [batch, seq_len], row-major int32.
struct token_batch {
  std::vector<std::int32_t> tokens;   // [batch, seq_len]
  std::vector<std::int32_t> targets;  // [batch, seq_len], ignore_index where no loss
  std::size_t batch = 0, seq_len = 0;
};

/// The permutation of [0, n) of epoch `epoch` (Fisher-Yates over Philox draws).
inline std::vector<std::uint64_t> epoch_permutation(std::uint64_t n, std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::uint64_t> p(n);
  std::iota(p.begin(), p.end(), std::uint64_t{0});
  const counter_rng rng(seed, static_cast<std::uint64_t>(epoch));
  for (std::uint64_t i = n; i > 1; --i) {
    const std::uint64_t k = n - i;  // draw index
    const std::uint64_t r = (static_cast<std::uint64_t>(rng.bits(2 * k)) << 32) | rng.bits(2 * k + 1);
    std::swap(p[i - 1], p[r % i]);
  }
  return p;
}

class token_loader {
 public:
  token_loader(std::vector<token_shard> shards, loader_options o) : shards_(std::move(shards)), o_(o) {
    LOOM_CHECK(o.seq_len >= 1, "token_loader: seq_len must be >= 1, got seq_len=", o.seq_len);
    LOOM_CHECK(o.batch >= 1, "token_loader: batch must be >= 1, got batch=", o.batch);
    LOOM_CHECK(o.vocab_size >= 1, "token_loader: vocab_size must be >= 1, got vocab_size=", o.vocab_size);
    LOOM_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, "token_loader: need 0 <= rank < world, got rank=", o.rank,
               " world=", o.world);
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
    batches_per_epoch_ = windows_ / (o.batch * static_cast<std::size_t>(o.world));
    LOOM_CHECK(batches_per_epoch_ > 0, "token_loader: empty dataset: ", windows_, " windows of seq_len=", o.seq_len,
               " are fewer than one global batch of batch*world=", o.batch * static_cast<std::size_t>(o.world));
  }

  std::size_t windows() const noexcept { return windows_; }
  std::size_t batches_per_epoch() const noexcept { return batches_per_epoch_; }
  const loader_options& options() const noexcept { return o_; }
  loader_state state() const noexcept { return state_; }
  void set_state(loader_state s) {
    LOOM_CHECK(s.epoch >= 0 && s.batch_in_epoch >= 0 && static_cast<std::size_t>(s.batch_in_epoch) < batches_per_epoch_,
               "token_loader: bad state epoch=", s.epoch, " batch_in_epoch=", s.batch_in_epoch, " (", batches_per_epoch_,
               " batches per epoch)");
    state_ = s;
    perm_epoch_ = -1;
  }

  /// Index of the window this rank reads as sample `b` of batch `batch_in_epoch` of epoch `epoch`.
  std::uint64_t window_of(std::int64_t epoch, std::int64_t batch_in_epoch, std::size_t b) {
    ensure_permutation(epoch);
    const std::size_t pos = (static_cast<std::size_t>(batch_in_epoch) * o_.batch + b) * static_cast<std::size_t>(o_.world) +
                            static_cast<std::size_t>(o_.rank);
    return o_.shuffle ? perm_[pos] : pos;
  }

  /// Fills `out` with the next batch and advances the state.
  void next(token_batch& out) {
    const std::size_t S = o_.seq_len, B = o_.batch;
    out.batch = B, out.seq_len = S;
    out.tokens.resize(B * S);
    out.targets.resize(B * S);
    window_.resize(S + 1);
    for (std::size_t b = 0; b < B; ++b) {
      const std::uint64_t w = window_of(state_.epoch, state_.batch_in_epoch, b);
      const std::size_t shard = static_cast<std::size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), w) -
                                                         first_window_.begin()) - 1;
      const std::size_t first = (w - first_window_[shard]) * S;
      shards_[shard].read(first, window_, o_.vocab_size);
      std::copy(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(S), out.tokens.begin() + static_cast<std::ptrdiff_t>(b * S));
      std::copy(window_.begin() + 1, window_.end(), out.targets.begin() + static_cast<std::ptrdiff_t>(b * S));
    }
    if (static_cast<std::size_t>(++state_.batch_in_epoch) == batches_per_epoch_) {
      state_.batch_in_epoch = 0;
      ++state_.epoch;
    }
  }

 private:
  void ensure_permutation(std::int64_t epoch) {
    if (!o_.shuffle || perm_epoch_ == epoch) return;
    perm_ = epoch_permutation(windows_, o_.seed, epoch);
    perm_epoch_ = epoch;
  }

  std::vector<token_shard> shards_;
  loader_options o_;
  std::vector<std::uint64_t> first_window_;  // prefix sums of windows per shard
  std::size_t windows_ = 0, batches_per_epoch_ = 0;
  loader_state state_;
  std::vector<std::uint64_t> perm_;
  std::int64_t perm_epoch_ = -1;
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
