// Conversion to collaborative attention, end to end: exactness at full rank, agreement with an
// independent evaluation of the paper's formula, the dropped key bias, rank selection, the saved
// format, and clear refusals.
#include "server/compress/collaborative.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "server/compress/collaborative_internal.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/engine.h"
#include "server/model/io/checkpoint.h"
#include "server/model/io/safetensors.h"
#include "server/model/param_counts.h"
#include "server/model/state_dict.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/process_env.h"
#include "tests/compress/compress_test_util.h"
#include "tests/testing/test_util.h"

namespace collabserve::compress {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;
using testing::ShellQuote;
using testing::TempDir;

std::vector<model::TokenizedInput> Inputs(const model::Engine& e) {
  std::vector<model::TokenizedInput> out;
  for (const char* t : {"the cat sat on the mat", "a completely different and rather longer sentence here",
                        "why?", "Stocks fell sharply after the central bank raised interest rates."}) {
    auto enc = e.tokenizer().Encode(t, std::nullopt, 0, true);
    out.push_back({enc->input_ids, enc->token_type_ids});
  }
  return out;
}

std::vector<std::vector<float>> Logits(const std::string& dir) {
  auto e = model::Engine::Load(dir);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  auto preds = (*e)->Run(Inputs(**e));
  EXPECT_TRUE(preds.ok());
  std::vector<std::vector<float>> out;
  for (auto& p : *preds) out.push_back(p.logits);
  return out;
}

float MaxDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::abs(a[i][j] - b[i][j]));
  return m;
}

using compress_testing::Rank;

// n calibration texts of 6 to 14 words.
std::vector<std::string> CalibrationTexts(int n) {
  const char* words[] = {"the", "market", "rose", "after", "a", "quiet", "night", "of", "rain",
                         "and", "music", "from", "old", "radio", "stations", "near", "river"};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    std::string t;
    for (int j = 0; j < 6 + i % 9; ++j) t += std::string(j ? " " : "") + words[(i * 7 + j * 5) % 17];
    out.push_back(t);
  }
  return out;
}

class CollaborativeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::MakeOptions m;
    m.seed = 11;
    ASSERT_TRUE(model::MakeCheckpoint(src_.path(), m).ok());
  }
  // A 4-layer checkpoint in work_/four (the CUDA comparisons' model).
  void MakeFourLayers() {
    model::MakeOptions m;
    m.seed = 13;
    m.layers = 4;
    ASSERT_TRUE(model::MakeCheckpoint(work_ / "four", m).ok());
  }
  TempDir src_, work_;
};

TEST_F(CollaborativeTest, FullRankIsExact) {
  // Standard attention is the block special case of collaborative attention: at D~ = N_h·d_k the
  // converted model gives the same logits.
  auto report = CompressModelDirectory(src_.path(), work_ / "out", Rank(64));
  ASSERT_TRUE(report.ok()) << report.status();
  for (const auto& l : report->layers) {
    EXPECT_TRUE(l.exact);
    EXPECT_LT(l.relative_error, 1e-6);
  }
  EXPECT_LT(MaxDiff(Logits(src_.path()), Logits(work_ / "out")), 1e-4);
  EXPECT_DOUBLE_EQ(report->fidelity.top1_agreement, 1.0);
  EXPECT_LT(report->fidelity.mean_kl, 1e-8);
}

TEST_F(CollaborativeTest, LowRankMatchesAnIndependentEvaluationOfTheFormula) {
  // The Python reference evaluates score_i = (X W~Q) diag(m_i) (Y W~K)^T + 1 v_i^T Y^T itself.
  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "out", Rank(24)).ok());
  auto engine = model::Engine::Load(work_ / "out");
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().collaborative_ranks, (std::vector<int>{24, 24}));
  auto inputs = Inputs(**engine);
  nlohmann::json req;
  for (auto& in : inputs) {
    req["input_ids"].push_back(in.input_ids);
    req["token_type_ids"].push_back(in.token_type_ids);
  }
  std::ofstream(work_ / "in.jsonl") << req.dump() << "\n";
  auto r = RunCommand(ShellQuote(testing::ReferencePython()) + " " + ShellQuote(testing::SourceDir() + "/tests/reference/bert_reference.py") +
                      " " + ShellQuote(work_ / "out") + " < " + ShellQuote(work_ / "in.jsonl"));
  ASSERT_EQ(r.exit_code, 0);
  auto expected = nlohmann::json::parse(r.output)["logits"].get<std::vector<std::vector<float>>>();
  auto preds = (*engine)->Run(inputs);
  ASSERT_TRUE(preds.ok());
  std::vector<std::vector<float>> got;
  for (auto& p : *preds) got.push_back(p.logits);
  EXPECT_LT(MaxDiff(got, expected), 1e-4);
}

TEST_F(CollaborativeTest, ErrorFallsAsRankGrowsAndFidelityFollows) {
  double last_error = 2;
  for (int r : {8, 24, 48}) {
    auto report = CompressModelDirectory(src_.path(), work_ / (std::string("r") + std::to_string(r)), Rank(r));
    ASSERT_TRUE(report.ok()) << report.status();
    double err = 0;
    for (const auto& l : report->layers) err = std::max(err, l.relative_error);
    EXPECT_LT(err, last_error) << "rank " << r;
    last_error = err;
    EXPECT_LT(report->qk_params_after, report->qk_params_before);
  }
}

