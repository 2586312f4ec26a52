// LoadStateDict: the parameters equal the checkpoint's tensors, the memory-mapped checkpoint's
// pages stop counting in the process's resident memory once copied, a checkpoint held in heap
// memory is never touched, and borrowed weights view the file's bytes only until Prepare packs them.
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
#include <utility>

#include "absl/strings/match.h"
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
  // The first or the last float of a tensor overwritten with NaN or an infinity, in a private copy
  // of the bytes: the largest tensor (the last float of a long scan), copied, and a weight Prepare
  // packs, copied or (borrow_packed) viewed in place.
  std::string largest, packed;
  for (const auto& [k, raw] : ckpt0->tensors) {
    if (largest.empty() || raw.numel() > ckpt0->tensors.at(largest).numel()) largest = k;
    if (packed.empty() && absl::StrContains(k, "intermediate.dense.weight")) packed = k;
  }
  ASSERT_FALSE(packed.empty());
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const std::string& key : {largest, packed}) {
    const io::RawTensor& raw = ckpt0->tensors.at(key);
    ASSERT_EQ(raw.dtype, io::DType::kF32) << key;
    const size_t first = static_cast<size_t>(raw.data - reinterpret_cast<const uint8_t*>(original->data()));
    const size_t last = first + raw.nbytes() - sizeof(float);
    ASSERT_LE(last + sizeof(float), original->size());
    for (const auto& [offset, bad] : {std::pair<size_t, float>{first, nan}, {last, -inf}, {last, inf}}) {
      for (const bool borrow : {false, true}) {
        auto copy = std::make_shared<std::string>(*original);
        std::memcpy(copy->data() + offset, &bad, sizeof(bad));
        auto ckpt = io::ParseSafetensorsBytes(io::BytesOfString(std::move(copy)), file_);
        ASSERT_TRUE(ckpt.ok());
        BertClassifier model(config_);
        absl::Status s = LoadStateDict(model, *ckpt, file_, borrow);
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key << ": " << bad << " at byte " << offset;
        EXPECT_NE(s.message().find("non-finite"), std::string::npos) << s;
        EXPECT_NE(s.message().find(NormalizeKey(key)), std::string::npos) << s;
      }
    }
  }
  // The largest finite float is a weight like any other.
  auto copy = std::make_shared<std::string>(*original);
  const float big = std::numeric_limits<float>::max();
  const io::RawTensor& raw = ckpt0->tensors.at(largest);
  std::memcpy(copy->data() + (raw.data - reinterpret_cast<const uint8_t*>(original->data())), &big, sizeof(big));
  auto ckpt = io::ParseSafetensorsBytes(io::BytesOfString(std::move(copy)), file_);
  ASSERT_TRUE(ckpt.ok());
  BertClassifier model(config_);
  EXPECT_TRUE(LoadStateDict(model, *ckpt, file_).ok());
}

TEST_F(StateDictTest, BorrowedWeightsViewTheCheckpointUntilPrepareHasPackedThem) {
  auto ckpt = io::ReadCheckpointFile(file_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const std::weak_ptr<const void> mapping = ckpt->tensors.begin()->second.owner;
  BertClassifier model(config_);
  ASSERT_TRUE(LoadStateDict(model, *ckpt, file_, /*borrow_packed=*/true).ok());
  ExpectSameWeights(model, *ckpt);
  // The weights Prepare packs are the file's own bytes; every other parameter is a copy.
  int borrowed = 0;
  for (const auto& [name, t] : NamedWeights(model)) {
    for (const auto& [key, raw] : ckpt->tensors) {
      if (NormalizeKey(key) != name) continue;
      const bool view = t.data_ptr() == static_cast<const void*>(raw.data);
      EXPECT_EQ(view, model.PackedOnPrepare(t)) << name;
      borrowed += view;
    }
  }
  EXPECT_EQ(borrowed, 6 * config_.num_hidden_layers);  // query, key, value, output, FFN in and out
  // The views hold the file's bytes after the checkpoint has gone...
  ckpt = absl::UnknownError("dropped");
  EXPECT_FALSE(mapping.expired());
  // ...until Prepare has packed them and dropped the views (where it packs).
  model.Prepare(c10::Device(c10::kCPU), at::kFloat, /*pack_weights=*/true);
  if (model.weights_released()) {
    EXPECT_TRUE(mapping.expired()) << "a view of the checkpoint outlived Prepare";
  }
}

}  // namespace
}  // namespace collabserve::model
