#include "server/batching/batch_scheduler.h"

#include <algorithm>
#include <iterator>

namespace collabserve::batching {

absl::Status ValidateSchedulerOptions(const SchedulerOptions& options,
                                      std::string_view field_prefix) {
  const std::string label = internal::SchedulerLabel(options.name);
  auto bad = [&label, field_prefix](const char* field, int64_t value, const char* requirement) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": ", absl::string_view(field_prefix.data(), field_prefix.size()),
                     field, " = ", value, "; it must be ", requirement));
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

bool FitsTokens(int64_t count, int64_t longest, const SchedulerOptions& options) {
  return longest == 0 || count <= options.max_batch_tokens / longest;
}

int64_t BatchTaskLimit(const SchedulerOptions& options, int64_t queued, int64_t in_process) {
  int64_t limit = options.max_batch_size;
  if (options.fair_share && options.num_batch_threads > 1) {
    const int64_t work = queued + in_process;
    limit = std::min(limit, (work + options.num_batch_threads - 1) / options.num_batch_threads);
  }
  return std::max<int64_t>(1, limit);
}

std::vector<uint64_t> SelectLengthAware(const LengthIndex& queue,
                                        std::pair<int64_t, uint64_t> oldest,
                                        const SchedulerOptions& options, int64_t max_tasks,
                                        bool* full) {
  const int64_t anchor = oldest.first;
  std::vector<uint64_t> chosen = {oldest.second};  // the oldest task is always in the batch
  int64_t longest = anchor;
  // Longer-or-equal candidates, closest first: ascending from the oldest (same length: older
  // first, as the oldest has the smallest sequence number of all).
  auto right = queue.upper_bound(oldest);
  bool right_open = true;
  // Shorter candidates, closest first: groups of equal length in descending length, each group
  // in arrival order, i.e. [group_begin, group_end).
  auto group_end = queue.lower_bound({anchor, 0});
  auto left = group_end;
  auto group_begin = group_end;
  auto next_left = [&] {
    if (left != group_end) ++left;
    if (left == group_end) {
      if (group_begin == queue.begin()) return false;
      group_end = group_begin;
      group_begin = queue.lower_bound({std::prev(group_end)->first, 0});
      left = group_begin;
    }
    return true;
  };
  bool left_open = next_left();

  while (static_cast<int64_t>(chosen.size()) < max_tasks) {
    const bool have_right = right_open && right != queue.end();
    if (!left_open && !have_right) break;
    const int64_t count = static_cast<int64_t>(chosen.size()) + 1;
    // On equal distance the shorter one: it does not raise the padded length.
    if (left_open && (!have_right || anchor - left->first <= right->first - anchor)) {
      // A shorter task keeps `longest`; if it does not fit, no other candidate can.
      if (!FitsTokens(count, longest, options)) break;
      chosen.push_back(left->second);
      left_open = next_left();
    } else {
      const int64_t new_longest = std::max(longest, right->first);
      if (!FitsTokens(count, new_longest, options)) {
        right_open = false;  // every later one is at least as long
        continue;
      }
      chosen.push_back(right->second);
      longest = new_longest;
      ++right;
    }
  }
  std::sort(chosen.begin(), chosen.end());
  *full = static_cast<int64_t>(chosen.size()) >= max_tasks || chosen.size() < queue.size();
  return chosen;
}

}  // namespace internal
}  // namespace collabserve::batching