TEST_F(CollaborativeTest, KeyBiasDoesNotMatter) {
  // The key bias adds a constant per query row, which the softmax cancels: the original model's
  // logits do not change when it is zeroed, so dropping it in the conversion loses nothing.
  auto before = Logits(src_.path());
  auto ckpt = model::io::ReadCheckpointFile(src_ / "model.safetensors");
  ASSERT_TRUE(ckpt.ok());
  std::map<std::string, at::Tensor> m;
  for (auto& [k, raw] : ckpt->tensors) m[k] = *model::RawToFloatTensor(raw, k);
  for (auto& [k, t] : m) {
    if (k.find("attention.self.key.bias") != std::string::npos) t.normal_(0, 3.0);
  }
  std::vector<model::io::TensorToWrite> out;
  for (auto& [k, t] : m) out.push_back({k, model::io::DType::kF32, t.sizes().vec(), t.data_ptr()});
  ASSERT_TRUE(model::io::WriteSafetensors(src_ / "model.safetensors", out, {}).ok());
  EXPECT_LT(MaxDiff(before, Logits(src_.path())), 1e-4);
  // And the converted models from both agree.
  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "out", Rank(64)).ok());
  EXPECT_LT(MaxDiff(before, Logits(work_ / "out")), 1e-4);
}

TEST_F(CollaborativeTest, QueryBiasSurvivesAsContentVector) {
  // Unlike the key bias, the query bias matters; the conversion keeps it as v_i = W_K^(i) b_Q^(i).
  auto config = model::BertConfig::FromFile(src_ / "config.json");
  auto src = model::LoadClassifier(src_.path(), *config);
  ASSERT_TRUE(src.ok());
  CompressReport report;
  auto conv = ConvertToCollaborative(**src, Rank(64), &report);
  ASSERT_TRUE(conv.ok());
  const auto& l = (*conv)->layers()[0];
  EXPECT_GT(l.content_bias.abs().max().item<float>(), 1e-3);
  const auto& s = (*src)->layers()[0];
  at::Tensor expected = at::matmul(s.key_w.view({4, 16, 64}).transpose(1, 2), s.query_b.view({4, 16, 1})).squeeze(2) / 4.0;
  EXPECT_TRUE(at::allclose(l.content_bias, expected, 1e-5, 1e-6));
}

TEST_F(CollaborativeTest, MaxErrorPicksTheSmallestSufficientRank) {
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kMaxError;
  o.spec.max_error = 0.3;
  auto report = CompressModelDirectory(src_.path(), work_ / "out", o);
  ASSERT_TRUE(report.ok()) << report.status();
  auto config = model::BertConfig::FromFile(src_ / "config.json");
  auto src = model::LoadClassifier(src_.path(), *config);
  for (const auto& l : report->layers) {
    EXPECT_LE(l.relative_error, 0.3);
    EXPECT_GT(l.ranks_tried, 1);
    // A binary search over the ranks 1..64 decomposes at most 7 of them (it reported one more).
    EXPECT_LE(l.ranks_tried, 7);
    if (l.rank > 1 && l.rank < 64) {
      // One step below the chosen rank the error is above the bound.
      CompressOptions lower = Rank(l.rank - 1);
      CompressReport r;
      ASSERT_TRUE(ConvertToCollaborative(**src, lower, &r).ok());
      EXPECT_GT(r.layers[l.layer].relative_error, 0.3) << "layer " << l.layer << " rank " << l.rank;
    }
  }
}

TEST_F(CollaborativeTest, PlantedRedundancyCompressesBetterThanRandomWeights) {
  model::MakeOptions m;
  m.seed = 11;
  m.planted_rank = 16;
  ASSERT_TRUE(model::MakeCheckpoint(work_ / "planted", m).ok());
  auto planted = CompressModelDirectory(work_ / "planted", work_ / "p_out", Rank(32));
  auto random = CompressModelDirectory(src_.path(), work_ / "r_out", Rank(32));
  ASSERT_TRUE(planted.ok() && random.ok());
  EXPECT_LT(planted->layers[0].relative_error, random->layers[0].relative_error / 2);
  EXPECT_GE(planted->fidelity.top1_agreement, random->fidelity.top1_agreement);
}

TEST_F(CollaborativeTest, PerLayerRanksAndStandardLayers) {
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kPerLayer;
  o.spec.ranks = {0, 16};
  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "out", o).ok());
  auto engine = model::Engine::Load(work_ / "out");
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().collaborative_ranks, (std::vector<int>{0, 16}));
  EXPECT_LT((*engine)->info().params.attention_qk, 2 * 2 * (64 * 64 + 64));
}

