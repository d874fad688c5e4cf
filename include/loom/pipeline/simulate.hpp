#pragma once
// The schedule simulator: runs a pipeline::schedule on a model of the machine and either proves
// it sound or says exactly what is wrong with it.
//
// Semantics. Each stage executes its ops in order, one at a time. Compute ops (forward,
// backward, optimizer step) take their cost. A send and a recv are blocking and rendezvous: a
// send completes only together with the matching recv on the peer (same kind, micro-batch and
// adjacent virtual stage), both stages are then busy for the communication cost. This is the
// strictest blocking semantics (MPI_Ssend, and what large messages get from MPI_Send): a
// schedule that runs here also runs when sends are buffered or asynchronous. Whether a
// schedule deadlocks does not depend on the costs (each stage's sequence is fixed, and an op
// completes only with its unique partner), so one simulation proves it for all costs.
//
// Checks. Every op's fields are in range and every send/recv names the right peer; each stage
// forwards and backwards every (micro-batch, chunk) exactly once, a forward only after its
// input activation arrived, a backward only after its forward and its output gradient, a send
// only after the pass that produced the tensor, the optimizer step once, after all backwards.
// A deadlock is reported with the op every unfinished stage is stuck at; nothing ever hangs.
//
// Report. Total time; per stage the busy time (compute ops; time in send/recv counts as idle)
// and the bubble fraction = idle / total time, the definition under which GPipe and 1F1B have
// (p-1)/(m+p-1); bubble_ratio() = idle / busy is Narayanan et al.'s "bubble time fraction"
// ((p-1)/m for 1F1B, (p-1)/(v m) interleaved). Peak in-flight activations per stage: the most
// (micro-batch, chunk) pairs forwarded and not yet backwarded at any time.
//
// Costs: op_costs.forward / .backward are the cost of a micro-batch through all the layers of
// one stage, so a chunk of an interleaved schedule costs forward / v and schedules with
// different v are compared on the same model.

#include <loom/core/error.hpp>
#include <loom/pipeline/schedule.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace loom::pipeline {

struct op_costs {
  double forward = 1;        ///< one micro-batch through all layers of a stage
  double backward = 2;       ///< the same, backward
  double communication = 0;  ///< one send/recv pair (both stages are busy for it)
  double optimizer = 0;      ///< the optimizer step of a stage
};

/// An op as it ran: [start, end) on its stage's clock.
struct timed_op {
  op o;
  double start = 0;
  double end = 0;
};

/// Where a stage stopped in a deadlock: the op at index `index` of its list.
struct stuck_op {
  int stage = 0;
  std::size_t index = 0;
  op o;
};

struct stage_result {
  std::vector<timed_op> timeline;  ///< the ops that ran, in order
  double busy = 0;                 ///< time in compute ops
  int peak_in_flight = 0;          ///< most (micro-batch, chunk) activations held at once
};

struct simulation {
  std::string name;
  int stages = 0, microbatches = 0, chunks = 1;
  bool deadlock = false;
  std::vector<stuck_op> stuck;        ///< when deadlocked: the op of every unfinished stage
  std::vector<std::string> problems;  ///< every violation found, in order (capped), deadlock included
  std::size_t problem_count = 0;      ///< all violations, including those not listed
  double total_time = 0;
  std::vector<stage_result> per_stage;

  /// True when the schedule is proven: no deadlock, every check passed.
  bool ok() const noexcept { return problem_count == 0; }
  /// idle / total time of stage s.
  double bubble_fraction(int s) const {
    LOOM_CHECK(s >= 0 && static_cast<std::size_t>(s) < per_stage.size(), "simulation::bubble_fraction: stage s=", s,
               " out of range [0, ", per_stage.size(), ") of the simulated stages");
    return total_time > 0 ? 1.0 - per_stage[static_cast<std::size_t>(s)].busy / total_time : 0.0;
  }
  /// Mean over stages of idle / total time.
  double bubble_fraction() const {
    double sum = 0;
    for (std::size_t s = 0; s < per_stage.size(); ++s) sum += bubble_fraction(static_cast<int>(s));
    return per_stage.empty() ? 0.0 : sum / static_cast<double>(per_stage.size());
  }
  /// Idle time over busy time, summed over stages (Narayanan et al.'s bubble time fraction).
  double bubble_ratio() const {
    double busy = 0;
    for (const auto& st : per_stage) busy += st.busy;
    return busy > 0 ? (total_time * static_cast<double>(per_stage.size()) - busy) / busy : 0.0;
  }
  /// A human-readable summary: verdict, problems, time, bubble and memory per stage.
  std::string report() const;
};

