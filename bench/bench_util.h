// What the benchmarks share: `--name=value` flags parsed into typed fields (a bad value or an unknown
// flag is one clear line and a false return), the median of a sample, CPU seconds, the load average.
#ifndef COLLABSERVE_BENCH_BENCH_UTIL_H_
#define COLLABSERVE_BENCH_BENCH_UTIL_H_

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace collabserve::bench {

// The flags of one program. Each call registers a flag and where its value goes; Parse fills them.
// `--name=value` (or a bare `--name` for a Bool); Ints/Strings take comma-separated lists.
//   FlagSet f("cp_bench");
//   f.Int("repeats", &flags.repeats, 1).Ints("ranks", &flags.ranks).Bool("skip_dense", &flags.skip);
//   if (!f.Parse(argc, argv)) return 2;
class FlagSet {
 public:
  explicit FlagSet(std::string program) : program_(std::move(program)) {}

  FlagSet& Int(const char* name, int* out, int min = std::numeric_limits<int>::min()) {
    return Add(name, "an integer >= " + std::to_string(min), [out, min](const std::string& v) {
      return absl::SimpleAtoi(v, out) && *out >= min;
    });
  }
  FlagSet& Double(const char* name, double* out, double min = -std::numeric_limits<double>::infinity()) {
    return Add(name, "a number >= " + std::to_string(min), [out, min](const std::string& v) {
      return absl::SimpleAtod(v, out) && *out >= min;
    });
  }
  FlagSet& String(const char* name, std::string* out) {
    return Add(name, "a string", [out](const std::string& v) {
      *out = v;
      return true;
    });
  }
  // Comma-separated integers, each >= min; at least one.
  FlagSet& Ints(const char* name, std::vector<int>* out, int min = 1) {
    return Add(name, "comma-separated integers >= " + std::to_string(min), [out, min](const std::string& v) {
      out->clear();
      for (absl::string_view part : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        int x = 0;
        if (!absl::SimpleAtoi(part, &x) || x < min) return false;
        out->push_back(x);
      }
      return !out->empty();
    });
  }
  // Comma-separated words, each one of `allowed` (any word when it is empty); at least one.
  FlagSet& Strings(const char* name, std::vector<std::string>* out, std::vector<std::string> allowed = {}) {
    return Add(name, allowed.empty() ? "comma-separated words" : "comma-separated words of " + Join(allowed),
               [out, allowed](const std::string& v) {
                 out->clear();
                 for (absl::string_view part : absl::StrSplit(v, ',', absl::SkipEmpty())) {
                   if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), part) == allowed.end()) {
                     return false;
                   }
                   out->emplace_back(part);
                 }
                 return !out->empty();
               });
  }
  // `--name` or `--name=true|false|1|0`.
  FlagSet& Bool(const char* name, bool* out) {
    bools_.push_back(name);
    return Add(name, "true or false", [out](const std::string& v) {
      if (v == "true" || v == "1") {
        *out = true;
      } else if (v == "false" || v == "0") {
        *out = false;
      } else {
        return false;
      }
      return true;
    });
  }

  // Parses argv[1..]; on an unknown flag or a bad value prints "<program>: ..." to stderr and
  // returns false.
  bool Parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const size_t eq = arg.find('=');
      const std::string name = arg.rfind("--", 0) == 0 ? arg.substr(2, eq == std::string::npos ? eq : eq - 2) : "";
      const Flag* flag = nullptr;
      for (const Flag& f : flags_) {
        if (f.name == name) flag = &f;
      }
      if (flag == nullptr) {
        std::fprintf(stderr, "%s: unknown flag '%s' (known: %s)\n", program_.c_str(), arg.c_str(), Known().c_str());
        return false;
      }
      const bool bare_bool = eq == std::string::npos &&
                             std::find(bools_.begin(), bools_.end(), name) != bools_.end();
      if (eq == std::string::npos && !bare_bool) {
        std::fprintf(stderr, "%s: --%s needs a value (--%s=...)\n", program_.c_str(), name.c_str(), name.c_str());
        return false;
      }
      const std::string value = bare_bool ? "true" : arg.substr(eq + 1);
      if (!flag->set(value)) {
        std::fprintf(stderr, "%s: --%s must be %s, got '%s'\n", program_.c_str(), name.c_str(),
                     flag->expect.c_str(), value.c_str());
        return false;
      }
    }
    return true;
  }

 private:
  struct Flag {
    std::string name, expect;
    std::function<bool(const std::string&)> set;
  };
  FlagSet& Add(const char* name, std::string expect, std::function<bool(const std::string&)> set) {
    flags_.push_back({name, std::move(expect), std::move(set)});
    return *this;
  }
  static std::string Join(const std::vector<std::string>& words) {
    std::string s;
    for (const std::string& w : words) s += (s.empty() ? "" : ", ") + w;
    return s;
  }
  std::string Known() const {
    std::string s;
    for (const Flag& f : flags_) s += (s.empty() ? "--" : ", --") + f.name;
    return s;
  }

  std::string program_;
  std::vector<Flag> flags_;
  std::vector<std::string> bools_;
};

// The median of v (0 for an empty sample).
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// User + system CPU seconds of this process, all threads.
inline double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         1e-6 * (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

// "1-minute 5-minute 15-minute" from /proc/loadavg.
inline std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

}  // namespace collabserve::bench

#endif  // COLLABSERVE_BENCH_BENCH_UTIL_H_