// An upload job compresses the model its validation engine loaded instead of reading the
// checkpoint again: the result must be the same files as compressing the directory.
TEST_F(CollaborativeTest, CompressingTheEnginesModelEqualsCompressingTheDirectory) {
  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "from_dir", Rank(24)).ok());
  model::EngineOptions unpacked;
  unpacked.pack_weights = false;  // as upload jobs load it
  auto engine = model::Engine::Load(src_.path(), unpacked);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto logits = [&] {
    auto preds = (*engine)->Run(Inputs(**engine));
    EXPECT_TRUE(preds.ok());
    std::vector<std::vector<float>> got;
    for (auto& p : *preds) got.push_back(p.logits);
    return got;
  };
  const std::vector<std::vector<float>> before = logits();
  std::vector<std::string> steps;
  CompressOptions o = Rank(24);
  o.on_step = [&steps](const std::string& s) { steps.push_back(s); };
  auto report = CompressLoadedModel((*engine)->classifier(), src_.path(), work_ / "from_engine", o);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(steps, (std::vector<std::string>{"convert", "fidelity", "write"}));
  auto read = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_TRUE(read(work_ / "from_dir/model.safetensors") ==
              read(work_ / "from_engine/model.safetensors"));
  // The engine's model is untouched and still serves the original logits.
  EXPECT_EQ(MaxDiff(logits(), before), 0);
  EXPECT_LT(MaxDiff(before, Logits(src_.path())), 1e-5);  // the served (packed) form
  // A collaborative engine is refused.
  auto collab = model::Engine::Load(work_ / "from_dir");
  ASSERT_TRUE(collab.ok()) << collab.status();
  EXPECT_THAT(std::string(CompressLoadedModel((*collab)->classifier(), work_ / "from_dir",
                                              work_ / "again", Rank(8)).status().message()),
              HasSubstr("already collaborative"));
  EXPECT_FALSE(std::filesystem::exists(work_ / "again"));
  // A served engine keeps its dense weights only packed: refused by name, nothing written (on
  // CPUs without AVX-512 nothing is packed and the compression runs).
  auto served = model::Engine::Load(src_.path());
  ASSERT_TRUE(served.ok()) << served.status();
  if ((*served)->classifier().weights_released()) {
    auto refused = CompressLoadedModel((*served)->classifier(), src_.path(), work_ / "served", Rank(8));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("pack_weights = false"));
    EXPECT_FALSE(std::filesystem::exists(work_ / "served"));
  }
}

