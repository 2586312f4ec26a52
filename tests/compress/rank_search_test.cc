// Ranks chosen by a fidelity target (RankSpec kTargetAgreement / kMaxKl, rank_search.cc): the
// returned model meets the target on the texts it was measured on (checked here independently of
// the search), it is the cheapest verified trial, the report says what was tried, and bad targets,
// impossible targets, the time limit and cancellation end the call cleanly with nothing written.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/compress/collaborative.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/param_counts.h"
#include "server/model/probe_sentences.h"
#include "tests/compress/compress_test_util.h"
#include "tests/testing/test_util.h"

namespace collabserve::compress {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

CompressOptions Agreement(double a) {
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kTargetAgreement;
  o.spec.target_agreement = a;
  return o;
}

CompressOptions MaxKl(double k) {
  CompressOptions o;
  o.spec.kind = RankSpec::Kind::kMaxKl;
  o.spec.max_kl = k;
  return o;
}

class RankSearchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::MakeOptions m;
    m.seed = 11;
    m.preset = "tiny";  // D = 64, 4 heads
    m.layers = 3;
    m.labels = 4;
    m.planted_rank = 8;  // heads that share a subspace, as trained heads do
    m.planted_noise = 0.3;
    ASSERT_TRUE(model::MakeCheckpoint(dir_.path(), m).ok());
    source_ = compress_testing::LoadPrepared(dir_.path());
    ASSERT_NE(source_, nullptr);
    // Held-out texts: the built-in probes and variations of them.
    for (const std::string& p : model::BuiltinProbeSentences()) {
      probes_.push_back(p);
      probes_.push_back("and then " + p);
    }
  }

  std::string Out(const std::string& name) const { return out_.path() + "/" + name; }

  absl::StatusOr<CompressReport> Run(CompressOptions o, const std::string& name) {
    if (o.probes.empty() && o.calibration.empty()) o.probes = probes_;
    return CompressLoadedModel(*source_, dir_.path(), Out(name), o);
  }

  // The written model's fidelity on `texts`, measured here.
  FidelityReport Measure(const std::string& name, const std::vector<std::string>& texts) {
    auto m = compress_testing::LoadPrepared(Out(name));
    if (m == nullptr) return {};
    auto f = MeasureFidelity(*source_, *m, dir_.path(), texts);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? *f : FidelityReport{};
  }

  // The cheapest trial that met the target, and the report agrees it is the result.
  static void ExpectCheapestVerifiedTrialChosen(const CompressReport& r) {
    ASSERT_TRUE(r.search.ran);
    ASSERT_FALSE(r.search.trials.empty());
    const RankSearchReport::Trial* best = nullptr;
    for (const auto& t : r.search.trials) {
      if (t.meets && (best == nullptr || t.qk_params < best->qk_params)) best = &t;
    }
    ASSERT_NE(best, nullptr);
    ASSERT_GE(r.search.chosen, 0);
    EXPECT_EQ(&r.search.trials[r.search.chosen], best);
    EXPECT_EQ(r.qk_params_after, best->qk_params);  // the search's parameter count is the model's
    std::vector<int> ranks;
    for (const LayerReport& l : r.layers) ranks.push_back(l.rank);
    EXPECT_EQ(ranks, best->ranks);
    EXPECT_DOUBLE_EQ(r.fidelity.top1_agreement, best->fidelity.top1_agreement);
    EXPECT_NEAR(r.fidelity.mean_kl, best->fidelity.mean_kl, 1e-9);
  }

  TempDir dir_, out_;
  std::unique_ptr<model::BertClassifier> source_;
  std::vector<std::string> probes_;
};

TEST_F(RankSearchTest, AnAgreementTargetHoldsOnTheTextsItWasMeasuredOn) {
  for (double target : {0.75, 0.9, 1.0}) {
    SCOPED_TRACE(target);
    const std::string name = "a" + std::to_string(static_cast<int>(target * 100));
    auto r = Run(Agreement(target), name);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GE(Measure(name, probes_).top1_agreement, target);
    ExpectCheapestVerifiedTrialChosen(*r);
    EXPECT_LT(r->qk_params_after, r->qk_params_before);
    for (const auto& t : r->search.trials) {
      EXPECT_EQ(t.meets, t.fidelity.top1_agreement >= target);
      EXPECT_EQ(static_cast<int>(t.ranks.size()), 3);
    }
  }
}

