// Stage-3 all-gather plan and scheduler: the plan's invariants are re-derived here by
// replaying it independently; the executor runs on thread ranks and is checked for the
// gathered values (against the unsharded parameters), the order of collectives, the
// prefetch depth, the live-element cap and that every gathered copy is released.
#include <loom/sched/all_gather_plan.hpp>
#include <loom/sched/all_gather_scheduler.hpp>

#include <loom/comm/thread_comm.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <vector>

using namespace loom::sched;

namespace {

layer_layout make_layout(const std::vector<std::size_t>& numel, const std::vector<std::size_t>& layer, std::size_t world) {
  return layer_layout(numel, layer, world);
}

// Independent replay: per step, live and ahead-of-use elements right after acquire.
void check_plan_invariants(const layer_layout& lay, const all_gather_plan& p, bool default_trace = true) {
  const std::size_t T = p.trace.size(), L = lay.layers();
  if (default_trace) REQUIRE(T == 2 * L);
  for (std::size_t t = 0; default_trace && t < L; ++t) {
    CHECK(p.trace[t].layer == t);
    CHECK(p.trace[t].phase == pass::forward);
    CHECK(p.trace[T - 1 - t].layer == t);
    CHECK(p.trace[T - 1 - t].phase == pass::backward);
  }
  for (std::size_t t = 0; t < T; ++t) {
    // issued instances by the end of acquire(t): those with issue_step <= t
    std::size_t live = 0, ahead = 0;
    for (std::size_t k = 0; k < p.instances.size(); ++k) {
      const gather_instance& g = p.instances[k];
      CHECK(g.issue_step <= g.first_step);
      if (g.issue_step <= t && g.last_step >= t) {
        live += g.numel;
        if (g.first_step > t) ahead += g.numel;
      }
      for (std::size_t j = k + 1; j < p.instances.size(); ++j) {  // no two live copies overlap in the arena
        const gather_instance& h = p.instances[j];
        const bool both_live = g.issue_step <= t && g.last_step >= t && h.issue_step <= t && h.last_step >= t;
        if (both_live)
          CHECK((g.arena_offset + g.numel <= h.arena_offset || h.arena_offset + h.numel <= g.arena_offset));
      }
      CHECK(g.arena_offset + g.numel <= p.arena_numel);
    }
    CHECK(live <= p.options.max_live_numel);
    CHECK(ahead <= p.options.prefetch_numel);
    const std::ptrdiff_t k = p.instance_at[t];
    if (p.layer_gather_numel[p.trace[t].layer] > 0) {
      REQUIRE(k >= 0);
      CHECK(p.instances[k].layer == p.trace[t].layer);
      CHECK(p.instances[k].first_step <= t);
      CHECK(p.instances[k].last_step >= t);
    } else {
      CHECK(k == -1);
    }
  }
  for (std::size_t par = 0; par < lay.params(); ++par)
    CHECK(bool(p.persistent[par]) == (lay.numel(par) <= p.options.persistence_threshold));
}

}  // namespace

TEST_CASE("all_gather plan: hand-checked prefetch and release schedule") {
  // 4 layers of 100 elements (world 1 keeps the numbers plain)
  const auto lay = make_layout({100, 100, 100, 100}, {0, 1, 2, 3}, 1);
  all_gather_options o;
  o.prefetch_numel = 100;
  o.max_live_numel = 300;
  o.persistence_threshold = 0;
  const all_gather_plan p = plan_all_gather(lay, o);
  check_plan_invariants(lay, p);
  // trace: f0 f1 f2 f3 b3 b2 b1 b0; f3+b3 share one instance -> 7 instances
  REQUIRE(p.instances.size() == 7);
  CHECK(p.instances[3].first_step == 3);
  CHECK(p.instances[3].last_step == 4);
  // instance 0 on demand at step 0, then one instance (100 elements) ahead at a time
  CHECK_FALSE(p.instances[0].prefetched);
  for (std::size_t k = 1; k < 7; ++k) {
    CHECK(p.instances[k].prefetched);
    CHECK(p.instances[k].issue_step == p.instances[k - 1].first_step);
  }
  CHECK(p.peak_live_numel == 200);
  CHECK(p.arena_numel == 200);

  o.prefetch_numel = 0;  // no prefetch: everything on demand, one layer live
  const all_gather_plan q = plan_all_gather(lay, o);
  check_plan_invariants(lay, q);
  for (const gather_instance& g : q.instances) CHECK_FALSE(g.prefetched);
  CHECK(q.peak_live_numel == 100);

  o.prefetch_numel = 1000;  // deep prefetch, capped by max_live = 300
  const all_gather_plan r = plan_all_gather(lay, o);
  check_plan_invariants(lay, r);
  CHECK(r.peak_live_numel == 300);
  CHECK(r.instances[2].issue_step == 0);
  CHECK(r.instances[3].issue_step == 1);
}

