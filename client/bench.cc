#include "client/bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"

namespace collabserve::client {
namespace {

// Common lower-case words, each a single token of bert-base-uncased.
constexpr const char* kWords[] = {
    "the",   "movie", "was",   "good",  "bad",   "and",  "very", "long",  "story", "actor",
    "film",  "great", "plot",  "music", "scene", "time", "love", "house", "world", "day",
    "night", "city",  "water", "light", "small", "old",  "new",  "man",   "woman", "car"};

// User + system CPU seconds of this process so far.
double ProcessCpuSeconds() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t k = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

}  // namespace

std::string MakeText(int num_tokens, uint64_t seed) {
  std::string text;
  uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (int i = 0; i < num_tokens - 2; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    if (i > 0) text += ' ';
    text += kWords[(x >> 33) % (sizeof(kWords) / sizeof(kWords[0]))];
  }
  return text;
}

absl::StatusOr<BenchResult> RunBench(const Client& client, const BenchOptions& options) {
  if (options.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (options.duration_s <= 0) return absl::InvalidArgumentError("--duration_s must be > 0");
  if (options.lengths.empty()) return absl::InvalidArgumentError("--lengths is empty");
  for (int l : options.lengths) {
    if (l < 3) return absl::InvalidArgumentError(absl::StrCat("input length ", l, " is < 3 tokens"));
  }
  if (options.inputs_per_request < 1) return absl::InvalidArgumentError("inputs per request < 1");

  // Pre-built requests so that the workers only send.
  std::vector<v1::ClassifyRequest> requests;
  for (size_t i = 0; i < std::max<size_t>(options.lengths.size(), 16); ++i) {
    v1::ClassifyRequest r;
    r.set_model_name(options.model);
    for (int j = 0; j < options.inputs_per_request; ++j) {
      r.add_inputs()->set_text(MakeText(options.lengths[(i + j) % options.lengths.size()], i * 131 + j));
    }
    requests.push_back(std::move(r));
  }

  using Clock = std::chrono::steady_clock;
  const double cpu_start = ProcessCpuSeconds();
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(options.duration_s));
  std::atomic<int64_t> issued{0};
  absl::Mutex mu;
  BenchResult result;
  std::vector<double> latencies_ms;
  // Adds one worker's figures; called once per worker, when it stops.
  auto merge = [&](const std::vector<double>& local, int64_t errors, const std::string& first_error) {
    absl::MutexLock lock(&mu);
    latencies_ms.insert(latencies_ms.end(), local.begin(), local.end());
    result.errors += errors;
    if (result.first_error.empty()) result.first_error = first_error;
  };
  // Whether a worker may send its next request.
  auto go_on = [&] {
    return Clock::now() < end &&
           (options.max_requests == 0 || issued.fetch_add(1) < options.max_requests);
  };

  if (options.api == BenchApi::kCallback) {
    // One in-flight call per worker; its completion callback (on a gRPC thread) records it and
    // starts the next. The context and response live in the callback, which gRPC destroys once
    // the call is done with them, so that nothing here outlives RunBench.
    struct Worker {
      int64_t next = 0;
      std::vector<double> latencies;
      int64_t errors = 0;
      std::string first_error;
    };
    std::vector<Worker> workers(options.concurrency);
    absl::BlockingCounter running(options.concurrency);
    std::function<void(Worker*)> send = [&](Worker* w) {
      if (!go_on()) {
        merge(w->latencies, w->errors, w->first_error);
        running.DecrementCount();  // last use of anything here: RunBench may return now
        return;
      }
      const v1::ClassifyRequest& request = requests[w->next % requests.size()];
      w->next += options.concurrency;
      auto context = std::make_shared<grpc::ClientContext>();
      context->set_deadline(std::chrono::system_clock::now() + options.deadline);
      auto response = std::make_shared<v1::ClassifyResponse>();
      const auto t0 = Clock::now();
      client.stub()->async()->Classify(
          context.get(), &request, response.get(),
          [&send, w, t0, context, response](grpc::Status status) {
            const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
            if (status.ok()) {
              w->latencies.push_back(ms);
            } else {
              ++w->errors;
              if (w->first_error.empty()) {
                w->first_error =
                    absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                                 status.error_message())
                        .ToString();
              }
            }
            send(w);
          });
    };
    for (int i = 0; i < options.concurrency; ++i) {
      workers[i].next = i;
      send(&workers[i]);
    }
    running.Wait();
  } else {
    std::vector<std::thread> workers;
    for (int w = 0; w < options.concurrency; ++w) {
      workers.emplace_back([&, w] {
        std::vector<double> local;
        int64_t errors = 0;
        std::string first_error;
        for (int64_t i = w; go_on(); i += options.concurrency) {
          const auto t0 = Clock::now();
          auto r = client.Classify(requests[i % requests.size()], options.deadline);
          const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
          if (r.ok()) {
            local.push_back(ms);
          } else {
            ++errors;
            if (first_error.empty()) first_error = r.status().ToString();
          }
        }
        merge(local, errors, first_error);
      });
    }
    for (auto& t : workers) t.join();
  }
  result.elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
  result.client_cpu_s = ProcessCpuSeconds() - cpu_start;
  result.requests = static_cast<int64_t>(latencies_ms.size());
  result.requests_per_s = result.requests / result.elapsed_s;
  result.inputs_per_s = result.requests_per_s * options.inputs_per_request;
  result.p50_ms = Percentile(latencies_ms, 0.50);
  result.p90_ms = Percentile(latencies_ms, 0.90);
  result.p99_ms = Percentile(latencies_ms, 0.99);
  return result;
}

}  // namespace collabserve::client
