// Batch scheduler benchmark: what length-aware grouping buys over arrival-order batching (TF
// Serving's policy), measured in the same run, and what the scheduler itself costs per task.
//
// Table 1 (policy): a producer keeps the queue full with requests of 1-8 inputs whose lengths follow
// a distribution; a simulated model costs --ns_per_token per *padded* token (batch x longest),
// slept on the batch thread. Reported: padding ratio, mean batch size, model tokens per real token,
// throughput (median of --repeats runs) and its ratio to arrival order.
// Table 2 (overhead): the same producer with a no-op model: scheduling cost per task.
//
// Usage: batching_bench [--tasks=20000] [--repeats=3] [--ns_per_token=50] [--overhead_tasks=200000]
//                       [--max_batch_size=32] [--max_batch_tokens=16384] [--max_queue_size=1024]
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "server/batching/batch_scheduler.h"

namespace collabserve::batching {
namespace {

using bench::Median;

struct Flags {
  int tasks = 20000;
  int repeats = 3;
  int ns_per_token = 50;
  int overhead_tasks = 200000;
  int max_batch_size = 32;
  int max_batch_tokens = 16384;
  int max_queue_size = 1024;
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  return bench::FlagSet("batching_bench")
      .Int("tasks", &flags->tasks, 1)
      .Int("repeats", &flags->repeats, 1)
      .Int("ns_per_token", &flags->ns_per_token, 1)
      .Int("overhead_tasks", &flags->overhead_tasks, 1)
      .Int("max_batch_size", &flags->max_batch_size, 1)
      .Int("max_batch_tokens", &flags->max_batch_tokens, 1)
      .Int("max_queue_size", &flags->max_queue_size, 1)
      .Parse(argc, argv);
}

class SimTask : public BatchTask {
 public:
  explicit SimTask(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  void Fail(const absl::Status& status) override {
    std::fprintf(stderr, "unexpected failure: %s\n", status.ToString().c_str());
  }

 private:
  int64_t size_;
};

struct Distribution {
  const char* name;
  std::function<int64_t(std::mt19937&)> sample;
};

std::vector<Distribution> Distributions() {
  return {
      {"uniform 8-512",
       [](std::mt19937& rng) { return std::uniform_int_distribution<int64_t>(8, 512)(rng); }},
      {"short-heavy 80% <=64",
       [](std::mt19937& rng) {
         return std::bernoulli_distribution(0.8)(rng)
                    ? std::uniform_int_distribution<int64_t>(8, 64)(rng)
                    : std::uniform_int_distribution<int64_t>(65, 512)(rng);
       }},
      {"bimodal 16/384",
       [](std::mt19937& rng) { return std::bernoulli_distribution(0.5)(rng) ? 16 : 384; }},
  };
}

struct RunResult {
  double seconds = 0;
  SchedulerStats stats;
};

// Schedules `sizes` (requests of 1-8 inputs, retrying while the queue is full) and drains.
RunResult Run(const std::vector<int64_t>& sizes, const Flags& flags, bool length_aware,
              int ns_per_token) {
  SchedulerOptions options;
  options.max_batch_size = flags.max_batch_size;
  options.max_batch_tokens = flags.max_batch_tokens;
  options.max_queue_size = flags.max_queue_size;
  options.max_queue_delay_micros = ns_per_token > 0 ? 2000 : 0;
  options.length_aware = length_aware;
  options.name = "bench";
  std::unique_ptr<BatchScheduler<SimTask>> scheduler;
  absl::Status created = BatchScheduler<SimTask>::Create(
      options,
      [ns_per_token](std::unique_ptr<Batch<SimTask>> batch) {
        if (ns_per_token > 0) absl::SleepFor(absl::Nanoseconds(batch->padded_size() * ns_per_token));
      },
      &scheduler);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.ToString().c_str());
    std::exit(1);
  }
  std::mt19937 rng(1);
  const absl::Time start = absl::Now();
  size_t next = 0;
  while (next < sizes.size()) {
    const size_t n = std::min<size_t>(sizes.size() - next,
                                      std::uniform_int_distribution<size_t>(1, 8)(rng));
    std::vector<std::unique_ptr<SimTask>> tasks;
    for (size_t i = 0; i < n; ++i) tasks.push_back(std::make_unique<SimTask>(sizes[next + i]));
    for (;;) {
      absl::Status s = scheduler->ScheduleAll(&tasks);
      if (s.ok()) break;
      if (s.code() != absl::StatusCode::kResourceExhausted) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        std::exit(1);
      }
      if (ns_per_token > 0) {
        absl::SleepFor(absl::Microseconds(20));
      } else {
        std::this_thread::yield();
      }
    }
    next += n;
  }
  scheduler->Shutdown();
  RunResult result;
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  result.stats = scheduler->stats();
  return result;
}

