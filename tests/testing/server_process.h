// build/bin/collabserve as a child process, for tests that need the real binary (signals, kill -9,
// restarts). Its stdout is read until the line "serving"; the ports it prints on the way
// ("listening on", "metrics on", "admin on", "http on") are kept. Without an --http_port argument
// it gets --http_port=0 (a free port), so that servers of tests run in parallel do not meet on
// the default 8000.
#ifndef COLLABSERVE_TESTS_TESTING_SERVER_PROCESS_H_
#define COLLABSERVE_TESTS_TESTING_SERVER_PROCESS_H_

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace collabserve::testing {

// $COLLABSERVE_BINARY_DIR/bin/<name> (set by ctest).
inline std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("COLLABSERVE_BINARY_DIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/bin/", name);
}

// <name> in this executable's directory (a benchmark's default server: build/bin/collabserve).
inline std::string SiblingBinary(const std::string& name) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string path = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string("./x");
  return path.substr(0, path.rfind('/') + 1) + name;
}

class ServerProcess {
 public:
  // Starts collabserve with `args`; blocks until it prints a line that starts with `until`
  // ("serving" by default; reached() then) or exits. Its stderr is appended to `stderr_log` when
  // given.
  // `in_child`, when given, runs in the child between fork and exec (e.g. to set a resource
  // limit or a signal disposition that exec keeps); it must only make async-signal-safe calls.
  // `binary`: the server to run (default: BinaryPath("collabserve")). `env`: NAME=VALUE entries
  // added to (or replacing those of) this process's environment in the child's.
  explicit ServerProcess(std::vector<std::string> args, const std::string& stderr_log = "",
                         const std::function<void()>& in_child = nullptr,
                         std::string binary = "", const std::vector<std::string>& env = {},
                         const std::string& until = "serving") {
    if (binary.empty()) binary = BinaryPath("collabserve");
    // The child's environment, built before fork (the child may only make async-signal-safe calls).
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('=') + 1);
      bool replaced = false;
      for (const std::string& x : env) replaced = replaced || absl::StartsWith(x, name);
      if (!replaced) env_strings.push_back(entry);
    }
    env_strings.insert(env_strings.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    bool http_port_given = false;
    for (const auto& a : args) http_port_given = http_port_given || absl::StartsWith(a, "--http_port");
    if (!http_port_given) args.push_back("--http_port=0");
    std::vector<char*> argv = {binary.data()};
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      close(fds[1]);
      if (!stderr_log.empty()) {
        FILE* err = std::fopen(stderr_log.c_str(), "a");
        if (err != nullptr) dup2(fileno(err), 2);
      }
      if (in_child) in_child();
      execve(binary.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[512];
    while (out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr) {
      std::string l(line);
      if (!ParsePort(l, "listening on 127.0.0.1:", &port_) &&
          !ParsePort(l, "metrics on 127.0.0.1:", &metrics_port_) &&
          !ParsePort(l, "http on 127.0.0.1:", &http_port_)) {
        ParsePort(l, "admin on 127.0.0.1:", &admin_port_);
      }
      serving_ = serving_ || absl::StartsWith(l, "serving");
      if (absl::StartsWith(l, until)) {
        reached_ = true;
        break;
      }
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) Kill();
    if (out_ != nullptr) fclose(out_);
  }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // SIGKILL, then reap.
  void Kill() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // SIGTERM, then the exit status (or -1 if it did not exit normally within 60 s: killed by a
  // signal, or still running).
  int Terminate() {
    kill(pid_, SIGTERM);
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    int status = 0;
    while (absl::Now() < give_up) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  bool serving() const { return serving_; }
  bool reached() const { return reached_; }  // the line `until` was read
  pid_t pid() const { return pid_; }  // -1 once killed or reaped
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  int admin_port() const { return admin_port_; }
  int http_port() const { return http_port_; }  // -1 when it serves no HTTP
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  static bool ParsePort(const std::string& line, const char* prefix, int* port) {
    if (!absl::StartsWith(line, prefix)) return false;
    *port = std::atoi(line.c_str() + std::strlen(prefix));
    return true;
  }

  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
  int metrics_port_ = -1;
  int admin_port_ = 0;
  int http_port_ = -1;
  bool serving_ = false;
  bool reached_ = false;
};

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_TESTING_SERVER_PROCESS_H_
