#include "client/bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/client_callback.h"

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

// One ClassifyStream call carrying `workers` closed-loop workers: each has one request in flight
// and sends its next (on the same stream) when the response to the previous one arrives. Writes go
// out one at a time from a queue (gRPC allows one outstanding write). When `go_on` says stop, the
// workers stop sending; once nothing is in flight the stream is half-closed, and OnDone reports
// the worker figures through `done`.
class StreamLoad final
    : public grpc::ClientBidiReactor<v1::StreamClassifyRequest, v1::StreamClassifyResponse> {
 public:
  using Clock = std::chrono::steady_clock;
  // Called once, from OnDone: latencies (ms) of OK responses, failed requests, the first error.
  using DoneFn = std::function<void(const std::vector<double>&, int64_t, const std::string&)>;

  StreamLoad(const std::vector<v1::ClassifyRequest>* requests, int first,
             std::function<bool()> go_on, DoneFn done)
      : requests_(requests), next_(first), go_on_(std::move(go_on)), done_(std::move(done)) {}

  void Start(v1::Inference::Stub* stub, std::chrono::system_clock::time_point deadline, int workers) {
    context_.set_deadline(deadline);
    stub->async()->ClassifyStream(&context_, this);
    StartRead(&response_);
    Next next;
    {
      absl::MutexLock lock(&mu_);
      for (int i = 0; i < workers; ++i) SendNextLocked();
      next = NextLocked();
    }
    Issue(next);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the stream is broken: OnDone says why
    Next next;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      next = NextLocked();
    }
    Issue(next);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the server finished the stream: OnDone follows
    const auto now = Clock::now();
    Next next;
    {
      absl::MutexLock lock(&mu_);
      auto it = sent_.find(response_.id());
      if (it != sent_.end()) {
        if (response_.has_error()) {
          ++errors_;
          if (first_error_.empty()) {
            first_error_ = absl::Status(static_cast<absl::StatusCode>(response_.error().code()),
                                        response_.error().message())
                               .ToString();
          }
        } else {
          latencies_.push_back(std::chrono::duration<double, std::milli>(now - it->second).count());
        }
        sent_.erase(it);
        SendNextLocked();
      }
      next = NextLocked();
    }
    Issue(next);
    StartRead(&response_);  // response_ belongs to the read path alone
  }

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok() || !sent_.empty()) {
        // Requests that never got an answer failed with the stream.
        errors_ += static_cast<int64_t>(sent_.size());
        if (first_error_.empty()) {
          first_error_ = status.ok() ? "the stream ended with requests unanswered"
                                     : absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                                                    status.error_message())
                                           .ToString();
        }
      }
    }
    DoneFn done = std::move(done_);
    std::vector<double> latencies = std::move(latencies_);
    const int64_t errors = errors_;
    const std::string first_error = first_error_;
    delete this;  // nothing of the reactor is used after this
    done(latencies, errors, first_error);
  }

 private:
  // Queues the next request of a worker unless the run is over.
  void SendNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_ || !go_on_()) {
      stopping_ = true;
      return;
    }
    v1::StreamClassifyRequest m;
    const std::string id = absl::StrCat(seq_++);
    m.set_id(id);
    *m.mutable_request() = (*requests_)[next_ % requests_->size()];
    next_ += 1;
    sent_[id] = Clock::now();
    queue_.push_back(std::move(m));
  }

  // What to start after releasing mu_ (gRPC's Start* calls are made without holding it).
  enum class Next { kNothing, kWrite, kWritesDone };

  // Claims the write slot for the next queued request (into current_), or for the half-close once
  // the run has stopped and nothing is in flight.
  Next NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || writes_done_) return Next::kNothing;
    if (!queue_.empty()) {
      current_ = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
      return Next::kWrite;
    }
    if (stopping_ && sent_.empty()) {
      writes_done_ = true;
      return Next::kWritesDone;
    }
    return Next::kNothing;
  }

  // current_ is owned by the write in flight (writing_), so it is read here without mu_.
  void Issue(Next next) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (next == Next::kWrite) StartWrite(&current_);
    if (next == Next::kWritesDone) StartWritesDone();
  }

  const std::vector<v1::ClassifyRequest>* const requests_;
  size_t next_ ABSL_GUARDED_BY(mu_);  // index of the next request to send
  const std::function<bool()> go_on_;
  DoneFn done_;
  grpc::ClientContext context_;
  v1::StreamClassifyResponse response_;  // owned by the one outstanding read

  absl::Mutex mu_;
  std::deque<v1::StreamClassifyRequest> queue_ ABSL_GUARDED_BY(mu_);
  v1::StreamClassifyRequest current_ ABSL_GUARDED_BY(mu_);  // the one outstanding write
  std::map<std::string, Clock::time_point> sent_ ABSL_GUARDED_BY(mu_);  // id -> when queued
  int64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);
  int64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::string first_error_ ABSL_GUARDED_BY(mu_);
};

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

  if (options.api == BenchApi::kStream) {
    const int streams = std::min(options.concurrency,
                                 options.streams > 0 ? options.streams : (options.concurrency + 15) / 16);
    absl::BlockingCounter running(streams);
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::duration<double>(options.duration_s)) +
                          options.deadline;
    int first = 0;
    for (int i = 0; i < streams; ++i) {
      // Workers spread evenly: the first (concurrency % streams) streams carry one more.
      const int workers = options.concurrency / streams + (i < options.concurrency % streams ? 1 : 0);
      auto* load = new StreamLoad(
          &requests, first, go_on,
          [&](const std::vector<double>& local, int64_t errors, const std::string& first_error) {
            merge(local, errors, first_error);
            running.DecrementCount();  // last use of anything here: RunBench may return now
          });
      load->Start(client.stub(), deadline, workers);  // `load` deletes itself in OnDone
      first += workers;
    }
    running.Wait();
  } else if (options.api == BenchApi::kCallback) {
    // One in-flight call per worker; its completion callback (on a gRPC thread) records it,
    // deletes the call's context and response, and only then starts the next call or counts the
    // worker out. The callback owns nothing (gRPC copies it): the context holds the channel, and a
    // copy left alive on another thread could outlive RunBench and the Client, so that the
    // channel's last reference dropped on a thread of gRPC's callback completion queue, which
    // cannot release the queue from its own thread (a later abort; bench_test's
    // NoCallOutlivesTheRun).
    struct Worker {
      int64_t next = 0;
      std::vector<double> latencies;
      int64_t errors = 0;
      std::string first_error;
    };
    struct Call {
      grpc::ClientContext context;
      v1::ClassifyResponse response;
      Clock::time_point start;
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
      auto* call = new Call;
      call->context.set_deadline(std::chrono::system_clock::now() + options.deadline);
      call->start = Clock::now();
      client.stub()->async()->Classify(
          &call->context, &request, &call->response, [&send, w, call](grpc::Status status) {
            const double ms = std::chrono::duration<double, std::milli>(Clock::now() - call->start).count();
            delete call;  // the call is done with its context and response
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
