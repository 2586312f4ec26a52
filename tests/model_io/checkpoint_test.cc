#include "server/model/io/checkpoint.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/io/safetensors.h"
#include "server/model/io/torch_zip.h"
#include "tests/model_io/test_helpers.h"

namespace collabserve::model::io {
namespace {

using ::testing::HasSubstr;
using testing::MakeFormulaTensors;
using testing::TempPath;

TEST(RawTensorTest, NumelAndContiguity) {
  RawTensor t;
  t.shape = {2, 3};
  t.strides = {3, 1};
  EXPECT_EQ(t.numel(), 6);
  EXPECT_TRUE(t.is_contiguous());
  t.strides = {1, 2};  // transposed view
  EXPECT_FALSE(t.is_contiguous());
  t.shape = {};
  t.strides = {};
  EXPECT_EQ(t.numel(), 1);
  EXPECT_TRUE(t.is_contiguous());
  t.shape = {0, 4};
  t.strides = {7, 1};
  EXPECT_EQ(t.numel(), 0);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(ContiguousStrides({2, 3, 4}), (std::vector<int64_t>{12, 4, 1}));
}

TEST(ReadCheckpointFileTest, DispatchesOnContentNotName) {
  auto t = MakeFormulaTensors("m");
  const std::string zip_named_safetensors = TempPath("really_a_zip.safetensors");
  const std::string st_named_bin = TempPath("really_safetensors.bin");
  ASSERT_TRUE(WriteTorchZip(zip_named_safetensors, t.tensors).ok());
  ASSERT_TRUE(WriteSafetensors(st_named_bin, t.tensors, {{"k", "v"}}).ok());
  auto a = ReadCheckpointFile(zip_named_safetensors);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->tensors.size(), t.tensors.size());
  EXPECT_TRUE(a->metadata.empty());
  auto b = ReadCheckpointFile(st_named_bin);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->tensors.size(), t.tensors.size());
  EXPECT_EQ(b->metadata.at("k"), "v");
}

TEST(ReadCheckpointFileTest, MissingAndEmptyFiles) {
  auto missing = ReadCheckpointFile("/nonexistent/pytorch_model.bin");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  const std::string empty = TempPath("empty.bin");
  testing::WriteBytes(empty, "");
  auto e = ReadCheckpointFile(empty);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("shorter than the 8-byte header length"));
}

TEST(ReadCheckpointFileTest, RefusesLegacyTorchFormatClearly) {
  auto r = ReadCheckpointFile(testing::SourcePath("tests/data/model_io/legacy.bin"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("legacy (pre-1.6, non-zip) torch.save format is not supported"));
}

}  // namespace
}  // namespace collabserve::model::io
