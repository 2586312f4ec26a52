// The engine against an independent Python reference written from transformers' modeling_bert
// (tests/reference/bert_reference.py): logits equal within 1e-4 on generated checkpoints in every
// file format and dtype, for text pairs and padded batches of mixed lengths.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "server/model/attention_ops.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/engine.h"
#include "server/model/param_counts.h"
#include "server/model/state_dict.h"
#include "server/text/bert_tokenizer.h"
#include "tests/testing/test_util.h"

namespace collabserve::model {
namespace {

using json = nlohmann::json;
using testing::RunCommand;
using testing::ShellQuote;
using testing::TempDir;

std::vector<TokenizedInput> MakeInputs(const Engine& engine) {
  const auto& tok = engine.tokenizer();
  std::vector<std::pair<std::string, std::optional<std::string>>> texts = {
      {"i like strawberries", std::nullopt},
      {"The quick brown fox jumps over the lazy dog.", std::nullopt},
      {"Is this a question?", std::string("Yes, it is a question about questions.")},
      {"Café déjà vu — naïve résumé!", std::nullopt},
      {"short", std::string("a much longer second sentence that pads the first one out quite a bit")},
      {"东京 is in 日本, and 🙂 emoji are unknown", std::nullopt},
  };
  std::vector<TokenizedInput> out;
  for (auto& [a, b] : texts) {
    std::optional<std::string_view> bv;
    if (b) bv = *b;
    auto e = tok.Encode(a, bv, 0, true);
    EXPECT_TRUE(e.ok()) << e.status();
    out.push_back(TokenizedInput{e->input_ids, e->token_type_ids});
  }
  // A long input (near the model's maximum length) with deterministic ids.
  TokenizedInput longer;
  longer.input_ids.push_back(tok.cls_id());
  for (int i = 0; i < 180; ++i) longer.input_ids.push_back(1000 + (i * 7919) % 20000);
  longer.input_ids.push_back(tok.sep_id());
  longer.token_type_ids.assign(longer.input_ids.size(), 0);
  out.push_back(longer);
  return out;
}

std::vector<std::vector<float>> ReferenceLogits(const std::string& dir, const std::vector<TokenizedInput>& inputs) {
  TempDir tmp;
  json req;
  for (const auto& in : inputs) {
    req["input_ids"].push_back(in.input_ids);
    req["token_type_ids"].push_back(in.token_type_ids);
  }
  std::ofstream(tmp / "in.jsonl") << req.dump() << "\n";
  auto r = RunCommand(ShellQuote(testing::ReferencePython()) + " " +
                      ShellQuote(testing::SourceDir() + "/tests/reference/bert_reference.py") +
                      " " + ShellQuote(dir) + " < " + ShellQuote(tmp / "in.jsonl"));
  EXPECT_EQ(r.exit_code, 0) << "the Python reference failed (is python3-torch installed? run scripts/install-deps.sh)";
  json out = json::parse(r.output, nullptr, false);
  if (out.is_discarded() || !out.contains("logits")) {
    ADD_FAILURE() << "bad reference output: " << r.output;
    return {};
  }
  return out["logits"].get<std::vector<std::vector<float>>>();
}

struct Case {
  std::string name;
  MakeOptions options;
};

class EngineReferenceTest : public ::testing::TestWithParam<Case> {};

MakeOptions Opts(std::string preset, WeightFormat f, WeightDType d, std::string act = "gelu", int labels = 2,
                 std::string problem = "", int layers = 0, int hidden = 0, int heads = 0) {
  MakeOptions o;
  o.preset = preset;
  o.format = f;
  o.dtype = d;
  o.hidden_act = act;
  o.labels = labels;
  o.problem_type = problem;
  o.layers = layers;
  o.hidden = hidden;
  o.heads = heads;
  o.seed = 7;
  return o;
}

// The engine on `dir` against the reference: served (weights packed, plain ones released) and
// unpacked, with 1 intra-op thread (the per-operation path) and 2 (the ThreadTeam paths where the
// shape allows; LibTorch's default here is one thread without OMP_NUM_THREADS). The inputs batch
// to 7 × 182 tokens (> 256: the sgemm products; when served, on each weight unpacked by the team
// members together (637 rows each, above kPackedMaxMemberRows), or on blocks of it unpacked on
// the per-operation path) and run alone (<= 256: PackedLinear; attention in registers up to 48
// tokens, on the micro-kernel above).
void ExpectCpuMatchesReference(const std::string& dir, const std::string& name,
                               const std::vector<std::vector<float>>& expected) {
  std::vector<std::vector<float>> served;
  const int saved_threads = at::get_num_threads();
  for (bool pack : {true, false}) {
    EngineOptions eo;
    eo.pack_weights = pack;
    auto engine = Engine::Load(dir, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    auto inputs = MakeInputs(**engine);
    ASSERT_EQ(expected.size(), inputs.size());
    for (int threads : {1, 2}) {
      at::set_num_threads(threads);
      const std::string what =
          name + (pack ? ", packed" : ", unpacked") + ", " + std::to_string(threads) + " thread(s)";
      auto batched = (*engine)->Run(inputs);
      ASSERT_TRUE(batched.ok()) << batched.status();
      float max_diff = 0, max_vs_served = 0;
      const bool have_served = served.size() == inputs.size();
      for (size_t i = 0; i < inputs.size(); ++i) {
        ASSERT_EQ((*batched)[i].logits.size(), expected[i].size());
        for (size_t c = 0; c < expected[i].size(); ++c) {
          max_diff = std::max(max_diff, std::abs((*batched)[i].logits[c] - expected[i][c]));
          if (have_served) {
            max_vs_served = std::max(max_vs_served, std::abs((*batched)[i].logits[c] - served[i][c]));
          }
        }
        if (!have_served) served.push_back((*batched)[i].logits);
      }
      EXPECT_LT(max_diff, 1e-4) << what;
      EXPECT_LT(max_vs_served, 1e-4) << what << " against the served model, 1 thread";

      // A sequence's logits do not depend on what it is batched with (to float rounding: alone,
      // a sequence of <= 256 tokens runs on PackedLinear, whose summation order differs from the
      // sgemm's that the batch's products run on; up to 1.3e-5 seen on the collaborative models).
      for (size_t i = 0; i < inputs.size(); ++i) {
        auto alone = (*engine)->Run(std::vector<TokenizedInput>{inputs[i]});
        ASSERT_TRUE(alone.ok());
        for (size_t c = 0; c < expected[i].size(); ++c) {
          const float x = (*batched)[i].logits[c];
          EXPECT_NEAR((*alone)[0].logits[c], x, 3e-5 * std::max(1.0f, std::abs(x))) << what << ", input " << i;
        }
      }

      // The last two inputs batch to 2 × 182 = 364 tokens, between kPackedMaxRows and
      // kPackedMaxMemberRows: served, every product runs on PackedLinear (on one thread the whole
      // pass's rows, on two each member's share).
      const size_t first = inputs.size() - 2;
      ASSERT_EQ(inputs[first + 1].input_ids.size(), 182u);
      auto pair = (*engine)->Run(std::vector<TokenizedInput>{inputs[first], inputs[first + 1]});
      ASSERT_TRUE(pair.ok()) << pair.status();
      for (size_t j = 0; j < 2; ++j) {
        for (size_t c = 0; c < expected[first + j].size(); ++c) {
          EXPECT_NEAR((*pair)[j].logits[c], expected[first + j][c], 1e-4) << what << ", 2 × 182 tokens";
        }
      }
    }
  }
  at::set_num_threads(saved_threads);
}

// The largest |logit - expected| over a batch's predictions; infinite when the shapes differ
// (which fails every bound, with a message).
float MaxLogitDiff(const std::vector<Prediction>& got, const std::vector<std::vector<float>>& expected) {
  EXPECT_EQ(got.size(), expected.size());
  if (got.size() != expected.size()) return INFINITY;
  float max_diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[i].logits.size(), expected[i].size()) << "input " << i;
    if (got[i].logits.size() != expected[i].size()) return INFINITY;
    for (size_t c = 0; c < expected[i].size(); ++c) {
      max_diff = std::max(max_diff, std::abs(got[i].logits[c] - expected[i][c]));
    }
  }
  return max_diff;
}

// A collaborative model loaded with each way of putting its attention to ATen's
// (collab_attention.h): the same logits. They differ where attention runs on ATen ops, which the
// CPU's own kernels do not: under COLLABSERVE_GEMM=aten (engine_reference_aten_test: explicit
// products and a softmax) and COLLABSERVE_ATTENTION=sdpa (engine_reference_sdpa_test: SDPA).
// The inputs' batch is padded (the mask folds into each way) and the last layer is [CLS]-only.
void ExpectWaysMatchReference(const std::string& dir, const std::string& name,
                              const std::vector<std::vector<float>>& expected) {
  for (CollabAttention way : kAllCollabAttentions) {
    EngineOptions eo;
    eo.collab_attention = way;
    auto engine = Engine::Load(dir, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    if ((*engine)->info().collaborative_ranks.empty()) return;
    auto got = (*engine)->Run(MakeInputs(**engine));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(MaxLogitDiff(*got, expected), 1e-4) << name << ", " << CollabAttentionName(way);
  }
}

// On CUDA, where a GPU is present (none on the development machines, where this part does not
// run; scripts/gpu-check.sh runs it on a GPU machine): float32 within the same 1e-4 of the
// reference; float16 and bfloat16 within ~100 units of their roundoff (2^-11 and 2^-8) on logits
// of order 1. Measured on an H200 (torch 2.11, 2026-12-04) over these 10 models: at most 0.028
// in float16 (58 units) and 0.20 in bfloat16 (51 units).
void ExpectCudaMatchesReference(const std::string& dir, const std::string& name,
                                const std::vector<std::vector<float>>& expected) {
  if (at::hasCUDA()) {
    auto cpu = Engine::Load(dir);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto inputs = MakeInputs(**cpu);
    const std::vector<std::pair<std::string, float>> dtypes = {
        {"float32", 1e-4f}, {"float16", 5e-2f}, {"bfloat16", 4e-1f}};
    // A collaborative model in every way its attention can be put to SDPA (collab_attention.h).
    std::vector<CollabAttention> ways = {CollabAttention::kBias};
    if (!(*cpu)->info().collaborative_ranks.empty()) {
      ways.assign(std::begin(kAllCollabAttentions), std::end(kAllCollabAttentions));
    }
    for (const auto& [dtype, bound] : dtypes) {
      for (CollabAttention way : ways) {
        EngineOptions eo;
        eo.device = "cuda";
        eo.dtype = dtype;
        eo.collab_attention = way;
        auto cuda = Engine::Load(dir, eo);
        ASSERT_TRUE(cuda.ok()) << cuda.status();
        auto got = (*cuda)->Run(inputs);
        ASSERT_TRUE(got.ok()) << got.status();
        const float max_diff = MaxLogitDiff(*got, expected);
        const std::string what = ways.size() > 1 ? std::string(", ") + CollabAttentionName(way) : "";
        EXPECT_LT(max_diff, bound) << name << ", cuda " << dtype << what;
        std::printf("[ cuda     ] %s %s%s: max |logit - reference| %.3g (bound %.3g)\n", name.c_str(),
                    dtype.c_str(), what.c_str(), max_diff, bound);
      }
    }
  }
}

// The engine on the CPU, then on CUDA where there is a GPU, against the reference: each part on
// its own, so that a CPU failure (a fatal assertion returns from its function) leaves the CUDA
// results of the same GPU run.
void ExpectEngineMatchesReference(const std::string& dir, const std::string& name) {
  const std::vector<std::vector<float>> expected = [&] {
    auto engine = Engine::Load(dir);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? ReferenceLogits(dir, MakeInputs(**engine)) : std::vector<std::vector<float>>{};
  }();
  ASSERT_FALSE(expected.empty()) << name << ": no reference logits";
  ExpectCpuMatchesReference(dir, name, expected);
  ExpectWaysMatchReference(dir, name, expected);
  ExpectCudaMatchesReference(dir, name, expected);

  // The logits vary across inputs (the generated weights are not degenerate).
  float spread = 0;
  for (size_t i = 1; i < expected.size(); ++i) spread = std::max(spread, std::abs(expected[i][0] - expected[0][0]));
  EXPECT_GT(spread, 0.05) << name;
}

// engine_reference_sdpa_test runs this file under COLLABSERVE_ATTENTION=sdpa (and
// COLLABSERVE_GEMM=aten): attention on at::scaled_dot_product_attention, as on CUDA. A LibTorch
// without it would quietly run the other path.
TEST(EngineReferenceSdpaTest, SdpaIsThereWhenAskedFor) {
  const char* attention = std::getenv("COLLABSERVE_ATTENTION");
  if (attention != nullptr && std::string(attention) == "sdpa") {
    EXPECT_TRUE(internal::SdpaAvailable()) << "COLLABSERVE_ATTENTION=sdpa needs LibTorch >= 2.1";
    EXPECT_TRUE(internal::UseSdpa(at::zeros({1})));
  }
}

TEST_P(EngineReferenceTest, LogitsMatchTheReference) {
  TempDir dir;
  ASSERT_TRUE(MakeCheckpoint(dir.path(), GetParam().options).ok());
  ExpectEngineMatchesReference(dir.path(), GetParam().name);

}

// A collaborative checkpoint as a compression writes one: `base` with the layers whose entry of
// `ranks` is non-zero made collaborative, their W~Q, W~K, mixing and content vectors drawn at
// random (scaled so that attention is peaked and the content scores matter), every other tensor
// the standard checkpoint's.
void MakeCollaborativeCheckpoint(const std::string& dir, const MakeOptions& base,
                                 const std::vector<int>& ranks) {
  ASSERT_TRUE(MakeCheckpoint(dir, base).ok());
  auto standard_config = BertConfig::FromFile(dir + "/config.json");
  ASSERT_TRUE(standard_config.ok()) << standard_config.status();
  auto standard = LoadClassifier(dir, *standard_config);
  ASSERT_TRUE(standard.ok()) << standard.status();
  BertConfig config = *standard_config;
  config.collaborative.ranks = ranks;
  config.collaborative.algorithm = "cp-als";
  config.collaborative.source = "engine_reference_test";
  BertClassifier m(config);
  std::map<std::string, at::Tensor> src;
  for (const auto& item : (*standard)->named_parameters(true)) src[item.key()] = item.value();
  const double D = config.hidden_size;
  for (auto& item : m.named_parameters(true)) {
    const std::string& key = item.key();
    at::Tensor& t = item.value();
    if (auto it = src.find(key); it != src.end()) {
      t.copy_(it->second);
      continue;
    }
    const uint64_t seed = HashSeed(base.seed, key);
    const double rank = static_cast<double>(t.size(-1));
    const double stddev = key.find("mixing") != std::string::npos ? 3.0 / std::sqrt(rank) : 1.0 / std::sqrt(D);
    FillNormal(t.data_ptr<float>(), t.numel(), seed, stddev);
  }
  ASSERT_TRUE(SaveWeights(m, dir, WeightFormat::kSafetensors).ok());
  std::ofstream(dir + "/config.json") << config.ToJson();
}

struct CollaborativeCase {
  std::string name;
  std::string preset;
  std::vector<int> ranks;
};

class CollaborativeReferenceTest : public ::testing::TestWithParam<CollaborativeCase> {};

// Collaborative layers on every path (team on prepacked PackedLinear, team with the sgemm by rows,
// per operation; attention in registers and on the micro-kernel (on the sgemm under engine_reference_sgemm_attention_test); the [CLS]-only last layer), served and
// unpacked, against the reference's own evaluation of the paper's formula. Under
// COLLABSERVE_GEMM=aten (ctest engine_reference_aten_test) the same checks run the ATen path.
TEST_P(CollaborativeReferenceTest, LogitsMatchTheReference) {
  TempDir dir;
  MakeOptions o = Opts(GetParam().preset, WeightFormat::kSafetensors, WeightDType::kF32, "gelu", 3);
  MakeCollaborativeCheckpoint(dir.path(), o, GetParam().ranks);
  if (HasFatalFailure()) return;
  auto engine = Engine::Load(dir.path());
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().collaborative_ranks, GetParam().ranks);
  ExpectEngineMatchesReference(dir.path(), GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, CollaborativeReferenceTest,
    ::testing::Values(
        // mini: 4 layers, 4 heads of d_k = 64 (the team paths).
        CollaborativeCase{"below_at_above_dk_then_standard", "mini", {24, 64, 100, 0}},
        CollaborativeCase{"standard_first_last_collaborative", "mini", {0, 200, 0, 37}},
        CollaborativeCase{"all_collaborative", "mini", {32, 32, 32, 32}},
        // tiny: 2 layers, 4 heads of d_k = 16 (per-operation path only).
        CollaborativeCase{"tiny_below_and_above_dk", "tiny", {8, 40}}),
    [](const auto& info) { return info.param.name; });


INSTANTIATE_TEST_SUITE_P(
    Checkpoints, EngineReferenceTest,
    ::testing::Values(
        Case{"safetensors_f32", Opts("tiny", WeightFormat::kSafetensors, WeightDType::kF32)},
        Case{"torch_bin", Opts("tiny", WeightFormat::kTorchBin, WeightDType::kF32)},
        Case{"safetensors_f16", Opts("tiny", WeightFormat::kSafetensors, WeightDType::kF16)},
        Case{"safetensors_bf16", Opts("tiny", WeightFormat::kSafetensors, WeightDType::kBF16)},
        Case{"mini_gelu_new_multilabel",
             Opts("mini", WeightFormat::kSafetensors, WeightDType::kF32, "gelu_new", 3, "multi_label_classification")},
        Case{"relu_three_heads", Opts("tiny", WeightFormat::kTorchBin, WeightDType::kF32, "relu", 4, "", 3, 48, 3)}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace collabserve::model
