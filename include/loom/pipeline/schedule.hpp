#pragma once
// Pipeline schedules as data: for every stage, the ordered list of operations it performs in
// one training step (forward / backward of a micro-batch on one of its model chunks, send /
// receive of an activation or a gradient, the optimizer step).
//
// Why data and not code: a schedule written as control flow (Megatron's schedules.py) can only
// be tested by running it, and a wrong send/recv order shows up as a hang at scale. As data, a
// schedule is built on the host, proven by the simulator (pipeline/simulate.hpp) and drawn
// (pipeline/render.hpp) before the executor (pipeline/executor.hpp) runs it op by op.
//
// Layout of the model. The model's layers are cut into p * v consecutive pieces, the virtual
// stages k = 0 .. p*v-1. Stage s holds the v chunks k = c*p + s (c = 0 .. v-1), as in the
// interleaved schedule of Narayanan et al. 2021; v = 1 is the ordinary pipeline. Activations
// flow k -> k+1, gradients k+1 -> k. Stages are the ranks of the pipeline group.
//
// How the generators work. Each generator states only what makes the schedule what it is: the
// order of forward and backward passes on every stage (GPipe: all forwards, then all
// backwards; 1F1B: p-s-1 warm-up forwards, then one forward / one backward; interleaved: the
// Megatron-LM order over chunks). The send/recv operations are then placed by one function,
// add_communication(): it times the compute order with unit costs, gives every transfer a time
// at which both of its stages are between compute ops (after the producer, before the
// consumer), and inserts the send and the matching recv at that time on both stages, ties
// broken by one global key. Every stage therefore meets its peers in one global
// order of transfers, which makes the schedule deadlock-free under blocking (rendezvous)
// send/recv by construction; the simulator checks it independently.
//
// Micro-batches, stages and chunks are numbered from 0. With p = 1 and v > 1 consecutive
// chunks live on the same stage: their tensors are handed over locally, without send/recv.

#include <loom/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace loom::pipeline {

enum class op_kind : std::uint8_t {
  forward,          ///< forward pass of `microbatch` through local chunk `chunk`
  backward,         ///< backward pass of `microbatch` through local chunk `chunk`
  send_activation,  ///< send the output of forward(microbatch, chunk) to stage `peer`
  recv_activation,  ///< receive the input of forward(microbatch, chunk) from stage `peer`
  send_gradient,    ///< send the input gradient of backward(microbatch, chunk) to stage `peer`
  recv_gradient,    ///< receive the output gradient of backward(microbatch, chunk) from stage `peer`
  optimizer_step,   ///< apply the gradients accumulated over all micro-batches
};

constexpr std::string_view op_kind_name(op_kind k) noexcept {
  switch (k) {
    case op_kind::forward: return "forward";
    case op_kind::backward: return "backward";
    case op_kind::send_activation: return "send_activation";
    case op_kind::recv_activation: return "recv_activation";
    case op_kind::send_gradient: return "send_gradient";
    case op_kind::recv_gradient: return "recv_gradient";
    case op_kind::optimizer_step: return "optimizer_step";
  }
  return "unknown";
}

constexpr bool is_compute(op_kind k) noexcept {
  return k == op_kind::forward || k == op_kind::backward || k == op_kind::optimizer_step;
}
constexpr bool is_send(op_kind k) noexcept { return k == op_kind::send_activation || k == op_kind::send_gradient; }
constexpr bool is_recv(op_kind k) noexcept { return k == op_kind::recv_activation || k == op_kind::recv_gradient; }

