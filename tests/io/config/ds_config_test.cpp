// ds_config.json: every key, "auto", DeepSpeed's batch rule, and the errors.
// Oracles: DeepSpeed's documented defaults and rules, written as literal expected values.
#include <support/error_of.hpp>
#include <loom/io/ds_config.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <unistd.h>

using loom::io::ds_config;
using nlohmann::json;

namespace {
ds_config parse(const char* text, bool allow_unknown = false) { return loom::io::parse_ds_config(json::parse(text), {allow_unknown}); }
ds_config resolved(const char* text, loom::io::ds_context ctx = {}) {
  auto c = parse(text);
  loom::io::resolve_ds_config(c, ctx);
  return c;
}
void refuses(const char* text, const char* needle) {
  CAPTURE(text);
  CHECK_THROWS_WITH_AS(resolved(text, {.hidden_size = 64, .total_steps = 100}), doctest::Contains(needle), loom::error);
}
}  // namespace

TEST_CASE("batch keys follow DeepSpeed's consistency rule") {
  struct row { const char* cfg; int world; long T, M, G; };
  for (row r : {row{R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 4, 32, 4, 2},
                row{R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 2, 32, 4, 4},
                row{R"({"train_batch_size": 32, "gradient_accumulation_steps": 4})", 2, 32, 4, 4},
                row{R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", 4, 60, 3, 5},
                row{R"({"train_batch_size": 24})", 4, 24, 6, 1},
                row{R"({"train_micro_batch_size_per_gpu": 8})", 2, 16, 8, 1},
                row{R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})", 1, 16, 16, 1}}) {
    CAPTURE(r.cfg);
    auto c = resolved(r.cfg, {.world_size = r.world});
    CHECK(c.train_batch_size == r.T);
    CHECK(c.train_micro_batch_size_per_gpu == r.M);
    CHECK(c.gradient_accumulation_steps == r.G);
  }
  // "auto" takes the program's value (HF's behaviour)
  auto c = resolved(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})",
                    {.world_size = 2, .micro_batch = 4, .grad_accum = 3});
  CHECK(c.train_batch_size == 24);
  refuses(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})",
          "train_batch_size=30 must equal train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2) * data-parallel size (1) = 8");
  refuses(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})", "train_batch_size=10");
  refuses(R"({"gradient_accumulation_steps": 2})", "either \"train_batch_size\" or \"train_micro_batch_size_per_gpu\"");
  refuses(R"({"train_batch_size": 0})", "\"train_batch_size\" must be >= 1, got 0");
  refuses(R"({"train_batch_size": 2.5})", "\"train_batch_size\" must be an integer, got 2.5");
}

TEST_CASE("fp16 keys, with DeepSpeed's defaults") {
  auto d = resolved(R"({"train_batch_size": 1, "fp16": {"enabled": true}})");
  CHECK(d.precision() == loom::dtype::f16);
  CHECK(d.fp16.loss_scale == 0.f);
  CHECK(d.fp16.initial_scale_power == 16);
  CHECK(d.fp16.loss_scale_window == 1000);
  CHECK(d.fp16.hysteresis == 2);
  CHECK(d.fp16.min_loss_scale == 1.f);
  CHECK_FALSE(d.fp16.consecutive_hysteresis);
  auto c = resolved(R"({"train_batch_size": 1, "fp16": {"enabled": true, "loss_scale": 128, "initial_scale_power": 12,
      "loss_scale_window": 50, "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 0.5}})");
  CHECK(c.fp16.loss_scale == 128.f);
  CHECK(c.fp16.initial_scale_power == 12);
  CHECK(c.fp16.loss_scale_window == 50);
  CHECK(c.fp16.hysteresis == 3);
  CHECK(c.fp16.consecutive_hysteresis);
  CHECK(c.fp16.min_loss_scale == 0.5f);
  CHECK(resolved(R"({"train_batch_size": 1, "fp16": {"enabled": "auto"}})", {.precision = loom::dtype::f16}).precision() == loom::dtype::f16);
  CHECK(resolved(R"({"train_batch_size": 1, "fp16": {"enabled": "auto"}})", {.precision = loom::dtype::bf16}).precision() == loom::dtype::f32);
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "hysteresis": 0}})", "\"fp16.hysteresis\" must be >= 1, got 0");
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": "yes"}})", "\"fp16.enabled\" must be true or false, got \"yes\"");
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "auto_cast": true}})", "unsupported key \"fp16.auto_cast\"");
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "loss_scale_window": "auto"}})", "\"fp16.loss_scale_window\" cannot be \"auto\"");
}