TEST_CASE("all_gather plan: a given trace (a pipeline stage's passes) shares a copy only between consecutive uses") {
  // 3 layers of 100; two micro-batches, each forward 0 1 2 then backward 2 1 0 (1F1B on one
  // stage): by hand, consecutive uses of a layer (f2 b2, b0 f0 of the next micro-batch, ...)
  // share one copy: instances {0} {1} {2,3} {4} {5,6} {7} {8,9} {10} {11}.
  const auto lay = make_layout({100, 100, 100}, {0, 1, 2}, 2);
  std::vector<trace_step> trace;
  for (int mb = 0; mb < 2; ++mb) {
    for (std::size_t l : {0, 1, 2}) trace.push_back({l, pass::forward});
    for (std::size_t l : {2, 1, 0}) trace.push_back({l, pass::backward});
  }
  all_gather_options o;
  o.prefetch_numel = 100;
  o.persistence_threshold = 0;
  const all_gather_plan p = plan_all_gather(lay, trace, o);
  check_plan_invariants(lay, p, false);
  REQUIRE(p.instances.size() == 9);
  const std::vector<std::pair<std::size_t, std::size_t>> spans = {{0, 0}, {1, 1}, {2, 3}, {4, 4}, {5, 6},
                                                                   {7, 7}, {8, 9}, {10, 10}, {11, 11}};
  for (std::size_t k = 0; k < spans.size(); ++k) {
    CAPTURE(k);
    CHECK(p.instances[k].first_step == spans[k].first);
    CHECK(p.instances[k].last_step == spans[k].second);
    CHECK(p.instances[k].layer == trace[spans[k].first].layer);
  }
  CHECK(p.peak_live_numel == 200);  // the copy in use and one prefetched
  CHECK_THROWS_WITH_AS(plan_all_gather(lay, {{3, pass::forward}}, o), doctest::Contains("uses layer 3 of a model with 3 layers"),
                       loom::error);
  CHECK_THROWS_WITH_AS(plan_all_gather(lay, {}, o), doctest::Contains("trace of layer uses is empty"), loom::error);
}

TEST_CASE("all_gather plan: persistent parameters are not gathered; limits are errors") {
  // layers: [w 64, b 8], [w 64, b 8], [norm 8]
  const auto lay = make_layout({64, 8, 64, 8, 8}, {0, 0, 1, 1, 2}, 4);
  all_gather_options o;
  o.persistence_threshold = 8;
  o.prefetch_numel = 64;
  o.max_live_numel = 128;
  const all_gather_plan p = plan_all_gather(lay, o);
  check_plan_invariants(lay, p);
  CHECK(p.persistent_numel == 24);
  CHECK(p.layer_gather_numel[0] == 64);
  CHECK(p.layer_gather_numel[2] == 0);
  CHECK(p.instance_at[2] == -1);  // f2: norm only
  CHECK(p.instance_at[3] == -1);  // b2

  o.max_live_numel = 63;
  CHECK_THROWS_WITH_AS(plan_all_gather(lay, o), doctest::Contains("stage3_max_live_parameters=63"), loom::error);
}

TEST_CASE("all_gather plan: invariants over a sweep of layouts and limits") {
  for (std::size_t world : {1, 2, 4})
    for (std::size_t pref : {0, 50, 130, 400, 100000})
      for (std::size_t live : {170, 300, 1000}) {
        const auto lay = make_layout({96, 7, 33, 128, 5, 1, 64, 64, 20}, {0, 0, 1, 1, 2, 2, 3, 4, 5}, world);
        all_gather_options o{pref, live, 7};
        const all_gather_plan p = plan_all_gather(lay, o);
        check_plan_invariants(lay, p);
      }
}