/// One operation of a stage. For send/recv, `chunk` is the local chunk the tensor belongs to
/// (the producer of a sent tensor, the consumer of a received one) and `peer` the other stage.
struct op {
  op_kind kind = op_kind::forward;
  int microbatch = -1;  ///< -1 for optimizer_step
  int chunk = 0;
  int peer = -1;  ///< -1 unless send/recv
  friend bool operator==(const op&, const op&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const op& o) {
  os << op_kind_name(o.kind);
  if (o.kind == op_kind::optimizer_step) return os;
  os << "(mb " << o.microbatch << ", chunk " << o.chunk;
  if (is_send(o.kind)) os << ", to stage " << o.peer;
  if (is_recv(o.kind)) os << ", from stage " << o.peer;
  return os << ')';
}

inline std::string to_string(const op& o) {
  std::ostringstream os;
  os << o;
  return os.str();
}

/// A pipeline schedule: p stages, m micro-batches, v chunks per stage, and per stage its ops.
struct schedule {
  std::string name;
  int stages = 0;        ///< p: ranks of the pipeline group
  int microbatches = 0;  ///< m: micro-batches per training step
  int chunks = 1;        ///< v: model chunks per stage (virtual pipeline size)
  std::vector<std::vector<op>> ops;  ///< [stage] -> operations in execution order
  /// An evaluation pass: forwards only (no backward, no gradient transfers, no optimizer step).
  bool forward_only = false;

