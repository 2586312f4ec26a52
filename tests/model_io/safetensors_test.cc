#include "server/model/io/safetensors.h"

#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/model_io/test_helpers.h"

namespace collabserve::model::io {
namespace {

using ::testing::HasSubstr;
using testing::FormulaValue;
using testing::MakeFormulaTensors;
using testing::TempPath;
using testing::Values;

// A safetensors file with `header` as its JSON and `data_bytes` zero bytes of data.
std::shared_ptr<const std::string> File(const std::string& header, size_t data_bytes) {
  std::string out;
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += header;
  out.append(data_bytes, '\0');
  return std::make_shared<const std::string>(std::move(out));
}

absl::Status ParseError(const std::string& header, size_t data_bytes) {
  return ParseSafetensors(File(header, data_bytes), "model.safetensors").status();
}

TEST(SafetensorsTest, RoundTripsEveryDTypeShapeAndMetadata) {
  auto t = MakeFormulaTensors("layer.0");
  const std::string path = TempPath("all.safetensors");
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "héllo"}};
  ASSERT_TRUE(WriteSafetensors(path, t.tensors, metadata).ok());
  auto ckpt = ReadSafetensors(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->metadata, metadata);
  ASSERT_EQ(ckpt->tensors.size(), t.tensors.size());
  for (const TensorToWrite& w : t.tensors) {
    SCOPED_TRACE(w.name);
    const RawTensor& r = ckpt->tensors.at(w.name);
    EXPECT_EQ(r.dtype, w.dtype);
    EXPECT_EQ(r.shape, w.shape);
    EXPECT_TRUE(r.is_contiguous());
    EXPECT_EQ(r.storage_bytes_available, r.nbytes());
    // Every tensor starts at a multiple of its element size (the writer lays them out so).
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.data) % DTypeSize(r.dtype), 0u);
    std::vector<double> v = Values(r);
    for (size_t k = 0; k < v.size(); ++k) EXPECT_EQ(v[k], FormulaValue(w.dtype, k)) << k;
  }
  // The dispatcher picks safetensors by content.
  auto again = ReadCheckpointFile(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tensors.size(), t.tensors.size());
}