// The compressed model costs only its new attention tensors: everything the conversion leaves
// unchanged shares the original's storage.
TEST_F(CollaborativeTest, UnchangedParametersShareTheOriginalsStorage) {
  auto config = model::BertConfig::FromFile(src_ / "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  auto source = model::LoadClassifier(src_.path(), *config);
  ASSERT_TRUE(source.ok()) << source.status();
  (*source)->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
  CompressReport report;
  auto out = ConvertToCollaborative(**source, Rank(16), &report);
  ASSERT_TRUE(out.ok()) << out.status();
  std::map<std::string, at::Tensor> src;
  for (const auto& item : (*source)->named_parameters(true)) src[item.key()] = item.value();
  int shared = 0;
  for (const auto& item : (*out)->named_parameters(true)) {
    auto it = src.find(item.key());
    if (it == src.end()) continue;  // a new collaborative tensor
    EXPECT_EQ(item.value().data_ptr(), it->second.data_ptr()) << item.key();
    ++shared;
  }
  EXPECT_GT(shared, 10);
  // The layers' own handles see the shared tensors too.
  EXPECT_EQ((*out)->layers()[0].value_w.data_ptr(), (*source)->layers()[0].value_w.data_ptr());
  EXPECT_EQ((*out)->layers()[1].inter_w.data_ptr(), (*source)->layers()[1].inter_w.data_ptr());
}

// Restores this thread's ATen thread count and OpenBLAS's at the end of a test that changes them.
class ThreadCountsRestorer {
 public:
  ThreadCountsRestorer() : aten_(at::get_num_threads()), blas_(util::BlasThreads()) {}
  ~ThreadCountsRestorer() {
    at::set_num_threads(aten_);
    if (blas_ > 0) util::SetBlasThreads(blas_);
  }

 private:
  const int aten_, blas_;
};

TEST(ResolveParallelLayersTest, AutomaticIsOneLayerPerCpuAtTheCallersThreadCount) {
  ThreadCountsRestorer restore;
  const int cpus = util::UsableCpus();
  at::set_num_threads(1);
  EXPECT_EQ(*ResolveParallelLayers(0, 1000, /*on_cpu=*/true), cpus);
  EXPECT_EQ(*ResolveParallelLayers(0, 1, true), 1);  // never more workers than layers
  at::set_num_threads(cpus);
  EXPECT_EQ(*ResolveParallelLayers(0, 1000, true), 1);
  EXPECT_EQ(*ResolveParallelLayers(0, 1000, /*on_cpu=*/false), 1);
  EXPECT_EQ(*ResolveParallelLayers(3, 1000, true), 3);  // an explicit count is taken as given
  EXPECT_EQ(*ResolveParallelLayers(3, 2, true), 2);
  EXPECT_THAT(std::string(ResolveParallelLayers(-1, 12, true).status().message()),
              HasSubstr("parallel_layers must be 0 (automatic) or positive, got -1"));
}

// Decomposing layers at once, in a work queue that starts with the costliest, gives the same
// factors as decomposing them one by one: each layer has its own seed and thread count, and only
// the order changes. OpenBLAS's pool, pinned to one thread while layers run at once, is restored.
TEST_F(CollaborativeTest, FactorsDoNotDependOnParallelLayers) {
  model::MakeOptions m;
  m.seed = 5;
  m.layers = 5;
  ASSERT_TRUE(model::MakeCheckpoint(work_ / "five", m).ok());
  auto config = model::BertConfig::FromFile(work_ / "five/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  auto source = model::LoadClassifier(work_ / "five", *config);
  ASSERT_TRUE(source.ok()) << source.status();
  (*source)->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);

  ThreadCountsRestorer restore;
  at::set_num_threads(1);  // every layer runs single-threaded, whatever parallel_layers is
  const bool has_openblas = util::SetBlasThreads(2);
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kPerLayer;
  o.spec.ranks = {8, 24, 0, 40, 16};
  o.tol = 0;
  o.max_iters = 30;
  o.seed = 3;
  std::vector<at::Tensor> expected;
  for (int p : {1, 2, 3, 0}) {
    // The serial run pins OpenBLAS as the parallel ones do, so that all run the same arithmetic.
    if (p == 1 && has_openblas) util::SetBlasThreads(1);
    o.parallel_layers = p;
    std::vector<int> done;
    std::mutex mu;
    o.on_layer = [&](const LayerReport& lr) {
      std::lock_guard<std::mutex> lock(mu);
      done.push_back(lr.layer);
    };
    CompressReport report;
    auto out = ConvertToCollaborative(**source, o, &report);
    ASSERT_TRUE(out.ok()) << out.status();
    if (p == 1 && has_openblas) util::SetBlasThreads(2);
    EXPECT_EQ(report.parallel_layers, p == 0 ? std::min(util::UsableCpus(), 5) : p);
    if (has_openblas) {
      EXPECT_EQ(util::BlasThreads(), 2) << "parallel_layers " << p;
    }
    if (p == 1) {
      // One worker takes the queue in order: highest rank first, the standard layer last.
      EXPECT_EQ(done, (std::vector<int>{3, 1, 4, 0, 2}));
    } else {
      EXPECT_EQ(done.size(), 5u);
    }
    std::vector<at::Tensor> got;
    for (int i : {0, 1, 3, 4}) {
      const model::EncoderLayer& l = (*out)->layers()[i];
      EXPECT_EQ(l.rank, o.spec.ranks[i]);
      got.insert(got.end(), {l.collab_query_w, l.collab_key_w, l.mixing, l.content_bias});
    }
    if (expected.empty()) {
      expected = got;
      continue;
    }
    for (size_t t = 0; t < got.size(); ++t) {
      EXPECT_TRUE(at::equal(got[t], expected[t])) << "parallel_layers " << p << ", tensor " << t;
    }
  }
}

// On a GPU (none on the development machines: scripts/gpu-check.sh runs this there) the whole
// conversion with CP-ALS on CUDA gives the CPU's: plain and activation-aware (calibration text),
// from the SVD and from a random start, per-layer ranks with a full-rank layer (the exact block
// form) and a standard one. The same per-layer errors (float32 sweeps: 1e-4, as cp_als_test's
// device check) and compressed models whose logits agree within 1e-2 (on an H200, torch 2.11,
// 2026-12-04: at most 0.002, whitened from the SVD start; 1.5e-5 to 6.5e-4 for the others).
TEST_F(CollaborativeTest, CudaConversionAgreesWithTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  ASSERT_NO_FATAL_FAILURE(MakeFourLayers());
  const std::vector<std::string> calibration = CalibrationTexts(40);
  for (bool whiten : {false, true}) {
    for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
      CompressOptions o;
      o.spec.kind = RankSpec::Kind::kPerLayer;
      o.spec.ranks = {64, 24, 0, 12};
      o.tol = 0;
      o.max_iters = 20;
      o.seed = 3;
      o.init = init;
      if (whiten) o.calibration = calibration;
      const std::string what = std::string(whiten ? "whitened" : "plain") +
                               (init == CpAlsOptions::Init::kSvd ? ", svd start" : ", random start");
      const std::string tag = std::to_string(whiten) + std::to_string(static_cast<int>(init));
      auto cpu = CompressModelDirectory(work_ / "four", work_ / ("cpu" + tag), o);
      o.device = "cuda";
      auto gpu = CompressModelDirectory(work_ / "four", work_ / ("gpu" + tag), o);
      ASSERT_TRUE(cpu.ok()) << what << ": " << cpu.status();
      ASSERT_TRUE(gpu.ok()) << what << ": " << gpu.status();
      ASSERT_EQ(cpu->layers.size(), gpu->layers.size());
      for (size_t i = 0; i < cpu->layers.size(); ++i) {
        EXPECT_EQ(gpu->layers[i].rank, cpu->layers[i].rank) << what << ", layer " << i;
        EXPECT_EQ(gpu->layers[i].exact, cpu->layers[i].exact) << what << ", layer " << i;
        EXPECT_NEAR(gpu->layers[i].relative_error, cpu->layers[i].relative_error, 1e-4) << what << ", layer " << i;
        EXPECT_NEAR(gpu->layers[i].activation_error, cpu->layers[i].activation_error, 1e-4)
            << what << ", layer " << i;
      }
      const float diff = MaxDiff(Logits(work_ / ("cpu" + tag)), Logits(work_ / ("gpu" + tag)));
      EXPECT_LT(diff, 1e-2) << what;
      std::printf("[ cuda     ] conversion %s: max |logit(cuda CP) - logit(cpu CP)| %.3g\n", what.c_str(), diff);
    }
  }
}

