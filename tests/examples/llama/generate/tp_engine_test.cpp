// The tensor-parallel paged-KV engine (tp = 2 on thread ranks) against the one-rank engine:
// greedy tokens of 32 concurrent sequences with chunked prefill, prefix sharing and
// preemption, for the LLaMA and the ChatGLM layout; each rank's weight memory against the
// formula of what it must hold; the step plan's wire form; splits tp cannot make.
//
// The oracle is llama_engine at tp = 1, itself checked token for token against a contiguous-KV
// reference (engine_test.cpp). The tp ranks sum the row-parallel projections' partial
// products over the group, so their logits differ from one rank's within rounding: tokens are
// demanded equal (a flip would need two logits within that rounding of each other), the
// logits within a tolerance.
#include <doctest/doctest.h>

#include "engine_requests.hpp"
#include "llama_engine.hpp"

#include <loom/comm/thread_comm.hpp>
#include <loom/kv/plan_broadcast.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

// A named namespace: this file is one of the unity-built generate group's files.
namespace llama_tp_engine_test {

using loom::comm::thread_comm;
using loom::kv::request;
using loom::kv::token_id;
using tokens_by_id = std::map<std::uint64_t, std::vector<token_id>>;

// Local slices of every tensor are multiples of 16 floats (the layout's alignment) and every
// packed weight's local rows a multiple of 32 (the widest sgemm panel) at tp = 1 and 2, so that
// weight memory has no padding and the formula below is exact.
llama::config tp_llama() {
  llama::config c;
  c.dim = 128, c.hidden_dim = 192, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 128, c.seq_len = 128;
  c.tied_output = false;
  return c;
}
llama::config tp_chatglm() {  // fused q/k/v with biases, fused gate/up, half-head interleaved rotary
  llama::config c = llama::config::chatglm();
  c.dim = 128, c.hidden_dim = 192, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 128, c.seq_len = 128;
  return c;
}

// A small pool (preemption), a token budget below the longest prompt (chunked prefill), the
// prefix cache on (the shared system prompt).
llama::engine_config tight_engine() {
  llama::engine_config ec;
  ec.num_blocks = 40;
  ec.block_size = 8;
  ec.scheduler.max_num_batched_tokens = 80;
  ec.scheduler.max_num_seqs = 32;
  ec.scheduler.enable_prefix_caching = true;
  return ec;
}

// What one rank keeps of the model, in bytes, from the full layout's names alone:
//   4 [ (N - R) / tp + R + P / tp ]
// N: elements of every tensor; R: the RMSNorm weights (replicated on every rank); P: the
// matrices the GEMMs read packed (all 2-D tensors but the embedding table, which the output
// projection reads too when tied). Every other tensor is split over tp.
std::size_t weight_bytes_formula(const llama::config& c, int tp) {
  std::size_t N = 0, R = 0, P = 0;
  const loom::nn::param_layout layout = llama3d::full_layout(c);
  for (const auto& e : layout.entries()) {
    N += e.numel;
    if (e.name.ends_with("norm.weight")) R += e.numel;
    if (e.shape.size() == 2 && (e.name != "tok_embeddings.weight" || c.tied_output)) P += e.numel;
  }
  const auto t = static_cast<std::size_t>(tp);
  REQUIRE((N - R) % t == 0);
  REQUIRE(P % t == 0);
  return sizeof(float) * ((N - R) / t + R + P / t);
}

struct rank_result {
  tokens_by_id tokens;
  std::size_t weight_bytes = 0;
  std::int64_t steps = 0, preemptions = 0, prefix_hits = 0;
};

// The requests on a tp-rank engine: rank 0 generates, the others follow.
std::vector<rank_result> run_tp(const llama::flat_weights& w, int tp, const std::vector<request>& reqs) {
  std::vector<rank_result> out(static_cast<std::size_t>(tp));
  loom::comm::run_ranks(tp, [&](thread_comm& comm) {
    rank_result& r = out[static_cast<std::size_t>(comm.rank())];
    loom::host_memory_resource weights("rank " + std::to_string(comm.rank()) + " weights");
    llama::llama_engine<float, thread_comm> eng(w, comm, tight_engine(), weights);
    r.weight_bytes = weights.current_bytes();
    if (comm.rank() == 0) {
      r.tokens = eng.generate(reqs);
      r.preemptions = eng.scheduler().num_preemptions();
      r.prefix_hits = eng.allocator().num_hits();
      eng.stop_followers();
    } else {
      eng.follow();
    }
    r.steps = eng.steps();
  });
  return out;
}

void check_tp_equals_one_rank(const llama::config& c) {
  const llama::flat_weights w = llama::flat_weights::random(c, 5);
  const auto reqs = llama_generate_test::make_requests(c, 32);
  llama::llama_engine<float> one(w, tight_engine());
  const tokens_by_id want = one.generate(reqs);
  REQUIRE(want.size() == reqs.size());

  const auto tp2 = run_tp(w, 2, reqs);
  const rank_result& lead = tp2[0];
  for (const auto& r : reqs) {
    CAPTURE(r.id);
    CHECK(lead.tokens.at(r.id) == want.at(r.id));
  }
  // the workload exercised what it is meant to: chunked prefill, prefix hits, preemptions
  std::size_t longest = 0;
  for (const auto& r : reqs) longest = std::max(longest, r.prompt.size());
  CHECK(static_cast<std::int32_t>(longest) > tight_engine().scheduler.max_num_batched_tokens);
  CHECK(lead.prefix_hits > 0);
  CHECK(lead.preemptions > 0);
  CHECK(lead.preemptions == one.scheduler().num_preemptions());  // the same plans as one rank
  CHECK(tp2[1].steps == lead.steps);                             // the follower ran every plan
  CHECK(lead.steps == one.steps());
  // weight memory: half of the split tensors and packed matrices, all of the norms
  for (const auto& r : tp2) CHECK(r.weight_bytes == weight_bytes_formula(c, 2));
  const auto tp1 = run_tp(w, 1, reqs);  // the same constructor on a group of one holds the whole model
  CHECK(tp1[0].weight_bytes == weight_bytes_formula(c, 1));
  CHECK(tp1[0].tokens == want);
}

TEST_CASE("tp 2 paged-KV engine: LLaMA (GQA) greedy tokens of 32 sequences equal one rank's; weights per rank = 1/tp + norms") {
  check_tp_equals_one_rank(tp_llama());
}

TEST_CASE("tp 2 paged-KV engine: ChatGLM (fused q/k/v with biases, fused gate/up, partial rotary) equals one rank") {
  check_tp_equals_one_rank(tp_chatglm());
}

TEST_CASE("tp 2 engine: the last step's logits on rank 0 equal one rank's within rounding") {
  const llama::config c = tp_llama();
  const llama::flat_weights w = llama::flat_weights::random(c, 9);
  request r;
  r.id = 1;
  r.prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  r.max_new_tokens = 1;
  llama::llama_engine<float> one(w, tight_engine());
  one.add(r);
  one.step();
  const std::vector<float> want(one.last_logits(0).begin(), one.last_logits(0).end());
  std::vector<float> got;
  loom::comm::run_ranks(2, [&](thread_comm& comm) {
    llama::llama_engine<float, thread_comm> eng(w, comm, tight_engine());
    if (comm.rank() == 0) {
      eng.add(r);
      eng.step();
      got.assign(eng.last_logits(0).begin(), eng.last_logits(0).end());
      eng.stop_followers();
    } else {
      eng.follow();
    }
  });
  REQUIRE(got.size() == want.size());
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  CHECK(worst <= 1e-5 * std::max(1.0, scale));
}

TEST_CASE("a step plan survives its wire form; truncated or inconsistent bytes are refused by name") {
  const llama::config c = tp_llama();
  loom::kv::block_allocator alloc(40, 8);
  loom::kv::scheduler sched(tight_engine().scheduler, alloc);
  for (auto& r : llama_generate_test::make_requests(c, 8)) sched.add(r);
  const loom::kv::step_plan& p = sched.schedule();
  REQUIRE(p.chunks.size() > 1);
  std::vector<std::uint8_t> wire;
  loom::kv::encode_plan(p, wire);
  loom::kv::step_plan q;
  loom::kv::decode_plan(wire, q);
  REQUIRE(q.chunks.size() == p.chunks.size());
  for (std::size_t i = 0; i < p.chunks.size(); ++i) {
    CHECK(q.chunks[i].seq == nullptr);
    CHECK(q.chunks[i].start == p.chunks[i].start);
    CHECK(q.chunks[i].len == p.chunks[i].len);
    CHECK(q.chunks[i].samples == p.chunks[i].samples);
    CHECK(q.chunks[i].adapter == p.chunks[i].adapter);
  }
  CHECK(q.token_ids == p.token_ids);
  CHECK(q.positions == p.positions);
  CHECK(q.batch_indices == p.batch_indices);
  CHECK(q.qo_indptr == p.qo_indptr);
  CHECK(q.csr.indptr == p.csr.indptr);
  CHECK(q.csr.indices == p.csr.indices);
  CHECK(q.csr.last_page_len == p.csr.last_page_len);
  CHECK(q.csr.block_size == p.csr.block_size);
  CHECK(q.num_decode == p.num_decode);

  auto short_wire = wire;
  short_wire.pop_back();
  CHECK_THROWS_WITH_AS(loom::kv::decode_plan(short_wire, q), doctest::Contains("kv::decode_plan: num_decode needs 4 bytes"),
                       loom::error);
  auto long_wire = wire;
  long_wire.push_back(0);
  CHECK_THROWS_WITH_AS(loom::kv::decode_plan(long_wire, q), doctest::Contains("1 bytes left after the plan"), loom::error);
  auto bad_tokens = p;
  bad_tokens.positions.pop_back();
  loom::kv::encode_plan(bad_tokens, wire);
  CHECK_THROWS_WITH_AS(loom::kv::decode_plan(wire, q), doctest::Contains("positions"), loom::error);
  auto huge = wire;
  const std::uint64_t chunks = ~std::uint64_t{0};
  std::memcpy(huge.data(), &chunks, sizeof chunks);
  CHECK_THROWS_WITH_AS(loom::kv::decode_plan(huge, q), doctest::Contains("kv::decode_plan: chunks="), loom::error);
}

// The memory plan a program prints before loading (llama_engine::memory_plan) against what
// each rank holds once the engine is made: its weight resource's bytes (a counting resource),
// the pool's bytes and the step buffers'; and a generation does not grow the workspace. A
// config whose panels need padding (dims not multiples of the kernel's width) and a GQA one.
TEST_CASE("memory plan per rank = the counting resource's weight bytes, the pool's and the workspace's, at tp 1, 2, 4") {
  llama::config odd = tp_llama();
  odd.dim = 96, odd.hidden_dim = 100, odd.n_heads = 4, odd.n_kv_heads = 4, odd.vocab = 260;  // head_dim 24, hidden/4 = 25
  for (const llama::config& c : {tp_llama(), odd}) {
    const llama::flat_weights w = llama::flat_weights::random(c, 3);
    const auto reqs = llama_generate_test::make_requests(c, 8);
    for (int tp : {1, 2, 4}) {
      if (c.n_kv_heads % tp) continue;
      CAPTURE(tp);
      CAPTURE(c.dim);
      const llama::engine_config ec = tight_engine();
      const llama::rank_memory plan = llama::llama_engine<float, thread_comm>::memory_plan(c, ec, tp);
      std::vector<llama::rank_memory> held(static_cast<std::size_t>(tp));
      std::vector<std::size_t> after(static_cast<std::size_t>(tp));
      loom::comm::run_ranks(tp, [&](thread_comm& comm) {
        loom::host_memory_resource weights("rank weights");
        llama::llama_engine<float, thread_comm> eng(w, comm, ec, weights);
        const auto r = static_cast<std::size_t>(comm.rank());
        held[r] = {weights.current_bytes(), eng.kv_bytes(), eng.workspace_bytes()};
        if (comm.rank() == 0) {
          eng.generate(reqs);
          eng.stop_followers();
        } else {
          eng.follow();
        }
        after[r] = eng.workspace_bytes();
      });
      for (std::size_t r = 0; r < held.size(); ++r) {
        CAPTURE(r);
        CHECK(held[r].weights == plan.weights);
        CHECK(held[r].kv == plan.kv);
        CHECK(held[r].workspace == plan.workspace);
        CHECK(after[r] == held[r].workspace);  // the layers' scratch was sized for the budget
      }
    }
  }
  // Weights follow the docs' formula where nothing is padded (tp_llama's sizes).
  CHECK(llama::llama_engine<float, thread_comm>::memory_plan(tp_llama(), tight_engine(), 2).weights ==
        weight_bytes_formula(tp_llama(), 2));
  // The smallest tp whose ranks fit a limit: the plan's own totals decide.
  const auto at = [](int tp) { return llama::llama_engine<float, thread_comm>::memory_plan(tp_llama(), tight_engine(), tp).total(); };
  using E = llama::llama_engine<float, thread_comm>;
  CHECK(E::smallest_tp(tp_llama(), tight_engine(), at(1)) == 1);
  CHECK(E::smallest_tp(tp_llama(), tight_engine(), at(1) - 1) == 2);
  CHECK(E::smallest_tp(tp_llama(), tight_engine(), at(2) - 1) == 0);  // n_kv_heads = 2: no tp beyond 2
}

// Each of two ranks' error from f(comm) (empty: none).
template <class F>
std::vector<std::string> errors_on_two_ranks(F f) {
  std::vector<std::string> errors(2);
  loom::comm::run_ranks(2, [&](thread_comm& comm) {
    try {
      f(comm);
    } catch (const loom::error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

TEST_CASE("tp engine refuses heads tp does not divide, and steps on a follower, by name") {
  auto make = [](llama::config c) {
    return [c](thread_comm& comm) {
      const llama::flat_weights w = llama::flat_weights::random(c, 5);
      llama::llama_engine<float, thread_comm> eng(w, comm, tight_engine());
    };
  };
  llama::config mqa = tp_llama();
  mqa.n_kv_heads = 1;  // one key/value head cannot be split over two ranks' caches
  for (const auto& e : errors_on_two_ranks(make(mqa))) CHECK(e.find("n_kv_heads (1) must be divisible by tp (2)") != std::string::npos);
  llama::config three = tp_llama();
  three.n_heads = 3, three.n_kv_heads = 1, three.dim = 96;  // three heads of 32
  for (const auto& e : errors_on_two_ranks(make(three))) CHECK(e.find("n_heads (3) must be divisible by tp (2)") != std::string::npos);

  const llama::flat_weights w = llama::flat_weights::random(tp_llama(), 5);
  const auto errors = errors_on_two_ranks([&](thread_comm& comm) {
    llama::llama_engine<float, thread_comm> eng(w, comm, tight_engine());
    if (comm.rank() == 1) eng.step();
    else eng.follow();
  });
  CHECK(errors[0].find("kv::engine::follow: rank 0 of the model's group leads") != std::string::npos);
  CHECK(errors[1].find("kv::engine::step: this rank follows rank 0's plans") != std::string::npos);
}

}  // namespace llama_tp_engine_test
