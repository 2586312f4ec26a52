// overload_bench: the collabserve binary at 4x its saturating load (issue 7, "Overload and slow
// clients"). Starts the server on a fresh checkpoint, measures the saturation throughput with a
// closed loop, then offers `--overload_factor` times that rate open-loop and reports how many calls
// were accepted and shed, how fast RESOURCE_EXHAUSTED came back, the accepted calls' latency
// against the saturated p99, the server's resident memory, and how quickly a call succeeds once
// the load stops. Prints a Markdown table (medians and percentiles of one run).
//
//   overload_bench [--collabserve=build/bin/collabserve] [--preset=mini] [--input_tokens=64]
//                  [--phase_s=10] [--max_queue_size=256] [--overload_factor=4]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "server/model/checkpoint_maker.h"
#include "server/util/process_memory.h"
#include "tests/testing/server_process.h"

ABSL_FLAG(std::string, collabserve, "", "the server binary (default: bin/collabserve next to this)");
ABSL_FLAG(std::string, preset, "mini", "checkpoint preset: tiny, mini or base");
ABSL_FLAG(int, input_tokens, 64, "words per input text (about as many tokens)");
ABSL_FLAG(double, phase_s, 10, "seconds of the saturation and of the overload phase");
ABSL_FLAG(int, max_queue_size, 64,
          "the server's --max_queue_size (default: the closed-loop concurrency, so that the queue\n"
          "admits what the saturation phase kept in flight)");
ABSL_FLAG(int, max_batch_size, 32, "the server's --max_batch_size");
ABSL_FLAG(double, overload_factor, 4, "offered load during overload, times the saturation rate");
ABSL_FLAG(int, concurrency, 64, "closed-loop calls in flight while measuring saturation");

namespace {

// ------------------------------------------------------------------------------ the server

using collabserve::testing::ServerProcess;

// VmRSS of a process in bytes (0 if it cannot be read).
int64_t Rss(pid_t pid) {
  absl::StatusOr<collabserve::util::ProcessMemory> m = collabserve::util::ReadProcessMemory(pid);
  return m.ok() ? m->rss_bytes : 0;
}

// ------------------------------------------------------------------------------ calls

struct Outcome {
  grpc::StatusCode code;
  absl::Duration latency;
};

class Recorder {
 public:
  void Add(grpc::StatusCode code, absl::Duration latency) {
    absl::MutexLock lock(&mu_);
    outcomes_.push_back({code, latency});
  }
  std::vector<Outcome> Take() {
    absl::MutexLock lock(&mu_);
    return std::move(outcomes_);
  }

 private:
  absl::Mutex mu_;
  std::vector<Outcome> outcomes_ ABSL_GUARDED_BY(mu_);
};

struct Call {
  grpc::ClientContext ctx;
  collabserve::v1::ClassifyResponse resp;
  absl::Time sent;
};

// Starts one async Classify; `done` runs on a gRPC thread with the outcome.
template <typename Done>
void StartCall(collabserve::v1::Inference::Stub* stub, const collabserve::v1::ClassifyRequest& req,
               Done done) {
  auto* call = new Call;
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  call->sent = absl::Now();
  stub->async()->Classify(&call->ctx, &req, &call->resp, [call, done](grpc::Status s) {
    const absl::Duration latency = absl::Now() - call->sent;
    delete call;
    done(s.error_code(), latency);
  });
}

double Percentile(std::vector<absl::Duration> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return absl::ToDoubleMilliseconds(v[i]);
}

std::vector<absl::Duration> Latencies(const std::vector<Outcome>& v, grpc::StatusCode code) {
  std::vector<absl::Duration> out;
  for (const Outcome& o : v) {
    if (o.code == code) out.push_back(o.latency);
  }
  return out;
}

// One synchronous call; its latency.
absl::Duration SyncCall(collabserve::v1::Inference::Stub* stub,
                        const collabserve::v1::ClassifyRequest& req, grpc::Status* status) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  collabserve::v1::ClassifyResponse resp;
  const absl::Time t = absl::Now();
  *status = stub->Classify(&ctx, req, &resp);
  return absl::Now() - t;
}

double Mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

