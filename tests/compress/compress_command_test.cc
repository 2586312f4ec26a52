// `collabserve-model compress` as a user runs it: by default one layer per CPU at once, each with one
// thread; --parallel_layers overrides it without changing the decomposition; --init picks the CP
// start; bad thread, line-search and init flags are refused with a message naming them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "server/model/checkpoint_maker.h"
#include "server/util/files.h"
#include "server/util/process_env.h"
#include "tests/testing/test_util.h"

namespace collabserve::compress {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;
using testing::ShellQuote;
using testing::TempDir;
using testing::Tool;

class CompressCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::MakeOptions m;
    m.seed = 9;
    m.layers = 4;
    ASSERT_TRUE(model::MakeCheckpoint(dir_ / "in", m).ok());
  }
  testing::CommandResult Compress(const std::string& out, const std::string& flags) {
    return RunCommand(Tool("collabserve-model") + " compress --model " + ShellQuote(dir_ / "in") +
                      " --out " + ShellQuote(dir_ / out) + " --rank 24 --max_iters 30 --tol 0 " +
                      flags + " 2>&1");
  }
  nlohmann::json Report(const std::string& out, const std::string& flags) {
    testing::CommandResult r = Compress(out, flags);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    // The report is the last line that is a JSON object (glog may write to stderr before it).
    std::string report;
    size_t begin = 0;
    while (begin < r.output.size()) {
      size_t end = r.output.find('\n', begin);
      if (end == std::string::npos) end = r.output.size();
      if (r.output[begin] == '{') report = r.output.substr(begin, end - begin);
      begin = end + 1;
    }
    return nlohmann::json::parse(report);
  }
  TempDir dir_;
};

TEST_F(CompressCommandTest, LayersRunInParallelByDefaultAndTheFactorsDoNotDependOnIt) {
  const int cpus = util::UsableCpus();
  nlohmann::json by_default = Report("default", "");
  nlohmann::json one = Report("one", "--parallel_layers 1");
  nlohmann::json per_cpu = Report("per_cpu", "--parallel_layers " + std::to_string(cpus));
  EXPECT_EQ(by_default["parallel_layers"], std::min(cpus, 4));
  EXPECT_EQ(one["parallel_layers"], 1);
  ASSERT_EQ(by_default["layers"].size(), 4u);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(by_default["layers"][l]["iterations"], 30);
    // One layer on every CPU rounds differently from one thread per layer; the result is the same.
    EXPECT_NEAR(one["layers"][l]["relative_error"].get<double>(),
                by_default["layers"][l]["relative_error"].get<double>(), 1e-5)
        << "layer " << l;
  }
  for (const char* step : {"load_seconds", "convert_seconds", "fidelity_seconds", "write_seconds"}) {
    EXPECT_GT(by_default["steps"][step].get<double>(), 0) << step;
  }
  // One thread per layer either way: the same model, bit for bit.
  EXPECT_TRUE(*util::ReadFile(dir_ / "default/model.safetensors") == *util::ReadFile(dir_ / "per_cpu/model.safetensors"));
}

TEST_F(CompressCommandTest, BadThreadAndLineSearchFlagsAreRefused) {
  testing::CommandResult r = Compress("a", "--parallel_layers -1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--parallel_layers must be 0 (one layer per CPU) or positive, got -1"));
  r = Compress("b", "--line_search yes");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--line_search 'yes' is not 0 or 1"));
  r = Compress("c", "--init hosvd");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--init 'hosvd' is not svd or random"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "a"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "b"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "c"));
}

