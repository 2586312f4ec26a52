#include "server/util/atomic_file_writer.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/util/files.h"
#include "tests/testing/test_util.h"

namespace collabserve::util {
namespace {

// A fresh empty directory in this process's temporary directory (removed, with everything in
// it, when the process exits).
std::string FreshDir(const std::string& name) {
  static const collabserve::testing::TempDir scratch;
  static int counter = 0;
  std::string dir = scratch / (std::to_string(counter++) + "_" + name);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir;
  return dir;
}

std::vector<std::string> List(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

TEST(AtomicFileWriter, PiecesBecomeTheFileOnCommit) {
  const std::string dir = FreshDir("commit");
  const std::string path = JoinPath(dir, "model.bin");
  auto w = AtomicFileWriter::Create(path);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append("hello, ").ok());
  ASSERT_TRUE((*w)->Append(std::string(1 << 20, 'x')).ok());
  EXPECT_FALSE(FileExists(path)) << "visible before Commit";
  EXPECT_EQ((*w)->bytes_written(), 7u + (1u << 20));
  ASSERT_TRUE((*w)->Commit().ok());
  auto bytes = ReadFile(path);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, "hello, " + std::string(1 << 20, 'x'));
  EXPECT_EQ(List(dir), std::vector<std::string>{"model.bin"}) << "a temporary file was left";
  EXPECT_EQ((*w)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*w)->Append("more").code(), absl::StatusCode::kFailedPrecondition);
}

TEST(AtomicFileWriter, AnAbandonedWriteLeavesTheOldFileAndNoTemporary) {
  const std::string dir = FreshDir("abandon");
  const std::string path = JoinPath(dir, "model.bin");
  ASSERT_TRUE(WriteFileAtomic(path, "old").ok());
  {
    auto w = AtomicFileWriter::Create(path);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append("half of the new one").ok());
  }  // destroyed without Commit
  auto bytes = ReadFile(path);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, "old");
  EXPECT_EQ(List(dir), std::vector<std::string>{"model.bin"});
}

TEST(AtomicFileWriter, ReplacesAnExistingFile) {
  const std::string dir = FreshDir("replace");
  const std::string path = JoinPath(dir, "config.json");
  ASSERT_TRUE(WriteFileAtomic(path, "old").ok());
  auto w = AtomicFileWriter::Create(path);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append("new").ok());
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(*ReadFile(path), "new");
}

TEST(AtomicFileWriter, AMissingDirectoryIsAnErrorNamingThePath) {
  auto w = AtomicFileWriter::Create("/nonexistent-dir-for-collabserve/model.bin");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(w.status().message().find("/nonexistent-dir-for-collabserve/model.bin"), std::string::npos)
      << w.status();
}

}  // namespace
}  // namespace collabserve::util