  int virtual_stages() const noexcept { return stages * chunks; }
  /// Position in the model of chunk `chunk` of stage `stage`.
  int virtual_stage(int stage, int chunk) const noexcept { return chunk * stages + stage; }
  int stage_of(int virtual_stage) const noexcept { return virtual_stage % stages; }
  int chunk_of(int virtual_stage) const noexcept { return virtual_stage / stages; }
};

namespace detail {

/// A compute op in a generator's order: forward or backward of (microbatch, chunk).
struct compute_step {
  bool backward = false;
  int microbatch = 0;
  int chunk = 0;
};

/// The op list of every stage: the given compute order with send/recv inserted so that all
/// stages meet in one global order of transfers (see the file comment), then the optimizer step.
// Every transfer gets a time at which both of its stages are idle in the unit-cost timing, so
// that blocking send/recv adds no waiting to it.
inline schedule add_communication(std::string name, int p, int m, int v,
                                  const std::vector<std::vector<compute_step>>& order, bool forward_only = false) {
  schedule out{std::move(name), p, m, v, std::vector<std::vector<op>>(static_cast<std::size_t>(p)), forward_only};
  const int V = p * v;
  const auto slot = [&](int mb, int k) { return static_cast<std::size_t>(mb) * static_cast<std::size_t>(V) + static_cast<std::size_t>(k); };
  // Time the compute order with forward 1, backward 2 and instant transfers (an integer grid:
  // the comparisons below are exact). *_end / *_start: -1 until done.
  const std::size_t n = static_cast<std::size_t>(m) * static_cast<std::size_t>(V);
  std::vector<long> fwd_start(n, -1), fwd_end(n, -1), bwd_start(n, -1), bwd_end(n, -1);
  std::vector<std::vector<long>> start(static_cast<std::size_t>(p));
  // [stage] -> the intervals [lo, hi] in which the stage is between two compute ops
  std::vector<std::vector<std::pair<long, long>>> idle(static_cast<std::size_t>(p), {{0L, 0L}});
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      auto& i = next[static_cast<std::size_t>(s)];
      auto& gaps = idle[static_cast<std::size_t>(s)];
      const auto& ord = order[static_cast<std::size_t>(s)];
      while (i < ord.size()) {
        const compute_step& c = ord[i];
        const int k = c.chunk * p + s;
        long ready = 0;
        if (!c.backward && k > 0) ready = fwd_end[slot(c.microbatch, k - 1)];
        if (c.backward) ready = k + 1 < V ? bwd_end[slot(c.microbatch, k + 1)] : fwd_end[slot(c.microbatch, k)];
        if (ready < 0) break;
        const long t0 = std::max(ready, gaps.back().first);
        const long t1 = t0 + (c.backward ? 2 : 1);
        (c.backward ? bwd_start : fwd_start)[slot(c.microbatch, k)] = t0;
        (c.backward ? bwd_end : fwd_end)[slot(c.microbatch, k)] = t1;
        start[static_cast<std::size_t>(s)].push_back(t0);
        gaps.back().second = t0;
        gaps.push_back({t1, t1});
        ++i;
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    LOOM_CHECK(next[static_cast<std::size_t>(s)] == order[static_cast<std::size_t>(s)].size(),
               "pipeline: schedule '", out.name, "' has a compute order that cannot run: stage ", s, " stops at step ",
               next[static_cast<std::size_t>(s)], " (p=", p, ", m=", m, ", v=", v, ")");
    idle[static_cast<std::size_t>(s)].back().second = std::numeric_limits<long>::max();
  }
  // A transfer produced at `ready` on stage a and consumed at `needed` on stage b happens at the
  // earliest moment in [ready, needed] at which both stages are between compute ops, so that
  // neither waits for the other; if there is none, just before the consumer.
  const auto meet = [&](int a, int b, long ready, long needed) {
    const auto& fa = idle[static_cast<std::size_t>(a)];
    const auto& fb = idle[static_cast<std::size_t>(b)];
    // Intervals are sorted and disjoint: start at the first one of each that ends at or after `ready`.
    const auto first_after = [&](const std::vector<std::pair<long, long>>& f) {
      return static_cast<std::size_t>(
          std::partition_point(f.begin(), f.end(), [&](const std::pair<long, long>& g) { return g.second < ready; }) -
          f.begin());
    };
    for (std::size_t i = first_after(fa), j = first_after(fb); i < fa.size() && j < fb.size();) {
      const long lo = std::max({fa[i].first, fb[j].first, ready}), hi = std::min(fa[i].second, fb[j].second);
      if (lo > needed) break;
      if (lo <= hi) return lo;
      (fa[i].second < fb[j].second ? i : j)++;
    }
    return needed;
  };

  // Every op gets a sort key (time, comm-before-compute, global id); each stage sorts its ops.
  using key = std::tuple<long, int, long>;
  std::vector<std::vector<std::pair<key, op>>> keyed(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    const auto& ord = order[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < ord.size(); ++i) {
      const compute_step& c = ord[i];
      const int k = c.chunk * p + s;
      keyed[static_cast<std::size_t>(s)].push_back(
          {key{start[static_cast<std::size_t>(s)][i], 1, static_cast<long>(i)},
           op{c.backward ? op_kind::backward : op_kind::forward, c.microbatch, c.chunk, -1}});
      // Both ends of a transfer get the same key.
      const bool sends = c.backward ? k > 0 : k + 1 < V;
      if (!sends) continue;
      const int to = c.backward ? k - 1 : k + 1;
      const int peer = to % p;
      if (peer == s) continue;  // p == 1: consecutive chunks hand over locally, no transfer
      const long t = meet(s, peer, (c.backward ? bwd_end : fwd_end)[slot(c.microbatch, k)],
                          (c.backward ? bwd_start : fwd_start)[slot(c.microbatch, to)]);
      const long id = (static_cast<long>(slot(c.microbatch, k)) << 1) | (c.backward ? 1 : 0);
      keyed[static_cast<std::size_t>(s)].push_back(
          {key{t, 0, id}, op{c.backward ? op_kind::send_gradient : op_kind::send_activation, c.microbatch, c.chunk, peer}});
      keyed[static_cast<std::size_t>(peer)].push_back(
          {key{t, 0, id}, op{c.backward ? op_kind::recv_gradient : op_kind::recv_activation, c.microbatch, to / p, s}});
    }
  }
  for (int s = 0; s < p; ++s) {
    auto& ks = keyed[static_cast<std::size_t>(s)];
    std::sort(ks.begin(), ks.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    auto& ops = out.ops[static_cast<std::size_t>(s)];
    ops.reserve(ks.size() + 1);
    for (const auto& [k, o] : ks) ops.push_back(o);
    if (!forward_only) ops.push_back(op{op_kind::optimizer_step, -1, 0, -1});
  }
  return out;
}

inline void check_sizes(const char* generator, int p, int m) {
  LOOM_CHECK(p >= 1, generator, ": number of stages p=", p, " must be >= 1");
  LOOM_CHECK(m >= 1, generator, ": number of micro-batches m=", m, " must be >= 1");
}

}  // namespace detail

/// GPipe (Huang et al. 2019): every stage runs the forward of all m micro-batches, then their
/// backward. Peak in-flight activations: m on every stage.
inline schedule gpipe(int p, int m) {
  detail::check_sizes("gpipe", p, m);
  std::vector<std::vector<detail::compute_step>> order(static_cast<std::size_t>(p));
  for (auto& ord : order) {
    for (int i = 0; i < m; ++i) ord.push_back({false, i, 0});
    for (int i = 0; i < m; ++i) ord.push_back({true, i, 0});
  }
  return detail::add_communication("gpipe", p, m, 1, order);
}

/// Evaluation (forward-only inference over the pipeline): every stage runs the forwards of its
/// chunks, chunk by chunk and micro-batch by micro-batch in order, with the activation
/// transfers between them; no backward, no optimizer step. v: chunks per stage, as the
/// training schedule of the same model has them.
inline schedule forward_only(int p, int m, int v = 1) {
  detail::check_sizes("forward_only", p, m);
  LOOM_CHECK(v >= 1, "pipeline::forward_only: chunks v=", v, " must be >= 1");
  std::vector<std::vector<detail::compute_step>> order(static_cast<std::size_t>(p));
  for (auto& ord : order)
    for (int c = 0; c < v; ++c)
      for (int i = 0; i < m; ++i) ord.push_back({false, i, c});
  return detail::add_communication("forward_only", p, m, v, order, true);
}

/// 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs min(p-s-1, m) warm-up forwards,
/// then alternates one forward and one backward, then drains the remaining backwards. Same
/// bubble as GPipe, but at most min(p-s, m) micro-batches in flight on stage s.
inline schedule one_f_one_b(int p, int m) {
  detail::check_sizes("one_f_one_b", p, m);
  std::vector<std::vector<detail::compute_step>> order(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& ord = order[static_cast<std::size_t>(s)];
    const int warmup = std::min(p - s - 1, m);
    for (int i = 0; i < warmup; ++i) ord.push_back({false, i, 0});
    for (int i = 0; i < m - warmup; ++i) {
      ord.push_back({false, warmup + i, 0});
      ord.push_back({true, i, 0});
    }
    for (int i = m - warmup; i < m; ++i) ord.push_back({true, i, 0});
  }
  return detail::add_communication("1f1b", p, m, 1, order);
}

/// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each stage holds v model chunks and
/// runs the m*v (micro-batch, chunk) passes in groups of p micro-batches per chunk (backwards
/// walk the chunks in reverse), which divides the bubble by v at the price of v times more
/// point-to-point transfers. Needs m to be a multiple of p. Stage s runs p-s-1 + (v-1)p warm-up
/// forwards, so at most min(vp - s, vm) chunk activations are in flight. (Megatron-LM warms up
/// with 2(p-s-1) + (v-1)p; with transfers placed by add_communication the smaller warm-up has
/// the same bubble and holds p-s-1 fewer activations, see docs/pipeline.md.) With v = 1 this is
/// exactly one_f_one_b(p, m).
inline schedule interleaved_one_f_one_b(int p, int m, int v) {
  detail::check_sizes("interleaved_one_f_one_b", p, m);
  LOOM_CHECK(v >= 1, "interleaved_one_f_one_b: number of chunks per stage v=", v, " must be >= 1");
  LOOM_CHECK(m % p == 0, "interleaved_one_f_one_b: number of micro-batches m=", m,
             " must be a multiple of the number of stages p=", p);
  const int total = m * v;
  // The j-th forward (backward) on every stage: micro-batches in groups of p, chunk by chunk
  // (backwards walk the chunks in reverse).
  const auto step = [&](int j, bool backward) {
    const int group = j / (p * v), in_group = j % (p * v);
    const int c = in_group / p;
    return detail::compute_step{backward, group * p + j % p, backward ? v - 1 - c : c};
  };
  std::vector<std::vector<detail::compute_step>> order(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& ord = order[static_cast<std::size_t>(s)];
    const int warmup = std::min((p - s - 1) + (v - 1) * p, total);
    for (int j = 0; j < warmup; ++j) ord.push_back(step(j, false));
    for (int j = 0; j < total - warmup; ++j) {
      ord.push_back(step(warmup + j, false));
      ord.push_back(step(j, true));
    }
    for (int j = total - warmup; j < total; ++j) ord.push_back(step(j, true));
  }
  return detail::add_communication("interleaved", p, m, v, order);
}

}  // namespace loom::pipeline
