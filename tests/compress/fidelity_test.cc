// MeasureFidelity: batched by length, with the two models on two threads when the caller leaves
// CPUs idle, it reports what a plain one-probe-at-a-time comparison of the two models reports.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "server/compress/collaborative.h"
#include "server/compress/collaborative_internal.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/engine.h"
#include "server/model/param_counts.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/files.h"
#include "server/util/process_env.h"
#include "tests/testing/test_util.h"

namespace collabserve::compress {
namespace {

using testing::TempDir;

// `n` words, from the `first`th of a short sentence over and over.
std::string Words(int n, int first) {
  const std::vector<std::string> words = {"the", "service", "was", "slow", "but", "the", "food",
                                          "excellent", "and", "we", "would", "come", "back"};
  std::string s;
  for (int w = 0; w < n; ++w) s += (w ? " " : "") + words[(first + w) % words.size()];
  return s;
}

// 37 probes of 1 to ~40 words: three batches of unequal lengths, in no particular order.
std::vector<std::string> Probes() {
  std::vector<std::string> out;
  for (int i = 0; i < 37; ++i) out.push_back(Words(1 + (i * 11) % 40, i));
  return out;
}

// The definition, one probe at a time, each cut at `max_len` tokens.
FidelityReport Reference(const model::BertClassifier& a, const model::BertClassifier& b,
                         const std::string& dir, const std::vector<std::string>& probes, int max_len) {
  auto tok = text::BertTokenizer::FromDirectory(dir);
  EXPECT_TRUE(tok.ok());
  c10::InferenceMode guard;
  FidelityReport f;
  double kl = 0;
  int agree = 0;
  for (const std::string& p : probes) {
    auto e = (*tok)->Encode(p, std::nullopt, max_len, true);
    EXPECT_TRUE(e.ok());
    f.truncated += e->truncated;
    std::vector<int64_t> ids(e->input_ids.begin(), e->input_ids.end());
    at::Tensor t = at::tensor(ids, at::kLong).unsqueeze(0);
    at::Tensor la = a.Forward(t, at::zeros_like(t), at::ones_like(t)).to(at::kDouble);
    at::Tensor lb = b.Forward(t, at::zeros_like(t), at::ones_like(t)).to(at::kDouble);
    f.max_abs_logit_diff = std::max(f.max_abs_logit_diff, (la - lb).abs().max().item<double>());
    agree += la.argmax(1).item<int64_t>() == lb.argmax(1).item<int64_t>();
    at::Tensor lp = at::log_softmax(la, 1), lq = at::log_softmax(lb, 1);
    kl += (lp.exp() * (lp - lq)).sum().item<double>();
  }
  f.probes = static_cast<int>(probes.size());
  f.top1_agreement = static_cast<double>(agree) / probes.size();
  f.mean_kl = kl / probes.size();
  return f;
}

class FidelityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::MakeOptions mo;
    mo.preset = "tiny";
    mo.seed = 11;
    ASSERT_TRUE(model::MakeCheckpoint(dir_.path(), mo).ok());
    auto config = model::BertConfig::FromFile(util::JoinPath(dir_.path(), "config.json"));
    ASSERT_TRUE(config.ok()) << config.status();
    auto source = model::LoadClassifier(dir_.path(), *config);
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = std::move(*source);
    source_->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
    CompressOptions o;
    o.spec.rank = 8;  // far below full: the two models disagree on some probes
    o.max_iters = 20;
    CompressReport report;
    auto compressed = ConvertToCollaborative(*source_, o, &report);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    compressed_ = std::move(*compressed);
    compressed_->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
  }

  // The length the engine serves the model's inputs at (ModelInfo::max_length).
  int ServedMaxLength() {
    auto engine = model::Engine::Load(dir_.path());
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? (*engine)->info().max_length : 0;
  }

  void ExpectMatchesReference(const FidelityReport& got, const FidelityReport& want) {
    EXPECT_EQ(got.probes, want.probes);
    EXPECT_EQ(got.truncated, want.truncated);
    EXPECT_DOUBLE_EQ(got.top1_agreement, want.top1_agreement);
    EXPECT_NEAR(got.max_abs_logit_diff, want.max_abs_logit_diff, 1e-4);
    EXPECT_NEAR(got.mean_kl, want.mean_kl, 1e-6 + 1e-4 * want.mean_kl);
  }

  TempDir dir_;
  std::unique_ptr<model::BertClassifier> source_, compressed_;
};

