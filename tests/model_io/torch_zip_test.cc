#include "server/model/io/torch_zip.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/io/zip_archive.h"
#include "tests/model_io/test_helpers.h"

namespace collabserve::model::io {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::FormulaValue;
using testing::MakeFormulaTensors;
using testing::SourcePath;
using testing::TempPath;
using testing::Values;

std::string Fixture(const std::string& name) { return SourcePath("tests/data/model_io/" + name); }

std::vector<double> Range(int n, double scale, double shift = 0) {
  std::vector<double> v;
  for (int k = 0; k < n; ++k) v.push_back((k + shift) * scale);
  return v;
}

// The tensors of hf_style_state_dict() in tests/reference/make_torch_checkpoints.py.
void ExpectHfStyle(const Checkpoint& c) {
  const TensorMap& t = c.tensors;
  ASSERT_EQ(t.size(), 15u);
  const RawTensor& w = t.at("bert.embeddings.word_embeddings.weight");
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_THAT(w.shape, ElementsAre(3, 4));
  EXPECT_EQ(Values(w), Range(12, 0.5));
  EXPECT_EQ(Values(t.at("f64")), Range(5, 0.25));
  EXPECT_EQ(t.at("f16").dtype, DType::kF16);
  EXPECT_EQ(Values(t.at("f16")), Range(6, 1, -2));
  EXPECT_EQ(t.at("bf16").dtype, DType::kBF16);
  EXPECT_EQ(Values(t.at("bf16")), Range(4, 2));
  EXPECT_EQ(Values(t.at("i64")), Range(6, 1e12, -3));
  EXPECT_EQ(Values(t.at("i32")), Range(8, 1e5, -4));
  EXPECT_EQ(Values(t.at("i16")), Range(8, 1e3, -4));
  EXPECT_EQ(t.at("i8").dtype, DType::kI8);
  EXPECT_EQ(Values(t.at("i8")), Range(8, 1, -4));
  EXPECT_EQ(t.at("u8").dtype, DType::kU8);
  EXPECT_EQ(Values(t.at("u8")), Range(6, 1, 250));
  EXPECT_EQ(t.at("bool").dtype, DType::kBool);
  EXPECT_THAT(Values(t.at("bool")), ElementsAre(1, 0, 1));
  // Two tensors viewing one storage: same bytes, different offsets.
  const RawTensor& a = t.at("shared.a");
  const RawTensor& b = t.at("shared.b");
  EXPECT_EQ(Values(a), Range(4, 1, 2));
  EXPECT_EQ(Values(b), Range(10, 1));
  EXPECT_EQ(a.data, b.data + 2 * sizeof(float));
  EXPECT_EQ(a.storage_bytes_available, 8 * sizeof(float));
  EXPECT_EQ(a.owner.get(), b.owner.get());
  // A transposed view: strides (1, 3), values read through the strides.
  const RawTensor& tr = t.at("transposed");
  EXPECT_THAT(tr.shape, ElementsAre(3, 2));
  EXPECT_THAT(tr.strides, ElementsAre(1, 3));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_THAT(Values(tr), ElementsAre(0, 3, 1, 4, 2, 5));
  EXPECT_TRUE(t.at("scalar").shape.empty());
  EXPECT_THAT(Values(t.at("scalar")), ElementsAre(3.5));
  EXPECT_THAT(t.at("empty").shape, ElementsAre(0, 3));
  EXPECT_EQ(t.at("empty").numel(), 0);
}

TEST(TorchZipTest, ReadsAHuggingFaceStyleStateDictSavedByTorch) {
  auto c = ReadTorchZip(Fixture("hf_style.bin"));
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectHfStyle(*c);
  EXPECT_TRUE(c->metadata.empty());
  auto d = ReadCheckpointFile(Fixture("hf_style.bin"));
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectHfStyle(*d);
}

TEST(TorchZipTest, ReadsZip64Rezip) {
  auto c = ReadTorchZip(Fixture("zip64.bin"));
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectHfStyle(*c);
}

TEST(TorchZipTest, UnwrapsASingleNestedStateDict) {
  auto c = ReadTorchZip(Fixture("nested.bin"));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->tensors.size(), 1u);
  EXPECT_THAT(Values(c->tensors.at("a")), ElementsAre(0, 1, 2));
}