TEST_CASE("bf16 / bfloat16 and their conflicts") {
  CHECK(resolved(R"({"train_batch_size": 1, "bf16": {"enabled": true}})").precision() == loom::dtype::bf16);
  CHECK(resolved(R"({"train_batch_size": 1, "bfloat16": {"enabled": true}})").precision() == loom::dtype::bf16);
  CHECK(resolved(R"({"train_batch_size": 1, "bf16": {"enabled": "auto"}})", {.precision = loom::dtype::bf16}).precision() == loom::dtype::bf16);
  CHECK(resolved(R"({"train_batch_size": 1})").precision() == loom::dtype::f32);
  refuses(R"({"train_batch_size": 1, "bf16": {"enabled": true}, "fp16": {"enabled": true}})", "both true");
  refuses(R"({"train_batch_size": 1, "bf16": {"enabled": true}, "bfloat16": {"enabled": true}})", "not both");
}

TEST_CASE("zero_optimization keys, defaults and \"auto\"") {
  auto d = resolved(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3}})");
  CHECK(d.zero.stage == 3);
  CHECK(d.zero.overlap());  // DeepSpeed: overlap_comm defaults to true for stage 3
  CHECK(d.zero.contiguous_gradients);
  CHECK(d.zero.reduce_bucket_size.value == 500000000);
  CHECK(d.zero.stage3_prefetch_bucket_size.value == 50000000);
  CHECK(d.zero.stage3_param_persistence_threshold.value == 100000);
  CHECK(d.zero.stage3_max_live_parameters == 1000000000);
  CHECK(d.zero.offload_optimizer.device == loom::io::offload_device::none);
  CHECK_FALSE(resolved(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2}})").zero.overlap());

  auto c = resolved(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": false,
      "reduce_scatter": false, "reduce_bucket_size": 2e6, "allgather_bucket_size": 3000, "sub_group_size": 1e9,
      "stage3_prefetch_bucket_size": 100, "stage3_param_persistence_threshold": 10, "stage3_max_live_parameters": 1e6,
      "stage3_max_reuse_distance": 5, "stage3_gather_16bit_weights_on_model_save": true,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "pin_memory": true}}})");
  CHECK(c.zero.overlap());
  CHECK_FALSE(c.zero.contiguous_gradients);
  CHECK_FALSE(c.zero.reduce_scatter);
  CHECK(c.zero.reduce_bucket_size.value == 2000000);
  CHECK(c.zero.allgather_bucket_size == 3000);
  CHECK(c.zero.sub_group_size == 1000000000);
  CHECK(c.zero.stage3_prefetch_bucket_size.value == 100);
  CHECK(c.zero.stage3_param_persistence_threshold.value == 10);
  CHECK(c.zero.stage3_max_live_parameters == 1000000);
  CHECK(c.zero.stage3_max_reuse_distance == 5);
  CHECK(c.zero.stage3_gather_16bit_weights_on_model_save);
  CHECK(c.zero.offload_optimizer.device == loom::io::offload_device::nvme);
  CHECK(c.zero.offload_optimizer.nvme_path == "/tmp/x");
  CHECK(c.zero.offload_optimizer.pin_memory);

  // HF's "auto" rules from the hidden size
  auto a = resolved(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})", {.hidden_size = 100});
  CHECK(a.zero.reduce_bucket_size.value == 10000);
  CHECK(a.zero.stage3_prefetch_bucket_size.value == 9000);
  CHECK(a.zero.stage3_param_persistence_threshold.value == 1000);
  CHECK_THROWS_WITH_AS(resolved(R"({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": "auto"}})"),
                       doctest::Contains("hidden size is unknown"), loom::error);

  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 4}})", "must be 0, 1, 2 or 3, got 4");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": "auto"}})", "\"zero_optimization.stage\" cannot be \"auto\"");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})", "needs stage 1, 2 or 3");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})", "needs stage 3, got stage 2");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
          "\"zero_optimization.offload_param.device\" must be \"none\" or \"cpu\", got \"nvme\"");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})", "nvme_path");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}})", "got \"gpu\"");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "buffer_count": 4}}})",
          "unsupported key \"zero_optimization.offload_optimizer.buffer_count\"");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3, "round_robin_gradients": true}})",
          "unsupported key \"zero_optimization.round_robin_gradients\"");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_com": true}})",
          "unknown key \"zero_optimization.overlap_com\"; supported keys in \"zero_optimization\": stage, offload_optimizer");
}