namespace {

// Counts what the executor does and checks the limits as it runs.
struct recording_observer : loom::sched::gather_observer {
  std::mutex m;
  std::size_t live = 0, peak_live = 0, ahead = 0, peak_ahead = 0, issues = 0, releases = 0;
  std::vector<std::size_t> ready_layers;
  std::vector<unsigned char> started;
  void on_issue(std::size_t, const gather_instance& g, std::size_t step) override {
    std::lock_guard lk(m);
    ++issues;
    live += g.numel;
    if (g.first_step > step) ahead += g.numel;
    peak_live = std::max(peak_live, live);
    peak_ahead = std::max(peak_ahead, ahead);
  }
  void on_ready(std::size_t, const gather_instance& g, std::size_t step) override {
    std::lock_guard lk(m);
    if (g.first_step > step) return;
    if (g.issue_step < step) ahead -= g.numel;  // was prefetched
    ready_layers.push_back(g.layer);
  }
  void on_release(std::size_t, const gather_instance& g, std::size_t) override {
    std::lock_guard lk(m);
    ++releases;
    live -= g.numel;
  }
};

// Wraps a communicator and logs which parameter each all_gather fetches (by shard offset).
template <class C>
struct logging_comm {
  C* c;
  std::vector<std::size_t>* log = nullptr;
  const float* shard_base = nullptr;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class T>
  loom::comm::work all_gather_async(std::span<const T> in, std::span<T> out) {
    log->push_back(static_cast<std::size_t>(in.data() - shard_base));
    return c->all_gather_async(in, out);
  }
  template <class T> void all_gather(std::span<const T> in, std::span<T> out) { c->all_gather(in, out); }
  template <class T> void reduce_scatter(std::span<const T> in, std::span<T> out, loom::comm::reduce_op op) { c->reduce_scatter(in, out, op); }
  template <class T> void all_reduce(std::span<const T> in, std::span<T> out, loom::comm::reduce_op op) { c->all_reduce(in, out, op); }
  template <class T> void broadcast(std::span<T> b, int root) { c->broadcast(b, root); }
  template <class T> void send(std::span<const T> in, int p, int t) { c->send(in, p, t); }
  template <class T> void recv(std::span<T> out, int p, int t) { c->recv(out, p, t); }
  void barrier() { c->barrier(); }
  template <class T> loom::comm::work reduce_scatter_async(std::span<const T> in, std::span<T> out, loom::comm::reduce_op op) { return c->reduce_scatter_async(in, out, op); }
  template <class T> loom::comm::work all_reduce_async(std::span<const T> in, std::span<T> out, loom::comm::reduce_op op) { return c->all_reduce_async(in, out, op); }
  template <class T> loom::comm::work send_async(std::span<const T> in, int p, int t) { return c->send_async(in, p, t); }
  template <class T> loom::comm::work recv_async(std::span<T> out, int p, int t) { return c->recv_async(out, p, t); }
  logging_comm split(int, int) { LOOM_THROW("logging_comm: split unsupported"); }
};
static_assert(loom::comm::communicator<logging_comm<loom::comm::thread_comm>>);

}  // namespace

TEST_CASE("all_gather scheduler: values, order, prefetch depth, live cap, release (thread ranks)") {
  const std::vector<std::size_t> numel{96, 7, 33, 128, 5, 1, 64, 64, 20};
  const std::vector<std::size_t> layer_of{0, 0, 1, 1, 2, 2, 3, 4, 5};
  for (int world : {1, 2, 4}) {
    const auto lay = make_layout(numel, layer_of, static_cast<std::size_t>(world));
    all_gather_options o{150, 300, 7};
    // unsharded parameter values: param p element i = 1000 p + i (padding zero)
    std::vector<float> full(lay.padded_total(), 0.f);
    for (std::size_t p = 0; p < lay.params(); ++p)
      for (std::size_t i = 0; i < lay.numel(p); ++i) full[lay.offset(p) + i] = float(1000 * p + i);
    loom::comm::run_ranks(world, [&](loom::comm::thread_comm& c0) {
      logging_comm<loom::comm::thread_comm> c{&c0};
      const std::size_t r = static_cast<std::size_t>(c.rank());
      loom::host_memory_resource scratch("scratch");
      std::vector<float> shard(lay.shard_total());
      for (std::size_t p = 0; p < lay.params(); ++p)
        for (std::size_t i = 0; i < lay.shard_numel(p); ++i)
          shard[lay.shard_offset(p) + i] = full[lay.offset(p) + r * lay.shard_numel(p) + i];
      std::vector<std::size_t> log;
      c.log = &log;
      c.shard_base = shard.data();
      recording_observer obs;
      {
        all_gather_scheduler<float, logging_comm<loom::comm::thread_comm>> s(c, lay, plan_all_gather(lay, o), scratch);
        s.set_observer(&obs);
        CHECK(scratch.current_bytes() == s.plan().arena_numel * sizeof(float));
        std::vector<float*> ptrs(lay.params(), nullptr);
        std::vector<std::size_t> expect_log;
        for (int iter = 0; iter < 2; ++iter) {
          std::size_t prev_layer = std::size_t(-1);
          for (std::size_t t = 0; t < s.steps(); ++t) {
            const std::size_t l = s.plan().trace[t].layer;
            if (l != prev_layer)
              for (std::size_t p = lay.layer_begin(l); p < lay.layer_end(l); ++p)
                if (numel[p] > o.persistence_threshold) expect_log.push_back(lay.shard_offset(p));
            prev_layer = l;
            s.acquire(t, shard, ptrs);
            for (std::size_t p = lay.layer_begin(l); p < lay.layer_end(l); ++p) {
              if (numel[p] <= o.persistence_threshold) continue;
              bool same = true;
              for (std::size_t i = 0; i < lay.padded_numel(p); ++i) same = same && ptrs[p][i] == full[lay.offset(p) + i];
              CHECK(same);
            }
            s.release(t);
          }
          CHECK(s.live_instances() == 0);
        }
        CHECK(log == expect_log);  // gathers issued in forward, then backward order
        CHECK(obs.peak_live <= o.max_live_numel);
        CHECK(obs.peak_ahead <= o.prefetch_numel);
        CHECK(obs.issues == obs.releases);
        CHECK(obs.issues == 2 * s.plan().instances.size());
        CHECK(obs.live == 0);
        CHECK_THROWS_WITH_AS(s.release(0), doctest::Contains("without acquire"), loom::error);
      }
      CHECK(scratch.current_bytes() == 0);
    });
  }
}
