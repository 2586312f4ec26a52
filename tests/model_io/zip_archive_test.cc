#include "server/model/io/zip_archive.h"

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/model_io/test_helpers.h"

namespace collabserve::model::io {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<ZipArchive> OpenString(std::string bytes) {
  return ZipArchive::Open(BytesOfString(std::make_shared<const std::string>(std::move(bytes))), "x.bin");
}

std::string TwoEntryZip(const std::string& name_a = "top/a", const std::string& name_b = "top/b") {
  auto z = BuildZip({{name_a, "hello, world"}, {name_b, std::string(100, 'b')}});
  EXPECT_TRUE(z.ok()) << z.status();
  return *z;
}

void Put32At(std::string* s, size_t pos, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*s)[pos + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Offset of the central directory record of entry `name`.
size_t CentralRecord(const std::string& zip, const std::string& name) {
  size_t pos = 0;
  while ((pos = zip.find("PK\x01\x02", pos)) != std::string::npos) {
    if (zip.compare(pos + 46, name.size(), name) == 0) return pos;
    ++pos;
  }
  ADD_FAILURE() << "no central record for " << name;
  return 0;
}

TEST(Crc32Test, MatchesTheStandardCheckValue) {
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32("", 0), 0u);
  std::string big(1000, 'x');
  EXPECT_EQ(Crc32(big.data() + 500, 500, Crc32(big.data(), 500)), Crc32(big.data(), 1000));
}

TEST(ZipArchiveTest, RoundTripsStoredEntriesAligned) {
  auto zip = OpenString(TwoEntryZip());
  ASSERT_TRUE(zip.ok()) << zip.status();
  ASSERT_EQ(zip->entries().size(), 2u);
  EXPECT_EQ(zip->Contents(*zip->Find("top/a")), "hello, world");
  EXPECT_EQ(zip->Contents(*zip->Find("top/b")), std::string(100, 'b'));
  EXPECT_EQ(zip->Find("top/c"), nullptr);
  for (const ZipEntry& e : zip->entries()) EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
}

TEST(ZipArchiveTest, ReadsForcedZip64) {
  ZipWriteOptions options;
  options.force_zip64 = true;
  auto bytes = BuildZip({{"a/x", "0123"}, {"a/y", ""}}, options);
  ASSERT_TRUE(bytes.ok());
  EXPECT_NE(bytes->find("PK\x06\x06"), std::string::npos);  // ZIP64 end record present
  auto zip = OpenString(*bytes);
  ASSERT_TRUE(zip.ok()) << zip.status();
  EXPECT_EQ(zip->Contents(*zip->Find("a/x")), "0123");
  EXPECT_EQ(zip->Contents(*zip->Find("a/y")), "");
}

TEST(ZipArchiveTest, ReadsPythonZip64LocalHeadersAndTorchDataDescriptors) {
  for (const char* f : {"zip64.bin", "hf_style.bin"}) {
    auto bytes = MapFileReadOnly(testing::SourcePath(std::string("tests/data/model_io/") + f));
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto zip = ZipArchive::Open(*bytes, f);
    ASSERT_TRUE(zip.ok()) << zip.status();
    EXPECT_NE(zip->Find("hf_style/data.pkl"), nullptr) << f;
    EXPECT_EQ(zip->Contents(*zip->Find("hf_style/version")), "3\n") << f;
  }
}

TEST(ZipArchiveTest, NotAZip) {
  EXPECT_INVALID(OpenString("this is certainly not a zip file, just some text").status(),
                 "x.bin: not a zip file, or truncated: no end-of-central-directory record");
  EXPECT_INVALID(OpenString("PK").status(), "not a zip file: 2 bytes is too short");
}

TEST(ZipArchiveTest, Truncated) {
  std::string z = TwoEntryZip();
  EXPECT_INVALID(OpenString(z.substr(0, z.size() - 10)).status(), "no end-of-central-directory record");
  // Cut the data but keep a well-formed end record: the central directory is now outside the file.
  std::string eocd = z.substr(z.size() - 22);
  EXPECT_INVALID(OpenString(z.substr(0, 100) + eocd).status(), "runs outside the file");
}

TEST(ZipArchiveTest, EntryThatLiesAboutItsSize) {
  std::string z = TwoEntryZip();
  const size_t cd = CentralRecord(z, "top/b");
  std::string lie = z;  // central says more bytes than there are, local agrees
  Put32At(&lie, cd + 20, 1u << 30);
  Put32At(&lie, cd + 24, 1u << 30);
  auto ok = OpenString(z);
  const uint64_t local = ok->Find("top/b")->local_header_offset;
  Put32At(&lie, local + 18, 1u << 30);
  Put32At(&lie, local + 22, 1u << 30);
  EXPECT_INVALID(OpenString(lie).status(), "zip entry 'top/b' claims 1073741824 bytes");
  std::string disagree = z;  // only the central record changes
  Put32At(&disagree, cd + 20, 99);
  Put32At(&disagree, cd + 24, 99);
  EXPECT_INVALID(OpenString(disagree).status(), "zip entry 'top/b' local header says 100 bytes");
}

TEST(ZipArchiveTest, OverlappingEntries) {
  std::string z = TwoEntryZip();
  auto ok = OpenString(z);
  ASSERT_TRUE(ok.ok());
  const ZipEntry a = *ok->Find("top/a");
  const uint64_t b_local = ok->Find("top/b")->local_header_offset;
  const uint32_t grown = static_cast<uint32_t>(b_local - a.data_offset + 8);  // reaches into b's header
  const size_t cd = CentralRecord(z, "top/a");
  Put32At(&z, cd + 20, grown);
  Put32At(&z, cd + 24, grown);
  Put32At(&z, a.local_header_offset + 18, grown);
  Put32At(&z, a.local_header_offset + 22, grown);
  EXPECT_INVALID(OpenString(z).status(), "zip entry 'top/b' overlaps entry 'top/a'");
}

TEST(ZipArchiveTest, CompressedEntry) {
  std::string z = TwoEntryZip();
  auto ok = OpenString(z);
  z[ok->Find("top/a")->local_header_offset + 8] = 8;
  z[CentralRecord(z, "top/a") + 10] = 8;
  EXPECT_INVALID(OpenString(z).status(),
                 "zip entry 'top/a' is compressed (method 8, deflate); only stored (uncompressed) entries "
                 "are supported");
}

TEST(ZipArchiveTest, DotDotAndAbsoluteNames) {
  EXPECT_FALSE(BuildZip({{"../evil", "x"}}).ok());
  std::string z = TwoEntryZip("top/XX/a", "Ytop/b");
  for (size_t pos = 0; (pos = z.find("top/XX/a", pos)) != std::string::npos; ++pos) z.replace(pos, 8, "top/../a");
  EXPECT_INVALID(OpenString(z).status(), "zip entry 'top/../a' has a '..' component");
  z = TwoEntryZip("top/a", "Ytop/b");
  for (size_t pos = 0; (pos = z.find("Ytop/b", pos)) != std::string::npos; ++pos) z[pos] = '/';
  EXPECT_INVALID(OpenString(z).status(), "zip entry '/top/b' is an absolute path");
}

TEST(ZipArchiveTest, DataDescriptorThatLies) {
  const std::string path = testing::SourcePath("tests/data/model_io/hf_style.bin");
  std::ifstream in(path, std::ios::binary);
  std::string z((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t desc = z.find("PK\x07\x08");  // torch writes one after every non-empty entry
  ASSERT_NE(desc, std::string::npos);
  z[desc + 8] ^= 1;  // its compressed size
  EXPECT_INVALID(OpenString(z).status(),
                 "zip entry 'hf_style/data.pkl' data descriptor is missing or disagrees with the central directory");
}

TEST(ZipArchiveTest, CorruptData) {
  std::string z = TwoEntryZip();
  auto ok = OpenString(z);
  z[ok->Find("top/b")->data_offset + 5] ^= 1;
  EXPECT_INVALID(OpenString(z).status(), "zip entry 'top/b' is corrupt: CRC-32");
}

TEST(ZipArchiveTest, EntryCountThatLies) {
  std::string z = TwoEntryZip();
  const size_t eocd = z.size() - 22;
  z[eocd + 8] = z[eocd + 10] = 3;
  EXPECT_INVALID(OpenString(z).status(), "cannot hold 3 entries");
  z[eocd + 8] = z[eocd + 10] = 1;
  EXPECT_INVALID(OpenString(z).status(), "but its 1 entries use");
}

TEST(ZipArchiveTest, DuplicateNames) {
  std::string z = TwoEntryZip("top/a", "top/b");
  for (size_t pos = 0; (pos = z.find("top/b", pos)) != std::string::npos; ++pos) z[pos + 4] = 'a';
  EXPECT_INVALID(OpenString(z).status(), "zip entry 'top/a' appears twice");
}

}  // namespace
}  // namespace collabserve::model::io