TEST_CASE("optimizer, scheduler, clipping and the remaining top-level keys") {
  auto c = resolved(R"({"train_batch_size": 1, "gradient_clipping": 0.5, "steps_per_print": 7, "wall_clock_breakdown": true,
      "communication_data_type": "bf16",
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0.1,
                    "warmup_num_steps": 10, "cos_min_ratio": 0.01, "warmup_type": "linear"}}})");
  CHECK(c.gradient_clipping.value == 0.5f);
  CHECK(c.steps_per_print == 7);
  CHECK(c.wall_clock_breakdown);
  CHECK(c.communication_data_type == loom::dtype::bf16);
  auto o = c.optimizer.adamw();
  CHECK(o.lr == 3e-4f);
  CHECK(o.beta1 == 0.8f);
  CHECK(o.beta2 == 0.95f);
  CHECK(o.eps == 1e-6f);
  CHECK(o.weight_decay == 0.1f);
  auto s = c.lr_schedule();
  // closed form of WarmupCosineLR, linear warmup: lr(5) = 3e-4 * (0.1 + 0.5 * 0.9)
  CHECK(s.lr(5) == doctest::Approx(3e-4 * 0.55));
  CHECK(s.lr(99) == doctest::Approx(3e-4 * 0.01));

  auto d = resolved(R"({"train_batch_size": 1, "optimizer": {"type": "adamw", "params": {"lr": "auto", "betas": "auto",
      "eps": "auto", "weight_decay": "auto"}}, "gradient_clipping": "auto",
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}})",
                    {.total_steps = 50, .warmup_steps = 5, .lr = 2e-3f, .weight_decay = 0.f, .beta1 = 0.7f, .gradient_clipping = 2.f});
  CHECK(d.optimizer.lr.value == 2e-3f);
  CHECK(d.optimizer.beta1.value == 0.7f);
  CHECK(d.optimizer.weight_decay.value == 0.f);
  CHECK(d.gradient_clipping.value == 2.f);
  CHECK(d.scheduler.total_num_steps.value == 50);
  CHECK(d.scheduler.warmup_num_steps.value == 5);
  CHECK(d.lr_schedule().lr(4) == doctest::Approx(2e-3 * std::log(5.0) / std::log(5.0)));
  CHECK(d.lr_schedule().lr(50) == 0.f);  // WarmupDecayLR reaches 0 at total_num_steps

  auto w = resolved(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
      "warmup_max_lr": 0.002, "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  CHECK(w.lr_schedule().lr(2) == doctest::Approx(0.0015));
  CHECK(w.lr_schedule().lr(10) == doctest::Approx(0.002));
  // no optimizer section: the program's lr, constant
  CHECK(resolved(R"({"train_batch_size": 1})", {.lr = 5e-4f}).lr_schedule().lr(123) == 5e-4f);

  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "Lamb"}})", "\"optimizer.type\" \"Lamb\" is not supported; supported optimizer types: AdamW");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})", "must be [beta1, beta2], got [0.9]");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})", "unsupported key \"optimizer.params.amsgrad\"");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": -1}}})", "\"optimizer.params.lr\" must be >= 0, got -1");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "OneCycle"}})", "\"scheduler.type\" \"OneCycle\" is not supported");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}})",
          "unknown key \"scheduler.params.total_num_steps\"");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}})",
          "total_num_steps (5) must exceed warmup_num_steps (10)");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_type": "exp"}}})",
          "warmup_type=\"exp\"");
  refuses(R"({"train_batch_size": 1, "gradient_clipping": -1})", "\"gradient_clipping\" must be >= 0, got -1");
  refuses(R"({"train_batch_size": 1, "communication_data_type": "int8"})", "must be fp32, fp16 or bf16, got \"int8\"");
  refuses(R"({"train_batch_size": 1, "steps_per_print": 0})", "\"steps_per_print\" must be >= 1, got 0");
  refuses(R"({"train_batch_size": 1, "prescale_gradients": true})", "unsupported key \"prescale_gradients\"");
}