namespace detail {

/// Per-stage bookkeeping of what happened to each (micro-batch, chunk).
struct stage_state {
  std::size_t pc = 0;
  double free_at = 0;
  int in_flight = 0;
  int optimizer_steps = 0;
  // [microbatch * chunks + chunk] counts
  std::vector<int> fwd, bwd, act_in, grad_in, act_out, grad_out;
};

class simulator {
 public:
  simulator(const schedule& s, const op_costs& c) : s_(s), c_(c) {
    r_.name = s.name;
    r_.stages = s.stages;
    r_.microbatches = s.microbatches;
    r_.chunks = s.chunks;
  }

  simulation run() {
    if (!check_structure()) return std::move(r_);
    const std::size_t n = static_cast<std::size_t>(s_.microbatches) * static_cast<std::size_t>(s_.chunks);
    st_.assign(static_cast<std::size_t>(s_.stages), stage_state{});
    for (auto& st : st_) st.fwd = st.bwd = st.act_in = st.grad_in = st.act_out = st.grad_out = std::vector<int>(n, 0);
    r_.per_stage.assign(static_cast<std::size_t>(s_.stages), stage_result{});
    for (bool progress = true; progress;) {
      progress = false;
      for (int s = 0; s < s_.stages; ++s)
        while (step(s)) progress = true;
    }
    for (int s = 0; s < s_.stages; ++s) r_.total_time = std::max(r_.total_time, st(s).free_at);
    for (int s = 0; s < s_.stages; ++s)
      if (st(s).pc < ops(s).size()) r_.stuck.push_back({s, st(s).pc, ops(s)[st(s).pc]});
    if (!r_.stuck.empty()) {
      r_.deadlock = true;
      for (const auto& k : r_.stuck) {
        std::ostringstream os;
        os << "deadlock: stage " << k.stage << " is stuck at op #" << k.index << ' ' << k.o;
        if (is_send(k.o.kind) || is_recv(k.o.kind)) {
          const auto& peer = st(k.o.peer);
          os << "; stage " << k.o.peer;
          if (peer.pc < ops(k.o.peer).size())
            os << " is at op #" << peer.pc << ' ' << ops(k.o.peer)[peer.pc];
          else
            os << " has finished";
        }
        problem(os.str());
      }
    } else {
      check_complete();
    }
    return std::move(r_);
  }

 private:
  const std::vector<op>& ops(int s) const { return s_.ops[static_cast<std::size_t>(s)]; }
  stage_state& st(int s) { return st_[static_cast<std::size_t>(s)]; }
  std::size_t idx(const op& o) const {
    return static_cast<std::size_t>(o.microbatch) * static_cast<std::size_t>(s_.chunks) + static_cast<std::size_t>(o.chunk);
  }

  void problem(std::string text) {
    if (r_.problems.size() < 64) r_.problems.push_back(std::move(text));
    ++r_.problem_count;
  }
  template <class... Parts>
  void problem_at(int s, const op& o, Parts&&... parts) {
    std::ostringstream os;
    os << "stage " << s << ", op #" << st(s).pc << ' ' << o << ": ";
    (os << ... << parts);
    problem(os.str());
  }

  /// The stage at the other end of a send/recv of stage s, chunk c; -1 if there is none.
  int expected_peer(int s, const op& o) const {
    const int k = s_.virtual_stage(s, o.chunk);
    const bool towards_next = o.kind == op_kind::send_activation || o.kind == op_kind::recv_gradient;
    const int other = towards_next ? k + 1 : k - 1;
    return other >= 0 && other < s_.virtual_stages() ? s_.stage_of(other) : -1;
  }

  bool check_structure() {
    std::ostringstream head;
    if (s_.stages < 1 || s_.microbatches < 1 || s_.chunks < 1) {
      head << "schedule '" << s_.name << "': stages=" << s_.stages << ", microbatches=" << s_.microbatches
           << ", chunks=" << s_.chunks << " must all be >= 1";
      problem(head.str());
      return false;
    }
    if (s_.ops.size() != static_cast<std::size_t>(s_.stages)) {
      head << "schedule '" << s_.name << "': has op lists for " << s_.ops.size() << " stages, expected stages=" << s_.stages;
      problem(head.str());
      return false;
    }
    const std::size_t before = r_.problem_count;
    for (int s = 0; s < s_.stages; ++s)
      for (std::size_t i = 0; i < ops(s).size(); ++i) {
        const op& o = ops(s)[i];
        std::ostringstream os;
        os << "stage " << s << ", op #" << i << ' ' << o << ": ";
        if (o.kind > op_kind::optimizer_step) {
          os << "unknown op kind " << static_cast<int>(o.kind);
        } else if (s_.forward_only && o.kind != op_kind::forward && o.kind != op_kind::send_activation &&
                   o.kind != op_kind::recv_activation) {
          os << "a forward-only schedule has no backward, gradient transfer or optimizer step";
        } else if (o.kind == op_kind::optimizer_step) {
          continue;
        } else if (o.microbatch < 0 || o.microbatch >= s_.microbatches) {
          os << "micro-batch out of range [0, " << s_.microbatches << ")";
        } else if (o.chunk < 0 || o.chunk >= s_.chunks) {
          os << "chunk out of range [0, " << s_.chunks << ")";
        } else if (is_compute(o.kind)) {
          continue;
        } else if (const int want = expected_peer(s, o); want < 0) {
          os << "virtual stage " << s_.virtual_stage(s, o.chunk) << " has no "
             << (o.kind == op_kind::send_activation || o.kind == op_kind::recv_gradient ? "next" : "previous")
             << " virtual stage to exchange with";
        } else if (want == s) {
          os << "a single stage hands tensors between its chunks locally, without send/recv";
        } else if (o.peer != want) {
          os << "peer should be stage " << want;
        } else {
          continue;
        }
        problem(os.str());
      }
    return r_.problem_count == before;
  }