// --init picks the CP start: svd is the default (the same factors as naming it), random starts
// elsewhere and so ends at other errors after the same 30 sweeps.
TEST_F(CompressCommandTest, InitSelectsTheStart) {
  nlohmann::json by_default = Report("default", "");
  nlohmann::json svd = Report("svd", "--init svd");
  nlohmann::json random = Report("random", "--init random");
  ASSERT_EQ(random["layers"].size(), 4u);
  EXPECT_TRUE(*util::ReadFile(dir_ / "default/model.safetensors") == *util::ReadFile(dir_ / "svd/model.safetensors"));
  int differ = 0;
  for (int l = 0; l < 4; ++l) {
    const double e_svd = svd["layers"][l]["relative_error"].get<double>();
    const double e_random = random["layers"][l]["relative_error"].get<double>();
    EXPECT_GT(e_random, 0) << "layer " << l;
    EXPECT_LT(e_random, 1) << "layer " << l;
    differ += std::abs(e_svd - e_random) > 1e-7;
  }
  EXPECT_GT(differ, 0) << "the random start gave the SVD start's errors on every layer";
}

// An --out with a trailing separator names the same directory: it used to create it as the
// temporary's parent and then fail to rename into it, after all the work, leaving it behind.
TEST_F(CompressCommandTest, AnOutWithATrailingSlashIsThatDirectory) {
  nlohmann::json report = Report("slash/", "");
  EXPECT_EQ(report["layers"].size(), 4u);
  EXPECT_TRUE(std::filesystem::is_regular_file(dir_ / "slash/model.safetensors"));
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
    entries.push_back(e.path().filename().string());
  }
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"in", "slash"}));  // no temporary left
}

TEST_F(CompressCommandTest, CalibrationTextWhitensAndSaysWhereFidelityWasMeasured) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "calibration sentence number " + std::to_string(i) + " about tools\n";
  ASSERT_TRUE(util::WriteFileAtomic(dir_ / "calib.txt", text).ok());
  nlohmann::json plain = Report("plain", "");
  EXPECT_FALSE(plain["whitening"]["on"].get<bool>());
  EXPECT_THAT(plain["whitening"]["note"].get<std::string>(), HasSubstr("no calibration text"));
  EXPECT_FALSE(plain["layers"][0].contains("activation_error"));
  nlohmann::json white = Report("white", "--calibration " + ShellQuote(dir_ / "calib.txt"));
  EXPECT_TRUE(white["whitening"]["on"].get<bool>());
  EXPECT_EQ(white["whitening"]["fit_texts"].get<int>(), 32);
  EXPECT_EQ(white["whitening"]["heldout_texts"].get<int>(), 8);
  EXPECT_EQ(white["fidelity"]["probes"].get<int>(), 8);  // the held-out part
  EXPECT_THAT(white["whitening"]["note"].get<std::string>(), HasSubstr("fidelity on the other 8"));
  EXPECT_TRUE(white["layers"][0].contains("activation_error"));
  EXPECT_TRUE(std::filesystem::exists(dir_ / "white/config.json"));

  ASSERT_TRUE(util::WriteFileAtomic(dir_ / "few.txt", "one\ntwo\n").ok());
  ASSERT_TRUE(util::WriteFileAtomic(dir_ / "empty.txt", "\n\n").ok());
  ASSERT_TRUE(util::WriteFileAtomic(dir_ / "binary.txt", std::string("\x7f" "ELF\0\0\1", 7)).ok());
  for (const auto& [file, message] : std::vector<std::pair<std::string, std::string>>{
           {"few.txt", "calibration: 2 texts; at least 16 are needed"},
           {"empty.txt", "no text lines"},
           {"binary.txt", "NUL byte at offset 4: not a text file"},
           {"missing.txt", "missing.txt"}}) {
    testing::CommandResult r = Compress("bad-" + file, "--calibration " + ShellQuote(dir_ / file));
    EXPECT_EQ(r.exit_code, 1) << file;
    EXPECT_THAT(r.output, HasSubstr(message)) << file;
    EXPECT_FALSE(std::filesystem::exists(dir_ / ("bad-" + file))) << "nothing half-written";
  }
  testing::CommandResult r = Compress("bad-damping", "--calibration " + ShellQuote(dir_ / "calib.txt") +
                                                         " --whiten_damping -1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("damping"));
}

}  // namespace
}  // namespace collabserve::compress