TEST_F(RankSearchTest, AKlBoundHoldsOnTheTextsItWasMeasuredOn) {
  // The bound between the KL of the cheapest candidate and zero, so that the search has to choose.
  auto loose = Run(MaxKl(1e9), "loose");
  ASSERT_TRUE(loose.ok()) << loose.status();
  const double cheapest_kl = loose->fidelity.mean_kl;
  ASSERT_GT(cheapest_kl, 0);
  const double bound = cheapest_kl / 20;
  auto r = Run(MaxKl(bound), "kl");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(Measure("kl", probes_).mean_kl, bound * (1 + 1e-6));
  ExpectCheapestVerifiedTrialChosen(*r);
  EXPECT_GT(r->qk_params_after, loose->qk_params_after);
}

TEST_F(RankSearchTest, TheReportSaysWhatWasSearched) {
  auto r = Run(Agreement(0.9), "report");
  ASSERT_TRUE(r.ok()) << r.status();
  const RankSearchReport& s = r->search;
  EXPECT_EQ(s.target, "top1_agreement >= 0.9");
  EXPECT_EQ(s.texts, static_cast<int>(probes_.size()));
  // The grid: steps of sqrt(2) from 64 / 2 = 32 down to 64 / 64 = 1, descending.
  ASSERT_FALSE(s.grid.empty());
  EXPECT_EQ(s.grid, (std::vector<int>{32, 23, 16, 11, 8, 6, 4, 3, 2, 1}));
  EXPECT_EQ(s.grid.front(), 32);
  EXPECT_EQ(s.grid.back(), 1);
  EXPECT_TRUE(std::is_sorted(s.grid.rbegin(), s.grid.rend()));
  EXPECT_EQ(s.decompositions, 3 * static_cast<int>(s.grid.size()));
  // Each layer's KL measured at the grid ranks nearest 64 / 8 and 64 / 16, and the proxy's exponent.
  EXPECT_EQ(s.sensitivity_ranks, (std::vector<int>{8, 4}));
  ASSERT_EQ(s.layer_kl.size(), 3u);
  ASSERT_EQ(s.kl_exponent.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(s.layer_kl[i].size(), 2u);
    EXPECT_GE(s.layer_kl[i][1], s.layer_kl[i][0]) << "layer " << i << ": a lower rank, no lower KL";
    EXPECT_GE(s.kl_exponent[i], 1.0);
    EXPECT_LE(s.kl_exponent[i], 8.0);
  }
  EXPECT_GE(s.candidates, static_cast<int>(s.trials.size()));
  EXPECT_FALSE(s.time_limited);
  // Bisection: at most ceil(log2(candidates + 1)) trials.
  EXPECT_LE(static_cast<int>(s.trials.size()), static_cast<int>(std::ceil(std::log2(s.candidates + 1.0))));
  for (const LayerReport& l : r->layers) EXPECT_EQ(l.ranks_tried, static_cast<int>(s.grid.size()));
  auto j = nlohmann::json::parse(r->ToJson());
  ASSERT_TRUE(j.contains("search"));
  EXPECT_EQ(j["search"]["target"], "top1_agreement >= 0.9");
  EXPECT_EQ(j["search"]["trials"].size(), s.trials.size());
  EXPECT_TRUE(j["search"]["trials"][0].contains("ranks"));
  CompressOptions fixed;
  fixed.spec.rank = 8;
  auto f = Run(fixed, "fixed");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->search.ran);
  EXPECT_FALSE(nlohmann::json::parse(f->ToJson()).contains("search"));
}

// Each layer's KL curve is measured from the original's hidden states entering the layer; it must
// be the KL of the whole model with that layer alone compressed (the same decomposition: a fixed
// per-layer rank, seed and options), measured as any compression's fidelity is.
TEST_F(RankSearchTest, EachLayersKlIsThatOfTheModelWithThatLayerAloneCompressed) {
  auto r = Run(Agreement(0.9), "curves");
  ASSERT_TRUE(r.ok()) << r.status();
  const RankSearchReport& s = r->search;
  ASSERT_EQ(s.layer_kl.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    for (size_t k = 0; k < s.sensitivity_ranks.size(); ++k) {
      CompressOptions alone;
      alone.spec.kind = RankSpec::Kind::kPerLayer;
      alone.spec.ranks = {0, 0, 0};
      alone.spec.ranks[i] = s.sensitivity_ranks[k];
      const std::string name = "alone" + std::to_string(i) + std::to_string(k);
      auto f = Run(alone, name);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_GT(f->fidelity.mean_kl, 0);
      EXPECT_NEAR(s.layer_kl[i][k], f->fidelity.mean_kl, 1e-3 * f->fidelity.mean_kl)
          << "layer " << i << " at rank " << s.sensitivity_ranks[k];
    }
  }
}