// On a GPU the model passes run there as well (CompressOptions::device): the calibration statistics,
// the compressed model's own inputs, the rank search's measurements and the fidelity probes. They
// give the CPU's statistics, errors, measurements and fidelity within float32 rounding and the
// CUDA CP-ALS's difference (the test above).
TEST_F(CollaborativeTest, CudaModelPassesAgreeWithTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  ASSERT_NO_FATAL_FAILURE(MakeFourLayers());
  {
    // The calibration statistics themselves, of the original: E[x xᵀ] and E[x] per layer within
    // float32 rounding of the passes (each batch's product is float64 on the GPU, float32 on the
    // CPU). What the compressions below build on, without their CP-ALS.
    auto m = compress_testing::LoadPrepared(work_ / "four");
    ASSERT_TRUE(m);
    auto on_gpu = internal::PassModel::On(*m, c10::Device("cuda"));
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
    const std::vector<std::string> texts = CalibrationTexts(60);
    auto cpu = CollectCalibrationStats(*m, work_ / "four", texts);
    auto gpu = CollectCalibrationStats(on_gpu->get(), work_ / "four", texts);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(gpu->tokens, cpu->tokens);
    ASSERT_EQ(gpu->second_moment.size(), cpu->second_moment.size());
    for (size_t l = 0; l < cpu->second_moment.size(); ++l) {
      EXPECT_TRUE(gpu->second_moment[l].is_cpu() && gpu->second_moment[l].scalar_type() == at::kDouble);
      const double m2 = (gpu->second_moment[l] - cpu->second_moment[l]).abs().max().item<double>();
      const double mu = (gpu->mean[l] - cpu->mean[l]).abs().max().item<double>();
      EXPECT_LT(m2, 1e-4 * cpu->second_moment[l].abs().max().item<double>()) << "layer " << l;
      EXPECT_LT(mu, 1e-4 * cpu->mean[l].abs().max().item<double>()) << "layer " << l;
      std::printf("[ cuda     ] statistics of layer %zu's inputs: max |Δ E[xxᵀ]| %.3g, max |Δ E[x]| %.3g\n", l, m2, mu);
    }
  }
  CompressOptions inputs;  // each layer whitened by its inputs in the partly compressed model
  inputs.spec.kind = RankSpec::Kind::kPerLayer;
  inputs.spec.ranks = {32, 24, 0, 12};
  inputs.whiten_compressed_inputs = true;
  CompressOptions target;  // the rank search
  target.spec.kind = RankSpec::Kind::kTargetAgreement;
  target.spec.target_agreement = 0.9;
  for (const auto& [what, options] : {std::pair<std::string, CompressOptions>{"compressed inputs", inputs},
                                      std::pair<std::string, CompressOptions>{"target search", target}}) {
    SCOPED_TRACE(what);
    CompressOptions o = options;
    o.calibration = CalibrationTexts(60);
    o.max_iters = 20;
    o.tol = 0;
    o.seed = 3;
    auto cpu = CompressModelDirectory(work_ / "four", work_ / ("cpu " + what), o);
    o.device = "cuda";
    auto gpu = CompressModelDirectory(work_ / "four", work_ / ("gpu " + what), o);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(gpu->calibration_tokens, cpu->calibration_tokens);
    EXPECT_EQ(gpu->fidelity.probes, cpu->fidelity.probes);
    if (what == "target search") {
      // Each layer's KL alone at two ranks: the same decompositions up to CP-ALS on CUDA.
      ASSERT_EQ(gpu->search.layer_kl.size(), cpu->search.layer_kl.size());
      for (size_t i = 0; i < cpu->search.layer_kl.size(); ++i) {
        for (size_t k = 0; k < cpu->search.layer_kl[i].size(); ++k) {
          EXPECT_NEAR(gpu->search.layer_kl[i][k], cpu->search.layer_kl[i][k], 0.05 * cpu->search.layer_kl[i][k])
              << "layer " << i << ", point " << k;
        }
      }
      EXPECT_GE(gpu->fidelity.top1_agreement, 0.9);
    }
    std::string ranks;
    bool same_ranks = gpu->layers.size() == cpu->layers.size();
    for (size_t i = 0; i < cpu->layers.size() && i < gpu->layers.size(); ++i) {
      ranks += std::to_string(cpu->layers[i].rank) + "/" + std::to_string(gpu->layers[i].rank) + " ";
      same_ranks &= cpu->layers[i].rank == gpu->layers[i].rank;
    }
    std::printf("[ cuda     ] %s: ranks (cpu/cuda) %s; top-1 agreement %.4f / %.4f, mean KL %.4g / %.4g\n",
                what.c_str(), ranks.c_str(), cpu->fidelity.top1_agreement, gpu->fidelity.top1_agreement,
                cpu->fidelity.mean_kl, gpu->fidelity.mean_kl);
    if (!same_ranks) continue;  // a search may settle one step apart on a borderline trial
    // The bounds, measured on the CPU with a run's hidden states rounded (each multiplied by
    // 1 + 1e-6·N(0, 1) in the statistics; 46 draws) or its statistics' products in float64 (the
    // GPU's; float32 on the CPU). The search whitens by the original's inputs: its activation errors
    // moved by 1e-6 at most, its KL by 1e-5 relative. Whitening by the compressed model's inputs
    // is chaotic on this random-weight model: CP-ALS amplifies what a layer's statistics inherit
    // from the converted layers before it, by up to 0.55% (layer 1) and 1.8% (layer 3) of the
    // activation errors and −37% to +8% of the KL. Whitening by the original's inputs instead
    // moves layer 1 by 1.9%, layer 3 by 1.4% and the KL by +40%: within reach of rounding but for
    // a thin margin at layer 1, so here the passes are held to the statistics above and to sanity
    // bounds (whitening_test checks which inputs whiten a layer). CUDA's CP-ALS differs from the
    // CPU's by more than rounding the hidden states does; its stand-in here, CP-ALS in float64
    // instead of float32 on the CPU, moved the chaotic case's layers 1 and 3 by 0.77% and 1.4% and
    // its KL by −38.5% (the search's errors by 5e-6 at most, its layer KLs by 1.3e-4 relative, its
    // KL by 0.01%): the KL is held within a factor of 3, which a wrong pass would still break.
    const bool chaotic = what == "compressed inputs";
    for (size_t i = 0; i < cpu->layers.size(); ++i) {
      EXPECT_NEAR(gpu->layers[i].activation_error, cpu->layers[i].activation_error,
                  chaotic ? 0.05 * std::abs(cpu->layers[i].activation_error) : 1e-4)
          << "layer " << i;
    }
    if (chaotic) {
      EXPECT_GT(gpu->fidelity.mean_kl, cpu->fidelity.mean_kl / 3);
      EXPECT_LT(gpu->fidelity.mean_kl, cpu->fidelity.mean_kl * 3);
    } else {
      EXPECT_NEAR(gpu->fidelity.mean_kl, cpu->fidelity.mean_kl, 0.05 * cpu->fidelity.mean_kl + 1e-7);
    }
    EXPECT_NEAR(gpu->fidelity.top1_agreement, cpu->fidelity.top1_agreement, 1.5 / cpu->fidelity.probes);
  }
}