TEST_CASE("activation_checkpointing keys") {
  auto c = resolved(R"({"train_batch_size": 1, "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
      "contiguous_memory_optimization": false, "number_checkpoints": 4, "synchronize_checkpoint_boundary": true, "profile": true}})");
  CHECK(c.activation_checkpointing.enabled);
  CHECK(c.activation_checkpointing.partition_activations);
  CHECK(c.activation_checkpointing.cpu_checkpointing);
  CHECK(c.activation_checkpointing.number_checkpoints == 4);
  CHECK(c.activation_checkpointing.synchronize_checkpoint_boundary);
  CHECK(c.activation_checkpointing.profile);
  CHECK_FALSE(resolved(R"({"train_batch_size": 1})").activation_checkpointing.enabled);
  refuses(R"({"train_batch_size": 1, "activation_checkpointing": {"contiguous_memory_optimization": true}})",
          "contiguous_memory_optimization\": true");
}

TEST_CASE("unknown keys: an error naming the key and the supported ones, or a warning with allow_unknown") {
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "zero_optimisation": {}})"),
                       doctest::Contains("unknown key \"zero_optimisation\"; supported keys in the top level: train_batch_size,"), loom::error);
  auto c = parse(R"({"train_batch_size": 1, "zero_optimisation": {}, "fp16": {"enabled": false, "loss_scale_windo": 3}})", true);
  REQUIRE(c.warnings.size() == 2);
  CHECK(c.warnings[0].find("zero_optimisation") != std::string::npos);
  CHECK(c.warnings[1].find("fp16.loss_scale_windo") != std::string::npos);
  // unsupported (known to DeepSpeed, refused by loom) stays an error even with allow_unknown
  CHECK_THROWS_AS(parse(R"({"train_batch_size": 1, "amp": {"enabled": true}})", true), loom::error);
  CHECK_THROWS_WITH_AS(parse("[1, 2]"), doctest::Contains("must be an object"), loom::error);
}

TEST_CASE("the seed's ds_config_zero3.json parses, with offload_param and activation_checkpointing accepted") {
  auto c = loom::io::load_ds_config(LOOM_TEST_DIR "/ds_config_zero3.json");
  loom::io::resolve_ds_config(c, {.world_size = 4, .hidden_size = 512});
  CHECK(c.train_batch_size == 1024);
  CHECK(c.gradient_accumulation_steps == 8);
  CHECK(c.train_micro_batch_size_per_gpu == 32);  // 1024 / 4 / 8
  CHECK(c.precision() == loom::dtype::f16);
  CHECK(c.fp16.loss_scale == 0.f);
  CHECK(c.zero.stage == 3);
  CHECK(c.zero.offload_optimizer.device == loom::io::offload_device::cpu);
  CHECK(c.zero.offload_param.device == loom::io::offload_device::cpu);
  CHECK(c.zero.reduce_bucket_size.value == 512 * 512);
  CHECK(c.zero.stage3_prefetch_bucket_size.value == static_cast<std::int64_t>(0.9 * 512 * 512));
  CHECK(c.zero.stage3_param_persistence_threshold.value == 5120);
  CHECK(c.activation_checkpointing.enabled);
  CHECK(c.communication_data_type == loom::dtype::f16);
  CHECK(c.gradient_clipping.value == 1.f);
  // world 3 does not divide 1024 / 8
  auto d = loom::io::load_ds_config(LOOM_TEST_DIR "/ds_config_zero3.json");
  CHECK_THROWS_WITH_AS(loom::io::resolve_ds_config(d, {.world_size = 3, .hidden_size = 512}), doctest::Contains("train_batch_size=1024"),
                       loom::error);
  CHECK_THROWS_WITH_AS(loom::io::load_ds_config("/nonexistent/ds.json"), doctest::Contains("cannot open"), loom::error);
}

namespace {
using loom::test::error_of;
/// [[[...[1]...]]], `depth` arrays deep, built without the parser.
json nested(int depth) {
  json j = 1;
  for (int i = 0; i < depth; ++i) j = json::array({std::move(j)});
  return j;
}
}  // namespace