TEST_F(FidelityTest, BatchedEqualsOneProbeAtATimeOnEitherPath) {
  const std::vector<std::string> probes = Probes();
  const FidelityReport want = Reference(*source_, *compressed_, dir_.path(), probes, ServedMaxLength());
  ASSERT_GT(want.max_abs_logit_diff, 0);
  const int threads = at::get_num_threads(), blas = util::BlasThreads();
  // Single-threaded caller with OpenBLAS pinned to one thread (an admin job's worker): the models
  // run on two threads when there are two CPUs; a caller using every CPU: one after the other.
  // The result is the same.
  for (int caller_threads : {1, std::max(1, util::UsableCpus())}) {
    at::set_num_threads(caller_threads);
    if (blas > 0) util::SetBlasThreads(caller_threads);
    auto got = MeasureFidelity(*source_, *compressed_, dir_.path(), probes);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectMatchesReference(*got, want);
  }
  at::set_num_threads(threads);
  if (blas > 0) util::SetBlasThreads(blas);
}

// Probes and calibration texts are cut where the engine cuts them when it serves the model (here
// 512 tokens), not shorter: a probe of 200 words is measured whole, one of 700 cut at 512.
TEST_F(FidelityTest, TextsAreCutWhereTheModelIsServed) {
  const int served = ServedMaxLength();
  ASSERT_EQ(served, 512);
  const std::vector<std::string> texts = {Words(200, 0), Words(700, 3), Words(30, 5), Words(140, 7)};
  auto tok = text::BertTokenizer::FromDirectory(dir_.path());
  ASSERT_TRUE(tok.ok()) << tok.status();
  int64_t want_tokens = 0;
  for (const std::string& t : texts) {
    auto e = (*tok)->Encode(t, std::nullopt, served, true);
    ASSERT_TRUE(e.ok()) << e.status();
    want_tokens += static_cast<int64_t>(e->input_ids.size());
  }
  ASSERT_EQ(want_tokens, 202 + 512 + 32 + 142);

  const FidelityReport want = Reference(*source_, *compressed_, dir_.path(), texts, served);
  ASSERT_EQ(want.truncated, 1);
  auto got = MeasureFidelity(*source_, *compressed_, dir_.path(), texts);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatchesReference(*got, want);

  auto stats = CollectCalibrationStats(*source_, dir_.path(), texts);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tokens, want_tokens);
  EXPECT_EQ(stats->truncated, 1);

  CompressReport report;
  report.fidelity = *got;
  EXPECT_NE(report.ToJson().find("\"truncated_probes\":1"), std::string::npos) << report.ToJson();
}

TEST_F(FidelityTest, AModelAgainstItselfIsExact) {
  auto got = MeasureFidelity(*source_, *source_, dir_.path(), Probes());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->probes, 37);
  EXPECT_DOUBLE_EQ(got->top1_agreement, 1.0);
  EXPECT_DOUBLE_EQ(got->max_abs_logit_diff, 0.0);
  EXPECT_NEAR(got->mean_kl, 0.0, 1e-12);
}

// A cancelled job's passes stop between batches: the fidelity pass (two models), the calibration
// pass, and any ForEachBatch, whose running batch finishes and whose later ones do not start.
TEST_F(FidelityTest, PassesStopBetweenBatchesWhenTheJobIsCancelled) {
  std::atomic<bool> cancelled{true};
  auto fidelity = MeasureFidelity(*source_, *compressed_, dir_.path(), Probes(), &cancelled);
  EXPECT_EQ(fidelity.status().code(), absl::StatusCode::kCancelled) << fidelity.status();
  auto stats = CollectCalibrationStats(*source_, dir_.path(), Probes(), &cancelled);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kCancelled) << stats.status();
  cancelled = false;
  EXPECT_TRUE(MeasureFidelity(*source_, *compressed_, dir_.path(), Probes(), &cancelled).ok());
  for (int workers : {1, 2}) {
    std::atomic<int> ran{0};
    absl::Status s = internal::ForEachBatch(8, workers, [&](int, size_t) {
      cancelled = true;  // cancelled during every worker's first batch
      ran.fetch_add(1);
    }, &cancelled);
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_LE(ran.load(), workers) << workers;  // no worker started a batch after its first
    cancelled = false;
  }
}

TEST_F(FidelityTest, BuiltInProbesWhenNoneAreGiven) {
  auto got = MeasureFidelity(*source_, *compressed_, dir_.path(), {});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->probes, 32);
}

TEST_F(FidelityTest, MissingVocabularyIsAnError) {
  TempDir empty;
  auto got = MeasureFidelity(*source_, *compressed_, empty.path(), Probes());
  EXPECT_FALSE(got.ok());
}

}  // namespace
}  // namespace collabserve::compress