// The copy a GPU's model passes run on (calibration, the rank search, the fidelity probes), made
// here on the CPU: its model's logits exactly, standard and collaborative, and the model itself
// left as it was (its handles keep their storage, its logits their values).
TEST_F(CollaborativeTest, APassCopyGivesItsModelsLogitsAndLeavesItAlone) {
  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "c16", Rank(16)).ok());
  const at::Tensor ids = at::arange(1, 25, at::kLong).view({2, 12}).remainder(90).add(5);
  const at::Tensor types = at::zeros_like(ids);
  at::Tensor mask = at::ones_like(ids);
  mask[1].narrow(0, 8, 4).zero_();
  for (const std::string& dir : {src_.path(), work_ / "c16"}) {
    SCOPED_TRACE(dir);
    auto config = model::BertConfig::FromFile(dir + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    auto m = model::LoadClassifier(dir, *config);
    ASSERT_TRUE(m.ok()) << m.status();
    (*m)->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
    c10::InferenceMode guard;
    const at::Tensor before = (*m)->Forward(ids, types, mask);
    const void* value_w = (*m)->layers()[0].value_w.data_ptr();
    {
      auto copy = internal::PassModel::On(**m, c10::Device(c10::kCPU), /*copy=*/true);
      ASSERT_TRUE(copy.ok()) << copy.status();
      ASSERT_NE(&copy->get(), m->get());
      EXPECT_EQ(copy->get().config().collaborative.ranks, (*m)->config().collaborative.ranks);
      EXPECT_TRUE(at::equal(copy->get().Forward(ids, types, mask), before));
    }
    EXPECT_EQ((*m)->layers()[0].value_w.data_ptr(), value_w);
    EXPECT_TRUE(at::equal((*m)->Forward(ids, types, mask), before));
    auto same = internal::PassModel::On(**m, c10::Device(c10::kCPU));
    ASSERT_TRUE(same.ok());
    EXPECT_EQ(&same->get(), m->get());  // already where its passes run: no copy
  }
  // A model prepared for serving keeps its dense weights packed only (on CPUs that pack them).
  auto config = model::BertConfig::FromFile(src_.path() + "/config.json");
  auto served = model::LoadClassifier(src_.path(), *config);
  ASSERT_TRUE(served.ok());
  (*served)->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/true);
  if ((*served)->weights_released()) {
    auto copy = internal::PassModel::On(**served, c10::Device(c10::kCPU), /*copy=*/true);
    EXPECT_EQ(copy.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(copy.status().message()), HasSubstr("pack_weights = false"));
  }
}