// `base`: the first byte of the file's bytes (data is 64-byte aligned relative to it).
void ExpectFormula(const Checkpoint& c, const std::vector<TensorToWrite>& written, const char* base = nullptr) {
  ASSERT_EQ(c.tensors.size(), written.size());
  for (const TensorToWrite& w : written) {
    SCOPED_TRACE(w.name);
    const RawTensor& r = c.tensors.at(w.name);
    EXPECT_EQ(r.dtype, w.dtype);
    EXPECT_EQ(r.shape, w.shape);
    EXPECT_TRUE(r.is_contiguous());
    // 64-byte aligned in the file like torch's writer (a mapping starts page-aligned).
    EXPECT_EQ((reinterpret_cast<uintptr_t>(r.data) - reinterpret_cast<uintptr_t>(base)) % 64, 0u);
    std::vector<double> v = Values(r);
    for (size_t k = 0; k < v.size(); ++k) EXPECT_EQ(v[k], FormulaValue(w.dtype, k)) << k;
  }
}

TEST(TorchZipTest, RoundTripsEveryDType) {
  auto t = MakeFormulaTensors("encoder.layer.0");
  const std::string path = TempPath("pytorch_model.bin");
  ASSERT_TRUE(WriteTorchZip(path, t.tensors).ok());
  auto c = ReadTorchZip(path);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectFormula(*c, t.tensors);
}

TEST(TorchZipTest, RoundTripsWithZip64Records) {
  auto t = MakeFormulaTensors("x");
  auto bytes = SerializeTorchZip(t.tensors, /*force_zip64=*/true);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto shared = std::make_shared<const std::string>(*bytes);
  auto c = ParseTorchZip(shared, "zip64.bin");
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectFormula(*c, t.tensors, shared->data());
}

// The writer streams the entries into the file: the file holds exactly the serialized bytes.
TEST(TorchZipTest, StreamedFileEqualsTheSerializedBytes) {
  auto t = MakeFormulaTensors("encoder.layer.0");
  const std::string path = TempPath("streamed.bin");
  ASSERT_TRUE(WriteTorchZip(path, t.tensors).ok());
  auto expected = SerializeTorchZip(t.tensors);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::ifstream in(path, std::ios::binary);
  std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, *expected);
}

TEST(TorchZipTest, WriterRejectsBadTensors) {
  float x = 0;
  EXPECT_INVALID(WriteTorchZip(TempPath("w.bin"), {{"a", DType::kF32, {1}, &x}, {"a", DType::kF32, {1}, &x}}),
                 "tensor 'a' appears twice");
  EXPECT_INVALID(WriteTorchZip(TempPath("w.bin"), {{"a", DType::kF32, {2, -3}, &x}}), "invalid dim -3");
  EXPECT_INVALID(WriteTorchZip(TempPath("w.bin"), {{"bad\xff", DType::kF32, {1}, &x}}),
                 "tensor name 'bad\\xff' is not valid UTF-8");
  EXPECT_TRUE(WriteTorchZip(TempPath("w.bin"), {{"gr\xc3\xbc\xc3\x9f.\xe2\x82\xac", DType::kF32, {1}, &x}}).ok());
}