struct Summary {
  double padding_ratio, mean_batch, model_tokens_per_token, tasks_per_second;
};

Summary Measure(const std::vector<int64_t>& sizes, const Flags& flags, bool length_aware,
                int ns_per_token) {
  std::vector<double> throughput;
  RunResult last;
  for (int r = 0; r < flags.repeats; ++r) {
    last = Run(sizes, flags, length_aware, ns_per_token);
    throughput.push_back(static_cast<double>(sizes.size()) / last.seconds);
  }
  const SchedulerStats& s = last.stats;
  Summary summary;
  summary.padding_ratio = 1.0 - static_cast<double>(s.tokens_batched) /
                                    static_cast<double>(s.padded_tokens_batched);
  summary.mean_batch = static_cast<double>(s.tasks_batched) / static_cast<double>(s.batches_formed);
  summary.model_tokens_per_token =
      static_cast<double>(s.padded_tokens_batched) / static_cast<double>(s.tokens_batched);
  summary.tasks_per_second = Median(throughput);
  return summary;
}

int Main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  std::printf("batch scheduler: max_batch_size %d, max_batch_tokens %d, max_queue_size %d, "
              "1 batch thread, median of %d runs\n\n",
              flags.max_batch_size, flags.max_batch_tokens, flags.max_queue_size, flags.repeats);

  std::printf("Table 1: policy, %d tasks, simulated model %d ns per padded token\n", flags.tasks,
              flags.ns_per_token);
  std::printf("%-22s %-14s %9s %10s %13s %11s %9s\n", "lengths", "policy", "padding", "mean batch",
              "model tok/tok", "tasks/s", "vs FIFO");
  for (const Distribution& d : Distributions()) {
    std::mt19937 rng(42);
    std::vector<int64_t> sizes(flags.tasks);
    for (int64_t& s : sizes) s = std::min<int64_t>(d.sample(rng), flags.max_batch_tokens);
    const Summary fifo = Measure(sizes, flags, false, flags.ns_per_token);
    const Summary aware = Measure(sizes, flags, true, flags.ns_per_token);
    for (const auto& [name, r] : {std::pair<const char*, Summary>{"arrival order", fifo},
                                  std::pair<const char*, Summary>{"length-aware", aware}}) {
      std::printf("%-22s %-14s %9.3f %10.1f %13.2f %11.0f %8.2fx\n", d.name, name, r.padding_ratio,
                  r.mean_batch, r.model_tokens_per_token, r.tasks_per_second,
                  r.tasks_per_second / fifo.tasks_per_second);
    }
  }

  std::printf("\nTable 2: scheduling overhead, %d tasks (uniform 8-512), no-op model, delay 0\n",
              flags.overhead_tasks);
  std::printf("%-14s %11s %9s %11s %9s\n", "policy", "tasks/s", "ns/task", "mean batch", "vs FIFO");
  {
    std::mt19937 rng(7);
    std::vector<int64_t> sizes(flags.overhead_tasks);
    for (int64_t& s : sizes) s = std::uniform_int_distribution<int64_t>(8, 512)(rng);
    const Summary fifo = Measure(sizes, flags, false, 0);
    const Summary aware = Measure(sizes, flags, true, 0);
    for (const auto& [name, r] : {std::pair<const char*, Summary>{"arrival order", fifo},
                                  std::pair<const char*, Summary>{"length-aware", aware}}) {
      std::printf("%-14s %11.0f %9.0f %11.1f %8.2fx\n", name, r.tasks_per_second,
                  1e9 / r.tasks_per_second, r.mean_batch, r.tasks_per_second / fifo.tasks_per_second);
    }
  }
  return 0;
}

}  // namespace
}  // namespace collabserve::batching

int main(int argc, char** argv) { return collabserve::batching::Main(argc, argv); }