TEST_F(CollaborativeTest, BadRequestsAreRefusedAndWriteNothing) {
  auto msg = [&](const CompressOptions& o) {
    return std::string(CompressModelDirectory(src_.path(), work_ / "out", o).status().message());
  };
  EXPECT_THAT(msg(Rank(0)), HasSubstr("rank must be at least 1"));
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kPerLayer;
  o.spec.ranks = {8, 8, 8};
  EXPECT_THAT(msg(o), HasSubstr("ranks has 3 entries but the model has 2 layers"));
  o.spec.kind = RankSpec::Kind::kRatio;
  o.spec.ratio = 0.5;
  EXPECT_THAT(msg(o), HasSubstr("ratio must be a number >= 1"));
  o.spec.kind = RankSpec::Kind::kMaxError;
  o.spec.max_error = 2;
  EXPECT_THAT(msg(o), HasSubstr("max_error must be in (0, 1)"));
  CompressOptions negative = Rank(8);
  negative.parallel_layers = -2;
  EXPECT_THAT(msg(negative), HasSubstr("parallel_layers must be 0 (automatic) or positive"));
  CompressOptions no_time = Rank(8);
  no_time.search_seconds = -5;
  EXPECT_THAT(msg(no_time), HasSubstr("search_seconds must be >= 0 (0: no limit), got -5"));
  no_time.search_seconds = std::nan("");
  EXPECT_THAT(msg(no_time), HasSubstr("search_seconds must be >= 0"));
  // Refused before the calibration pass, not after it.
  CompressOptions calibrated = Rank(0);
  calibrated.calibration.assign(20, "a calibration text about films");
  std::vector<std::string> steps;
  calibrated.on_step = [&](const std::string& step) { steps.push_back(step); };
  EXPECT_THAT(msg(calibrated), HasSubstr("rank must be at least 1"));
  // (CompressModelDirectory reports "load" first; the calibration pass runs within "convert".)
  EXPECT_EQ(std::count(steps.begin(), steps.end(), std::string("convert")), 0);
  EXPECT_FALSE(std::filesystem::exists(work_ / "out"));

  std::atomic<bool> cancelled{true};
  CompressOptions c = Rank(8);
  c.cancelled = &cancelled;
  EXPECT_EQ(CompressModelDirectory(src_.path(), work_ / "out", c).status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(std::filesystem::exists(work_ / "out"));

  ASSERT_TRUE(CompressModelDirectory(src_.path(), work_ / "out", Rank(8)).ok());
  EXPECT_THAT(std::string(CompressModelDirectory(src_.path(), work_ / "out", Rank(8)).status().message()),
              HasSubstr("already exists"));
  EXPECT_THAT(std::string(CompressModelDirectory(work_ / "out", work_ / "again", Rank(8)).status().message()),
              HasSubstr("already collaborative"));

  std::ofstream(src_ / "config.json") << R"({"architectures": ["GPT2LMHeadModel"]})";
  EXPECT_THAT(std::string(CompressModelDirectory(src_.path(), work_ / "x", Rank(8)).status().message()),
              HasSubstr("GPT2LMHeadModel\" is not supported"));
  // No temporary directories are left behind.
  for (auto& e : std::filesystem::directory_iterator(work_.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  }
}

// Fidelity as the model serves its outputs: for a single-logit or multi-label model (sigmoid) the
// argmax of one logit always agreed and a softmax over it had no KL, so a target search went to
// the cheapest ranks and every gate passed.
TEST(CompareLogitsTest, FollowsTheModelsOutputFunction) {
  const auto t = [](std::vector<double> v, int64_t cols) {
    return at::tensor(v, at::kDouble).view({-1, cols});
  };
  // One logit (sigmoid): probe 0 flips (2 -> -0.5), probe 1 stays no (-1 -> -2).
  const std::vector<at::Tensor> a1 = {t({2.0, -1.0}, 1)}, b1 = {t({-0.5, -2.0}, 1)};
  auto one = internal::CompareLogits(a1, b1, 2, model::OutputFunction::kSigmoid);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_DOUBLE_EQ(one->top1_agreement, 0.5);
  const auto bernoulli = [](double x, double y) {
    const double p = 1 / (1 + std::exp(-x)), q = 1 / (1 + std::exp(-y));
    return p * std::log(p / q) + (1 - p) * std::log((1 - p) / (1 - q));
  };
  EXPECT_NEAR(one->mean_kl, (bernoulli(2.0, -0.5) + bernoulli(-1.0, -2.0)) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(one->max_abs_logit_diff, 2.5);
  // The softmax of one logit is 1 whatever it is: what this measure used to report.
  auto as_softmax = internal::CompareLogits(a1, b1, 2, model::OutputFunction::kSoftmax);
  ASSERT_TRUE(as_softmax.ok());
  EXPECT_DOUBLE_EQ(as_softmax->top1_agreement, 1.0);
  EXPECT_DOUBLE_EQ(as_softmax->mean_kl, 0.0);
  // Multi-label: a probe agrees only when every label's decision does.
  const std::vector<at::Tensor> a2 = {t({1, 1, -1, /**/ 1, -1, -1}, 3)};
  const std::vector<at::Tensor> b2 = {t({2, 0.5, -3, /**/ 1, 0.2, -1}, 3)};
  auto multi = internal::CompareLogits(a2, b2, 2, model::OutputFunction::kSigmoid);
  ASSERT_TRUE(multi.ok());
  EXPECT_DOUBLE_EQ(multi->top1_agreement, 0.5);
  // Regression: no classes, no distribution.
  auto none = internal::CompareLogits(a1, b1, 2, model::OutputFunction::kNone);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(std::isnan(none->top1_agreement));
  EXPECT_TRUE(std::isnan(none->mean_kl));
  EXPECT_DOUBLE_EQ(none->max_abs_logit_diff, 2.5);
}

// The row form the offline tool's `evaluate --reference` uses: the same figures as the batched
// tensors, and rows that do not line up are refused by name.
TEST(CompareLogitsTest, RowsGiveTheSameFiguresAndMustLineUp) {
  const std::vector<std::vector<float>> a = {{1, 1, -1}, {1, -1, -1}}, b = {{2, 0.5, -3}, {1, 0.2, -1}};
  auto rows = CompareLogitRows(a, b, model::OutputFunction::kSigmoid);
  ASSERT_TRUE(rows.ok()) << rows.status();
  auto tensors = internal::CompareLogits({at::tensor({1., 1., -1., 1., -1., -1.}, at::kDouble).view({2, 3})},
                                         {at::tensor({2., .5, -3., 1., .2, -1.}, at::kDouble).view({2, 3})}, 2,
                                         model::OutputFunction::kSigmoid);
  ASSERT_TRUE(tensors.ok());
  EXPECT_EQ(rows->probes, 2);
  EXPECT_DOUBLE_EQ(rows->top1_agreement, 0.5);
  EXPECT_NEAR(rows->mean_kl, tensors->mean_kl, 1e-6);
  EXPECT_NEAR(rows->max_abs_logit_diff, 2.0, 1e-6);
  auto softmax = CompareLogitRows(a, b, model::OutputFunction::kSoftmax);
  ASSERT_TRUE(softmax.ok());
  EXPECT_DOUBLE_EQ(softmax->top1_agreement, 1.0);  // both rows' argmax is label 0 in both
  EXPECT_THAT(std::string(CompareLogitRows(a, {b[0]}, model::OutputFunction::kSoftmax).status().message()),
              HasSubstr("2 reference rows but 1 others"));
  EXPECT_THAT(std::string(CompareLogitRows(a, {b[0], {1, 2}}, model::OutputFunction::kSoftmax).status().message()),
              HasSubstr("row 1 has 3 reference and 2 other logits"));
  EXPECT_THAT(std::string(CompareLogitRows({{}}, {{}}, model::OutputFunction::kSoftmax).status().message()),
              HasSubstr("at least one"));
}

// What an agreement is worth on few probes: the Wilson lower bound, checked against values worked
// by hand (p = 1: 1 / (1 + z²/n)) and a textbook case.
TEST(CompareLogitsTest, ReportsTheAgreementsLowerBound) {
  const double z2 = 1.6448536269514722 * 1.6448536269514722;
  EXPECT_NEAR(WilsonLower95(3, 3), 1 / (1 + z2 / 3), 1e-12);  // 0.526
  EXPECT_NEAR(WilsonLower95(300, 300), 1 / (1 + z2 / 300), 1e-12);  // 0.991
  EXPECT_NEAR(WilsonLower95(50, 100), 0.41885, 1e-4);  // statsmodels proportion_confint(50, 100, 0.1, "wilson")
  EXPECT_EQ(WilsonLower95(0, 10), 0.0);
  EXPECT_EQ(WilsonLower95(0, 0), 0.0);
  for (int64_t n : {1, 7, 40}) {
    for (int64_t k = 0; k <= n; ++k) EXPECT_LE(WilsonLower95(k, n), double(k) / n) << k << "/" << n;
  }
  const std::vector<std::vector<float>> a = {{1, 0}, {0, 1}, {1, 0}}, b = {{1, 0}, {0, 1}, {0, 1}};
  auto f = CompareLogitRows(a, b, model::OutputFunction::kSoftmax);
  ASSERT_TRUE(f.ok());
  EXPECT_DOUBLE_EQ(f->agreement_lower95, WilsonLower95(2, 3));
  EXPECT_TRUE(std::isnan(CompareLogitRows(a, b, model::OutputFunction::kNone)->agreement_lower95));
}

TEST(ResolveRanksTest, FidelityTargetsNeedAClassifier) {
  model::BertConfig regression;
  regression.num_hidden_layers = 2;
  regression.hidden_size = 64;
  regression.problem_type = model::ProblemType::kRegression;
  for (RankSpec::Kind kind : {RankSpec::Kind::kTargetAgreement, RankSpec::Kind::kMaxKl}) {
    RankSpec spec;
    spec.kind = kind;
    spec.target_agreement = 0.9;
    spec.max_kl = 0.01;
    auto r = ResolveRanks(spec, regression);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("a regression model"));
  }
  RankSpec rank;
  rank.kind = RankSpec::Kind::kRank;
  rank.rank = 16;
  EXPECT_TRUE(ResolveRanks(rank, regression).ok());
}

// N_h·d_k is the most: the conversion is exact there (a check), and a rank above it is refused
// rather than cut, as a ratio below 1 is.
TEST(ResolveRanksTest, RanksAboveNhDkAreRefused) {
  model::BertConfig c;
  c.num_hidden_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  RankSpec spec;
  spec.kind = RankSpec::Kind::kRank;
  spec.rank = 64;
  auto r = ResolveRanks(spec, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<int>({64, 64}));
  spec.rank = 65;
  r = ResolveRanks(spec, c);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("rank 65 is above the model's N_h·d_k = 64 (4 heads x 16)"));
  spec.kind = RankSpec::Kind::kPerLayer;
  spec.ranks = {8, 100};
  r = ResolveRanks(spec, c);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("layer 1's rank 100 is above the model's N_h·d_k = 64"));
  spec.ranks = {64, 0};
  r = ResolveRanks(spec, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<int>({64, 0}));
}

}  // namespace
}  // namespace collabserve::compress