TEST_F(RankSearchTest, WithCalibrationTextItMeasuresOnTheHeldOutPart) {
  CompressOptions o = Agreement(0.9);
  for (int i = 0; i < 3; ++i) {
    for (const std::string& p : model::BuiltinProbeSentences()) o.calibration.push_back(std::to_string(i) + " " + p);
  }
  auto r = Run(o, "whitened");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->whitened);
  EXPECT_EQ(r->search.texts, r->calibration_heldout_texts);
  for (const LayerReport& l : r->layers) {
    if (l.rank > 0) {
      EXPECT_GE(l.activation_error, 0);
    }
  }
  const std::vector<std::string> heldout(o.calibration.end() - r->calibration_heldout_texts, o.calibration.end());
  EXPECT_GE(Measure("whitened", heldout).top1_agreement, 0.9);
}

TEST_F(RankSearchTest, AnUnreachableTargetIsAClearErrorAndWritesNothing) {
  auto r = Run(MaxKl(1e-300), "never");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("no compressed allocation meets mean_kl <= 1e-300"));
  EXPECT_FALSE(std::filesystem::exists(Out("never")));
}

TEST_F(RankSearchTest, TheTimeLimitAndCancellationEndItWithNothingWritten) {
  CompressOptions o = Agreement(0.9);
  o.search_seconds = 1e-9;
  auto r = Run(o, "late");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("search_seconds"));
  EXPECT_FALSE(std::filesystem::exists(Out("late")));

  std::atomic<bool> cancel{true};
  o = Agreement(0.9);
  o.cancelled = &cancel;
  r = Run(o, "cancelled");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(std::filesystem::exists(Out("cancelled")));
}

TEST_F(RankSearchTest, ProgressIsReportedForEveryTrial) {
  CompressOptions o = Agreement(0.9);
  std::vector<int64_t> seen;
  o.on_trial = [&](const RankSearchReport::Trial& t) { seen.push_back(t.qk_params); };
  int layers = 0;
  o.on_layer = [&](const LayerReport&) { ++layers; };
  auto r = Run(o, "progress");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(seen.size(), r->search.trials.size());
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], r->search.trials[i].qk_params);
  EXPECT_EQ(layers, 3);
}

TEST_F(RankSearchTest, BadTargetsAreRefusedByName) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double a : {0.0, -0.5, 1.5, nan}) {
    auto r = ResolveRanks(Agreement(a).spec, source_->config());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("target_agreement must be in (0, 1]"));
  }
  for (double k : {0.0, -1.0, nan, std::numeric_limits<double>::infinity()}) {
    auto r = ResolveRanks(MaxKl(k).spec, source_->config());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("max_kl must be a finite number > 0"));
  }
  CompressReport report;
  auto c = ConvertToCollaborative(*source_, Agreement(0.9), &report);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("a fidelity target needs texts to measure on"));
}

TEST(CollaborativeQkParams, MatchTheParameterTreeAtEveryRank) {
  model::MakeOptions m;
  auto c = model::MakeConfig(m);
  ASSERT_TRUE(c.ok());
  for (int rank : {1, 7, 32, 64}) {
    model::BertConfig cc = *c;
    cc.collaborative.ranks.assign(cc.num_hidden_layers, 0);
    cc.collaborative.ranks[0] = rank;
    cc.collaborative.errors.assign(cc.num_hidden_layers, 0);
    model::BertClassifier collab(cc), standard(*c);
    EXPECT_EQ(model::CountParams(collab).attention_qk,
              model::CollaborativeQkParamsPerLayer(cc, rank) +
                  (cc.num_hidden_layers - 1) * model::CollaborativeQkParamsPerLayer(cc, 0))
        << rank;
    EXPECT_EQ(model::CountParams(standard).attention_qk,
              c->num_hidden_layers * model::CollaborativeQkParamsPerLayer(*c, 0));
  }
}

}  // namespace
}  // namespace collabserve::compress