// Our writer's files must load in Python's torch.load (also weights_only=True) with equal values.
TEST(TorchZipTest, OurFilesLoadInPythonTorch) {
  if (::access("/usr/bin/python3", X_OK) != 0) {
    FAIL() << "/usr/bin/python3 (with torch) is required for this test and is missing";
  }
  auto t = MakeFormulaTensors("bert.encoder.layer.0");
  const std::string plain = TempPath("ours.bin");
  const std::string zip64 = TempPath("ours_zip64.bin");
  ASSERT_TRUE(WriteTorchZip(plain, t.tensors).ok());
  auto bytes = SerializeTorchZip(t.tensors, /*force_zip64=*/true);
  ASSERT_TRUE(bytes.ok());
  testing::WriteBytes(zip64, *bytes);
  const std::string log = TempPath("python.log");
  const std::string cmd = "/usr/bin/python3 " + SourcePath("tests/reference/make_torch_checkpoints.py") +
                          " check-ours " + plain + " " + zip64 + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream out;
  out << in.rdbuf();
  ASSERT_EQ(rc, 0) << "python check failed (is torch importable by /usr/bin/python3?):\n" << out.str();
  EXPECT_THAT(out.str(), HasSubstr("10 tensors checked"));
  EXPECT_THAT(out.str(), HasSubstr("weights_only=True"));
}

// ---- hostile or malformed files ----

std::shared_ptr<const std::string> Zip(const std::vector<ZipSource>& entries) {
  auto z = BuildZip(entries);
  EXPECT_TRUE(z.ok()) << z.status();
  return std::make_shared<const std::string>(*z);
}

absl::Status ParseError(const std::string& pickle, const std::string& storage = std::string(24, '\0')) {
  return ParseTorchZip(Zip({{"archive/data.pkl", pickle}, {"archive/data/0", storage}, {"archive/version", "3\n"}}),
                       "pytorch_model.bin")
      .status();
}

std::string Str(const std::string& s) {
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((s.size() >> (8 * i)) & 0xff));
  return out + s;
}

// {key: tensor of `numel` floats in storage `storage_key`} as torch.save writes it.
std::string OneTensor(const std::string& storage_key, int numel) {
  return B("\x80\x02") + "ccollections\nOrderedDict\n)R(" + Str("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
         Str("storage") + "ctorch\nFloatStorage\n" + Str(storage_key) + Str("cpu") + "K" +
         std::string(1, static_cast<char>(numel)) + "tQ" + B("K\x00K") + std::string(1, static_cast<char>(numel)) +
         "\x85" + B("K\x01\x85") + "\x89" + "ccollections\nOrderedDict\n)RtRu.";
}

TEST(TorchZipTest, HandMadeStateDictParses) {
  auto c = ParseTorchZip(Zip({{"archive/data.pkl", OneTensor("0", 6)},
                              {"archive/data/0", std::string(24, '\0')},
                              {"archive/version", "3\n"}}),
                         "pytorch_model.bin");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->tensors.at("w").shape, ElementsAre(6));
}

TEST(TorchZipTest, RefusesOsSystemInDataPkl) {
  EXPECT_INVALID(ParseError(B("\x80\x02") + "cos\nsystem\n" + Str("touch /tmp/pwned") + "\x85R."),
                 "pytorch_model.bin: data.pkl: global 'os.system' is not allowed in a state dict");
}

// A file torch.save really wrote for a payload whose __reduce__ is os.system (pickled as
// posix.system on Linux). Reading it must refuse it, and run nothing.
TEST(TorchZipTest, RefusesARealMaliciousTorchSave) {
  const std::string path = Fixture("hostile.bin");
  EXPECT_INVALID(ReadTorchZip(path).status(),
                 path + ": data.pkl: global 'posix.system' is not allowed in a state dict");
  EXPECT_INVALID(ReadCheckpointFile(path).status(), "global 'posix.system' is not allowed");
}

TEST(TorchZipTest, MissingStorageEntry) {
  EXPECT_INVALID(ParseError(OneTensor("7", 6)), "tensor 'w': storage entry 'archive/data/7' is missing");
}

TEST(TorchZipTest, StorageEntryTooSmall) {
  EXPECT_INVALID(ParseError(OneTensor("0", 6), std::string(20, '\0')),
                 "tensor 'w': storage '0' claims 6 F32 elements but its entry has 20 bytes");
}

TEST(TorchZipTest, ValueThatIsNotATensor) {
  EXPECT_INVALID(ParseError(B("\x80\x02}") + Str("a") + "K\x01s."), "tensor 'a': value is a int, not a tensor");
  EXPECT_INVALID(ParseError(B("\x80\x02]") + "."), "the saved object is a list, not a state dict");
}

