#include "server/batching/batch_scheduler.h"

#include <cstdlib>
#include <tuple>

namespace collabserve::batching {

absl::Status ValidateSchedulerOptions(const SchedulerOptions& options) {
  const std::string label = internal::SchedulerLabel(options.name);
  auto bad = [&label](const char* field, int64_t value, const char* requirement) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": SchedulerOptions.", field, " = ",
                                                   value, "; it must be ", requirement));
  };
  if (options.max_batch_size < 1) return bad("max_batch_size", options.max_batch_size, ">= 1");
  if (options.max_batch_tokens < 1) {
    return bad("max_batch_tokens", options.max_batch_tokens, ">= 1");
  }
  if (options.max_queue_delay_micros < 0) {
    return bad("max_queue_delay_micros", options.max_queue_delay_micros, ">= 0");
  }
  if (options.max_queue_size < 1) return bad("max_queue_size", options.max_queue_size, ">= 1");
  // A thread per batch in flight; thousands would only be a typo.
  if (options.num_batch_threads < 1 || options.num_batch_threads > 1024) {
    return bad("num_batch_threads", options.num_batch_threads, "between 1 and 1024");
  }
  return absl::OkStatus();
}

namespace internal {

std::string SchedulerLabel(const std::string& name) {
  return name.empty() ? std::string("batch scheduler")
                      : absl::StrCat("batch scheduler '", name, "'");
}

namespace {

// True if a batch of `count` tasks whose longest has `longest` tokens stays within the budget.
bool FitsTokens(int64_t count, int64_t longest, int64_t max_batch_tokens) {
  return longest == 0 || count <= max_batch_tokens / longest;
}

}  // namespace

std::vector<size_t> SelectBatch(const std::vector<int64_t>& sizes, const SchedulerOptions& options,
                                bool* full) {
  std::vector<size_t> chosen;
  const size_t n = sizes.size();
  if (n == 0) {
    *full = false;
    return chosen;
  }
  const size_t max_count = static_cast<size_t>(std::min<int64_t>(
      options.max_batch_size, static_cast<int64_t>(n)));
  chosen.reserve(max_count);
  chosen.push_back(0);  // the oldest task is always in the batch
  int64_t longest = sizes[0];
  if (!options.length_aware) {
    for (size_t i = 1; i < n && chosen.size() < max_count; ++i) {
      const int64_t new_longest = std::max(longest, sizes[i]);
      if (!FitsTokens(static_cast<int64_t>(chosen.size()) + 1, new_longest,
                      options.max_batch_tokens)) {
        break;
      }
      chosen.push_back(i);
      longest = new_longest;
    }
  } else {
    // Candidates by closeness of length to the oldest task; on equal distance a shorter one (it
    // does not raise the padded length), then an older one.
    const int64_t anchor = sizes[0];
    std::vector<std::tuple<int64_t, bool, size_t>> candidates;
    candidates.reserve(n - 1);
    for (size_t i = 1; i < n; ++i) {
      candidates.emplace_back(std::llabs(sizes[i] - anchor), sizes[i] > anchor, i);
    }
    std::sort(candidates.begin(), candidates.end());
    for (const auto& candidate : candidates) {
      if (chosen.size() >= max_count) break;
      const size_t i = std::get<2>(candidate);
      const int64_t new_longest = std::max(longest, sizes[i]);
      // A candidate that does not fit is skipped, not a stop: a farther but shorter one may fit.
      if (!FitsTokens(static_cast<int64_t>(chosen.size()) + 1, new_longest,
                      options.max_batch_tokens)) {
        continue;
      }
      chosen.push_back(i);
      longest = new_longest;
    }
    std::sort(chosen.begin(), chosen.end());
  }
  *full = static_cast<int64_t>(chosen.size()) >= options.max_batch_size || chosen.size() < n;
  return chosen;
}

}  // namespace internal
}  // namespace collabserve::batching