TEST_CASE("hostile numbers: no silent narrowing, wrapping or inf; each names the key and the value") {
  // float fields: 1e300 would be inf as a float
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"weight_decay": 1e300}}})",
          "\"optimizer.params.weight_decay\" must be <= 10, got 1e+300");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1000}}})", "\"optimizer.params.lr\" must be <= 10, got 1000");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"eps": 1e-60}}})",
          "\"optimizer.params.eps\" is too small for a 32-bit float, got 1e-60");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1e300]}}})",
          "\"optimizer.params.betas[1]\" must be <= 1, got 1e+300");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": [1, 0.9]}}})",
          "\"optimizer.params.betas[0]\" must be in [0, 1), got 1");
  refuses(R"({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": ["0.9", 0.9]}}})",
          "\"optimizer.params.betas[0]\" must be a number, got \"0.9\"");
  refuses(R"({"train_batch_size": 1, "gradient_clipping": 1e300})", "\"gradient_clipping\" must be <= ");
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "loss_scale": 1e39}})", "\"fp16.loss_scale\" must be <= ");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "cos_min_ratio": 2}}})",
          "\"scheduler.params.cos_min_ratio\" must be <= 1, got 2");
  // int fields: 2^32 + 64 would read as 64 through a 32-bit cast
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "hysteresis": 4294967360}})",
          "\"fp16.hysteresis\" must be <= 2147483647, got 4294967360");
  refuses(R"({"train_batch_size": 1, "fp16": {"enabled": true, "initial_scale_power": 128}})",
          "\"fp16.initial_scale_power\" must be <= 127, got 128");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": -1}})", "\"zero_optimization.stage\" must be >= 0, got -1");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 4294967298}})", "\"zero_optimization.stage\" must be <= 2147483647, got 4294967298");
  // int64 fields: unsigned beyond int64, integral floats beyond int64, negative counts
  refuses(R"({"train_batch_size": 18446744073709551615})", "\"train_batch_size\" must be <= 2147483647, got 18446744073709551615");
  refuses(R"({"train_batch_size": 1e300})", "\"train_batch_size\" must be <= 2147483647, got 1e+300");
  refuses(R"({"train_batch_size": 1, "steps_per_print": 1e19})", "\"steps_per_print\" must be <= 9223372036854775807, got 1e+19");
  refuses(R"({"train_batch_size": 1, "steps_per_print": -1e19})", "\"steps_per_print\" must be >= 1, got -1e+19");
  refuses(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": -5}})",
          "\"zero_optimization.reduce_bucket_size\" must be >= 1, got -5");
  refuses(R"({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 18446744073709551615}}})",
          "last_batch_iteration\" other than -1 is not supported");
  // in range they still read exactly
  auto c = resolved(R"({"train_batch_size": 2147483647, "steps_per_print": 9223372036854775807, "fp16": {"enabled": true, "hysteresis": 2147483647}})");
  CHECK(c.steps_per_print == 9223372036854775807LL);
  CHECK(c.fp16.hysteresis == 2147483647);
  // batch sizes whose product with the world size overflows, set by a caller after parsing
  auto d = parse(R"({"train_batch_size": 1})");
  d.train_batch_size_given = std::nullopt;
  d.micro_batch_given = std::int64_t{1} << 40, d.grad_accum_given = std::int64_t{1} << 40;
  CHECK_THROWS_WITH_AS(loom::io::resolve_ds_config(d, {.world_size = 1 << 20}), doctest::Contains("batch sizes out of range"), loom::error);
}