int Run() {
  std::string binary = absl::GetFlag(FLAGS_collabserve);
  if (binary.empty()) binary = collabserve::testing::SiblingBinary("collabserve");
  char tmpl[] = "/tmp/collabserve-overload-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "cannot create a temporary directory\n");
    return 1;
  }
  const std::string repo = tmpl;
  collabserve::model::MakeOptions mo;
  mo.preset = absl::GetFlag(FLAGS_preset);
  mo.label_names = {"negative", "positive"};
  if (absl::Status s = collabserve::model::MakeCheckpoint(repo + "/bench/1", mo); !s.ok()) {
    std::fprintf(stderr, "cannot make the checkpoint: %s\n", s.ToString().c_str());
    return 1;
  }

  const int queue = absl::GetFlag(FLAGS_max_queue_size);
  const int max_batch = absl::GetFlag(FLAGS_max_batch_size);
  ServerProcess server({"--port=0", "--metrics_port=-1", "--host=127.0.0.1",
                        absl::StrCat("--model_repository=", repo), "--poll_interval_s=0",
                        absl::StrCat("--max_queue_size=", queue),
                        absl::StrCat("--max_batch_size=", max_batch)},
                       /*stderr_log=*/"", /*in_child=*/nullptr, binary);
  if (!server.serving()) {
    std::fprintf(stderr, "%s did not start\n", binary.c_str());
    return 1;
  }
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = collabserve::v1::Inference::NewStub(channel);

  collabserve::v1::ClassifyRequest req;
  req.set_model_name("bench");
  {
    std::string text;
    const char* words[] = {"the", "movie", "was", "good", "and", "long", "but", "fine"};
    for (int i = 0; i < absl::GetFlag(FLAGS_input_tokens) - 2; ++i) {
      absl::StrAppend(&text, i ? " " : "", words[i % 8]);
    }
    req.add_inputs()->set_text(text);
  }
  grpc::Status status;
  for (int i = 0; i < 20; ++i) SyncCall(stub.get(), req, &status);  // warm up
  if (!status.ok()) {
    std::fprintf(stderr, "classify failed: %s\n", status.error_message().c_str());
    return 1;
  }
  std::vector<absl::Duration> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(SyncCall(stub.get(), req, &status));

  // Saturation: a closed loop keeps `concurrency` calls in flight.
  const absl::Duration phase = absl::Seconds(absl::GetFlag(FLAGS_phase_s));
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  Recorder saturated;
  std::atomic<bool> stop{false};
  std::atomic<int> in_flight{0};
  std::function<void()> loop = [&] {
    in_flight.fetch_add(1);
    StartCall(stub.get(), req, [&](grpc::StatusCode code, absl::Duration latency) {
      saturated.Add(code, latency);
      in_flight.fetch_sub(1);
      if (!stop.load()) loop();
    });
  };
  const absl::Time sat_start = absl::Now();
  for (int i = 0; i < concurrency; ++i) loop();
  absl::SleepFor(phase);
  stop.store(true);
  const absl::Duration sat_elapsed = absl::Now() - sat_start;
  while (in_flight.load() > 0) absl::SleepFor(absl::Milliseconds(5));
  const std::vector<Outcome> sat = saturated.Take();
  const std::vector<absl::Duration> sat_ok = Latencies(sat, grpc::StatusCode::OK);
  const double rate = sat_ok.size() / absl::ToDoubleSeconds(sat_elapsed);
  const double sat_p50 = Percentile(sat_ok, 0.5), sat_p99 = Percentile(sat_ok, 0.99);

  // Overload: open loop at factor x rate; RSS sampled every 20 ms.
  const double factor = absl::GetFlag(FLAGS_overload_factor);
  const double offered = factor * rate;
  const int64_t rss_start = Rss(server.pid());
  std::atomic<int64_t> rss_peak{rss_start};
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling.load()) {
      const int64_t r = Rss(server.pid());
      int64_t p = rss_peak.load();
      while (r > p && !rss_peak.compare_exchange_weak(p, r)) {
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  Recorder overload;
  std::atomic<int> outstanding{0};
  const absl::Time ol_start = absl::Now();
  int64_t issued = 0;
  for (;;) {
    const absl::Time now = absl::Now();
    if (now - ol_start >= phase) break;
    const int64_t due = static_cast<int64_t>(absl::ToDoubleSeconds(now - ol_start) * offered);
    for (; issued < due; ++issued) {
      outstanding.fetch_add(1);
      StartCall(stub.get(), req, [&](grpc::StatusCode code, absl::Duration latency) {
        overload.Add(code, latency);
        outstanding.fetch_sub(1);
      });
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  const double achieved = issued / absl::ToDoubleSeconds(absl::Now() - ol_start);

  // Load drops. Admission reopens as soon as the queue has room (the first call not shed), but
  // that call waits behind the backlog the overload left (at most --max_queue_size inputs);
  // latency is back to normal once the backlog has drained. Calls every 5 ms until then.
  const absl::Time drop = absl::Now();
  const double idle_p50 = Percentile(idle, 0.5);
  int recovery_attempts = 0;
  absl::Duration first_accepted = absl::InfiniteDuration(), first_accepted_call;
  absl::Duration normal = absl::InfiniteDuration();
  while (absl::Now() - drop < absl::Seconds(60)) {
    ++recovery_attempts;
    const absl::Time t = absl::Now();
    const absl::Duration latency = SyncCall(stub.get(), req, &status);
    if (status.ok() && first_accepted == absl::InfiniteDuration()) {
      first_accepted = t - drop;
      first_accepted_call = latency;
    }
    if (status.ok() && absl::ToDoubleMilliseconds(latency) <= 2 * idle_p50) {
      normal = absl::Now() - drop;
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  const bool recovered = normal != absl::InfiniteDuration();
  while (outstanding.load() > 0) absl::SleepFor(absl::Milliseconds(5));
  std::vector<absl::Duration> after;
  for (int i = 0; i < 20; ++i) after.push_back(SyncCall(stub.get(), req, &status));
  sampling.store(false);
  sampler.join();
  const int64_t rss_end = Rss(server.pid());

  const std::vector<Outcome> ol = overload.Take();
  const std::vector<absl::Duration> ok = Latencies(ol, grpc::StatusCode::OK);
  const std::vector<absl::Duration> shed = Latencies(ol, grpc::StatusCode::RESOURCE_EXHAUSTED);
  const int64_t other = static_cast<int64_t>(ol.size() - ok.size() - shed.size());

  std::printf("## collabserve at %.0fx its saturating load\n\n", factor);
  std::printf("preset %s, %d-word inputs, 1 input per call, --max_queue_size=%d "
              "--max_batch_size=%d, %.0f s per phase, client and server on the same %u cores\n\n",
              mo.preset.c_str(), absl::GetFlag(FLAGS_input_tokens), queue, max_batch,
              absl::ToDoubleSeconds(phase), std::thread::hardware_concurrency());
  std::printf("| measure | value | vs baseline |\n|---|---|---|\n");
  std::printf("| idle latency p50 (sequential calls) | %.2f ms | baseline for recovery |\n",
              Percentile(idle, 0.5));
  std::printf("| saturation throughput (closed loop, %d in flight) | %.0f calls/s | 1.00x |\n",
              concurrency, rate);
  std::printf("| saturated latency p50 / p99 | %.1f / %.1f ms | p99 = baseline for accepted |\n",
              sat_p50, sat_p99);
  std::printf("| offered during overload (open loop) | %.0f calls/s | %.2fx saturation |\n",
              achieved, achieved / rate);
  std::printf("| calls issued / accepted (OK) / shed (RESOURCE_EXHAUSTED) / other | %zu / %zu / "
              "%zu / %lld | accepted %.2fx saturation rate |\n",
              ol.size(), ok.size(), shed.size(), static_cast<long long>(other),
              ok.size() / absl::ToDoubleSeconds(phase) / rate);
  std::printf("| time to RESOURCE_EXHAUSTED p50 / p99 | %.2f / %.2f ms | p99 %.3fx saturated p99 |\n",
              Percentile(shed, 0.5), Percentile(shed, 0.99), Percentile(shed, 0.99) / sat_p99);
  std::printf("| accepted latency p50 / p99 | %.1f / %.1f ms | p99 %.2fx saturated p99 |\n",
              Percentile(ok, 0.5), Percentile(ok, 0.99), Percentile(ok, 0.99) / sat_p99);
  std::printf("| server RSS start / peak / end | %.0f / %.0f / %.0f MiB | peak %.2fx start |\n",
              Mib(rss_start), Mib(rss_peak.load()), Mib(rss_end),
              static_cast<double>(rss_peak.load()) / rss_start);
  std::printf("| after the load stops: first call admitted (not shed) | sent after %.1f ms, "
              "answered in %.1f ms (behind the backlog) | backlog bound: %d inputs = %.0f ms at the "
              "saturation rate |\n",
              absl::ToDoubleMilliseconds(first_accepted),
              absl::ToDoubleMilliseconds(first_accepted_call), queue, 1000.0 * queue / rate);
  std::printf("| after the load stops: first call within 2x idle p50 | %s | %d calls, 5 ms apart |\n",
              recovered ? absl::StrCat(absl::ToDoubleMilliseconds(normal), " ms").c_str()
                        : "not within 60 s",
              recovery_attempts);
  std::printf("| idle latency p50 after the burst drained | %.2f ms | %.2fx before |\n",
              Percentile(after, 0.5), Percentile(after, 0.5) / Percentile(idle, 0.5));
  std::fflush(stdout);
  std::error_code ec;
  std::filesystem::remove_all(repo, ec);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}
