// UploadSession and AdminAuth without a server: what a header may promise, how chunks are
// checked, and the token comparison.
#include "server/service/admin_upload.h"

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/service/admin_auth.h"
#include "tests/admin/admin_test_util.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::HeaderFor;
using ::collabserve::testing::Sha256Hex;
using ::collabserve::testing::TempDir;
using ::testing::HasSubstr;

std::map<std::string, std::string> Files() {
  return {{"config.json", "{}"}, {"vocab.txt", "[PAD]\n"}, {"model.safetensors", "weights!"}};
}

v1::UploadChunk Chunk(const std::string& name, int64_t offset, const std::string& data) {
  v1::UploadChunk c;
  c.set_file_name(name);
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

TEST(UploadSessionTest, HeaderRules) {
  EXPECT_TRUE(UploadSession::ValidateHeader(HeaderFor("m", Files()), 1000).ok());
  auto refused = [](v1::UploadHeader h, int64_t max = 1000) {
    absl::Status s = UploadSession::ValidateHeader(h, max);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  auto files = Files();
  files["sub/config.json"] = "";
  EXPECT_THAT(refused(HeaderFor("m", files)), HasSubstr("path separators"));
  files = Files();
  files["..vocab.txt"] = "";
  EXPECT_THAT(refused(HeaderFor("m", files)), HasSubstr("'..'"));
  files = Files();
  files["pytorch_model.bin"] = "";
  EXPECT_THAT(refused(HeaderFor("m", files)), HasSubstr("exactly one weights file"));
  files = Files();
  files.erase("config.json");
  EXPECT_THAT(refused(HeaderFor("m", files)), HasSubstr("no config.json"));
  EXPECT_THAT(refused(HeaderFor("m", Files()), 10), HasSubstr("--max_upload_bytes"));
  EXPECT_THAT(refused(HeaderFor("../m", Files())), HasSubstr("model_name"));
  v1::UploadHeader h = HeaderFor("m", Files());
  h.mutable_files(0)->set_sha256("abc");
  EXPECT_THAT(refused(h), HasSubstr("64 hexadecimal digits"));
  h = HeaderFor("m", Files());
  *h.add_files() = h.files(0);
  EXPECT_THAT(refused(h), HasSubstr("listed twice"));
  h = HeaderFor("m", Files());
  h.mutable_files(0)->set_size(-1);
  EXPECT_THAT(refused(h), HasSubstr("negative size"));
  EXPECT_TRUE(UploadSession::IsKnownFile("special_tokens_map.json"));
  EXPECT_FALSE(UploadSession::IsKnownFile("tokenizer.json"));
}

TEST(UploadSessionTest, ChunksInOrderAndVerified) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/u";
  auto s = UploadSession::Create(HeaderFor("m", Files()), dir, 1000);
  ASSERT_TRUE(s.ok()) << s.status();
  UploadSession& u = **s;
  EXPECT_EQ(u.bytes_total(), 2 + 6 + 8);
  EXPECT_TRUE(u.Append(Chunk("config.json", 0, "{}")).ok());
  EXPECT_THAT(u.Append(Chunk("vocab.txt", 3, "x")).message(), HasSubstr("expected 0"));
  EXPECT_THAT(u.Append(Chunk("tokenizer.json", 0, "x")).message(), HasSubstr("does not list"));
  EXPECT_TRUE(u.Append(Chunk("vocab.txt", 0, "[PAD]")).ok());
  EXPECT_THAT(u.Append(Chunk("vocab.txt", 5, "\n\n")).message(), HasSubstr("larger than"));
  EXPECT_TRUE(u.Append(Chunk("vocab.txt", 5, "\n")).ok());
  EXPECT_THAT(u.Finish().message(), HasSubstr("'model.safetensors' is incomplete: 0 of 8"));
  EXPECT_TRUE(u.Append(Chunk("model.safetensors", 0, "weights!")).ok());
  EXPECT_EQ(u.bytes_received(), u.bytes_total());
  EXPECT_TRUE(u.Finish().ok());
  auto content = util::ReadFile(dir + "/model.safetensors");
  ASSERT_TRUE(content.ok());
  EXPECT_EQ(*content, "weights!");
}

TEST(UploadSessionTest, ChecksumMismatchNamesTheFile) {
  TempDir tmp;
  v1::UploadHeader h = HeaderFor("m", Files());
  for (auto& f : *h.mutable_files()) {
    if (f.name() == "vocab.txt") f.set_sha256(Sha256Hex("[PAD]\r"));
  }
  auto s = UploadSession::Create(h, tmp.path() + "/u", 1000);
  ASSERT_TRUE(s.ok());
  for (const auto& [name, content] : Files()) ASSERT_TRUE((*s)->Append(Chunk(name, 0, content)).ok());
  absl::Status f = (*s)->Finish();
  EXPECT_EQ(f.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.message(), HasSubstr("checksum mismatch for 'vocab.txt'"));
}

std::multimap<grpc::string_ref, grpc::string_ref> Md(const std::string& key,
                                                     const std::string& value) {
  return {{grpc::string_ref(key), grpc::string_ref(value)}};
}

TEST(AdminAuthTest, BearerTokenMustMatch) {
  auto auth = AdminAuth::FromToken("tok3n");
  ASSERT_TRUE(auth.ok());
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer tok3n")).ok());
  EXPECT_TRUE((*auth)->Check(Md("authorization", "bearer tok3n")).ok());
  for (const std::string bad : {"Bearer tok3", "Bearer tok3n ", "Bearer ", "tok3n", "Basic tok3n"}) {
    EXPECT_EQ((*auth)->Check(Md("authorization", bad)).code(), absl::StatusCode::kUnauthenticated)
        << bad;
  }
  EXPECT_THAT((*auth)->Check({}).message(), HasSubstr("missing"));
  EXPECT_FALSE(AdminAuth::FromToken("").ok());
  EXPECT_FALSE(AdminAuth::FromToken("two words").ok());
}

TEST(AdminAuthTest, TokenFileIsTrimmed) {
  TempDir tmp;
  ASSERT_TRUE(util::WriteFileAtomic(tmp.path() + "/t", "  abc123\n").ok());
  auto auth = AdminAuth::FromTokenFile(tmp.path() + "/t");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer abc123")).ok());
  EXPECT_EQ(AdminAuth::FromTokenFile(tmp.path() + "/missing").status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(util::WriteFileAtomic(tmp.path() + "/empty", "\n").ok());
  EXPECT_EQ(AdminAuth::FromTokenFile(tmp.path() + "/empty").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The token file is followed, as a Kubernetes Secret volume updates it (a new file swapped in):
// the new token replaces the old at the next call; a changed file without a valid token leaves the
// old one in force until it holds one again.
TEST(AdminAuthTest, AChangedTokenFileReplacesTheToken) {
  TempDir tmp;
  const std::string file = tmp.path() + "/token";
  ASSERT_TRUE(util::WriteFileAtomic(file, "first-token\n").ok());
  auto auth = AdminAuth::FromTokenFile(file);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer first-token")).ok());

  ASSERT_TRUE(util::WriteFileAtomic(file, "second-token\n").ok());  // a rename: another inode
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer second-token")).ok());
  EXPECT_EQ((*auth)->Check(Md("authorization", "Bearer first-token")).code(),
            absl::StatusCode::kUnauthenticated);

  ASSERT_TRUE(util::WriteFileAtomic(file, "\n").ok());  // no valid token: the old one stands
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer second-token")).ok());
  std::filesystem::remove(file);  // nor does a missing file end it
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer second-token")).ok());

  ASSERT_TRUE(util::WriteFileAtomic(file, "third-token").ok());
  EXPECT_TRUE((*auth)->Check(Md("authorization", "Bearer third-token")).ok());
  EXPECT_EQ((*auth)->Check(Md("authorization", "Bearer second-token")).code(),
            absl::StatusCode::kUnauthenticated);
}

}  // namespace
}  // namespace collabserve::service
