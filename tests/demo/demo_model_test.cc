// The built-in demo model (server/model/demo/, compiled in): the binary holds exactly the committed
// checkpoint, the engine reaches the test accuracy that its training reported (a regression guard
// on fixed files: tests/data/demo/), and it answers the README's examples.
#include "server/model/demo_model.h"

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/model/engine.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/files.h"
#include "tests/testing/test_util.h"

namespace collabserve::model {
namespace {

using testing::SourceDir;

TEST(DemoModelTest, TheBinaryHoldsTheCommittedCheckpoint) {
  ASSERT_EQ(DemoModelFiles().size(), 4u);
  for (const auto& [name, bytes] : DemoModelFiles()) {
    auto on_disk = util::ReadFile(util::JoinPath(SourceDir(), "server/model/demo/" + name));
    ASSERT_TRUE(on_disk.ok()) << on_disk.status();
    EXPECT_TRUE(*on_disk == bytes) << name << ": " << on_disk->size() << " bytes on disk, " << bytes.size()
                                   << " compiled in";
  }
  EXPECT_LE(DemoModelFiles()[1].second.size(), 25u * 1000 * 1000) << "the served checkpoint stays under 25 MB";
}

class DemoEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    ASSERT_TRUE(WriteDemoCheckpoint(dir_->path() + "/demo").ok());
    auto e = Engine::Load(dir_->path() + "/demo", EngineOptions{});
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = e->release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    delete dir_;
  }
  static std::string Classify(const std::string& text) {
    auto enc = engine_->tokenizer().Encode(text, std::nullopt, 0, true);
    EXPECT_TRUE(enc.ok());
    TokenizedInput in;
    in.input_ids = enc->input_ids;
    in.token_type_ids = enc->token_type_ids;
    auto p = engine_->Run(std::vector<TokenizedInput>{in});
    EXPECT_TRUE(p.ok()) << p.status();
    return engine_->info().labels[(*p)[0].label];
  }
  static testing::TempDir* dir_;
  static Engine* engine_;
};
testing::TempDir* DemoEngineTest::dir_ = nullptr;
Engine* DemoEngineTest::engine_ = nullptr;

TEST_F(DemoEngineTest, ReachesTheTestAccuracyItsTrainingReported) {
  auto report_text = util::ReadFile(util::JoinPath(SourceDir(), "tests/data/demo/training.json"));
  ASSERT_TRUE(report_text.ok()) << report_text.status();
  const double documented = nlohmann::json::parse(*report_text)["test"]["accuracy"].get<double>();
  std::ifstream in(util::JoinPath(SourceDir(), "tests/data/demo/test.jsonl"));
  ASSERT_TRUE(in) << "tests/data/demo/test.jsonl";
  std::vector<TokenizedInput> inputs;
  std::vector<std::string> labels;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    auto enc = engine_->tokenizer().Encode(j["text"].get<std::string>(), std::nullopt, 0, true);
    ASSERT_TRUE(enc.ok()) << enc.status();
    TokenizedInput t;
    t.input_ids = enc->input_ids;
    t.token_type_ids = enc->token_type_ids;
    inputs.push_back(std::move(t));
    labels.push_back(j["label"].get<std::string>());
  }
  ASSERT_GT(inputs.size(), 500u);
  int correct = 0;
  for (size_t start = 0; start < inputs.size(); start += 32) {
    std::vector<TokenizedInput> batch(inputs.begin() + start,
                                      inputs.begin() + std::min(inputs.size(), start + 32));
    auto preds = engine_->Run(batch);
    ASSERT_TRUE(preds.ok()) << preds.status();
    for (size_t i = 0; i < preds->size(); ++i) {
      correct += engine_->info().labels[(*preds)[i].label] == labels[start + i];
    }
  }
  const double accuracy = static_cast<double>(correct) / inputs.size();
  EXPECT_GE(accuracy, documented - 0.01) << correct << " of " << inputs.size();
}

TEST_F(DemoEngineTest, AnswersTheReadmeExamples) {
  EXPECT_EQ(engine_->info().labels.size(), 14u);
  EXPECT_EQ(Classify("a 3D racing game with split-screen multiplayer"), "games");
}

}  // namespace
}  // namespace collabserve::model