  void record(int s, const op& o, double start, double end) {
    auto& res = r_.per_stage[static_cast<std::size_t>(s)];
    res.timeline.push_back({o, start, end});
    if (is_compute(o.kind)) res.busy += end - start;
    st(s).free_at = end;
    ++st(s).pc;
  }

  /// Runs the op at stage s's pc if it can run now; false if the stage is finished or blocked.
  bool step(int s) {
    stage_state& me = st(s);
    if (me.pc >= ops(s).size()) return false;
    const op& o = ops(s)[me.pc];
    const double per_chunk = 1.0 / s_.chunks;
    if (is_compute(o.kind)) {
      double cost = c_.optimizer;
      if (o.kind == op_kind::forward) cost = c_.forward * per_chunk;
      if (o.kind == op_kind::backward) cost = c_.backward * per_chunk;
      check_compute(s, o);
      record(s, o, me.free_at, me.free_at + cost);
      return true;
    }
    // A send or recv: runs together with the peer's op if that is its partner.
    const int q = o.peer;
    stage_state& other = st(q);
    if (other.pc >= ops(q).size()) return false;
    const op& p = ops(q)[other.pc];
    const bool i_send = is_send(o.kind);
    const op& snd = i_send ? o : p;
    const op& rcv = i_send ? p : o;
    const int from = i_send ? s : q, to = i_send ? q : s;
    const bool pair_kind = (snd.kind == op_kind::send_activation && rcv.kind == op_kind::recv_activation) ||
                           (snd.kind == op_kind::send_gradient && rcv.kind == op_kind::recv_gradient);
    if (!pair_kind || p.peer != s || snd.microbatch != rcv.microbatch) return false;
    const int k_from = s_.virtual_stage(from, snd.chunk), k_to = s_.virtual_stage(to, rcv.chunk);
    if (k_to != (snd.kind == op_kind::send_activation ? k_from + 1 : k_from - 1)) return false;
    check_send(from, snd);
    check_recv(to, rcv);
    const double start = std::max(me.free_at, other.free_at), end = start + c_.communication;
    record(s, o, start, end);
    record(q, p, start, end);
    return true;
  }

  void check_compute(int s, const op& o) {
    stage_state& me = st(s);
    if (o.kind == op_kind::optimizer_step) {
      if (me.optimizer_steps++ > 0) problem_at(s, o, "a second optimizer step");
      for (int mb = 0; mb < s_.microbatches; ++mb)
        for (int c = 0; c < s_.chunks; ++c)
          if (me.bwd[idx(op{op_kind::backward, mb, c, -1})] == 0) {
            problem_at(s, o, "runs before backward(mb ", mb, ", chunk ", c, ")");
            return;
          }
      return;
    }
    const std::size_t i = idx(o);
    const int k = s_.virtual_stage(s, o.chunk);
    if (o.kind == op_kind::forward) {
      if (me.fwd[i]++ > 0) problem_at(s, o, "micro-batch forwarded a second time");
      if (k > 0 && s_.stages > 1 && me.act_in[i] == 0) problem_at(s, o, "runs before its input activation was received");
      if (k > 0 && s_.stages == 1 && me.fwd[i - 1] == 0) problem_at(s, o, "runs before the forward of the previous chunk");
      if (++me.in_flight > r_.per_stage[static_cast<std::size_t>(s)].peak_in_flight)
        r_.per_stage[static_cast<std::size_t>(s)].peak_in_flight = me.in_flight;
    } else {
      if (me.fwd[i] == 0) problem_at(s, o, "runs before the forward of this micro-batch");
      if (me.bwd[i]++ > 0) problem_at(s, o, "micro-batch backwarded a second time");
      if (k + 1 < s_.virtual_stages() && s_.stages > 1 && me.grad_in[i] == 0)
        problem_at(s, o, "runs before its output gradient was received");
      if (k + 1 < s_.virtual_stages() && s_.stages == 1 && me.bwd[i + 1] == 0)
        problem_at(s, o, "runs before the backward of the next chunk");
      if (me.optimizer_steps > 0) problem_at(s, o, "runs after the optimizer step");
      --me.in_flight;
    }
  }