TEST(TorchZipTest, ZipWithoutDataPkl) {
  EXPECT_INVALID(ParseTorchZip(Zip({{"archive/version", "3\n"}}), "pytorch_model.bin").status(),
                 "pytorch_model.bin: zip has no <folder>/data.pkl entry: not a torch.save checkpoint");
}

TEST(TorchZipTest, NotAZip) {
  EXPECT_INVALID(ParseTorchZip(std::make_shared<const std::string>("definitely not a zip archive........"),
                               "pytorch_model.bin")
                     .status(),
                 "pytorch_model.bin: not a zip file");
  EXPECT_INVALID(ParseTorchZip(std::make_shared<const std::string>(""), "pytorch_model.bin").status(),
                 "file is empty");
}

TEST(TorchZipTest, TruncatedFile) {
  std::ifstream in(Fixture("hf_style.bin"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_INVALID(ParseTorchZip(std::make_shared<const std::string>(bytes.substr(0, bytes.size() / 2)), "p.bin").status(),
                 "no end-of-central-directory record");
}

TEST(TorchZipTest, BigEndianByteorder) {
  auto c = ParseTorchZip(Zip({{"archive/data.pkl", OneTensor("0", 6)},
                              {"archive/byteorder", "big"},
                              {"archive/data/0", std::string(24, '\0')},
                              {"archive/version", "3\n"}}),
                         "pytorch_model.bin");
  EXPECT_INVALID(c.status(), "byteorder is 'big'; only little-endian checkpoints are supported");
}

// Reads every element of every tensor (bounds are EXPECTed inside ElementAt) unless it is huge.
void TouchAll(const Checkpoint& c) {
  for (const auto& [name, t] : c.tensors) {
    if (t.numel() < 100000) Values(t);
  }
}

std::string ReadFixture(const std::string& name) {
  std::ifstream in(Fixture(name), std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Random byte mutations of a real torch file: each either reads (in bounds) or fails with
// INVALID_ARGUMENT; never a crash, hang or other code. The zip layer sees them directly; to reach
// the unpickler past the CRC check, data.pkl is also mutated and re-zipped with a correct CRC.
TEST(TorchZipTest, MutatedFilesFailCleanlyOrReadInBounds) {
  const std::string original = ReadFixture("hf_style.bin");
  auto zip = ZipArchive::Open(BytesOfString(std::make_shared<const std::string>(original)), "f");
  ASSERT_TRUE(zip.ok());
  std::mt19937 rng(20261130);
  int ok = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string m = original;
    for (int k = 1 + rng() % 4; k > 0; --k) m[rng() % m.size()] = static_cast<char>(rng());
    auto c = ParseTorchZip(std::make_shared<const std::string>(m), "m.bin");
    if (c.ok()) {
      ++ok;
      TouchAll(*c);
    } else {
      ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    }
  }
  int pickle_ok = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<std::string> contents;
    for (const ZipEntry& e : zip->entries()) contents.emplace_back(zip->Contents(e));
    std::string& pkl = contents[0];
    for (int k = 1 + rng() % 3; k > 0; --k) pkl[rng() % pkl.size()] = static_cast<char>(rng());
    std::vector<ZipSource> entries;
    for (size_t e = 0; e < contents.size(); ++e) entries.push_back({zip->entries()[e].name, contents[e]});
    auto c = ParseTorchZip(std::make_shared<const std::string>(*BuildZip(entries)), "m.bin");
    if (c.ok()) {
      ++pickle_ok;
      TouchAll(*c);
    } else {
      ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    }
  }
  for (size_t len = 0; len < original.size(); len += 7) {
    EXPECT_FALSE(ParseTorchZip(std::make_shared<const std::string>(original.substr(0, len)), "t.bin").ok()) << len;
  }
  // Some mutations are harmless (padding, names of unused entries, values): both paths must see some.
  EXPECT_GT(ok, 0);
  EXPECT_GT(pickle_ok, 0);
}

}  // namespace
}  // namespace collabserve::model::io