TEST(SafetensorsTest, TensorsOutliveTheCheckpointAndTheFile) {
  auto t = MakeFormulaTensors("x");
  const std::string path = TempPath("keep.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, t.tensors, {}).ok());
  RawTensor kept;
  {
    auto ckpt = ReadSafetensors(path);
    ASSERT_TRUE(ckpt.ok());
    kept = ckpt->tensors.at("x.F32");
  }
  std::remove(path.c_str());
  EXPECT_EQ(Values(kept)[0], FormulaValue(DType::kF32, 0));
}

TEST(SafetensorsTest, EmptyCheckpointRoundTrips) {
  const std::string path = TempPath("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}, {}).ok());
  auto ckpt = ReadSafetensors(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->tensors.empty());
}

TEST(SafetensorsTest, WriterRejectsBadTensors) {
  float x = 1;
  EXPECT_INVALID(WriteSafetensors(TempPath("w"), {{"", DType::kF32, {1}, &x}}, {}), "name is empty");
  EXPECT_INVALID(WriteSafetensors(TempPath("w"), {{"a", DType::kF32, {1}, &x}, {"a", DType::kF32, {1}, &x}}, {}),
                 "'a' appears twice");
  EXPECT_INVALID(WriteSafetensors(TempPath("w"), {{"a", DType::kF32, {-1}, &x}}, {}), "invalid dim -1");
  EXPECT_INVALID(WriteSafetensors(TempPath("w"), {{"a", DType::kF32, {2}, nullptr}}, {}), "has no data");
  EXPECT_INVALID(WriteSafetensors(TempPath("w"), {{"__metadata__", DType::kF32, {1}, &x}}, {}), "reserved");
}

// The writer streams the tensors into the file: the file holds exactly the serialized bytes, and a
// rejected write leaves an existing file as it was, with no temporary file beside it.
TEST(SafetensorsTest, StreamedFileEqualsTheSerializedBytes) {
  auto t = MakeFormulaTensors("layer.0");
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const std::string path = TempPath("streamed.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, t.tensors, metadata).ok());
  auto expected = SerializeSafetensors(t.tensors, metadata);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::ifstream in(path, std::ios::binary);
  std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, *expected);
}

TEST(SafetensorsTest, ARejectedWriteLeavesTheOldFile) {
  const std::string path = TempPath("kept.safetensors");
  auto t = MakeFormulaTensors("a");
  ASSERT_TRUE(WriteSafetensors(path, t.tensors, {}).ok());
  float x = 1;
  EXPECT_INVALID(WriteSafetensors(path, {{"b", DType::kF32, {2}, nullptr}}, {}), "has no data");
  auto ckpt = ReadSafetensors(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->tensors.size(), t.tensors.size());
  EXPECT_FALSE(WriteSafetensors("/nonexistent-dir-for-collabserve/x.safetensors",
                                {{"a", DType::kF32, {1}, &x}}, {}).ok());
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  auto r = ReadSafetensors("/nonexistent/model.safetensors");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("/nonexistent/model.safetensors"));
}

TEST(SafetensorsTest, EmptyFile) {
  const std::string path = TempPath("empty_file.safetensors");
  testing::WriteBytes(path, "");
  EXPECT_INVALID(ReadSafetensors(path).status(), "0 bytes is shorter than the 8-byte header length");
}

TEST(SafetensorsTest, TruncatedData) {
  auto t = MakeFormulaTensors("x");
  auto bytes = SerializeSafetensors(t.tensors, {});
  ASSERT_TRUE(bytes.ok());
  auto cut = std::make_shared<const std::string>(bytes->substr(0, bytes->size() - 4));
  EXPECT_INVALID(ParseSafetensors(cut, "model.safetensors").status(), "-byte data buffer");
}

TEST(SafetensorsTest, TruncatedHeader) {
  auto t = MakeFormulaTensors("x");
  auto bytes = SerializeSafetensors(t.tensors, {});
  ASSERT_TRUE(bytes.ok());
  auto cut = std::make_shared<const std::string>(bytes->substr(0, 40));
  EXPECT_INVALID(ParseSafetensors(cut, "model.safetensors").status(), "runs past the end of the 40-byte file");
}

TEST(SafetensorsTest, HugeHeaderLength) {
  auto bytes = std::make_shared<const std::string>(std::string(8, '\xff') + "{}");
  EXPECT_INVALID(ParseSafetensors(bytes, "model.safetensors").status(),
                 "model.safetensors: header length 18446744073709551615 is over the limit of 100000000 bytes");
}

TEST(SafetensorsTest, NonJsonHeader) {
  EXPECT_INVALID(ParseError("{\"a\": nope}", 0), "model.safetensors: header is not valid JSON");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\"", 0), "header is not valid JSON");
}

TEST(SafetensorsTest, HeaderNotAnObject) {
  EXPECT_INVALID(ParseError("[1, 2, 3]", 0), "header is not a JSON object");
}

TEST(SafetensorsTest, EntryOfWrongType) {
  EXPECT_INVALID(ParseError("{\"w\": 3}", 0), "tensor 'w': entry must be an object, got a number");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": 1, \"shape\": [], \"data_offsets\": [0, 4]}}", 4),
                 "tensor 'w': dtype must be a string");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": \"F32\", \"shape\": [[[[1]]]], \"data_offsets\": [0, 4]}}", 4),
                 "tensor 'w': shape must contain only integers, got an array");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4),
                 "shape has non-integer value 1.5");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4], \"x\": 1}}", 4),
                 "unknown field 'x'");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": \"F32\", \"shape\": []}}", 4), "missing field 'data_offsets'");
  EXPECT_INVALID(ParseError("{\"w\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0]}}", 4),
                 "data_offsets must have exactly 2 numbers");
  EXPECT_INVALID(ParseError("{\"__metadata__\": {\"k\": 1}}", 0), "__metadata__: value of 'k' must be a string");
}

