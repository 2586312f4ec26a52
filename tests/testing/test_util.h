// Shared test helpers: temporary directories, the source tree, and running a command.
#ifndef COLLABSERVE_TESTS_TESTING_TEST_UTIL_H_
#define COLLABSERVE_TESTS_TESTING_TEST_UTIL_H_

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace collabserve::testing {

// COLLABSERVE_SOURCE_DIR as set by ctest (falls back to the current directory's parents).
inline std::string SourceDir() {
  const char* s = std::getenv("COLLABSERVE_SOURCE_DIR");
  return s ? s : ".";
}
inline std::string BinaryDir() {
  const char* s = std::getenv("COLLABSERVE_BINARY_DIR");
  return s ? s : ".";
}
inline std::string TestData(const std::string& name) { return SourceDir() + "/tests/data/" + name; }
// The Python that runs the references (torch and numpy): COLLABSERVE_PYTHON where set (a GPU
// machine's PyTorch lives in its own environment; scripts/gpu-check.sh sets it), else Debian's.
inline std::string ReferencePython() {
  const char* s = std::getenv("COLLABSERVE_PYTHON");
  return s != nullptr && *s != '\0' ? s : "/usr/bin/python3";
}
inline std::string Tool(const std::string& name) { return BinaryDir() + "/bin/" + name; }

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "collabserve-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout only
};

// Runs `command` through /bin/sh, returning its stdout and exit status.
inline CommandResult RunCommand(const std::string& command) {
  CommandResult r;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return r;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_TESTING_TEST_UTIL_H_
