// Malicious checkpoint uploads are refused with a named reason, execute nothing and write nothing.
// The corpus (tests/hostile/corpus, made by make_corpus.py) covers pickles reaching os.system,
// subprocess, builtins.eval/exec and __reduce__ chains, nested/recursive structures and memo abuse;
// zips with lying sizes, overlapping entries, deflate bombs and names outside the archive root;
// safetensors with overlapping, out-of-range or negative offsets, huge or non-JSON headers and
// dtype/shape mismatches. Pickles generated here run `touch` on a fresh random path if executed.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/io/checkpoint.h"
#include "server/model/io/safetensors.h"
#include "server/model/io/torch_zip.h"
#include "server/model/io/zip_archive.h"

namespace collabserve::model::io {
namespace {

using ::testing::HasSubstr;
using namespace std::string_literals;  // pickles hold NUL bytes

std::string SourceDir() {
  const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
  return dir ? dir : ".";
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::set<std::string> ListDir(const std::string& dir) {
  std::set<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") out.insert(name);
  }
  closedir(d);
  return out;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// A fresh staging directory for one upload, removed with its files at the end of the test.
class Staging {
 public:
  Staging() {
    std::string templ = ::testing::TempDir() + "hostile_staging.XXXXXX";
    EXPECT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  ~Staging() {
    for (const std::string& f : ListDir(dir_)) std::remove((dir_ + "/" + f).c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Put(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// The marker a corpus pickle would create (make_corpus.py's MARKER) and the place a zip entry named
// ../../../../tmp/collabserve-hostile-escape would land if anything extracted it.
constexpr const char* kCorpusMarker = "/tmp/collabserve-hostile-pwned";
constexpr const char* kEscapeMarker = "/tmp/collabserve-hostile-escape";

TEST(HostileCheckpointsTest, EveryCorpusFileIsRefusedWithItsReasonAndNothingHappens) {
  const std::string corpus = SourceDir() + "/tests/hostile/corpus";
  std::ifstream manifest(corpus + "/expected.tsv");
  ASSERT_TRUE(manifest.good()) << corpus << "/expected.tsv is missing";
  std::remove(kCorpusMarker);
  std::remove(kEscapeMarker);
  std::set<std::string> listed = {"expected.tsv"};
  std::string line;
  int checked = 0;
  while (std::getline(manifest, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos) << line;
    const std::string file = line.substr(0, tab), reason = line.substr(tab + 1);
    listed.insert(file);
    SCOPED_TRACE(file);
    ASSERT_FALSE(reason.empty()) << "every corpus file must name the reason it is refused";
    Staging staging;
    const std::string path = staging.Put(file, ReadAll(corpus + "/" + file));
    auto result = ReadCheckpointFile(path);
    ASSERT_FALSE(result.ok()) << "a hostile file was accepted";
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(path));
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(reason));
    EXPECT_EQ(ListDir(staging.dir()), std::set<std::string>{file}) << "the reader wrote a file";
    ++checked;
  }
  EXPECT_GE(checked, 60);
  EXPECT_EQ(ListDir(corpus), listed) << "every corpus file needs a line in expected.tsv";
  EXPECT_FALSE(Exists(kCorpusMarker)) << "a pickle in the corpus was executed";
  EXPECT_FALSE(Exists(kEscapeMarker)) << "a zip entry was extracted outside the archive";
}

// ---- pickles generated per run, with a marker path nobody can have created beforehand ----

std::string U(const std::string& s) {  // BINUNICODE
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((s.size() >> (8 * i)) & 0xff));
  return out + s;
}

std::string Global(const std::string& module, const std::string& name, bool stack_global) {
  if (!stack_global) return "c" + module + "\n" + name + "\n";
  return U(module) + U(name) + "\x93";  // STACK_GLOBAL
}

std::string TorchZip(const std::string& pickle) {
  auto zip = BuildZip({{"archive/data.pkl", pickle},
                       {"archive/byteorder", "little"},
                       {"archive/data/0", std::string(64, '\0')},
                       {"archive/version", "3\n"}});
  EXPECT_TRUE(zip.ok()) << zip.status();
  return zip.ok() ? *zip : "";
}

TEST(HostileCheckpointsTest, PicklesThatWouldRunACommandRunNothing) {
  std::random_device rd;
  const std::string marker = absl::StrCat("/tmp/pwned-", rd(), rd());
  ASSERT_FALSE(Exists(marker));
  const std::string touch = "touch " + marker;
  struct Callee {
    std::string module, name, arg;
  };
  const std::vector<Callee> callees = {
      {"os", "system", touch},
      {"posix", "system", touch},
      {"nt", "system", touch},
      {"os", "popen", touch},
      {"subprocess", "Popen", touch},
      {"subprocess", "call", touch},
      {"subprocess", "run", touch},
      {"subprocess", "check_output", touch},
      {"subprocess", "getoutput", touch},
      {"builtins", "eval", "__import__('os').system('" + touch + "')"},
      {"builtins", "exec", "import os; os.system('" + touch + "')"},
      {"__builtin__", "eval", "__import__('os').system('" + touch + "')"},
      {"builtins", "__import__", "os"},
      {"builtins", "getattr", "os"},
      {"builtins", "open", marker},
      {"importlib", "import_module", "os"},
      {"pty", "spawn", touch},
      {"runpy", "run_path", marker},
      {"pickle", "loads", "cos\nsystem\n(S'x'\ntR."},
      {"torch", "load", marker},
      {"torch.serialization", "load", marker},
      {"collections", "namedtuple", "x"},   // an allowed module, a disallowed name
      {"torch._utils", "_rebuild_qtensor", touch},
      {"torch", "FloatStorage.__new__", touch},
      {"numpy.core.multiarray", "_reconstruct", touch},
  };
  int refused = 0;
  for (const Callee& c : callees) {
    for (bool stack_global : {false, true}) {
      const std::string call = Global(c.module, c.name, stack_global) + U(c.arg) + "\x85R";
      // The call as a value, as a key, inside a tensor's arguments, and as BUILD state.
      const std::vector<std::string> pickles = {
          "\x80\x02}" + U("w") + call + "s.",
          "\x80\x02}" + call + U("w") + "s.",
          "\x80\x02}" + U("w") + Global("torch._utils", "_rebuild_tensor_v2", stack_global) + "(" + call +
              "K\x00)))tRs."s,
          "\x80\x02" + Global("collections", "OrderedDict", stack_global) + ")R" + call + "b.",
      };
      for (const std::string& pickle : pickles) {
        SCOPED_TRACE(absl::StrCat(c.module, ".", c.name, stack_global ? " (STACK_GLOBAL)" : " (GLOBAL)"));
        Staging staging;
        const std::string path = staging.Put("pytorch_model.bin", TorchZip(pickle));
        auto result = ReadCheckpointFile(path);
        ASSERT_FALSE(result.ok());
        EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(result.status().message()),
                    HasSubstr(absl::StrCat("global '", c.module, ".", c.name, "' is not allowed")));
        EXPECT_EQ(ListDir(staging.dir()), std::set<std::string>{"pytorch_model.bin"});
        ++refused;
      }
    }
  }
  EXPECT_EQ(refused, static_cast<int>(callees.size()) * 8);
  EXPECT_FALSE(Exists(marker)) << "a pickle was executed: " << marker << " exists";
}

std::string Repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// Memo and nesting abuse at sizes far beyond the corpus files: refused quickly, bounded memory.
TEST(HostileCheckpointsTest, HugeNestingAndMemoAbuseAreRefused) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\x80\x02" + std::string(1'000'000, ']') + std::string(999'999, 'a') + ".", "nest deeper than"},
      {"\x80\x02" + std::string(1'000'000, '(') + "}.", "MARK"},
      {"\x80\x02}r\xff\xff\xff\xff.", "is over the limit"},
      {"\x80\x02}q\x00"s + Repeat("h\x00"s, 1'100'000) + ".", "stack deeper than"},  // BINGET x 1.1M
  };
  for (const auto& [pickle, reason] : cases) {
    Staging staging;
    const std::string path = staging.Put("pytorch_model.bin", TorchZip(pickle));
    auto result = ReadCheckpointFile(path);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(reason));
  }
}

// A safetensors header of a million entries that all alias one range, and one of 100 MB of
// whitespace: refused (overlap / not an object), never turned into a DOM of the whole header.
TEST(HostileCheckpointsTest, HugeSafetensorsHeadersAreRefused) {
  std::string header = "{";
  for (int i = 0; i < 200'000; ++i) {
    absl::StrAppend(&header, i ? "," : "", "\"t", i, "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}");
  }
  header += "}";
  std::string file;
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  file += header + std::string(4, '\0');
  auto r = ParseSafetensors(std::make_shared<const std::string>(file), "aliased.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("overlap tensor"));

  const uint64_t n = kMaxSafetensorsHeaderBytes;
  std::string blank;
  for (int i = 0; i < 8; ++i) blank.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  blank += '{';
  blank.append(n - 1, ' ');
  auto b = ParseSafetensors(std::make_shared<const std::string>(std::move(blank)), "blank.safetensors");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("not valid JSON"));
}

}  // namespace
}  // namespace collabserve::model::io