  void check_send(int s, const op& o) {
    stage_state& me = st(s);
    const std::size_t i = idx(o);
    if (o.kind == op_kind::send_activation) {
      if (me.fwd[i] == 0) problem_at(s, o, "sends an activation its forward has not produced");
      if (me.act_out[i]++ > 0) problem_at(s, o, "activation sent a second time");
    } else {
      if (me.bwd[i] == 0) problem_at(s, o, "sends a gradient its backward has not produced");
      if (me.grad_out[i]++ > 0) problem_at(s, o, "gradient sent a second time");
    }
  }

  void check_recv(int s, const op& o) {
    stage_state& me = st(s);
    auto& count = o.kind == op_kind::recv_activation ? me.act_in[idx(o)] : me.grad_in[idx(o)];
    if (count++ > 0) problem_at(s, o, "received a second time");
  }

  void check_complete() {
    for (int s = 0; s < s_.stages; ++s) {
      stage_state& me = st(s);
      for (int mb = 0; mb < s_.microbatches; ++mb)
        for (int c = 0; c < s_.chunks; ++c) {
          const std::size_t i = idx(op{op_kind::forward, mb, c, -1});
          const int k = s_.virtual_stage(s, c);
          std::ostringstream os;
          os << "stage " << s << ": micro-batch " << mb << ", chunk " << c;
          if (me.fwd[i] == 0) problem(os.str() + " is never forwarded");
          if (!s_.forward_only && me.bwd[i] == 0) problem(os.str() + " is never backwarded");
          if (s_.stages == 1) continue;  // chunks of a single stage hand over locally
          if (k + 1 < s_.virtual_stages() && me.act_out[i] == 0) problem(os.str() + ": its activation is never sent");
          if (!s_.forward_only && k > 0 && me.grad_out[i] == 0) problem(os.str() + ": its input gradient is never sent");
        }
      if (!s_.forward_only && me.optimizer_steps == 0)
        problem("stage " + std::to_string(s) + " never runs the optimizer step");
    }
  }

  const schedule& s_;
  op_costs c_;
  simulation r_;
  std::vector<stage_state> st_;
};

}  // namespace detail

/// Simulates `s` with the given costs (all >= 0 and finite); never throws on a bad schedule:
/// what is wrong is in the result's problems.
inline simulation simulate(const schedule& s, const op_costs& costs = {}) {
  for (const auto& [name, value] : {std::pair{"forward", costs.forward}, std::pair{"backward", costs.backward},
                                    std::pair{"communication", costs.communication}, std::pair{"optimizer", costs.optimizer}})
    LOOM_CHECK(std::isfinite(value) && value >= 0, "simulate: cost ", name, "=", value, " must be finite and >= 0");
  return detail::simulator(s, costs).run();
}

/// Throws loom::error with the simulation report unless `s` is proven sound.
inline simulation prove(const schedule& s, const op_costs& costs = {}) {
  simulation r = simulate(s, costs);
  LOOM_CHECK(r.ok(), "pipeline schedule '", s.name, "' is not sound:\n", r.report());
  return r;
}

inline std::string simulation::report() const {
  std::ostringstream os;
  os << "schedule " << name << ": p=" << stages << " stages, m=" << microbatches << " micro-batches";
  if (chunks > 1) os << ", v=" << chunks << " chunks per stage";
  os << '\n';
  if (ok()) {
    os << "proven: deadlock-free under blocking send/recv; every micro-batch forwarded and backwarded once per "
          "stage in dependency order\n";
  } else {
    os << (deadlock ? "DEADLOCK" : "INVALID") << ": " << problem_count << " problem(s)\n";
    for (const auto& p : problems) os << "  " << p << '\n';
    if (problems.size() < problem_count) os << "  ... and " << problem_count - problems.size() << " more\n";
    if (deadlock || per_stage.empty()) return os.str();
  }
  os << "total time " << total_time << ", bubble fraction (idle/total) " << bubble_fraction() << ", bubble/busy "
     << bubble_ratio() << '\n';
  os << "stage  busy      bubble    peak in-flight activations\n";
  for (int s = 0; s < stages; ++s) {
    const auto& st = per_stage[static_cast<std::size_t>(s)];
    char line[96];
    std::snprintf(line, sizeof line, "%5d  %-8g  %-8.4f  %d\n", s, st.busy, bubble_fraction(s), st.peak_in_flight);
    os << line;
  }
  return os.str();
}

}  // namespace loom::pipeline
