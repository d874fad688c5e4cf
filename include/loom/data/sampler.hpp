#pragma once
// Which sample each rank reads at each step: per-epoch shuffling and rank striding.
//
// Each epoch is a permutation of all n samples (Fisher-Yates driven by the counter-based
// RNG with stream = epoch: epoch e's order is a pure function of (seed, e), so resuming
// needs only (epoch, batch) and no generator state). Position p of the permutation goes to
// rank p % world (DistributedSampler's striding). An epoch has floor(n / (batch * world))
// batches per rank; the tail is dropped so every rank steps the same number of times.
// Consequence used by data-parallel tests: the union over ranks of their j-th batches of
// size b is exactly the j-th batch of size b * world of a one-rank run with the same seed.

#include <loom/core/error.hpp>
#include <loom/core/random.hpp>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace loom::data {

struct sampler_options {
  std::size_t batch = 8;  ///< this rank's micro-batch size
  std::uint64_t seed = 1234;
  bool shuffle = true;
  int rank = 0;
  int world = 1;
};

/// Position in the data stream; what a checkpoint stores to resume the data order exactly.
struct loader_state {
  std::int64_t epoch = 0;
  std::int64_t batch_in_epoch = 0;
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

class distributed_sampler {
 public:
  distributed_sampler() = default;
  /// `what` names the dataset in errors ("token_loader", "chat_loader").
  distributed_sampler(std::size_t n, sampler_options o, const char* what = "sampler") : n_(n), o_(o) {
    LOOM_CHECK(o.batch >= 1, what, ": batch must be >= 1, got batch=", o.batch);
    LOOM_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, what, ": need 0 <= rank < world, got rank=", o.rank,
               " world=", o.world);
    LOOM_CHECK(n > 0, what, ": empty dataset (no samples)");
    batches_per_epoch_ = n / (o.batch * static_cast<std::size_t>(o.world));
    LOOM_CHECK(batches_per_epoch_ > 0, what, ": empty dataset: ", n, " samples are fewer than one global batch of batch*world=",
               o.batch * static_cast<std::size_t>(o.world));
  }
  std::size_t size() const noexcept { return n_; }
  std::size_t batches_per_epoch() const noexcept { return batches_per_epoch_; }
  const sampler_options& options() const noexcept { return o_; }

  /// The sample this rank reads as element b of batch `s.batch_in_epoch` of epoch `s.epoch`.
  std::uint64_t sample(loader_state s, std::size_t b) {
    const std::size_t pos = (static_cast<std::size_t>(s.batch_in_epoch) * o_.batch + b) * static_cast<std::size_t>(o_.world) +
                            static_cast<std::size_t>(o_.rank);
    if (!o_.shuffle) return pos;
    if (perm_epoch_ != s.epoch) {
      perm_ = epoch_permutation(n_, o_.seed, s.epoch);
      perm_epoch_ = s.epoch;
    }
    return perm_[pos];
  }
  /// The state after s.
  loader_state advance(loader_state s) const noexcept {
    if (static_cast<std::size_t>(++s.batch_in_epoch) == batches_per_epoch_) s.batch_in_epoch = 0, ++s.epoch;
    return s;
  }
  void check_state(loader_state s, const char* what) const {
    LOOM_CHECK(s.epoch >= 0 && s.batch_in_epoch >= 0 && static_cast<std::size_t>(s.batch_in_epoch) < batches_per_epoch_, what,
               ": bad state epoch=", s.epoch, " batch_in_epoch=", s.batch_in_epoch, " (", batches_per_epoch_, " batches per epoch)");
  }

 private:
  std::size_t n_ = 0, batches_per_epoch_ = 0;
  sampler_options o_;
  std::vector<std::uint64_t> perm_;
  std::int64_t perm_epoch_ = -1;
};

}  // namespace loom::data