TEST(SafetensorsTest, EmptyAndDuplicateNames) {
  EXPECT_INVALID(ParseError("{\"\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4]}}", 4),
                 "tensor name is empty");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4]}, "
                            "\"a\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [4, 8]}}", 8),
                 "tensor 'a': name appears twice");
}

TEST(SafetensorsTest, OverlappingRanges) {
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}, "
                            "\"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", 12),
                 "tensor 'b': data_offsets [4, 12) overlap tensor 'a' at [0, 8)");
}

TEST(SafetensorsTest, OffsetsOutOfRange) {
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [25], \"data_offsets\": [0, 100]}}", 8),
                 "tensor 'a': data_offsets [0, 100) run past the 8-byte data buffer");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}", 8),
                 "data_offsets [8, 0) has begin after end");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [-8, 0]}}", 8),
                 "negative offset -8");
}

TEST(SafetensorsTest, NegativeDim) {
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1, 2], \"data_offsets\": [0, 8]}}", 8),
                 "tensor 'a': shape has negative dim -1");
}

TEST(SafetensorsTest, HugeDims) {
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [1099511627776, 1099511627776], "
                            "\"data_offsets\": [0, 8]}}", 8),
                 "tensor 'a': shape [1099511627776, 1099511627776...] overflows 64 bits");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [18446744073709551615], "
                            "\"data_offsets\": [0, 8]}}", 8),
                 "shape dim 18446744073709551615 is over the limit");
  EXPECT_INVALID(ParseError("{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "
                            "\"data_offsets\": [0, 4]}}", 4),
                 "shape has more than 16 dims");
}

TEST(SafetensorsTest, DTypeShapeMismatch) {
  EXPECT_INVALID(ParseError("{\"x\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [10, 20]}}", 20),
                 "model.safetensors: tensor 'x': data_offsets [10, 20) is 10 bytes but F32 [3] needs 12");
}

TEST(SafetensorsTest, UnknownDType) {
  EXPECT_INVALID(ParseError("{\"x\": {\"dtype\": \"F7\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1),
                 "tensor 'x': unknown or unsupported dtype 'F7'");
  EXPECT_INVALID(ParseError("{\"x\": {\"dtype\": \"U16\", \"shape\": [1], \"data_offsets\": [0, 2]}}", 2),
                 "unsupported dtype 'U16'");
}

TEST(SafetensorsTest, AcceptsEmptyTensorsAnywhereAndHoles) {
  auto r = ParseSafetensors(File("{\"e\": {\"dtype\": \"F32\", \"shape\": [0, 5], \"data_offsets\": [4, 4]}, "
                                 "\"a\": {\"dtype\": \"I8\", \"shape\": [2], \"data_offsets\": [2, 4]}}", 8),
                            "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensors.at("e").numel(), 0);
  EXPECT_EQ(r->tensors.at("a").numel(), 2);
}

// Random byte mutations (mostly landing in the header) either read in bounds or fail with
// INVALID_ARGUMENT; truncation at any length fails.
TEST(SafetensorsTest, MutatedFilesFailCleanlyOrReadInBounds) {
  auto t = MakeFormulaTensors("layer");
  auto bytes = SerializeSafetensors(t.tensors, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok());
  std::mt19937 rng(7);
  const size_t header_end = 8 + static_cast<uint8_t>((*bytes)[0]) + (static_cast<uint8_t>((*bytes)[1]) << 8);
  int ok = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string m = *bytes;
    for (int k = 1 + rng() % 3; k > 0; --k) m[rng() % header_end] = static_cast<char>(rng());
    auto c = ParseSafetensors(std::make_shared<const std::string>(m), "m");
    if (c.ok()) {
      ++ok;
      for (const auto& [name, r] : c->tensors) Values(r);
    } else {
      ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    }
  }
  EXPECT_GT(ok, 0);
  for (size_t len = 0; len < bytes->size(); ++len) {
    EXPECT_FALSE(ParseSafetensors(std::make_shared<const std::string>(bytes->substr(0, len)), "t").ok()) << len;
  }
}

}  // namespace
}  // namespace collabserve::model::io
