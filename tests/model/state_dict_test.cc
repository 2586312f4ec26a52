// LoadStateDict: the parameters equal the checkpoint's tensors, the memory-mapped checkpoint's
// pages stop counting in the process's resident memory once copied, and a checkpoint held in heap
// memory is never touched.
#include "server/model/state_dict.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>

#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/io/checkpoint.h"
#include "server/model/io/safetensors.h"
#include "server/util/files.h"
#include "tests/testing/test_util.h"

namespace collabserve::model {
namespace {

using testing::TempDir;

// Resident kB of the mapping of this process that contains `p` (/proc/self/smaps), -1 if none.
int64_t MappingRssKb(const void* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in_it = false;
  while (std::getline(smaps, line)) {
    unsigned long long lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {  // a mapping's first line
      in_it = addr >= lo && addr < hi;
      continue;
    }
    if (in_it && line.rfind("Rss:", 0) == 0) return std::stoll(line.substr(4));
  }
  return -1;
}

class StateDictTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeOptions o;
    o.preset = "mini";  // ~45 MB of float32 weights: many pages per tensor
    o.layers = 2;
    o.seed = 5;
    ASSERT_TRUE(MakeCheckpoint(dir_.path(), o).ok());
    auto config = BertConfig::FromFile(util::JoinPath(dir_.path(), "config.json"));
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    file_ = util::JoinPath(dir_.path(), "model.safetensors");
  }

  // Every parameter of `model` equals its tensor in `ckpt`.
  void ExpectSameWeights(const BertClassifier& model, const io::Checkpoint& ckpt) {
    int compared = 0;
    for (const auto& [name, t] : NamedWeights(model)) {
      for (const auto& [key, raw] : ckpt.tensors) {
        if (NormalizeKey(key) != name) continue;
        auto want = RawToFloatTensor(raw, key);
        ASSERT_TRUE(want.ok()) << want.status();
        EXPECT_TRUE(at::equal(t, *want)) << name;
        ++compared;
      }
    }
    EXPECT_EQ(compared, static_cast<int>(NamedWeights(model).size()));
  }

  TempDir dir_;
  BertConfig config_;
  std::string file_;
};

TEST_F(StateDictTest, MappedCheckpointPagesAreReleasedOnceCopied) {
  auto ckpt = io::ReadCheckpointFile(file_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const void* some_tensor = ckpt->tensors.begin()->second.data;
  BertClassifier model(config_);
  ASSERT_TRUE(LoadStateDict(model, *ckpt, file_).ok());
  ExpectSameWeights(model, *ckpt);  // reads every tensor of the file again...
  // ...and a fresh load releases them all again: what stays resident is the header and the
  // pages two tensors share (a few per tensor), far below the file's size.
  BertClassifier again(config_);
  ASSERT_TRUE(LoadStateDict(again, *ckpt, file_).ok());
  const int64_t file_kb = static_cast<int64_t>(std::ifstream(file_, std::ios::ate).tellg()) / 1024;
  const int64_t rss_kb = MappingRssKb(some_tensor);
  ASSERT_GE(rss_kb, 0) << "the checkpoint's mapping is not in /proc/self/smaps";
  EXPECT_LT(rss_kb, file_kb / 10) << "file " << file_kb << " kB";
  ExpectSameWeights(again, *ckpt);  // the released pages read back from the file unchanged
}

TEST_F(StateDictTest, CheckpointInHeapMemoryIsLeftIntact) {
  auto bytes = util::ReadFile(file_, int64_t{1} << 30);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto held = std::make_shared<const std::string>(*bytes);
  auto ckpt = io::ParseSafetensorsBytes(io::BytesOfString(held), file_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  BertClassifier model(config_);
  ASSERT_TRUE(LoadStateDict(model, *ckpt, file_).ok());
  EXPECT_TRUE(*held == *bytes);  // not a byte zeroed
  ExpectSameWeights(model, *ckpt);
}

TEST_F(StateDictTest, NonFiniteValueIsRefusedByName) {
  auto bytes = util::ReadFile(file_, int64_t{1} << 30);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto original = std::make_shared<const std::string>(*bytes);
  auto ckpt0 = io::ParseSafetensorsBytes(io::BytesOfString(original), file_);
  ASSERT_TRUE(ckpt0.ok());
  // Overwrite the first float of one tensor with NaN in a private copy of the bytes.
  const auto& [key, raw] = *ckpt0->tensors.begin();
  ASSERT_EQ(raw.dtype, io::DType::kF32) << key;
  const size_t offset = static_cast<size_t>(raw.data - reinterpret_cast<const uint8_t*>(original->data()));
  ASSERT_LT(offset + sizeof(float), original->size());
  auto copy = std::make_shared<std::string>(*original);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(copy->data() + offset, &nan, sizeof(nan));
  auto ckpt = io::ParseSafetensorsBytes(io::BytesOfString(std::move(copy)), file_);
  ASSERT_TRUE(ckpt.ok());
  BertClassifier model(config_);
  absl::Status s = LoadStateDict(model, *ckpt, file_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("non-finite"), std::string::npos) << s;
  EXPECT_NE(s.message().find(NormalizeKey(key)), std::string::npos) << s;
}

}  // namespace
}  // namespace collabserve::model