TEST_CASE("hostile structure: deep nesting and huge values give short messages naming the key") {
  // a value nested far deeper than any stack: quoting it in the message must stay bounded
  json j = {{"train_batch_size", nested(200000)}};
  std::string m = error_of([&] { loom::io::parse_ds_config(j); });
  CHECK(m.find("\"train_batch_size\" must be an integer, got [[[[") != std::string::npos);
  CHECK(m.size() < 400);
  j = {{"train_batch_size", 1}, {"fp16", nested(200000)}};
  m = error_of([&] { loom::io::parse_ds_config(j); });
  CHECK(m.find("\"fp16\" must be an object") != std::string::npos);
  CHECK(m.size() < 400);
  // a 20 MB string value, and a 20 MB unknown key
  const std::string big(20 << 20, 'x');
  j = {{"train_batch_size", 1}, {"optimizer", {{"type", big}}}};
  m = error_of([&] { loom::io::parse_ds_config(j); });
  CHECK(m.find("\"optimizer.type\" \"xxxx") != std::string::npos);
  CHECK(m.find("... (20971520 bytes)") != std::string::npos);
  CHECK(m.size() < 400);
  j = {{"train_batch_size", 1}, {big, 1}};
  m = error_of([&] { loom::io::parse_ds_config(j); });
  CHECK(m.find("unknown key \"xxxx") != std::string::npos);
  CHECK(m.size() < 1000);
  j = {{"train_batch_size", 1}, {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", big + "\x1b[2J"}}}}}};
  m = error_of([&] { loom::io::parse_ds_config(j); });
  CHECK(m.find("\"zero_optimization.offload_optimizer.device\" must be") != std::string::npos);
  CHECK(m.size() < 400);

  // from a file: nesting beyond the parser's limit is refused while parsing, naming the file
  const std::string path = std::string("/tmp/loom_ds_deep_") + std::to_string(::getpid()) + ".json";
  {
    std::ofstream f(path);
    f << R"({"train_batch_size": )" << std::string(100000, '[') << std::string(100000, ']') << "}";
  }
  m = error_of([&] { loom::io::load_ds_config(path); });
  CHECK(m.find(path) != std::string::npos);
  CHECK(m.find("nesting deeper than 64") != std::string::npos);
  {
    std::ofstream f(path);
    f << R"({"train_batch_size": ")" << big << "\x01\"}";  // invalid: a control byte ends a 20 MB string
  }
  m = error_of([&] { loom::io::load_ds_config(path); });
  CHECK(m.find("not valid JSON") != std::string::npos);
  CHECK(m.size() < 1000);
  std::remove(path.c_str());
}

TEST_CASE("param_groups and progressive_unfreezing: the seed's 30/40/30 recipe, and refusals naming the key") {
  auto c = parse(R"({"train_batch_size": 1,
    "param_groups": [{"name": "lora", "params": ["*lora_A*", "*lora_B*"], "lr": 3e-4, "weight_decay": 0},
                     {"name": "top", "layers": [-8, null], "lr": 3e-5},
                     {"name": "base", "lr": 1e-5}],
    "progressive_unfreezing": [{"until": 0.3, "trainable": ["lora"]}, {"until": 0.7, "trainable": ["lora", "top"]},
                               {"until": 1, "trainable": ["lora", "top", "base"]}]})");
  const auto& g = c.groups;
  REQUIRE(g.groups.size() == 3);
  CHECK(g.groups[0].patterns == std::vector<std::string>{"*lora_A*", "*lora_B*"});
  CHECK(*g.groups[0].lr == doctest::Approx(3e-4));
  CHECK(*g.groups[0].weight_decay == 0.f);
  CHECK(*g.groups[1].first_layer == -8);
  CHECK_FALSE(g.groups[1].last_layer);
  CHECK_FALSE(g.groups[1].weight_decay);
  CHECK(g.groups[2].name == "base");
  REQUIRE(g.phases.size() == 3);
  CHECK(g.phases[1].until == doctest::Approx(0.7));
  CHECK(g.phases[2].trainable == std::vector<std::string>{"lora", "top", "base"});
  // without the keys: no groups, nothing to check
  CHECK(parse(R"({"train_batch_size": 1})").groups.groups.empty());

  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"name": "a", "params": ["x"], "lr": 1e300}]})"),
                       doctest::Contains("param_groups[0].lr"), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"name": "a", "parms": ["x"]}]})"),
                       doctest::Contains("\"param_groups[0].parms\""), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"params": ["x"]}]})"),
                       doctest::Contains("param_groups[0].name\" is required"), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"name": "a", "layers": [1]}]})"),
                       doctest::Contains("param_groups[0].layers\" must be [first, last)"), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"name": "a", "params": "x"}]})"),
                       doctest::Contains("param_groups[0].params\" must be an array"), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "progressive_unfreezing": [{"until": 1.5, "trainable": ["base"]}]})"),
                       doctest::Contains("progressive_unfreezing[0].until"), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "progressive_unfreezing": [{"until": 1}]})"),
                       doctest::Contains("needs \"until\" and \"trainable\""), loom::error);
  CHECK_THROWS_WITH_AS(parse(R"({"train_batch_size": 1, "param_groups": [{"name": "lora", "params": ["*lora*"]}, {"name": "base", "lr": 1e-5}],
                                 "progressive_unfreezing": [{"until": 1, "trainable": ["lora"]}]})"),
                       doctest::Contains("group \"base\" is frozen in every phase but is given lr="), loom::error);
}
