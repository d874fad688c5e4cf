// The tensor- and pipeline-parallel paged-KV engine (tp = 2, pp = 2 and both, on thread ranks)
// against the one-rank engine: greedy tokens of 32 concurrent sequences with chunked prefill,
// prefix sharing and preemption, for the LLaMA and the ChatGLM layout; each rank's weight
// memory against the formula of what its stage must hold; the step plan's wire form and its
// micro-batches; splits tp or pp cannot make; a failed pipeline rank.
//
// The oracle is llama_engine at tp = 1, itself checked token for token against a contiguous-KV
// reference (engine_test.cpp). The tp ranks sum the row-parallel projections' partial
// products over the group, so their logits differ from one rank's within rounding: tokens are
// demanded equal (a flip would need two logits within that rounding of each other), the
// logits within a tolerance. Pipeline stages at tp = 1 compute every row as one rank does
// (each row's result does not depend on the micro-batch it runs in), so their logits are
// demanded equal bit for bit.
#include <doctest/doctest.h>

#include "engine_requests.hpp"
#include "llama_cli.hpp"
#include "llama_engine.hpp"

#include <loom/comm/mesh.hpp>
#include <loom/comm/thread_comm.hpp>
#include <loom/kv/micro_batch.hpp>
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

// What one rank of stage `stage` of pp keeps of the model, in bytes, from the full layout's
// names alone:
//   4 [ (N - R) / tp + R + P / tp ]
// N: elements of every tensor of the stage; R: its RMSNorm weights (replicated on every rank);
// P: the matrices the GEMMs read packed (all 2-D tensors but the embedding table, which the
// output projection reads too when tied). Every other tensor is split over tp. A stage holds
// layers.{i} for i in its equal share of the layers (the configs here split evenly), the
// first one tok_embeddings, the last one norm and output (untied: no copy of the embedding).
std::size_t weight_bytes_formula(const llama::config& c, int tp, int pp = 1, int stage = 0) {
  REQUIRE(c.n_layers % pp == 0);
  REQUIRE((pp == 1 || !c.tied_output));
  const auto on_stage = [&](const std::string& name) {
    if (name.starts_with("layers.")) return std::stoll(name.substr(7)) / (c.n_layers / pp) == stage;
    if (name.starts_with("tok_embeddings.")) return stage == 0;
    return stage == pp - 1;  // norm, output
  };
  std::size_t N = 0, R = 0, P = 0;
  const loom::nn::param_layout layout = llama3d::full_layout(c);
  for (const auto& e : layout.entries()) {
    if (!on_stage(e.name)) continue;
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
  tokens_by_id tokens;              // rank 0: every request's tokens but the first's first one
  std::vector<float> first_logits;  // rank 0: the logits of the first step (the first request alone)
  std::int64_t steps = 0, preemptions = 0, prefix_hits = 0;
  loom::comm::mesh_coord at;  // where the rank is in its mesh
  llama::rank_memory held;    // its weight resource's bytes, its pool's, its step buffers'
};

// The workload on rank `rank` of an engine: rank 0 runs the first request alone for one step
// (its logits kept), then the rest with it, and stops the followers; the others follow.
template <class Engine>
void run_workload(Engine& eng, int rank, const std::vector<request>& reqs, rank_result& r) {
  if (rank == 0) {
    eng.add(reqs.front());
    eng.step();
    r.first_logits.assign(eng.last_logits(0).begin(), eng.last_logits(0).end());
    r.tokens = eng.generate(std::vector<request>(reqs.begin() + 1, reqs.end()));
    r.preemptions = eng.scheduler().num_preemptions();
    r.prefix_hits = eng.allocator().num_hits();
    eng.stop_followers();
  } else {
    eng.follow();
  }
  r.steps = eng.steps();
}

// The requests on one rank, as the split engines run them.
rank_result run_one_rank(const llama::flat_weights& w, const std::vector<request>& reqs, llama::engine_config ec = tight_engine()) {
  rank_result r;
  llama::llama_engine<float> one(w, ec);
  run_workload(one, 0, reqs, r);
  return r;
}

// The requests on a tp-rank engine (the tensor group's constructor).
std::vector<rank_result> run_tp(const llama::flat_weights& w, int tp, const std::vector<request>& reqs) {
  std::vector<rank_result> out(static_cast<std::size_t>(tp));
  loom::comm::run_ranks(tp, [&](thread_comm& comm) {
    rank_result& r = out[static_cast<std::size_t>(comm.rank())];
    loom::host_memory_resource weights("rank " + std::to_string(comm.rank()) + " weights");
    llama::llama_engine<float, thread_comm> eng(w, comm, tight_engine(), weights);
    r.held = {weights.current_bytes(), eng.kv_bytes(), eng.workspace_bytes()};
    run_workload(eng, comm.rank(), reqs, r);
  });
  return out;
}

void check_tp_equals_one_rank(const llama::config& c) {
  const llama::flat_weights w = llama::flat_weights::random(c, 5);
  const auto reqs = llama_generate_test::make_requests(c, 32);
  const rank_result one = run_one_rank(w, reqs);
  const tokens_by_id& want = one.tokens;
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
  CHECK(lead.preemptions == one.preemptions);  // the same plans as one rank
  CHECK(tp2[1].steps == lead.steps);           // the follower ran every plan
  CHECK(lead.steps == one.steps);
  // weight memory: half of the split tensors and packed matrices, all of the norms
  for (const auto& r : tp2) CHECK(r.held.weights == weight_bytes_formula(c, 2));
  const auto tp1 = run_tp(w, 1, reqs);  // the same constructor on a group of one holds the whole model
  CHECK(tp1[0].held.weights == weight_bytes_formula(c, 1));
  CHECK(tp1[0].tokens == want);
}

TEST_CASE("tp 2 paged-KV engine: LLaMA (GQA) greedy tokens of 32 sequences equal one rank's; weights per rank = 1/tp + norms") {
  check_tp_equals_one_rank(tp_llama());
}

TEST_CASE("tp 2 paged-KV engine: ChatGLM (fused q/k/v with biases, fused gate/up, partial rotary) equals one rank") {
  check_tp_equals_one_rank(tp_chatglm());
}

// The requests on a (tp, pp) mesh of thread ranks (ec.micro_batches micro-batches): rank 0
// generates, the others follow.
std::vector<rank_result> run_mesh(const llama::flat_weights& w, int tp, int pp, const std::vector<request>& reqs,
                                  llama::engine_config ec = tight_engine()) {
  std::vector<rank_result> out(static_cast<std::size_t>(tp * pp));
  loom::comm::run_ranks(tp * pp, [&](thread_comm& comm) {
    rank_result& r = out[static_cast<std::size_t>(comm.rank())];
    loom::comm::mesh<thread_comm> mesh(comm, {1, tp, pp});
    loom::host_memory_resource weights("rank " + std::to_string(comm.rank()) + " weights");
    llama::llama_engine<float, thread_comm> eng(w, mesh, ec, weights);
    r.at = mesh.coord();
    r.held = {weights.current_bytes(), eng.kv_bytes(), eng.workspace_bytes()};
    run_workload(eng, comm.rank(), reqs, r);
  });
  return out;
}

void check_mesh_equals_one_rank(const llama::config& c, int tp, int pp) {
  CAPTURE(tp);
  CAPTURE(pp);
  const llama::flat_weights w = llama::flat_weights::random(c, 5);
  const auto reqs = llama_generate_test::make_requests(c, 32);
  const rank_result want = run_one_rank(w, reqs);
  const auto ranks = run_mesh(w, tp, pp, reqs);
  const rank_result& lead = ranks[0];
  REQUIRE(lead.tokens.size() == want.tokens.size());
  for (const auto& [id, tokens] : want.tokens) {
    CAPTURE(id);
    CHECK(lead.tokens.at(id) == tokens);
  }
  // the workload exercised what it is meant to, and every rank ran rank 0's plans, which
  // were one rank's plans
  CHECK(lead.prefix_hits > 0);
  CHECK(lead.preemptions > 0);
  CHECK(lead.preemptions == want.preemptions);
  CHECK(lead.steps == want.steps);
  for (const auto& r : ranks) CHECK(r.steps == lead.steps);
  if (tp == 1) CHECK(lead.first_logits == want.first_logits);  // no sum over ranks: the same bits
  // weight memory: the stage's tensors, split over its tp ranks (norms whole)
  for (const auto& r : ranks) {
    CAPTURE(r.at);
    CHECK(r.held.weights == weight_bytes_formula(c, tp, pp, r.at.pp));
  }
}

TEST_CASE("pp 2 and tp 2 x pp 2 paged-KV engine: LLaMA greedy tokens of 32 sequences equal one rank's; weights per rank = the stage's share") {
  check_mesh_equals_one_rank(tp_llama(), 1, 2);
  check_mesh_equals_one_rank(tp_llama(), 2, 2);
}

TEST_CASE("pp 2 and tp 2 x pp 2 paged-KV engine: ChatGLM equals one rank") {
  check_mesh_equals_one_rank(tp_chatglm(), 1, 2);
  check_mesh_equals_one_rank(tp_chatglm(), 2, 2);
}

// Micro-batches do not change any row's result: one, three and many micro-batches over pp 2
// (and three stages over an uneven split of three layers) give one rank's tokens and logits.
// Tied output: the last stage projects with its copy of the first stage's embedding.
TEST_CASE("pipeline micro-batches: every count gives one rank's tokens and logits bit for bit; uneven stages; tied output") {
  llama::config c = tp_llama();
  c.n_layers = 3;
  c.tied_output = true;
  const llama::flat_weights w = llama::flat_weights::random(c, 8);
  const auto reqs = llama_generate_test::make_requests(c, 12);
  const rank_result want = run_one_rank(w, reqs);
  for (const auto& [pp, m] : {std::pair{2, 1}, std::pair{2, 3}, std::pair{2, 64}, std::pair{3, 0}}) {
    CAPTURE(pp);
    CAPTURE(m);
    llama::engine_config ec = tight_engine();
    ec.micro_batches = m;
    const auto ranks = run_mesh(w, 1, pp, reqs, ec);
    CHECK(ranks[0].tokens == want.tokens);
    CHECK(ranks[0].first_logits == want.first_logits);
    CHECK(ranks[0].steps == want.steps);
  }
}

// A plan's micro-batches against the plan itself: they cover its chunks in order, each
// non-empty; laid end to end, their tokens, positions and block tables are the plan's, with
// each micro-batch's indices counted from its own start.
TEST_CASE("a step plan cut into micro-batches of whole chunks: each a plan of its own, together the plan") {
  const llama::config c = tp_llama();
  loom::kv::block_allocator alloc(200, 8);
  loom::kv::scheduler_config sc = tight_engine().scheduler;
  sc.max_num_batched_tokens = 256;
  loom::kv::scheduler sched(sc, alloc);
  for (auto& r : llama_generate_test::make_requests(c, 12)) sched.add(r);
  // the second step: decode rows of the sequences the first one finished prefilling, then
  // prefill chunks
  const loom::kv::step_plan& first = sched.schedule();
  sched.commit(std::vector<token_id>(static_cast<std::size_t>(
                   std::count_if(first.chunks.begin(), first.chunks.end(), [](const auto& ch) { return ch.samples; })),
               1));
  const loom::kv::step_plan& p = sched.schedule();
  const auto B = static_cast<std::int32_t>(p.chunks.size());
  REQUIRE(B > 3);
  REQUIRE(p.num_decode > 0);
  REQUIRE(p.num_decode < B);
  std::vector<std::int32_t> bounds;
  for (std::int32_t m : {1, 2, 3, B, B + 5}) {
    CAPTURE(m);
    loom::kv::split_micro_batches(p, m, bounds);
    REQUIRE(static_cast<std::int32_t>(bounds.size()) == std::min(m, B) + 1);
    CHECK(bounds.front() == 0);
    CHECK(bounds.back() == B);
    loom::kv::step_plan joined, mb;
    std::int32_t decodes = 0;
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
      REQUIRE(bounds[k] < bounds[k + 1]);
      loom::kv::slice_plan(p, bounds[k], bounds[k + 1], mb);
      REQUIRE(mb.chunks.size() == static_cast<std::size_t>(bounds[k + 1] - bounds[k]));
      CHECK(mb.qo_indptr.front() == 0);
      CHECK(mb.csr.indptr.front() == 0);
      CHECK(mb.copies.empty());
      for (std::size_t b = 0; b < mb.chunks.size(); ++b) {
        const auto& want = p.chunks[static_cast<std::size_t>(bounds[k]) + b];
        CHECK(mb.chunks[b].len == want.len);
        CHECK(mb.chunks[b].start == want.start);
        CHECK(mb.qo_indptr[b + 1] - mb.qo_indptr[b] == want.len);
        for (auto t = mb.qo_indptr[b]; t < mb.qo_indptr[b + 1]; ++t) CHECK(mb.batch_indices[static_cast<std::size_t>(t)] == static_cast<std::int32_t>(b));
      }
      joined.token_ids.insert(joined.token_ids.end(), mb.token_ids.begin(), mb.token_ids.end());
      joined.positions.insert(joined.positions.end(), mb.positions.begin(), mb.positions.end());
      joined.csr.indices.insert(joined.csr.indices.end(), mb.csr.indices.begin(), mb.csr.indices.end());
      joined.csr.last_page_len.insert(joined.csr.last_page_len.end(), mb.csr.last_page_len.begin(), mb.csr.last_page_len.end());
      decodes += mb.num_decode;
    }
    CHECK(joined.token_ids == p.token_ids);
    CHECK(joined.positions == p.positions);
    CHECK(joined.csr.indices == p.csr.indices);
    CHECK(joined.csr.last_page_len == p.csr.last_page_len);
    CHECK(decodes == p.num_decode);
  }
  loom::kv::step_plan mb;
  CHECK_THROWS_WITH_AS(loom::kv::slice_plan(p, 2, B + 1, mb), doctest::Contains("kv::slice_plan: chunks [2, "), loom::error);
  CHECK_THROWS_WITH_AS(loom::kv::split_micro_batches(p, 0, bounds), doctest::Contains("micro-batches must be >= 1, got 0"),
                       loom::error);
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

// The memory plan per stage against what each rank of a (tp, pp) mesh holds; the plan for a
// mesh is its largest stage's (what a limit per rank must cover).
TEST_CASE("memory plan per rank of a pipeline stage = its counting resource's weight bytes, its pool's and its workspace's") {
  const llama::config c = tp_llama();
  const llama::flat_weights w = llama::flat_weights::random(c, 3);
  const auto reqs = llama_generate_test::make_requests(c, 8);
  using E = llama::llama_engine<float, thread_comm>;
  for (const auto& [tp, pp] : {std::pair{1, 2}, std::pair{2, 2}}) {
    CAPTURE(tp);
    CAPTURE(pp);
    const auto ranks = run_mesh(w, tp, pp, reqs);
    std::size_t most = 0;
    for (const auto& r : ranks) {
      CAPTURE(r.at);
      const llama::rank_memory plan = E::memory_plan(c, tight_engine(), tp, pp, r.at.pp);
      CHECK(r.held.weights == plan.weights);
      CHECK(r.held.kv == plan.kv);
      CHECK(r.held.workspace == plan.workspace);
      most = std::max(most, plan.total());
    }
    CHECK(E::memory_plan(c, tight_engine(), tp, pp).total() == most);
    // each stage's pool holds its half of the layers: half of one stage's pool at this tp
    CHECK(ranks[0].held.kv * 2 == E::memory_plan(c, tight_engine(), tp).kv);
  }
  CHECK_THROWS_WITH_AS(E::memory_plan(c, tight_engine(), 1, 3), doctest::Contains("n_layers (2) must be >= pp (3)"), loom::error);
  CHECK_THROWS_WITH_AS(E::memory_plan(c, tight_engine(), 1, 0), doctest::Contains("pp must be >= 1, got pp=0"), loom::error);
}

// A rank of a pipeline that fails ends every rank's step with an error (thread_comm aborts the
// waits of the whole mesh: the stages' sends and receives, the plan's broadcast) and the run
// with an error naming it; nothing hangs. Each rank in turn: the leader, a follower of the first
// stage, the last stage's ranks.
TEST_CASE("tp 2 x pp 2 engine: a failed rank ends the run with an error naming it, never a hang") {
  const llama::config c = tp_llama();
  const llama::flat_weights w = llama::flat_weights::random(c, 5);
  const auto reqs = llama_generate_test::make_requests(c, 8);
  for (int failing = 0; failing < 4; ++failing) {
    CAPTURE(failing);
    std::string thrown;
    try {
      llama::run_tensor_ranks(4, [&](thread_comm& comm, const std::atomic<bool>&) {
        loom::comm::mesh<thread_comm> mesh(comm, {1, 2, 2});
        llama::llama_engine<float, thread_comm> eng(w, mesh, tight_engine());
        if (comm.rank() == failing) throw loom::error("this rank gives up");
        if (comm.rank() != 0) return eng.follow();
        eng.generate(reqs);
        eng.stop_followers();
      });
    } catch (const loom::error& e) {
      thrown = e.what();
    }
    CHECK(thrown.find("rank " + std::to_string(failing) + " of 4: this rank gives up") != std::string::npos);
  }
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

TEST_CASE("pipeline engine refuses more stages than layers, and a mesh with dp > 1, by name") {
  const llama::flat_weights w = llama::flat_weights::random(tp_llama(), 5);  // two layers
  const auto errors_on = [&](int ranks, loom::comm::mesh_shape shape) {
    std::vector<std::string> errors(static_cast<std::size_t>(ranks));
    loom::comm::run_ranks(ranks, [&](thread_comm& comm) {
      loom::comm::mesh<thread_comm> mesh(comm, shape);
      try {
        llama::llama_engine<float, thread_comm> eng(w, mesh, tight_engine());
      } catch (const loom::error& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return errors;
  };
  for (const auto& e : errors_on(3, {1, 1, 3})) CHECK(e.find("n_layers (2) must be >= pp (3)") != std::string::npos);
  for (const auto& e : errors_on(2, {2, 1, 1})) CHECK(e.find("a mesh with dp=2") != std::string::npos);
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
