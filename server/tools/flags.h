// A tiny `--key value` / `--key=value` parser for the offline tool's subcommands (absl flags are
// global, and each subcommand takes its own set).
#ifndef COLLABSERVE_SERVER_TOOLS_FLAGS_H_
#define COLLABSERVE_SERVER_TOOLS_FLAGS_H_

#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/util/status_macros.h"

namespace collabserve::tools {

class Flags {
 public:
  // Parses argv[first..]; every flag must be in `known` and have a value (`--flag value` or
  // `--flag=value`, not empty: no flag of the tool is a switch).
  static absl::StatusOr<Flags> Parse(int argc, char** argv, int first, const std::set<std::string>& known) {
    Flags f;
    for (int i = first; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
      }
      std::string key = a.substr(2), value;
      auto eq = key.find('=');
      if (eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      }
      if (!known.count(key)) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", key, " (known: --",
                                                       absl::StrJoin(known, ", --"), ")"));
      }
      if (value.empty()) return absl::InvalidArgumentError(absl::StrCat("--", key, " needs a value"));
      f.values_[key] = value;
    }
    return f;
  }
  bool Has(const std::string& k) const { return values_.count(k) > 0; }
  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = values_.find(k);
    return it == values_.end() ? def : it->second;
  }
  // An int (a count, a rank, a size): a larger value is refused rather than cut to 32 bits.
  absl::StatusOr<int> GetInt(const std::string& k, int def) const {
    ASSIGN_OR_RETURN(int64_t v, GetInt64(k, def));
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("--", k, " = ", v, " is out of range"));
    }
    return static_cast<int>(v);
  }
  absl::StatusOr<int64_t> GetInt64(const std::string& k, int64_t def) const {
    if (!Has(k)) return def;
    int64_t v;
    if (!absl::SimpleAtoi(Get(k), &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", k, " must be an integer, got '", Get(k), "'"));
    }
    return v;
  }
  absl::StatusOr<double> GetDouble(const std::string& k, double def) const {
    if (!Has(k)) return def;
    double v;
    if (!absl::SimpleAtod(Get(k), &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", k, " must be a number, got '", Get(k), "'"));
    }
    return v;
  }

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace collabserve::tools

#endif  // COLLABSERVE_SERVER_TOOLS_FLAGS_H_
